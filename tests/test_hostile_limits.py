"""What a hostile user cannot make abtrain do: delete or change a file outside its run directory (temporary
directories planted in $TMPDIR, hard links in the run directory), start workers with values no consumer holds,
hang at start-up, drown its one line in torch's logs, hang or crash the library, die silently on a signal, print
more than one line, say the wrong thing, or read a file of gigabytes."""

import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import abtrain
from abtrain.cli import build_parser, config_from_args, main
from abtrain.comm.topology import Topology
from abtrain.config import SECTIONS, config_fields
from abtrain.methods import registry
from abtrain.run.interrupt import signal_name
from abtrain.run.private_tmp import remove_orphaned
from helpers import ABTRAIN, catches, clean_env, free_port, left_behind, one_line, tree_digest

CLI = [sys.executable, *ABTRAIN]
JOB = ["train", "--method", "ddp", "--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "16",
       "--log-every", "1", "--seed", "3"]


def _in_process(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    return code, one_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped after step 6 of 30 (a complete checkpoint, config.json, status 'stopped')."""
    out = tmp_path_factory.mktemp("limits") / "stopped"
    p = subprocess.run(CLI + JOB + ["--steps", "30", "--checkpoint-every", "3", "--stop-after", "6", "--out", str(out)],
                       capture_output=True, text=True, env=clean_env(), timeout=240)
    assert p.returncode == 0, p.stderr
    return out


def _copy(stopped, tmp_path):
    run = tmp_path / "parent" / "run"
    shutil.copytree(stopped, run)
    return run


# -- 1: the clean-up of a killed launcher's temporary directories removes only what it can have made ----------
def _plant_tmp(root: Path, victim: Path) -> dict[str, Path]:
    """Under ``root`` (a $TMPDIR anyone can write into): directories named like a dead launcher's private one,
    each recording a fork-server socket directory that is someone else's."""
    dead = 4_194_400  # above any pid Linux hands out (pid_max <= 2**22)
    (victim / "pymp-abcdefgh").mkdir(parents=True)
    (victim / "pymp-abcdefgh" / "keep").write_text("precious\n")
    (root / "pymp-linkedxx").symlink_to(victim / "pymp-abcdefgh")
    plants = {}
    for n, (recorded, mode, owner) in enumerate([
            (victim / "pymp-abcdefgh", 0o700, None),          # a socket directory somewhere else
            (root / "pymp-linkedxx", 0o700, None),            # a link in the right place
            (root / ".." / root.name / "pymp-zzzzzzzz", 0o700, None),  # not a plain path
            (root / "pymp-ownedxxx", 0o755, None),            # others may write into the private directory
            (root / "pymp-ownedxxx", 0o700, 12345)]):         # another user's private directory
        d = root / f"abtrain-{dead + n}-plant{n:03d}"
        d.mkdir()
        (d / "fork-server-dir").write_text(str(recorded))
        os.chmod(d, mode)
        if owner is not None:
            os.chown(d, owner, owner)
        plants[f"plant{n}"] = d
    (root / "pymp-ownedxxx").mkdir(mode=0o700)
    (root / "pymp-zzzzzzzz").mkdir(mode=0o700)
    (root / f"abtrain-{dead + 9}-linkxxxx").symlink_to(victim)  # a link named like a private directory
    return plants


@pytest.mark.skipif(os.geteuid() != 0, reason="plants a directory of another user (chown)")
def test_the_temporary_clean_up_removes_only_what_a_dead_launcher_of_this_user_made(tmp_path):
    root, victim = tmp_path / "tmp", tmp_path / "victim"
    root.mkdir()
    plants = _plant_tmp(root, victim)
    before_victim = tree_digest(victim)
    # The one directory a dead launcher of this user can have left: removed, with its socket directory.
    mine = root / "abtrain-4194410-mineabcd"
    mine.mkdir(mode=0o700)
    (root / "pymp-minexxxx").mkdir(mode=0o700)
    (mine / "fork-server-dir").write_text(str(root / "pymp-minexxxx"))
    p = subprocess.run(CLI + JOB + ["--steps", "2", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                       env=clean_env(TMPDIR=str(root)), timeout=240)
    assert p.returncode == 0, p.stderr
    assert tree_digest(victim) == before_victim
    assert not mine.exists() and not (root / "pymp-minexxxx").exists()
    left = {p.name for p in root.iterdir()}
    assert left >= {"pymp-linkedxx", "pymp-ownedxxx", "pymp-zzzzzzzz", "abtrain-4194409-linkxxxx",
                    plants["plant3"].name, plants["plant4"].name}, left
    # The clean-up itself, once more: nothing further goes.
    assert remove_orphaned(str(root)) == []
    assert tree_digest(victim) == before_victim and (root / "pymp-ownedxxx").is_dir()


# -- 2: a hard link in the run directory never carries a write outside it -------------------------------
def test_a_hard_link_at_the_lock_is_refused_and_its_other_name_kept(tmp_path, capsys):
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.write_text("precious\n")
    os.link(outside, run / ".lock")
    code, line = _in_process(capsys, JOB + ["--steps", "2", "--out", str(run)])
    assert code == 2 and line == (f"abtrain: error: {run / '.lock'} has 2 hard links: abtrain writes into it in "
                                  f"place, which would change the file behind its other names too; remove it, or "
                                  f"pass another run directory")
    assert outside.read_text() == "precious\n" and sorted(os.listdir(run)) == [".lock"]


def test_files_replaced_by_rename_leave_their_hard_linked_other_names_alone(tmp_path):
    parent = tmp_path / "parent"
    run = parent / "run"
    run.mkdir(parents=True)
    for name in ("status.json", "config.json", "metrics.csv", "model.pt"):
        (parent / f"outside-{name}").write_text("precious\n")
        os.link(parent / f"outside-{name}", run / name)
    before = tree_digest(parent, skip=("run",))
    p = subprocess.run(CLI + JOB + ["--steps", "3", "--out", str(run)], capture_output=True, text=True,
                       env=clean_env(), timeout=240)
    assert p.returncode == 0, p.stderr
    after = tree_digest(parent, skip=("run",))
    assert {k: v[:2] for k, v in after.items()} == {k: v[:2] for k, v in before.items()}  # bytes, not link counts
    assert json.loads((run / "status.json").read_text())["status"] == "complete"


# -- 3: every numeric flag and TOML value is refused before any worker starts when no consumer holds it --------
def _numeric_flags():
    flags = [("ddp", "--" + f.name.replace("_", "-"), f.name, None) for f in config_fields()
             if str(f.type).split(" ")[0] in ("int", "float")]
    for spec in registry.with_options():
        for f in dataclasses.fields(SECTIONS[spec.section]):
            if str(f.type).split(" ")[0] in ("int", "float"):
                flags.append((spec.name, f"--{spec.name}-{f.name.replace('_', '-')}", f.name, spec.section))
    return flags


HOSTILE_VALUES = ["-1", "nan", "inf", "-inf", "1e308", "1" * 30, "-" + "1" * 30]


def _build(argv):
    return config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("method, flag, name, section", _numeric_flags(), ids=lambda v: str(v))
def test_every_numeric_flag_refuses_what_no_consumer_holds(tmp_path, method, flag, name, section):
    base = ["train", "--method", method, "--workers", "2", "--model", "mlp", "--dataset", "synthetic",
            "--out", str(tmp_path / "run")]
    for value in HOSTILE_VALUES:
        with pytest.raises((ValueError, SystemExit)) as err:
            _build(base + [f"{flag}={value}"])
        if err.type is ValueError:  # AB-training's rank rules name the option by its rule ("fraction must be ...")
            message = str(err.value)
            assert (flag in message or f"{name.split('_')[-1]} must be" in message) and "\n" not in message, \
                (value, message)
        # ... and the same value in a TOML file, under the option's own name
        text = f"method = {json.dumps(method)}\n" + (f"[{section}]\n" if section else "") + f"{name} = {value}\n"
        path = tmp_path / "c.toml"
        path.write_text(text)
        from abtrain.config import TrainConfig, merge, nest, read_config_file
        with pytest.raises(ValueError) as err:
            TrainConfig.from_dict(merge(read_config_file(str(path)), nest({"method": method})))
        assert flag in str(err.value) or f"{name.split('_')[-1]} must be" in str(err.value), (value, err.value)


@pytest.mark.parametrize("flag, limit", [("--threads", "1,024"), ("--streaming-diloco-scale-block", "65,536")])
def test_a_field_declares_a_narrower_range_where_its_consumer_holds_less(tmp_path, flag, limit):
    method = "streaming-diloco" if flag.startswith("--streaming") else "ddp"
    with pytest.raises(ValueError, match=f"^{flag} 1000000000 is beyond any real run \\(at most {limit}\\)"):
        _build(["train", "--method", method, "--out", str(tmp_path / "run"), f"{flag}=1000000000"])


@pytest.mark.parametrize("flag, value", [("--lr", "1e308"), ("--weight-decay", "1e308"), ("--bucket-cap-mb", "1e308"),
                                         ("--powersgd-seed", "-1")])
def test_a_value_no_consumer_holds_is_one_line_before_any_worker(tmp_path, flag, value):
    out = tmp_path / "run"
    method = ["--method", "powersgd"] if flag.startswith("--powersgd") else []
    p = subprocess.run(CLI + JOB + method + ["--steps", "2", flag, value, "--out", str(out)], capture_output=True,
                       text=True, env=clean_env(), timeout=240)
    line = one_line(p.stderr)
    assert p.returncode == 2 and line.startswith(f"abtrain: error: {flag} ") and not out.exists(), line


# -- 4: a start-up has a deadline, and a signal during it ends it as at any other time ----------------------
SERVER_HANGS = "import sys, time\nif 'abtrain.run.fork_server_tie' in sys.modules:\n    time.sleep(3600)\n"
PATCHED = ("import sys; import abtrain.run.launch as launch; launch.MIN_START_S = float(sys.argv.pop(1)); "
           "from abtrain.cli import main; sys.exit(main())")


def _hanging_start(tmp_path, deadline_s, *extra):
    """The real launcher, whose fork server hangs while it imports the workers' code (a plugin module that sleeps
    there), with its start-up deadline at ``deadline_s`` seconds (--timeout 1)."""
    (tmp_path / "hang_in_server.py").write_text(SERVER_HANGS)
    env = clean_env(ABTRAIN_METHOD_MODULES="hang_in_server",
                    PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", PATCHED, str(deadline_s), *JOB, "--steps", "4", "--timeout", "1",
                             "--out", str(tmp_path / "run"), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)


def test_a_start_up_that_hangs_ends_at_its_deadline_in_one_line(tmp_path):
    proc = _hanging_start(tmp_path, 3)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = one_line(stderr)
    assert proc.returncode == 1 and "the workers did not start within 3 s" in line, stderr
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and status["kind"] == "start"
    assert left_behind(proc.pid) == []


def test_signals_while_the_start_up_hangs_end_it_as_at_any_other_time(tmp_path):
    proc = _hanging_start(tmp_path, 300)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "run" / "status.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the launcher now waits on its fork server
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the fork server gets it too
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and one_line(stderr).startswith("abtrain: interrupted (SIGINT)"), stderr
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "interrupted"
    assert left_behind(proc.pid) == []


# -- 5: a worker that cannot join says so in one line, before torch's logs --------------------------------
def test_a_worker_without_rank_0_fails_in_one_line(tmp_path):
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()))
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    p = subprocess.run(CLI + JOB + ["--steps", "2", "--timeout", "2", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 1 and "worker 1 could not join the world of 2 workers" in one_line(p.stderr)


def test_a_master_address_that_does_not_resolve_is_refused_before_start(tmp_path, capsys, monkeypatch):
    for name, value in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    code, line = _in_process(capsys, JOB + ["--steps", "2", "--out", str(tmp_path / "run")])
    assert code == 2 and "MASTER_ADDR='no-such-host.invalid' does not resolve" in line
    assert not (tmp_path / "run").exists()


# -- 6: the library refuses what it cannot run, naming the argument and what it accepts ------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    ({"total_steps": 10 ** 30, "sync": "only-b"}, ValueError, "total_steps must be an integer from 1 to 1,000,000,000"),
    ({"total_steps": float("nan")}, TypeError, "total_steps must be an integer from 1"),
    ({"total_steps": "10"}, TypeError, "total_steps must be an integer from 1"),
    ({"total_steps": 0}, ValueError, "total_steps must be an integer from 1"),
    ({"total_steps": -5}, ValueError, "total_steps must be an integer from 1"),
    ({"timeout_s": -1}, ValueError, r"timeout_s must be a number of seconds in \(0, 604800\]"),
    ({"timeout_s": float("inf")}, ValueError, "timeout_s must be a number of seconds in"),
    ({"backend": "mpi2"}, ValueError, "unknown backend 'mpi2'; choose one of: auto, gloo, nccl"),
    ({"device": "tpu"}, ValueError, "unknown device 'tpu'; choose one of: auto, cpu, cuda"),
])
def test_setup_refuses_arguments_out_of_range(kwargs, error, message):
    start = time.monotonic()
    with pytest.raises(error, match=message):
        abtrain.setup("ab" if "total_steps" in kwargs else "ddp", **kwargs)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("kwargs, error, message", [
    ({"rank": 5, "world_size": 2}, ValueError, r"rank in \[0, world_size\)"),
    ({"world_size": 0}, ValueError, "world_size must be >= 1"),
    ({"rank": -1, "world_size": 2}, ValueError, r"rank in \[0, world_size\)"),
    ({"world_size": 2.0}, TypeError, "world_size must be an integer"),
    ({"world_size": 2, "local_world_size": 3}, ValueError, r"local_world_size must be in \[1, world_size=2\]"),
])
def test_topology_refuses_a_world_that_cannot_be(kwargs, error, message):
    with pytest.raises(error, match=message):
        Topology(**kwargs)


