"""Restarts as a user meets them: --stop-after / --resume, a worker SIGKILLed under --max-restarts, refusals."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from abtrain.cli import main
from abtrain.run.checkpoint import VERSION
from helpers import launcher_workers

ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
STEPS = 40


def _env():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(var, None)
    return env


def _args(fashion_dir, out, *extra):
    return ["train", "--workers", "2", "--method", "ab", "--group-size", "1", "--model", "mlp",
            "--data-dir", str(fashion_dir), "--limit-test", "64", "--batch-size", "8", "--steps", str(STEPS),
            "--eval-every", "10", "--log-every", "1", "--seed", "7", "--ab-warmup-steps", "4",
            "--ab-sync-every", "8", "--ab-rebound-steps", "2", "--ab-rank-fraction", "0.25",
            "--out", str(out), *extra]


def run(args):
    return subprocess.run(ABTRAIN + list(args), capture_output=True, text=True, timeout=240, env=_env())


def _weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.fixture(scope="module")
def reference(fashion_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("restart") / "ref"
    p = run(_args(fashion_dir, out))
    assert p.returncode == 0, p.stderr
    return out


def test_stop_then_resume_equals_uninterrupted(fashion_dir, tmp_path, reference):
    out = tmp_path / "run"
    p = run(_args(fashion_dir, out, "--stop-after", "13"))
    assert p.returncode == 0, p.stderr
    assert "--resume" in p.stdout
    assert json.loads((out / "status.json").read_text())["status"] == "stopped"
    assert not (out / "results.json").exists()
    p = run(["train", "--resume", str(out)])
    assert p.returncode == 0, p.stderr
    assert "continuing from the checkpoint of step 13" in p.stdout
    assert json.loads((out / "status.json").read_text())["status"] == "complete"
    assert _same(_weights(out), _weights(reference))
    ref, res = (json.loads((d / "results.json").read_text()) for d in (reference, out))
    assert res["comm"]["wire_bytes"] == ref["comm"]["wire_bytes"] and res["final"] == ref["final"]


def test_sigkilled_worker_restarts_and_finishes_identically(fashion_dir, tmp_path, reference):
    out = tmp_path / "killed"
    proc = subprocess.Popen(ABTRAIN + _args(fashion_dir, out, "--checkpoint-every", "4", "--max-restarts", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    killed = None
    deadline = time.time() + 200
    for line in proc.stdout:
        if killed is None and line.startswith("step 15/"):
            workers = launcher_workers(proc.pid)
            assert len(workers) == 2
            killed = workers[-1]
            os.kill(killed, signal.SIGKILL)
        assert time.time() < deadline
    proc.wait(timeout=200)
    assert killed is not None
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    # One line says what happened; the survivor's lost-peer error and gloo's text stay out of sight.
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    # rank 0 printed step 15; in an AB phase (groups of one worker) the killed worker may be a few steps behind it,
    # past the checkpoint of step 12 that every worker wrote
    assert re.fullmatch(r"abtrain: worker [01] died \(killed by SIGKILL\) at step 1[2-9], restarting from the "
                        r"checkpoint of step (12|16)", lines[0]), lines[0]
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "complete"
    assert _same(_weights(out), _weights(reference))


def test_resume_refusals_are_one_line(fashion_dir, tmp_path, reference, capsys):
    # A directory with an unfinished run's checkpoint (its manifest is all the checks before launching read).
    stopped = tmp_path / "stopped"
    (stopped / "checkpoint").mkdir(parents=True)
    (stopped / "config.json").write_text((reference / "config.json").read_text())
    (stopped / "checkpoint" / "latest.json").write_text(json.dumps(
        {"format": "abtrain-checkpoint", "version": VERSION, "step": 3, "world_size": 4, "dir": "step-00000003",
         "files": {}, "sha256": {}}))
    cases = [
        (["--resume", str(reference)], "finished run"),
        (["--resume", str(tmp_path / "nowhere")], "no such run directory"),
        (["--resume", str(reference), "--batch-size", "4"], "--batch-size would change it"),
        (["--resume", str(tmp_path)], "has no config.json"),
        (_args(fashion_dir, stopped)[1:], "holds a checkpoint of an unfinished run"),
        (["--resume", str(stopped)], "written by 4 workers, this run has 2"),
    ]
    for args, message in cases:
        code = main(["train", *args])  # these checks run before any worker starts
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, lines)
    assert json.loads((reference / "status.json").read_text())["status"] == "complete"


def test_a_run_stopped_inside_a_local_warm_up_resumes_to_the_same_model(fashion_dir, tmp_path):
    """--ab-dense-comm local: the workers' models differ inside the warm-up; each worker's checkpoint shard keeps its
    own, so a run stopped there resumes to the uninterrupted run's model and bytes."""
    local = ("--ab-dense-comm", "local", "--ab-warmup-steps", "6")
    ref, out = tmp_path / "ref", tmp_path / "run"
    p = run(_args(fashion_dir, ref, *local))
    assert p.returncode == 0, p.stderr
    p = run(_args(fashion_dir, out, *local, "--stop-after", "3"))
    assert p.returncode == 0, p.stderr
    p = run(["train", "--resume", str(out)])
    assert p.returncode == 0, p.stderr
    assert "continuing from the checkpoint of step 3" in p.stdout
    assert _same(_weights(out), _weights(ref))
    a, b = (json.loads((d / "results.json").read_text()) for d in (ref, out))
    assert b["comm"]["wire_bytes"] == a["comm"]["wire_bytes"] and b["final"] == a["final"]
    assert "warmup" not in a["comm"]["by_phase"]  # the warm-up sent nothing


def test_a_run_with_an_outer_step_and_a_quantised_sync_resumes_to_the_same_model(fashion_dir, tmp_path):
    """--ab-outer-lr/--ab-outer-momentum with --ab-sync-codec e3m0: the outer step's momenta and starting points
    and the sync's error memories travel in the checkpoint, so a run stopped between two syncs resumes to the
    uninterrupted run's model, bytes and peak step."""
    opts = ("--ab-outer-lr", "0.7", "--ab-outer-momentum", "0.9", "--ab-sync-codec", "e3m0", "--ab-rebound-steps", "0")
    ref, out = tmp_path / "ref", tmp_path / "run"
    p = run(_args(fashion_dir, ref, *opts))
    assert p.returncode == 0, p.stderr
    p = run(_args(fashion_dir, out, *opts, "--stop-after", "13"))
    assert p.returncode == 0, p.stderr
    p = run(["train", "--resume", str(out)])
    assert p.returncode == 0, p.stderr
    assert _same(_weights(out), _weights(ref))
    a, b = (json.loads((d / "results.json").read_text()) for d in (ref, out))
    assert b["final"] == a["final"] and b["comm"]["wire_bytes"] == a["comm"]["wire_bytes"]
    assert b["comm"]["peak_global_step_bytes"] == a["comm"]["peak_global_step_bytes"] > 0
