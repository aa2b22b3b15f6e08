"""A run directory nobody can turn against its owner, no orphaned workers, every failure in its class: links,
FIFOs and wrong kinds of files in a run directory, a launcher killed in its first moments, AB-training's
divergence, data of the wrong shape, manifests without checksums, half-set launcher variables, a resume after
kill -9, odd config files, signals at any moment, and a run directory removed under a live run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from abtrain.cli import main
from abtrain.methods.ab.lowrank import prepare_model, svd
from abtrain.methods.ab.lowrank.decompose import NonFiniteWeight
from abtrain.run import checkpoint as ckpt
from abtrain.run.launch import external_world
from abtrain.run.lifeline import die_with_parent
from abtrain.run.rundir import RunLock
from abtrain.run.worker import classify
from helpers import catches, children, free_port, left_behind, make_fake_fashion, session_pids, write_idx

ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
JOB = ["train", "--method", "ddp", "--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "16",
       "--log-every", "1", "--seed", "3"]


def _env(**extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT"):
        if var not in extra:
            env.pop(var, None)
    return env


def _one_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _in_process(capsys, argv):
    code = main(argv)
    return code, _one_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped after step 6 of 30 (a complete checkpoint, config.json, status 'stopped')."""
    out = tmp_path_factory.mktemp("hostile") / "stopped"
    p = subprocess.run(ABTRAIN + JOB + ["--steps", "30", "--checkpoint-every", "3", "--stop-after", "6",
                                        "--out", str(out)], capture_output=True, text=True, env=_env(), timeout=240)
    assert p.returncode == 0, p.stderr
    return out


