"""The run's generic options: the learning-rate schedule with --min-lr (timm's warm-up start and cosine floor)
step by step, and --precision bf16 (autocast of the training forward pass), in one process and end to end."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from abtrain.config import TrainConfig
from abtrain.run.plan import forward_precision, lr_lambda


def _timm(t: int, lr: float, floor: float, warm: int, total: int) -> float:
    """timm's CosineLRScheduler at update t with warmup_lr_init = min_lr = ``floor``, warmup_prefix."""
    if t < warm:
        return floor + t * (lr - floor) / warm
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * (t - warm) / (total - warm)))


def test_min_lr_gives_timms_warm_up_and_cosine():
    lr, floor, warm, total = 3e-3, 1e-5, 10, 50
    factor = lr_lambda(TrainConfig(lr=lr, min_lr=floor, warmup_lr_steps=warm), total)
    assert [lr * factor(t) for t in range(total)] == pytest.approx([_timm(t, lr, floor, warm, total)
                                                                   for t in range(total)], rel=1e-12)
    assert lr * factor(0) == pytest.approx(floor) and factor(warm) == 1.0  # starts at the floor, peaks after T
    constant = lr_lambda(TrainConfig(lr=lr, min_lr=floor, warmup_lr_steps=warm, lr_schedule="constant"), total)
    assert lr * constant(0) == pytest.approx(floor) and [constant(t) for t in range(warm, total)] == [1.0] * 40


def test_without_min_lr_the_schedule_is_abtrains_own():
    factor = lr_lambda(TrainConfig(lr=0.1, warmup_lr_steps=4), 20)
    assert [factor(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the peak on the warm-up's last step
    assert factor(4) == 1.0 and factor(19) == pytest.approx(0.5 * (1 + math.cos(math.pi * 15 / 16)))


@pytest.mark.parametrize("min_lr", [-1e-6, 0.1, 0.5])
def test_min_lr_outside_zero_to_lr_is_refused(min_lr):
    with pytest.raises(ValueError, match=r"--min-lr must be in \[0, --lr\)"):
        TrainConfig(lr=0.1, min_lr=min_lr)


def test_bf16_autocasts_the_forward_and_fp32_leaves_it():
    model, x = nn.Linear(4, 3), torch.randn(2, 4)
    with forward_precision(TrainConfig(precision="bf16"), torch.device("cpu")):
        assert model(x).dtype == torch.bfloat16
    with forward_precision(TrainConfig(), torch.device("cpu")):
        assert model(x).dtype == torch.float32
    with pytest.raises(ValueError, match="unknown --precision 'fp16'"):
        TrainConfig(precision="fp16")


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    p = subprocess.run([sys.executable, "-m", "abtrain.cli", "train", "--method", "ddp", "--workers", "2",
                        "--model", "mlp", "--dataset", "synthetic", "--steps", "6", "--batch-size", "16",
                        "--eval-every", "1", "--lr", "0.05", "--warmup-lr-steps", "3", "--log-every", "100",
                        "--out", str(out), *extra], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads((out / "results.json").read_text())


def test_a_bf16_run_with_a_floor_applies_both(tmp_path):
    fp32 = _run(tmp_path, "fp32", "--min-lr", "1e-3")
    bf16 = _run(tmp_path, "bf16", "--min-lr", "1e-3", "--precision", "bf16")
    assert bf16["config"]["precision"] == "bf16" and bf16["config"]["min_lr"] == 1e-3
    # the learning rate each step applied: timm's schedule (evaluated after every step)
    assert [r["lr"] for r in bf16["history"]] == pytest.approx([_timm(t, 0.05, 1e-3, 3, 6) for t in range(6)])
    assert all(math.isfinite(r["train_loss"]) for r in bf16["history"])
    assert [r["train_loss"] for r in bf16["history"]] != [r["train_loss"] for r in fp32["history"]]
