"""benchmarks/cost.py on its tiniest setting: the JSON's fields, DDP's training state equal to its formula,
the amortised time equal to the schedule's counts times the measured medians; benchmarks/gpu_check.py
refusing to start without CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from abtrain.methods.ab import ABConfig, Schedule
from abtrain.methods.memory import dense_training_state_bytes

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "cost.py")


def _cost_module():
    spec = importlib.util.spec_from_file_location("cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("cost") / "cost.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--size", "tiny", "--models", "gpt2", "--methods", "ddp,ab",
                           "--warm", "1", "--steps", "2", "--cycle", "4", "--cycles", "1", "--run-steps", "2000",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| gpt2 | ddp |" in proc.stdout and "| gpt2 | ab |" in proc.stdout
    return json.loads(out.read_text())


def test_the_json_holds_every_measured_field(record):
    assert record["workers"] == 2 and record["device"] == "cpu" and record["size"] == "tiny"
    assert record["run_steps"] == 2000 and record["command"].startswith("benchmarks/cost.py --size tiny")
    rows = {r["variant"]: r for r in record["rows"]}
    assert list(rows) == ["ddp", "ab"]
    for row in rows.values():
        for key in ("step_seconds", "step_seconds_by_phase", "event_seconds", "amortised_step_seconds",
                    "extra_vs_ddp_seconds", "extra_vs_ddp_percent", "training_state_bytes",
                    "training_state_main_phase_bytes", "ddp_formula_bytes", "state_vs_ddp", "default_schedule"):
            assert key in row, key
        assert row["step_seconds"] > 0 and row["amortised_step_seconds"] > 0 and row["missing"] == []
        assert len(row["steps"]) == 2  # both workers' step records
    assert rows["ddp"]["extra_vs_ddp_percent"] == 0.0
    ab = rows["ab"]
    assert set(ab["step_seconds_by_phase"]) == {"warmup", "ab"}
    assert set(ab["event_seconds"]) == {"decompose_first", "sync", "decompose"}
    assert ab["lowrank_product_seconds"] > 0 and sorted(ab["roles"]) == ["A", "B"]
    assert ab["extra_vs_ddp_percent"] == pytest.approx(
        100 * (ab["amortised_step_seconds"] - rows["ddp"]["amortised_step_seconds"])
        / rows["ddp"]["amortised_step_seconds"])


def test_ddp_holds_the_formulas_state(record):
    """DDP's measured training state: parameters, gradients and AdamW's two moments of the dense model, plus
    AdamW's step counts (a 4-byte scalar per parameter tensor, as tests/test_memory.py counts them)."""
    net, _, _ = _cost_module().build("gpt2", "tiny", full=False)
    params = sum(p.numel() for p in net.parameters())
    tensors = len(list(net.parameters()))
    ddp = next(r for r in record["rows"] if r["variant"] == "ddp")
    assert (ddp["params"], ddp["param_tensors"], ddp["moments_per_element"]) == (params, tensors, 2)
    assert ddp["ddp_formula_bytes"] == dense_training_state_bytes(params, 2) == 16 * params
    assert ddp["training_state_bytes"] == ddp["ddp_formula_bytes"] + 4 * tensors
    assert ddp["training_state_bytes_by_rank"] == [ddp["training_state_bytes"]] * 2
    assert ddp["state_vs_ddp"] == 1.0


def test_the_amortised_time_follows_the_default_schedule(record):
    ab = next(r for r in record["rows"] if r["variant"] == "ab")
    sched = Schedule.from_config(ABConfig(quiet=True), 2000)
    plan = ab["default_schedule"]
    assert plan["phase_steps"] == {"warmup": sched.warmup, "ab": 2000 - sched.warmup}
    assert plan["events"] == {"sync": sched.syncs(), "decompose_first": 1, "decompose": sched.syncs() - 1}
    steps, events = ab["step_seconds_by_phase"], ab["event_seconds"]
    total = sum(n * steps[p] for p, n in plan["phase_steps"].items())
    total += sum(n * events[e] for e, n in plan["events"].items())
    assert ab["amortised_step_seconds"] == pytest.approx(total / 2000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_check_stops_at_once_without_cuda(tmp_path):
    script = os.path.join(os.path.dirname(SCRIPT), "gpu_check.py")
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path / "check")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("gpu_check: CUDA is not available here") and "--allow-cpu" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "check").exists()