# -- 7: every signal that ends a run ends it as SIGTERM does -------------------------------------------------
@pytest.mark.parametrize("sig, moment", [(signal.SIGHUP, "start"), (signal.SIGUSR1, "step 3"),
                                         (signal.SIGRTMIN + 2, "step 3")])
def test_other_signals_end_a_run_as_sigterm_does(tmp_path, sig, moment):
    out = tmp_path / "run"
    proc = subprocess.Popen(CLI + JOB + ["--steps", "100000", "--checkpoint-every", "2", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)
    try:
        if moment == "start":  # as soon as the command's own handlers are in: torch is still being imported
            while not catches(proc.pid, signal.SIGTERM) and proc.poll() is None:
                time.sleep(0.005)
        else:
            for line in proc.stdout:
                if line.startswith(f"{moment}/"):
                    break
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    name = signal_name(sig)
    assert proc.returncode == 130 and one_line(stderr).startswith(f"abtrain: interrupted ({name})"), stderr
    if moment != "start":
        assert json.loads((out / "status.json").read_text())["status"] == "interrupted"
    assert left_behind(proc.pid) == []


SWALLOWED = """
import os, signal, time
from abtrain.run import interrupt
interrupt.install()
class Dropped:
    def __del__(self):  # Python prints what a __del__ raises and goes on, as it does in the import system's callbacks
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(1000):
            pass
Dropped()
try:
    time.sleep(20)
    print("lost")
except KeyboardInterrupt as exc:
    interrupt.acknowledge()
    print("caught", interrupt.signal_of(exc))
"""


def test_an_interruption_raised_where_python_only_prints_it_is_delivered_again():
    # A SIGHUP met while torch was being imported raised inside a weakref callback of the import system: Python
    # printed the exception, and the run went on for ever. The signal is sent again until it is caught.
    p = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=60, env=clean_env())
    assert p.stdout.strip() == "caught SIGHUP" and p.stderr == "", (p.stdout, p.stderr)