def _copy(stopped, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    return run


def _tree(run):
    return {str(p.relative_to(run)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(run.rglob("*")) if p.name not in ("status.json", ".lock")}


# -- 1 and 10: links, FIFOs and wrong kinds of files in a run directory --------------------------
PLANTS = ["symlink", "fifo", "dir"]


@pytest.mark.parametrize("name", [".lock", "status.json", "config.json", "results.json", "metrics.csv", "model.pt"])
@pytest.mark.parametrize("plant", PLANTS)
def test_a_fresh_run_refuses_a_planted_file_and_leaves_its_target_alone(tmp_path, capsys, name, plant):
    run, target = tmp_path / "run", tmp_path / "precious"
    run.mkdir()
    target.write_text("precious\n")
    path = run / name
    if plant == "symlink":
        path.symlink_to(target)
    elif plant == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    code, line = _in_process(capsys, JOB + ["--steps", "2", "--out", str(run)])
    kind = {"symlink": "a symbolic link", "fifo": "a FIFO", "dir": "a directory"}[plant]
    assert code == 2 and line == (f"abtrain: error: {path} is {kind}, not a regular file: abtrain neither follows "
                                  f"nor replaces it; remove it, or pass another run directory")
    assert target.read_text() == "precious\n"
    assert sorted(os.listdir(run)) == [name]  # nothing written: no config.json, no status.json, no lock


@pytest.mark.parametrize("where", ["checkpoint", "checkpoint/latest.json", "checkpoint/step-00000006",
                                   "checkpoint/step-00000006/rank1.pt", "config.json", "status.json", "tensorboard"])
@pytest.mark.parametrize("plant", ["symlink", "fifo", "file-or-dir"])
def test_a_resume_refuses_a_planted_path_before_reading_it(stopped, tmp_path, capsys, where, plant):
    run = _copy(stopped, tmp_path)
    path = run / where
    is_dir = path.is_dir()
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(path), str(elsewhere))
    if plant == "symlink":
        path.symlink_to(elsewhere)
    elif plant == "fifo":
        os.mkfifo(path)
    elif is_dir:
        path.write_text("a file where a directory belongs\n")
    else:
        path.mkdir()
    before = _tree(run)
    code, line = _in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and f"{path} is " in line and "abtrain neither follows nor replaces it" in line, line
    assert _tree(run) == before


def test_a_run_directory_that_is_a_link_is_refused(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "real")
    code, line = _in_process(capsys, JOB + ["--steps", "2", "--out", str(tmp_path / "run")])
    assert code == 2 and "is a symbolic link, not a directory" in line
    assert os.listdir(tmp_path / "real") == []


def test_the_lock_is_never_opened_through_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link"):
        RunLock(str(tmp_path / "run")).acquire()
    assert target.read_text() == "precious\n"


def test_a_run_directory_removed_under_a_live_run_is_one_line(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(ABTRAIN + JOB + ["--steps", "100000", "--checkpoint-every", "5", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 3/"):
                break
        os.rename(out, tmp_path / "gone")  # rmtree alone races with the run's next write into the directory
        shutil.rmtree(tmp_path / "gone", ignore_errors=True)
        proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = _one_line(proc.stderr.read())
    assert proc.returncode == 4 and line == (f"abtrain: error: run directory {out} was removed while the run was "
                                             f"going on; start the run again")
    assert not out.exists()


# -- 2: workers never outlive their launcher ----------------------------------------------
def test_a_process_whose_parent_died_before_the_tie_ends_itself():
    # The parent it expects is not its parent: as if that one had died before the death signal was armed.
    code = ("import os; from abtrain.run.lifeline import die_with_parent; die_with_parent((os.getppid() + 1,)); "
            "print('survived')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL and "survived" not in p.stdout
    # ... and one whose parent is the expected one lives on.
    die_with_parent((os.getppid(),))


@pytest.mark.parametrize("moment", ["fork server started", "first worker forked"])
def test_a_launcher_killed_in_its_first_moments_leaves_no_process(tmp_path, moment):
    proc = subprocess.Popen(ABTRAIN + JOB + ["--steps", "100000", "--out", str(tmp_path / "run")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), start_new_session=True)
    try:
        found = False
        while not found and proc.poll() is None:
            for child in children(proc.pid):
                try:
                    server = b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes()
                except OSError:
                    continue
                if server and (moment == "fork server started" or children(child)):
                    found = True
                    break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert found
        assert left_behind(proc.pid) == []
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)


# -- 3: AB-training's divergence is a divergence ------------------------------------------------
def test_a_weight_that_cannot_be_decomposed_is_a_divergence_with_the_same_advice(stopped):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    (fp,) = prepare_model(model)
    with torch.no_grad():
        fp.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeight, match="cannot decompose .*holds inf or nan") as err:
        svd(fp)
    assert classify(err.value) == ("diverged", 1, False)
    from abtrain.run.worker import as_divergence
    diverged = as_divergence(err.value, str(stopped), lr=0.05)
    assert classify(diverged) == ("diverged", 1, False)
    assert str(diverged).startswith("cannot decompose ")
    assert ("the last good checkpoint, of step 6" in str(diverged)
            and f"'abtrain train --resume {stopped} --lr 0.005'" in str(diverged))


# -- 4: data of the wrong shape is found before training -----------------------------------------
@pytest.mark.parametrize("split, shape", [("t10k", (28, 27)), ("train", (27, 28)), ("t10k", (32, 32)),
                                          ("train", (14, 14))])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_images_of_the_wrong_size_are_refused_in_the_preflight(tmp_path, capsys, split, shape, model):
    data = make_fake_fashion(tmp_path / "data", n_train=64, n_test=16)
    n = 64 if split == "train" else 16
    write_idx(data / f"{split}-images-idx3-ubyte.gz", np.zeros((n, *shape), dtype=np.uint8))
    code, line = _in_process(capsys, ["train", "--workers", "2", "--model", model, "--dataset", "fashion-mnist",
                                      "--data-dir", str(data), "--steps", "2", "--batch-size", "8",
                                      "--out", str(tmp_path / "run")])
    assert code == 2 and f"images of {shape[0]}x{shape[1]} pixels, Fashion-MNIST's are 28x28" in line
    assert not (tmp_path / "run" / "status.json").exists()


def test_the_model_is_tried_on_the_samples_of_both_splits():
    from abtrain.data import Dataset, DataError, Split
    from abtrain.models import build_model
    from abtrain.run.plan import check_samples
    good = Split(torch.zeros(4, 32), torch.zeros(4, dtype=torch.long))
    ds = Dataset("synthetic", "classify", good, Split(torch.zeros(4, 31), torch.zeros(4, dtype=torch.long)), (32,), 4)
    with pytest.raises(DataError, match=r"the test samples of synthetic have shape \(31,\), the dataset's are \(32,\)"):
        check_samples(ds, build_model("mlp", ds), "mlp")
    wide = Dataset("synthetic", "classify", good, good, (32,), 4)
    with pytest.raises(DataError, match="model mlp cannot take the training samples"):
        check_samples(wide, build_model("mlp", Dataset("synthetic", "classify", good, good, (16,), 4)), "mlp")


# -- 5: a manifest without its checksums is refused ------------------------------------------------
@pytest.mark.parametrize("change", ["no sha256", "one sum missing", "sums not a table"])
def test_a_manifest_without_its_checksums_is_refused(stopped, tmp_path, capsys, change):
    run = _copy(stopped, tmp_path)
    path = run / "checkpoint" / "latest.json"
    manifest = json.loads(path.read_text())
    if change == "no sha256":
        del manifest["sha256"]
    elif change == "one sum missing":
        del manifest["sha256"]["rank1.pt"]
    else:
        manifest["sha256"] = "none"
    path.write_text(json.dumps(manifest))
    shard = run / "checkpoint" / "step-00000006" / "rank1.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only a checksum can tell
    shard.write_bytes(bytes(data))
    before = _tree(run)
    code, line = _in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "the checkpoint cannot be checked, so it is not used" in line, line
    assert _tree(run) == before


# -- 6: half-set launcher variables ------------------------------------------------------------------
WORLD = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "0", **WORLD}, "WORLD_SIZE='0' is not a count of at least 1"),
    ({"RANK": "0", "WORLD_SIZE": "-3", **WORLD}, "WORLD_SIZE='-3' is not a count of at least 1"),
    ({"RANK": "0", "WORLD_SIZE": "two", **WORLD}, "WORLD_SIZE='two' is not a count"),
    ({"RANK": "2", "WORLD_SIZE": "2", **WORLD}, "RANK=2 is outside a world of WORLD_SIZE=2 workers"),
    ({"RANK": "-1", "WORLD_SIZE": "2", **WORLD}, "RANK='-1' is not a count of at least 0"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", **WORLD}, "LOCAL_RANK=2"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3", **WORLD}, "LOCAL_WORLD_SIZE=3 do not fit"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "WORLD_SIZE=2 without MASTER_ADDR"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_NTASKS_PER_NODE": "0", **WORLD},
     "SLURM_NTASKS_PER_NODE='0'"),
])
def test_half_set_launcher_variables_are_refused(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        external_world(dict(env))


def test_half_set_launcher_variables_are_one_line_and_leave_no_lock(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run(ABTRAIN + JOB + ["--steps", "2", "--out", str(out)], capture_output=True, text=True,
                       env=_env(RANK="0", WORLD_SIZE="0", **WORLD), timeout=120)
    assert p.returncode == 2 and "WORLD_SIZE='0'" in _one_line(p.stderr)
    assert not out.exists()  # refused before the run directory was touched


def test_a_peer_that_never_comes_fails_the_run(tmp_path):
    out = tmp_path / "run"
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    p = subprocess.run(ABTRAIN + JOB + ["--steps", "2", "--timeout", "2", "--out", str(out)], capture_output=True,
                       text=True, env=env, timeout=240)
    line = _one_line(p.stderr)
    status = json.loads((out / "status.json").read_text())
    assert p.returncode == 1 and "could not join the world of 2 workers" in line, p.stderr
    assert status["status"] == "failed" and status["kind"] == "peer" and status["exit_code"] == 1


# -- 7: a resume after kill -9 says so ------------------------------------------------------------------
def test_a_resume_after_the_launcher_was_killed_says_so(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    # What a SIGKILLed launcher leaves: 'running' with its pid, and a lock nobody holds.
    (run / "status.json").write_text(json.dumps({"status": "running", "world_size": 2, "pid": 2 ** 22 + 1}))
    p = subprocess.run(ABTRAIN + ["train", "--resume", str(run)], capture_output=True, text=True, env=_env(),
                       timeout=240)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[0] == "abtrain: the run was left 'running' by a process that is gone; resuming it"


# -- 8: config files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("lr = " + "[" * 2000 + "]" * 2000 + "\n", "nests tables or arrays too deeply"),
    ("lr = [[[[[1]]]]]\n", "more than 3 levels deep"),
    ("[ab]\nfull_rank = [[[[\"x\"]]]]\n", "more than 3 levels deep"),
    ("batch-size = 8\nbatch_size = 16\n", "sets batch_size twice, as 'batch-size' and as 'batch_size'"),
    ("ab-tau = 0.1\n[ab]\ntau = 0.2\n", "sets ab.tau twice, as 'ab-tau' and as '[ab] tau'"),
    ("ab_rank_fraction = 0.1\nab-rank-fraction = 0.2\n", "sets ab.rank_fraction twice"),
])
def test_odd_config_files_are_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    code, line = _in_process(capsys, ["train", "--config", str(path), "--out", str(tmp_path / "run")])
    assert code == 2 and message in line, line


def test_a_json_config_with_a_key_twice_is_refused(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text('{"lr": 0.1, "lr": 0.2}')
    code, line = _in_process(capsys, ["train", "--config", str(path), "--out", str(tmp_path / "run")])
    assert code == 2 and "the key 'lr' appears twice" in line


# -- 9: signals at any moment -------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_command_starts_is_one_line_and_exit_130(tmp_path, sig):
    proc = subprocess.Popen(ABTRAIN + JOB + ["--steps", "100000", "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    # Python catches SIGINT from its start; SIGTERM is caught once the command has installed its handlers (both).
    while not catches(proc.pid, signal.SIGTERM) and proc.poll() is None:
        time.sleep(0.005)
    os.kill(proc.pid, sig)  # as soon as the command can catch it: torch is still being imported
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and _one_line(stderr).startswith(f"abtrain: interrupted ({sig.name})"), stderr


def test_a_double_ctrl_c_exits_130_with_one_line(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(ABTRAIN + JOB + ["--steps", "100000", "--checkpoint-every", "5", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step 6/"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends, twice
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    line = _one_line(stderr)
    assert proc.returncode == 130 and line.startswith("abtrain: interrupted (SIGINT)"), stderr
    assert json.loads((out / "status.json").read_text())["status"] == "interrupted"
    assert left_behind(proc.pid) == []


# -- also: a copied run directory, and the refused pickle's message --------------------------------------
def test_a_copied_run_directory_resumes_under_its_new_path(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    p = subprocess.run(ABTRAIN + ["train", "--resume", str(run), "--stop-after", "9"], capture_output=True,
                       text=True, env=_env(), timeout=240)
    assert p.returncode == 0, p.stderr
    assert json.loads((run / "status.json").read_text())["resume"] == f"abtrain train --resume {run}"
    p = subprocess.run(ABTRAIN + ["train", "--resume", str(run)], capture_output=True, text=True, env=_env(),
                       timeout=240)
    assert p.returncode == 0, p.stderr
    assert json.loads((run / "results.json").read_text())["config"]["out"] == str(run)
    assert str(stopped) not in (run / "results.json").read_text()


def test_a_refused_pickle_is_not_advice_to_load_it_unsafely(tmp_path):
    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))
    path = tmp_path / "rank0.pt"
    torch.save({"format": ckpt.FORMAT, "x": Payload()}, path)
    with pytest.raises(ValueError) as err:
        ckpt.load_shard(str(path))
    message = str(err.value)
    assert "Unsupported global" in message and "abtrain does not load it" in message
    assert "weights_only" not in message and "False" not in message
    assert not (tmp_path / "pwned").exists()
