"""How runs end when something goes wrong, as a user meets it: signals to the launcher, dead and stopped
workers, a run directory in use, corrupt or edited checkpoints, divergence, a full disk, temporary files."""

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from abtrain.cli import main
from abtrain.comm.topology import Topology
from abtrain.config import TrainConfig
from abtrain.run import checkpoint as ckpt
from abtrain.run.rundir import RunLock, is_locked, read_status
from abtrain.run.safefile import NoSpaceError, atomic_write, is_no_space, write_json
from abtrain.run.train import Trainer
from abtrain.run.worker import classify
from helpers import launcher_workers

ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
JOB = ["train", "--method", "ddp", "--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "16",
       "--checkpoint-every", "5", "--log-every", "1", "--seed", "3"]


def _env(tmpdir=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(var, None)
    if tmpdir is not None:
        os.makedirs(tmpdir, exist_ok=True)
        env["TMPDIR"] = str(tmpdir)
    return env


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _start(out, steps, *extra, tmpdir=None):
    return subprocess.Popen(ABTRAIN + JOB + ["--steps", str(steps), "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmpdir),
                            start_new_session=True)


def _wait_for_step(proc, step):
    for line in proc.stdout:
        if line.startswith(f"step {step}/"):
            return
    raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()}")


def _finish(proc):
    rest = proc.stdout.read()
    proc.wait(timeout=120)
    return rest, proc.stderr.read()


def _weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _one_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


STEPS = 150


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("rel") / "ref"
    p = subprocess.run(ABTRAIN + JOB + ["--steps", str(STEPS), "--out", str(out)], capture_output=True, text=True,
                       env=_env(), timeout=240)
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped after step 6 of 30 (a complete checkpoint, config.json, status 'stopped')."""
    out = tmp_path_factory.mktemp("rel") / "stopped"
    p = subprocess.run(ABTRAIN + JOB + ["--steps", "30", "--stop-after", "6", "--out", str(out)], capture_output=True,
                       text=True, env=_env(), timeout=240)
    assert p.returncode == 0, p.stderr
    return out


# -- 1: preflight -------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("flags, message", [(["--device", "cuda"], "CUDA is not available"),
                                            (["--backend", "nccl"], "nccl backend needs CUDA")])
def test_device_and_backend_are_checked_before_workers_start(tmp_path, capsys, flags, message):
    code = main(JOB + ["--steps", "5", "--out", str(tmp_path / "run"), *flags])
    assert code == 2 and message in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "status.json").exists()  # refused before any worker started


# -- 2: signals to the launcher -------------------------------------------------
@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGINT to the process group"])
def test_signal_to_the_launcher_stops_the_run_resumably(tmp_path, reference, how):
    out, tmpdir = tmp_path / "run", tmp_path / "tmp"
    proc = _start(out, STEPS, tmpdir=tmpdir)
    _wait_for_step(proc, 12)
    workers = launcher_workers(proc.pid)
    assert len(workers) == 2
    if how.startswith("SIGTERM"):
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, stderr = _finish(proc)
    line = _one_line(stderr)
    status = json.loads((out / "status.json").read_text())
    assert proc.returncode == 130, stderr
    assert status["status"] == "interrupted" and status["checkpoint"] >= 10
    assert f"the checkpoint of step {status['checkpoint']} is kept" in line and f"--resume {out}" in line
    assert not any(_alive(w) for w in workers)
    assert os.listdir(tmpdir) == []  # torch's temporary files went with the run
    if how.startswith("SIGINT"):
        return  # resuming once (below) is enough
    p = subprocess.run(ABTRAIN + ["train", "--resume", str(out)], capture_output=True, text=True, env=_env(),
                       timeout=240)
    assert p.returncode == 0, p.stderr
    assert _same(_weights(out), _weights(reference))


# -- 2 and 7: the run directory's lock ----------------------------------------------
def test_a_live_run_owns_its_directory_until_it_dies(tmp_path, capsys, monkeypatch):
    out, tmpdir = tmp_path / "run", tmp_path / "tmp"
    proc = _start(out, 100000, tmpdir=tmpdir)
    try:
        _wait_for_step(proc, 5)
        assert is_locked(str(out))
        for args in (JOB + ["--steps", "5", "--out", str(out)], ["train", "--resume", str(out)]):
            code = main(args)
            line = _one_line(capsys.readouterr().err)
            assert code == 2 and "is in use by another abtrain process" in line, line
        workers = launcher_workers(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # no handler runs: the kernel releases the lock, workers follow
        proc.wait(timeout=30)
        deadline = time.time() + 30
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads((out / "status.json").read_text())["status"] == "running"
    assert not is_locked(str(out)) and read_status(str(out))["status"] == "interrupted"
    # SIGKILL ran no cleanup: the next launcher removes the dead one's temporary directory, and its fork
    # server's socket directory.
    from abtrain.run.fork_server import SOCKET_DIR_RECORD
    from abtrain.run.private_tmp import remove_orphaned
    private = [n for n in os.listdir(tmpdir) if n.startswith(f"abtrain-{proc.pid}-")]
    assert len(private) == 1
    socket_dir = (tmpdir / private[0] / SOCKET_DIR_RECORD).read_text()  # under tmpdir, or /tmp if that is too long
    assert os.path.isdir(socket_dir) and os.path.basename(socket_dir).startswith("pymp-")
    assert sorted(os.listdir(tmpdir)) == sorted(private + [os.path.basename(socket_dir)] * (
        os.path.dirname(socket_dir) == str(tmpdir)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    assert remove_orphaned() == [str(tmpdir / private[0])]
    assert os.listdir(tmpdir) == [] and not os.path.exists(socket_dir)


def test_lock_is_exclusive_and_released(tmp_path):
    with RunLock(str(tmp_path)):
        with pytest.raises(ValueError, match=f"pid {os.getpid()}"):
            RunLock(str(tmp_path)).acquire()
    RunLock(str(tmp_path)).acquire().release()


# -- 3: a dead worker -----------------------------------------------------------------
def test_a_killed_worker_is_one_line_with_its_own_exit_code(tmp_path):
    out, tmpdir = tmp_path / "run", tmp_path / "tmp"
    proc = _start(out, STEPS, tmpdir=tmpdir)
    _wait_for_step(proc, 12)
    os.kill(launcher_workers(proc.pid)[0], signal.SIGKILL)
    _, stderr = _finish(proc)
    line = _one_line(stderr)
    assert proc.returncode == 3, stderr
    assert "died (killed by SIGKILL) at step" in line and "gloo" not in line and f"--resume {out}" in line
    status = json.loads((out / "status.json").read_text())
    assert status["kind"] == "worker-died" and status["exit_code"] == 3
    assert os.listdir(tmpdir) == []  # no torchelastic_* directory, no pytorch-errorfile-*


# -- 11: a stopped worker ends like the timeout it causes ------------------------------
def test_a_stopped_worker_fails_after_the_timeout_with_exit_code_1(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, 100000, "--timeout", "5")
    _wait_for_step(proc, 8)
    stopped = launcher_workers(proc.pid)[1]
    os.kill(stopped, signal.SIGSTOP)
    _, stderr = _finish(proc)
    line = _one_line(stderr)
    status = json.loads((out / "status.json").read_text())
    assert proc.returncode == 1 and "peer stopped answering?" in line, stderr
    assert status["retry"] is True and status["exit_code"] == 1


# -- 4, 6, 11: checkpoints and configuration checked on resume ---------------------------
def _copy(stopped, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(stopped, d)
    return d


def test_a_corrupt_shard_of_unchanged_size_is_refused(stopped, tmp_path, capsys):
    d = _copy(stopped, tmp_path)
    shard = d / "checkpoint" / "step-00000006" / "rank1.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)  # zeroed bytes inside a tensor
    shard.write_bytes(bytes(data))
    assert main(["train", "--resume", str(d)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"checkpoint shard {shard} is corrupt" in line


@pytest.mark.parametrize("key, value", [("lr", 0.5), ("steps", 3)])
def test_an_edited_config_json_is_refused_naming_the_keys(stopped, tmp_path, capsys, key, value):
    d = _copy(stopped, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config[key] = value
    (d / "config.json").write_text(json.dumps(config))
    assert main(["train", "--resume", str(d)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "differs from the configuration the checkpoint of step 6 was written with" in line and f"({key})" in line


def test_a_refused_stop_after_on_resume_leaves_the_status_alone(stopped, tmp_path, capsys):
    d = _copy(stopped, tmp_path)
    before = (d / "status.json").read_bytes()
    assert main(["train", "--resume", str(d), "--stop-after", "4"]) == 2
    assert "already at step 6" in _one_line(capsys.readouterr().err)
    assert (d / "status.json").read_bytes() == before


# -- 5: divergence -------------------------------------------------------------------
def _diverging(run_dir, lr):
    return TrainConfig(method="ddp", model="mlp", dataset="synthetic", steps=60, batch_size=16, log_every=100,
                       lr=lr, warmup_lr_steps=200, checkpoint_every=5, seed=3)


def test_divergence_keeps_a_checkpoint_with_a_sane_loss_and_resumes_with_a_lower_lr(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    write_json(os.path.join(run_dir, "config.json"), _diverging(run_dir, 20.0).to_dict())
    trainer = Trainer(_diverging(run_dir, 20.0), Topology(), run_dir)
    with pytest.raises(FloatingPointError) as err:
        trainer.run()
    manifest = ckpt.read_manifest(run_dir)
    good = manifest["step"]
    # Finite but exploding checkpoints came after it; only one whose loss is sane is named.
    assert manifest["train_loss"] < 3 * torch.log(torch.tensor(4.0)).item()
    assert f"last good checkpoint, of step {good} " in str(err.value) and "--lr 2" in str(err.value)
    assert sorted(os.listdir(ckpt.checkpoint_root(run_dir))) == ["latest.json", f"step-{good:08d}"]
    resumed = Trainer(_diverging(run_dir, 2.0), Topology(), run_dir, resume=True)
    assert resumed.step == good
    results = resumed.run()
    assert results["resumes"] == [{"step": good, "lr": 2.0, "before": {"lr": 20.0}}]
    assert ckpt.read_manifest(run_dir)["settings"]["lr"] == 2.0  # a later plain resume keeps it


def test_resume_may_lower_the_lr_and_keeps_it_afterwards(stopped, tmp_path):
    from abtrain.cli import build_parser, config_for_resume
    d = _copy(stopped, tmp_path)
    cfg = config_for_resume(build_parser().parse_args(["train", "--resume", str(d), "--lr", "0.01"]))
    assert cfg.lr == 0.01
    manifest = json.loads((d / "checkpoint" / "latest.json").read_text())
    manifest["settings"] = {"lr": 0.02, "grad_clip": 1.0}  # what an earlier resume changed
    (d / "checkpoint" / "latest.json").write_text(json.dumps(manifest))
    cfg = config_for_resume(build_parser().parse_args(["train", "--resume", str(d)]))
    assert (cfg.lr, cfg.grad_clip) == (0.02, 1.0)


# -- 8: a full disk ---------------------------------------------------------------------
def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    cfg = TrainConfig(method="ddp", model="mlp", dataset="synthetic", steps=20, batch_size=16, log_every=100,
                      checkpoint_every=3, seed=3)
    trainer = Trainer(cfg, Topology(), run_dir)
    real_fsync = os.fsync

    def fsync(fd):
        if trainer.step >= 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(NoSpaceError) as err:
        trainer.run()
    assert str(err.value) == (f"no space left on device while writing the checkpoint of step 6 in "
                              f"{ckpt.checkpoint_root(run_dir)}; the checkpoint of step 3 is intact")
    assert classify(err.value)[1] == 4
    assert ckpt.read_manifest(run_dir)["step"] == 3
    assert sorted(os.listdir(ckpt.checkpoint_root(run_dir))) == ["latest.json", "step-00000003"]
    ckpt.load_shard(ckpt.shard_path(run_dir, ckpt.read_manifest(run_dir), 0))


def test_a_full_disk_inside_torch_save_is_recognised():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")
    except RuntimeError as exc:
        assert is_no_space(exc)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounts a small tmpfs (root)")
def test_a_full_disk_ends_the_run_with_exit_code_4(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = disk / "run"  # one checkpoint of this job takes ~1.3 MB: the second does not fit
        p = subprocess.run(ABTRAIN + JOB + ["--steps", "40", "--out", str(out)], capture_output=True, text=True,
                           env=_env(), timeout=240)
        line = _one_line(p.stderr)
        assert p.returncode == 4, p.stderr
        assert line == (f"abtrain: error: no space left on device while writing the checkpoint of step 10 in "
                        f"{out}/checkpoint; the checkpoint of step 5 is intact")
        assert ckpt.read_manifest(str(out))["step"] == 5
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_shard_whose_directory_another_worker_removed_reports_the_full_disk(tmp_path, monkeypatch):
    """Worker 0 fills the disk and removes the step's directory while worker 1 still writes there: worker 1's
    missing file is the same full disk, and says so (the launcher reports whichever worker failed first)."""
    run = str(tmp_path / "run")
    os.makedirs(run)  # the trainer makes it at its start
    ckpt.save(run, 5, 1, {"step": 5}, lambda: None, None, 2, True, None)
    ckpt.save(run, 5, 0, {"step": 5}, lambda: None, {"step": 5}, 2, True, None)

    def removed_while_writing(path, state):
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)

        def write(fh):
            shutil.rmtree(directory)  # what worker 0 does after its ENOSPC, while this file is being written
            torch.save(state, fh)
        atomic_write(path, write)  # the rename into the removed directory: FileNotFoundError

    monkeypatch.setattr(ckpt, "save_shard", removed_while_writing)
    with pytest.raises(NoSpaceError, match="writing the checkpoint of step 10 .*; the checkpoint of step 5 is intact"):
        ckpt.save(run, 10, 1, {"step": 10}, lambda: None, None, 2, True, None)
    assert not os.path.exists(ckpt.step_dir(run, 10)) and ckpt.read_manifest(run)["step"] == 5
    # a missing file while the step's directory is still there is not a full disk
    os.makedirs(ckpt.step_dir(run, 15))
    monkeypatch.setattr(ckpt, "save_shard", lambda path, state: open(os.path.join(str(tmp_path), "nowhere", "x")))
    with pytest.raises(FileNotFoundError):
        ckpt.save(run, 15, 1, {"step": 15}, lambda: None, None, 2, True, None)


# -- 9: file modes ---------------------------------------------------------------------------
def test_output_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    os.umask(old)
    write_json(str(tmp_path / "a.json"), {"x": 1})
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o666 & ~old


# -- 11: smaller things ------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--steps", "99999999999999999999"], "--steps 99999999999999999999 is beyond any real run"),
    (["--timeout", "0.5"], "--timeout must be between 1 and 604800 seconds"),
])
def test_absurd_counts_and_timeouts_are_refused(tmp_path, capsys, flags, message):
    assert main(JOB + ["--out", str(tmp_path / "run"), *flags]) == 2
    assert message in _one_line(capsys.readouterr().err)


def test_config_file_problems_name_the_file(tmp_path, capsys):
    latin = tmp_path / "latin1.toml"
    latin.write_bytes('method = "ddp" # caf\xe9\n'.encode("latin-1"))
    for path, message in ((latin, f"config file {latin} is not UTF-8 text"),
                          (tmp_path, f"config file {tmp_path} is a directory")):
        assert main(JOB + ["--steps", "5", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
        assert message in _one_line(capsys.readouterr().err)


def test_an_idx_file_with_the_wrong_number_of_dimensions_says_so(tmp_path):
    import numpy as np

    from abtrain.data import DataError, load_fashion_mnist
    from helpers import make_fake_fashion, write_idx
    d = make_fake_fashion(tmp_path / "fashion", n_train=32, n_test=16)
    write_idx(d / "train-images-idx3-ubyte.gz", np.zeros((32, 28, 28, 1), dtype=np.uint8))
    with pytest.raises(DataError, match="declares 4 dimensions, expected 3"):
        load_fashion_mnist(d)


def test_many_more_workers_than_cores_warns_about_memory(capsys):
    from abtrain.run.launch import _warn_about_memory
    _warn_about_memory(64 * (os.cpu_count() or 1))
    assert "expect high memory use" in _one_line(capsys.readouterr().err)
    _warn_about_memory(1)
    assert capsys.readouterr().err == ""