# -- 8: one line, and nothing after a kill -------------------------------------------------------------------
def test_an_ab_divergence_at_its_first_sync_is_one_line(tmp_path):
    p = subprocess.run(CLI + JOB + ["--method", "ab", "--group-size", "1", "--steps", "12", "--ab-warmup-steps", "0",
                                    "--ab-sync-every", "3", "--lr", "1e6", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, env=clean_env(), timeout=240)
    line = one_line(p.stderr)
    assert p.returncode == 1 and ("holds inf or nan" in line or "became nan" in line), line


def test_a_sigkilled_launcher_prints_nothing(tmp_path):
    proc = subprocess.Popen(CLI + JOB + ["--steps", "100000", "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step 3/"):
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert left_behind(proc.pid) == []  # the resource tracker too: it has written all it will
    assert proc.stderr.read() == ""


def test_bench_says_a_flag_that_no_run_takes_on_stderr(tmp_path, capsys):
    code, line = _in_process(capsys, ["bench", "--quick", "--extra", "--frobnicate 3", "--out", str(tmp_path / "b")])
    assert code == 2 and line == "abtrain: error: --extra '--frobnicate 3': unrecognized arguments: --frobnicate 3"
    code, line = _in_process(capsys, ["bench", "--quick", "--method-args", "ab:--lr fast", "--out", str(tmp_path / "b")])
    assert code == 2 and "--method-args 'ab:--lr fast'" in line and "invalid float value: 'fast'" in line
    assert not (tmp_path / "b").exists()


# -- 9: lines that say what is wrong -------------------------------------------------------------------------
@pytest.mark.parametrize("path, kind", [("/dev/zero", "a device"), ("/dev/null", "a device"),
                                        ("/dev/urandom", "a device"), ("fifo", "a FIFO")])
def test_a_config_that_is_no_file_says_what_it_is(tmp_path, capsys, path, kind):
    if path == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    code, line = _in_process(capsys, ["train", "--config", path, "--out", str(tmp_path / "run")])
    assert code == 2 and line == (f"abtrain: error: config file {path} is {kind}, not a regular file; pass a TOML "
                                  f"file (--config FILE)")


@pytest.mark.parametrize("text, flag", [('data_dir = "a\\u0000b"\n', "--data-dir"), ('out = "r\\u0000"\n', "--out"),
                                        ('[ab]\nfull_rank = "x\\u0000"\n', "--ab-full-rank")])
def test_a_nul_character_in_a_config_value_names_its_option(tmp_path, capsys, text, flag):
    path = tmp_path / "c.toml"
    path.write_text('workers = 2\nmodel = "mlp"\ndataset = "synthetic"\nsteps = 1\n' + text)
    out = [] if flag == "--out" else ["--out", str(tmp_path / "run")]  # a flag would override the file's value
    code, line = _in_process(capsys, ["train", "--config", str(path), *out])
    assert code == 2 and line.startswith(f"abtrain: error: {flag} holds a NUL character"), line


@pytest.mark.parametrize("change, message", [
    (lambda m: m["settings"].update(lr="fast"), "holds settings.lr = 'fast', not a positive number"),
    (lambda m: m["settings"].update(grad_clip=float("nan")), "holds settings.grad_clip = nan, not a positive number"),
    (lambda m: m["sha256"].update({"rank1.pt": 123}), "holds sha256.rank1.pt = 123, not 64 hexadecimal digits"),
    (lambda m: m["files"].update({"rank1.pt": "big"}), "holds files.rank1.pt = 'big', not a size in bytes"),
])
def test_a_forged_manifest_value_blames_the_manifest(stopped, tmp_path, capsys, change, message):
    run = _copy(stopped, tmp_path)
    path = run / "checkpoint" / "latest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    before = tree_digest(run.parent)
    code, line = _in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and message in line and "--lr" not in line and "changed bytes" not in line, line
    assert tree_digest(run.parent) == before


def test_a_world_size_beyond_any_world_names_the_variable(tmp_path, capsys, monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="9" * 20, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    code, line = _in_process(capsys, JOB + ["--steps", "2", "--out", str(tmp_path / "run")])
    assert code == 2 and line.startswith(f"abtrain: error: WORLD_SIZE={'9' * 20} is beyond any real world"), line


def test_a_checkpoint_of_nan_weights_is_not_advice_to_resume_it(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    path = run / "checkpoint" / "latest.json"
    manifest = json.loads(path.read_text())
    for rank in (0, 1):
        shard = run / "checkpoint" / "step-00000006" / f"rank{rank}.pt"
        state = torch.load(shard, weights_only=True)
        for tensor in state["model"].values():
            if tensor.is_floating_point():
                tensor.fill_(math.nan)
        torch.save(state, shard)
        manifest["files"][shard.name] = shard.stat().st_size
        manifest["sha256"][shard.name] = hashlib.sha256(shard.read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))  # forged to match
    p = subprocess.run(CLI + ["train", "--resume", str(run)], capture_output=True, text=True, env=clean_env(),
                       timeout=240)
    line = one_line(p.stderr)
    assert p.returncode == 2 and "holds inf or nan in model." in line and "it cannot be continued" in line, line
    assert "--resume" not in line and "--lr" not in line


# -- 10: sizes are checked before anything is read ---------------------------------------------------------
def test_a_sparse_manifest_of_gigabytes_is_refused_without_reading_it(stopped, tmp_path, capsys):
    run = _copy(stopped, tmp_path)
    with open(run / "checkpoint" / "latest.json", "r+b") as fh:
        fh.truncate(2 << 30)  # sparse: 2 GB that cost nothing to make and seconds to read
    start = time.monotonic()
    code, line = _in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "latest.json is 2,147,483,648 bytes, far more than abtrain writes there" in line, line
    assert time.monotonic() - start < 5


def test_a_sparse_config_file_is_refused_without_reading_it(tmp_path, capsys):
    path = tmp_path / "c.toml"
    with open(path, "wb") as fh:
        fh.truncate(2 << 30)
    code, line = _in_process(capsys, ["train", "--config", str(path), "--out", str(tmp_path / "run")])
    assert code == 2 and "holds 2,147,483,648 bytes, more than a configuration" in line, line
