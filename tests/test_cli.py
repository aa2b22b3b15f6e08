"""The CLI as a user types it: end-to-end runs on tiny data, bad input, config files, the flag surface."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from abtrain.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
TINY = ["--steps", "4", "--batch-size", "16", "--limit-test", "64", "--log-every", "2"]


def run(args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        env.pop(var, None)
    return subprocess.run(ABTRAIN + list(args), capture_output=True, text=True, timeout=240, env=env, **kw)


def test_ddp_end_to_end(tmp_path, fashion_dir):
    out = tmp_path / "run"
    p = run(["train", "--workers", "2", "--data-dir", str(fashion_dir), "--model", "cnn", "--out", str(out), *TINY])
    assert p.returncode == 0, p.stderr
    r = json.loads((out / "results.json").read_text())
    for key in ("method", "world_size", "steps", "wall_seconds", "params", "peak_rss_bytes", "history"):
        assert key in r
    assert (r["method"], r["world_size"], r["steps"]) == ("ddp", 2, 4)
    assert 0 <= r["final"]["test_accuracy"] <= 1 and r["final"]["test_loss"] > 0
    comm = r["comm"]
    for key in ("payload_bytes", "wire_bytes", "calls", "by_phase"):
        assert key in comm
    for scope in ("global", "group"):
        assert set(comm["by_scope"][scope]) >= {"payload_bytes", "wire_bytes"}
    assert comm["by_phase"]["train"]["payload_bytes"] == 4 * r["params"] * 4
    row = r["history"][-1]
    assert set(row) >= {"step", "epoch", "test_accuracy", "test_loss", "train_loss", "wire_bytes", "wall_seconds"}
    assert row["wire_bytes"] == pytest.approx(comm["wire_bytes"] - comm["by_phase"]["eval"]["wire_bytes"], rel=0.01)
    assert (out / "metrics.csv").read_text().startswith("step,epoch,test_accuracy")
    assert json.loads((out / "status.json").read_text())["status"] == "complete"
    assert "test accuracy" in p.stdout and "results.json" in p.stdout


def test_ab_end_to_end_with_config_file(tmp_path, fashion_dir):
    out = tmp_path / "ab"
    cfg = tmp_path / "ab.toml"
    cfg.write_text('method = "ab"\nworkers = 4\ngroup-size = 2\nsteps = 100\n'
                   '[ab]\nwarmup-steps = 2\ncycle-steps = 4\nrebound-steps = 1\nrank-fraction = 0.25\n')
    p = run(["train", "--config", str(cfg), "--data-dir", str(fashion_dir), "--model", "cnn", "--out", str(out), *TINY,
             "--steps", "12"])  # the flag overrides the file's steps
    assert p.returncode == 0, p.stderr
    r = json.loads((out / "results.json").read_text())
    assert r["method"] == "ab" and r["steps"] == 12 and r["world_size"] == 4
    assert set(r["comm"]["by_phase"]) >= {"warmup", "ab", "sync", "rebound"}
    assert r["comm"]["by_scope"]["group"]["wire_bytes"] > 0 and r["comm"]["by_scope"]["global"]["wire_bytes"] > 0
    assert r["compression_ratio"] > 1
    assert [p["phase"] for p in r["phases"]] == ["warmup", "ab", "rebound", "ab", "rebound", "ab"]
    assert r["ranks"][0]["step"] == 2 and len(r["ranks"]) == 3
    assert r["svd_seconds"] > 0 and r["sync_seconds"] > 0


BAD = [
    (["--method", "gossip"], "invalid choice"),
    (["--model", "transformer9"], "invalid choice"),
    (["--batch-size", "0"], "must be positive"),
    (["--lr", "-1"], "must be positive"),
    (["--steps", "abc"], "invalid int value"),
    (["--batch-size", "4096"], "larger than each worker's shard"),
    (["--data-dir", "/nonexistent/fashion"], "not found"),
    (["--model", "gpt"], "gpt"),
    (["--method", "ab"], "at least 2 groups"),
    (["--method", "ab", "--group-size", "3", "--workers", "4"], "cannot be split into groups of 3"),
    (["--method", "ab", "--group-size", "1", "--ab-tau", "1.5"], "tau"),
    (["--method", "ab", "--group-size", "1", "--ab-rebound-steps", "10", "--ab-cycle-steps", "10"], "must be smaller"),
    (["--method", "ab", "--group-size", "1", "--ab-full-rank", "*"], "nothing to factorise"),
    (["--method", "ab", "--group-size", "1", "--ab-tau", "0.2", "--ab-rank", "3"], "choose one rank rule"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_clear_line(tmp_path, fashion_dir, args, message):
    out = tmp_path / "bad"
    data = [] if "--data-dir" in args else ["--data-dir", str(fashion_dir)]
    p = run(["train", "--workers", "2", *data, "--out", str(out), "--steps", "2", *args])
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("abtrain: error:"), p.stderr
    assert message in lines[0]
    assert "Traceback" not in p.stderr + p.stdout
    assert not (out / "results.json").exists()


def test_unwritable_run_dir_and_bad_config(tmp_path, fashion_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = run(["train", "--data-dir", str(fashion_dir), "--out", str(blocker / "run")])
    assert p.returncode == 2 and "cannot write to run directory" in p.stderr
    cfg = tmp_path / "c.toml"
    cfg.write_text("lerning_rate = 0.1\n")
    p = run(["train", "--config", str(cfg), "--data-dir", str(fashion_dir)])
    assert p.returncode == 2 and "unknown key 'lerning_rate'" in p.stderr
    cfg.write_text('batch-size = "big"\n')
    p = run(["train", "--config", str(cfg), "--data-dir", str(fashion_dir)])
    assert p.returncode == 2 and "must be an integer" in p.stderr


def test_corrupt_dataset_is_reported(tmp_path, fashion_dir):
    bad = tmp_path / "corrupt"
    shutil.copytree(fashion_dir, bad)
    data = (bad / "train-images-idx3-ubyte.gz").read_bytes()
    (bad / "train-images-idx3-ubyte.gz").write_bytes(data[: len(data) // 2])
    p = run(["train", "--data-dir", str(bad), "--out", str(tmp_path / "r"), "--steps", "2"])
    assert p.returncode == 2
    assert "train-images-idx3-ubyte.gz" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_example_runs_under_torchrun():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    p = subprocess.run(torchrun + [str(ROOT / "examples" / "own_loop.py")], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("test accuracy")]
    assert len(line) == 1
    acc = float(line[0].split()[2].rstrip(";"))
    assert acc > 0.6  # a learnable problem: the factorised model must still learn it


FLAGS = {
    "--config", "--method", "--workers", "--model", "--dataset", "--data-dir", "--epochs", "--steps", "--batch-size",
    "--lr", "--optimizer", "--momentum", "--weight-decay", "--lr-schedule", "--warmup-lr-steps", "--label-smoothing",
    "--grad-clip", "--seed", "--out", "--eval-every", "--log-every", "--group-size", "--backend", "--device",
    "--threads", "--bucket-cap-mb", "--block-size", "--limit-train", "--limit-test", "--timeout", "--ledger",
    "--no-ledger", "--checkpoint-every", "--stop-after", "--max-restarts", "--resume",
    "--ab-warmup-steps", "--ab-cycle-steps", "--ab-rebound-steps", "--ab-tau", "--ab-rank", "--ab-rank-fraction",
    "--ab-energy", "--ab-min-compression", "--ab-truncate-first", "--no-ab-truncate-first", "--ab-sync",
    "--ab-independent", "--no-ab-independent", "--ab-lr-rebound-steps", "--ab-lr-floor", "--ab-split",
    "--ab-optimizer-state", "--ab-init", "--ab-full-rank", "--ab-final-rebound-steps",
    "--localsgd-h", "--diloco-h", "--diloco-outer-lr", "--diloco-outer-momentum", "--powersgd-rank",
    "--powersgd-start-iter", "--powersgd-min-compression-rate", "--powersgd-orthogonalization-epsilon",
    "--powersgd-seed", "--ef21-fraction", "--ef21-warmup-steps", "--onebit-warmup-steps", "--onebit-chunk-size",
    "--hlocalsgd-h",
}


def test_public_flag_surface_is_frozen():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {s for a in train._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    assert flags == FLAGS
    for action in train._actions:
        assert action.help, f"{action.option_strings} has no help text"
