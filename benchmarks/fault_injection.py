"""Fault injection: kill workers and the launcher, corrupt what runs leave behind, feed the CLI bad input.

Part 1 runs a tiny job (2 workers, MLP on synthetic data, DDP or AB-training)
once without faults per method, then

- ``--runs`` times under ``--max-restarts 1`` while killing one random worker
  process with SIGKILL right after a random step,
- ``--checkpoint-kills`` times the same right after a checkpoint step (the
  kill lands while the checkpoint is being written),
- ``--launcher-runs`` times a signal to the launcher (SIGINT, SIGTERM, SIGINT
  to the whole process group as Ctrl-C sends it, SIGKILL) at a random step,
  followed by ``abtrain train --resume``,
- ``--double-ctrl-c`` times two Ctrl-C at a random step, then a resume,
- ``--signal-runs`` times another signal that ends a run (SIGHUP, SIGUSR1,
  SIGUSR2 to the group, SIGQUIT, SIGALRM, SIGRTMIN+3) during training, right
  after a checkpoint step, or after the last step (the shutdown: final
  checkpoint, results), then a resume,
- ``--start-faults`` times a fork server that hangs while it imports the
  workers' code, ended by the start-up deadline or killed while the launcher
  waits for it (one line, exit 1), then the run started again,
- ``--early-kills`` times SIGKILL to the launcher 0-100 ms after its first
  worker is forked, and ``--early-signals`` times SIGTERM, SIGINT, SIGHUP or
  SIGUSR1 in the command's first seconds (torch still importing, the
  preflight, the first fork); no process of the run may be left, and the run,
  started again (or resumed where a checkpoint was kept), must end
  bit-identical,

and compares each run's final weights (RUN_DIR/model.pt) with the
uninterrupted run's. Part 2 feeds bad input: invalid flags and values,
conflicting options, broken config files, corrupt datasets (in-process through
``abtrain.cli.main``, which is what the command runs before any worker starts),
and a subset through the real command: truncated, garbled, zeroed (same size),
foreign and code-running checkpoints, edited config.json files, runs writing
into the directory of a live run (concurrent writers) and a run on a full disk
(a 2 MB tmpfs, when run as root); links, FIFOs, sockets and wrong kinds of
files at every run-directory path, data of every wrong shape, half-set
launcher variables, nested and duplicated config keys, manifests without
checksums (benchmarks/hostile_cases.py). Each must end with one
``abtrain: error:`` line, a documented exit code (2 for bad input, 4 for a full
disk), no traceback and nothing already saved changed, inside the run
directory or outside it. A diverging run of each method must end as
``diverged`` (exit 1), and a run whose directory is removed with exit 4.

    .venv/bin/python benchmarks/fault_injection.py [--runs 20] [--checkpoint-kills 4] [--launcher-runs 8]
                                                   [--double-ctrl-c 4] [--signal-runs 12] [--start-faults 4]
                                                   [--early-kills 16] [--early-signals 8]
                                                   [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hostile_cases as hostile
from abtrain.cli import main as cli_main
from abtrain.config import SECTIONS, config_fields, section_fields

ROOT = Path(__file__).resolve().parent.parent
ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
STEPS = 30
JOB = ["--method", "ddp", "--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--steps", str(STEPS), "--batch-size", "16",
       "--eval-every", "10", "--log-every", "1", "--seed", "3"]
METHODS = {
    "ddp": ["--method", "ddp"],
    "ab": ["--method", "ab", "--group-size", "1", "--ab-warmup-steps", "4", "--ab-sync-every", "8",
           "--ab-rebound-steps", "2", "--ab-rank-fraction", "0.25"],
}


def env() -> dict[str, str]:
    e = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT"):
        e.pop(var, None)
    return e


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def worker_pids(pid: int) -> list[int]:
    """The launcher's worker processes, from /proc: the children of its fork server (or spawned children)."""
    out = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmdline:
            out += _children(child)
        elif b"spawn_main" in cmdline:
            out.append(child)
    return sorted(out)


def launcher_run(method: str, run_dir: Path, kill_step: int, how: str) -> dict:
    """Signal the launcher right after ``kill_step``, then resume; the run must end as if never stopped."""
    args = ABTRAIN + ["train", *JOB, *METHODS[method], "--checkpoint-every", "3", "--out", str(run_dir)]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            start_new_session=True)
    sent = False
    assert proc.stdout is not None
    for line in proc.stdout:
        if not sent and line.startswith(f"step {kill_step}/"):
            if how == "double Ctrl-C":
                os.killpg(proc.pid, signal.SIGINT)
                os.killpg(proc.pid, signal.SIGINT)
            else:  # "SIGUSR1", "SIGRTMIN+3", "SIGINT to the group" ...
                name = how.removesuffix(" to the group")
                sig = signal.SIGRTMIN + int(name[9:]) if name.startswith("SIGRTMIN+") else getattr(signal, name)
                (os.killpg if how.endswith(" to the group") else os.kill)(proc.pid, sig)
            sent = True
    proc.wait()
    stderr = proc.stderr.read() if proc.stderr else ""
    left = hostile.left_behind(proc.pid)
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    completed = (run_dir / "results.json").exists()  # the signal came during the run's last clean-up
    expected = -9 if how == "SIGKILL" else 130
    one_line = how == "SIGKILL" or (len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr)
    deadline = time.time() + 30
    while how == "SIGKILL" and os.path.exists(run_dir / ".lock") and time.time() < deadline:
        from abtrain.run.rundir import is_locked
        if not is_locked(str(run_dir)):
            break
        time.sleep(0.2)
    resumed = subprocess.run(ABTRAIN + ["train", "--resume", str(run_dir)], capture_output=True, text=True, env=env(),
                             timeout=300)
    return {"method": method, "signal": how, "kill_step": kill_step, "sent": sent, "returncode": proc.returncode,
            "left_behind": len(left), "completed_before_resume": completed,
            "expected_returncode": expected, "one_line": one_line, "status_after_signal": status.get("status"),
            "resume_returncode": resumed.returncode, "seconds": round(time.perf_counter() - start, 1),
            "status": json.loads((run_dir / "status.json").read_text()).get("status"),
            "error": (stderr.strip().splitlines() or [None])[-1] if proc.returncode not in (0, expected) else None}


def start_fault(method: str, run_dir: Path, how: str) -> dict:
    """The fork server hangs while it imports the workers' code, and either the start-up deadline (3 s here)
    ends the run, or the server is killed while the launcher waits for it: one line, exit code 1, status failed
    (kind start), no process left."""
    plugin = run_dir.parent / "plugins"
    plugin.mkdir(exist_ok=True)
    (plugin / "hang_in_server.py").write_text(hostile.SERVER_HANGS)
    e = {**env(), "ABTRAIN_METHOD_MODULES": "hang_in_server",
         "PYTHONPATH": os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", hostile.PATCHED_DEADLINE, "3" if how == "deadline" else "600",
                             "train", *JOB, *METHODS[method], "--checkpoint-every", "3", "--timeout", "1",
                             "--out", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=e, start_new_session=True)
    if how == "fork server killed":
        server, deadline = None, time.time() + 120
        while server is None and proc.poll() is None and time.time() < deadline:
            server = hostile._server_of(proc.pid)
            time.sleep(0.05)
        time.sleep(1.0)  # the launcher now waits for it
        if server is not None:
            os.kill(server, signal.SIGKILL)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
    left = hostile.left_behind(proc.pid)
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    words = "did not start within 3 s" if how == "deadline" else "was killed by SIGKILL"
    return {"how": how, "method": method, "returncode": proc.returncode, "left_behind": len(left),
            "as_documented": one_clear_line(proc.returncode, stderr, 1) and words in stderr
            and status.get("kind") == "start", "seconds": round(time.perf_counter() - start, 1),
            "message": stderr.strip()[-300:]}


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


# ---------------------------------------------------------------- part 1: kills
def kill_run(method: str, run_dir: Path, kill_step: int, rng: random.Random) -> dict:
    args = ABTRAIN + ["train", *JOB, *METHODS[method], "--checkpoint-every", "3", "--max-restarts", "1",
                      "--out", str(run_dir)]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    killed = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if killed is None and line.startswith(f"step {kill_step}/"):
            workers = worker_pids(proc.pid)
            if workers:
                killed = rng.randrange(len(workers))
                os.kill(workers[killed], signal.SIGKILL)
    proc.wait()
    stderr = proc.stderr.read() if proc.stderr else ""
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    return {"method": method, "kill_step": kill_step, "killed_worker": killed, "returncode": proc.returncode,
            "status": status.get("status"), "seconds": round(time.perf_counter() - start, 1),
            "error": stderr.strip().splitlines()[-1] if proc.returncode and stderr.strip() else None}


# ---------------------------------------------------------------- part 2: bad input
def bad_argvs(tmp: Path) -> list[list[str]]:
    """Flags and values a user might get wrong; each list is one invocation's arguments after 'train'."""
    base = ["--workers", "2", "--dataset", "synthetic", "--model", "mlp", "--steps", "2", "--out", str(tmp / "fuzz-run")]
    bad_values = ["0", "-1", "-7", "abc", "nan", "inf", "1e400", "", "1.5"]
    positive_ints = ["--workers", "--batch-size", "--block-size", "--epochs", "--steps", "--eval-every", "--log-every",
                     "--group-size", "--threads", "--limit-train", "--limit-test", "--checkpoint-every", "--stop-after",
                     "--ab-sync-every", "--localsgd-sync-every", "--diloco-sync-every", "--powersgd-rank"]
    positive_floats = ["--lr", "--timeout", "--bucket-cap-mb", "--grad-clip", "--diloco-outer-lr"]
    unit_interval = ["--momentum", "--label-smoothing", "--ab-tau", "--ab-rank-fraction",
                     "--diloco-outer-momentum"]
    out: list[list[str]] = []
    for flag in positive_ints:
        out += [base + [flag, v] for v in bad_values]
    for flag in positive_floats:
        out += [base + [flag, v] for v in ("0", "-1", "abc", "nan", "inf", "1e400", "")]
    for flag in unit_interval:
        out += [base + [flag, v] for v in ("-0.5", "1.5", "abc", "nan", "7")]
    for flag in ("--method", "--model", "--dataset", "--optimizer", "--lr-schedule", "--backend", "--device",
                 "--ab-sync", "--ab-split", "--ab-init", "--ab-optimizer-state"):
        out += [base + [flag, v] for v in ("bogus", "", "DDP")]
    out += [base + [flag] for flag in ("--lerning-rate", "--ab", "--resume-from", "--worker", "-x")]
    out += [base + [flag, v] for flag in ("--weight-decay", "--warmup-lr-steps", "--max-restarts", "--ab-warmup-steps",
                                          "--ab-rebound-steps", "--ab-lr-rebound-steps", "--ab-lr-floor",
                                          "--powersgd-warmup-steps",
                                          "--powersgd-min-compression-rate", "--powersgd-orthogonalization-epsilon")
            for v in ("-1", "abc", "nan")]
    huge = "99999999999999999999"
    out += [base + [flag, huge] for flag in ("--workers", "--batch-size", "--block-size", "--epochs", "--steps",
                                             "--eval-every", "--log-every", "--group-size", "--threads",
                                             "--limit-train", "--limit-test", "--checkpoint-every", "--stop-after",
                                             "--warmup-lr-steps", "--max-restarts", "--seed")]
    out += [base + ["--steps", "10000000000"], base + ["--epochs", "2000000000"]]
    out += [base + ["--timeout", v] for v in ("0.5", "0.01", "1e9", "999999999")]
    if not torch.cuda.is_available():
        out += [base + ["--device", "cuda"], base + ["--backend", "nccl"], base + ["--backend", "nccl", "--device", "cpu"]]
    conflicts = [
        ["--method", "ab", "--group-size", "2"],  # one group of 2 workers: AB needs two groups
        ["--method", "ab", "--group-size", "1", "--ab-tau", "0.2", "--ab-rank", "3"],
        ["--method", "ab", "--group-size", "1", "--ab-rebound-steps", "8", "--ab-sync-every", "8"],
        ["--method", "ab", "--group-size", "1", "--ab-full-rank", "*"],
        ["--group-size", "3"],
        ["--stop-after", "2"],
        ["--stop-after", "5"],
        ["--batch-size", "4096"],
        ["--workers", "5000"],
        ["--limit-train", "1"],
        ["--powersgd-warmup-steps", "1", "--method", "powersgd"],
        ["--resume", str(tmp / "no-such-run")],
        ["--resume", str(tmp)],
    ]
    out += [base + c for c in conflicts]
    return out


def bad_files(tmp: Path) -> list[list[str]]:
    """Broken config files and datasets."""
    base = ["--workers", "2", "--model", "mlp", "--steps", "2", "--out", str(tmp / "fuzz-run")]
    cases = []
    tomls = ['lerning_rate = 0.1\n', 'batch-size = "big"\n', 'lr = nan\n', 'steps = 1.5\n', 'method = 3\n',
             '[ab]\ntau = "x"\n', '[ab]\nbogus = 1\n', 'ab = 4\n', 'this is not toml\n', 'workers = -2\n',
             'ledger = "yes"\n', '[localsgd]\nh = 0\n', 'timeout = inf\n', 'steps = -5\n',
             'steps = 99999999999999999999\n', 'timeout = 0.5\n', 'workers = 1e3\n', '[ab\nx = 1\n',
             'lr = 0.1\nlr = 0.2\n', 'device = "cuda"\n', '= 3\n']
    for i, text in enumerate(tomls):
        path = tmp / f"bad{i}.toml"
        path.write_text(text)
        # Only the file's values: flags would override them.
        cases.append(["--dataset", "synthetic", "--model", "mlp", "--out", str(tmp / "fuzz-run"), "--config", str(path)])
    cases.append(base + ["--dataset", "synthetic", "--config", str(tmp / "missing.toml")])
    for name, raw in (("latin1", 'method = "ddp" # caf\xe9\n'.encode("latin-1")), ("binary", os.urandom(64) + b"\xff"),
                      ("utf16", 'steps = 3\n'.encode("utf-16"))):
        path = tmp / f"bad-{name}.toml"
        path.write_bytes(raw)
        cases.append(["--dataset", "synthetic", "--model", "mlp", "--out", str(tmp / "fuzz-run"), "--config", str(path)])
    (tmp / "a-directory.toml").mkdir()
    cases.append(base + ["--dataset", "synthetic", "--config", str(tmp / "a-directory.toml")])
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import make_fake_fashion
    good = make_fake_fashion(tmp / "fashion-good", n_train=256, n_test=64)
    damages = {
        "truncated": lambda b: b[: len(b) // 2],
        "empty": lambda b: b"",
        "garbage": lambda b: os.urandom(len(b)),
        "not-gzip": lambda b: gzip.decompress(b)[:100],
        "bad-magic": lambda b: gzip.compress(b"\x00\x00\x09\x03" + gzip.decompress(b)[4:]),
        "short-payload": lambda b: gzip.compress(gzip.decompress(b)[:-50]),
        "wrong-ndim": lambda b: gzip.compress(gzip.decompress(b)[:3] + bytes([gzip.decompress(b)[3] + 1])
                                              + gzip.decompress(b)[4:]),
        "bad-type-code": lambda b: gzip.compress(gzip.decompress(b)[:2] + b"\x07" + gzip.decompress(b)[3:]),
    }
    for name, damage in damages.items():
        for stem in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz"):
            d = tmp / f"fashion-{name}-{stem[:4]}-{stem[5:9]}"
            shutil.copytree(good, d)
            (d / stem).write_bytes(damage((d / stem).read_bytes()))
            cases.append(base + ["--dataset", "fashion-mnist", "--data-dir", str(d)])
    missing = tmp / "fashion-missing"
    shutil.copytree(good, missing)
    (missing / "t10k-labels-idx1-ubyte.gz").unlink()
    cases.append(base + ["--dataset", "fashion-mnist", "--data-dir", str(missing)])
    cases.append(base + ["--dataset", "fashion-mnist", "--data-dir", str(tmp / "nowhere")])
    return cases


def in_process(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli_main(["train", *argv])
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """``os.environ`` with the launcher variables of ``values`` only (the others removed), for one call."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
             "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_ID", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
    saved = {k: os.environ.get(k) for k in names}
    for k in names:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rerun_identical(method: str, run_dir: Path, ref: dict) -> tuple[int, bool]:
    """After an early kill or signal: resume where a checkpoint was kept, else start the run again."""
    from abtrain.run.checkpoint import read_manifest
    if read_manifest(str(run_dir)) is not None:
        argv = ABTRAIN + ["train", "--resume", str(run_dir)]
    else:
        argv = ABTRAIN + ["train", *JOB, *METHODS[method], "--checkpoint-every", "3", "--out", str(run_dir)]
    p = subprocess.run(argv, capture_output=True, text=True, env=env(), timeout=300)
    return p.returncode, p.returncode == 0 and same(weights(run_dir), ref)


def run_failures(tmp: Path) -> list[dict]:
    """Failures after the start, classed by what happened: a diverging run of each method, a removed run dir."""
    out = []
    for method in METHODS:
        run_dir = tmp / f"diverge-{method}"
        p = subprocess.run(ABTRAIN + ["train", *JOB, *METHODS[method], "--lr", "50", "--checkpoint-every", "3",
                                      "--out", str(run_dir)], capture_output=True, text=True, env=env(), timeout=300)
        status = json.loads((run_dir / "status.json").read_text())
        lines = p.stderr.strip().splitlines()
        out.append({"case": f"diverging-{method}", "exit": p.returncode, "kind": status.get("kind"),
                    "handled": p.returncode == 1 and status.get("kind") == "diverged" and len(lines) == 1
                    and "Traceback" not in p.stderr, "message": p.stderr.strip()[-300:]})
    run_dir = tmp / "removed"
    proc = subprocess.Popen(ABTRAIN + ["train", *JOB, "--steps", "100000", "--checkpoint-every", "5",
                                       "--out", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(), start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 4/"):
            # Renamed away first: rmtree alone races with the run's next write into the directory.
            os.rename(run_dir, tmp / "removed-gone")
            shutil.rmtree(tmp / "removed-gone", ignore_errors=True)
            break
    _, stderr = proc.communicate(timeout=300)
    out.append({"case": "run-dir-removed", "exit": proc.returncode,
                "handled": one_clear_line(proc.returncode, stderr, EXIT_NO_SPACE) and "was removed" in stderr,
                "left_behind": len(hostile.left_behind(proc.pid)), "message": stderr.strip()[-300:]})
    return out


#: The exit codes docs/reliability.md documents: 2 bad input, 4 no space left on device.
EXIT_INPUT, EXIT_NO_SPACE = 2, 4


def one_clear_line(code: int, stderr: str, expected: int = EXIT_INPUT) -> bool:
    lines = stderr.strip().splitlines()
    return (code == expected and len(lines) == 1 and lines[0].startswith("abtrain: error:")
            and "Traceback" not in stderr)


def digest(run_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(run_dir.rglob("*")):
        if path.is_file() and path.name not in ("status.json", ".lock"):  # the lock file holds its owner's pid
            h.update(str(path.relative_to(run_dir)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # would create the marker file if unpickled unsafely
        return (open, (self.marker, "w"))


def checkpoint_cases(tmp: Path) -> list[tuple[str, list[str], Path, Path | None]]:
    """Through the real command: damaged checkpoints of a stopped run, and a resume that changes the run."""
    stopped = tmp / "stopped"
    p = subprocess.run(ABTRAIN + ["train", *JOB, *METHODS["ddp"], "--stop-after", "6", "--out", str(stopped)],
                       capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode == 0, p.stderr
    shard = "checkpoint/step-00000006/rank1.pt"
    cases = []

    def variant(name: str, change) -> None:
        d = tmp / f"ckpt-{name}"
        shutil.copytree(stopped, d)
        marker = change(d)
        cases.append((name, ["--resume", str(d)], d, marker if isinstance(marker, Path) else None))

    variant("truncated-shard", lambda d: (d / shard).write_bytes((d / shard).read_bytes()[:1000]))

    def garble(d: Path) -> None:
        data = bytearray((d / shard).read_bytes())
        for i in range(200, len(data), 997):
            data[i] ^= 0xFF
        (d / shard).write_bytes(bytes(data))
    variant("garbled-shard", garble)

    def zeroed(rank: int, where: float, length: int):
        def change(d: Path) -> None:  # same size, bytes changed inside a tensor: only the checksum sees it
            path = d / f"checkpoint/step-00000006/rank{rank}.pt"
            data = bytearray(path.read_bytes())
            at = int(len(data) * where)
            data[at:at + length] = bytes(length)
            path.write_bytes(bytes(data))
        return change
    for rank in (0, 1):
        for where, length in ((0.3, 64), (0.6, 4), (0.9, 1024)):
            variant(f"zeroed-shard-rank{rank}-at{where}-{length}B", zeroed(rank, where, length))

    def flip_bit(d: Path) -> None:
        path = d / shard
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    variant("one-bit-flipped-shard", flip_bit)

    def random_same_size(d: Path) -> None:
        path = d / shard
        path.write_bytes(os.urandom(path.stat().st_size))
    variant("random-bytes-same-size", random_same_size)

    def edit_config(key: str, value) -> None:
        def change(d: Path) -> None:
            config = json.loads((d / "config.json").read_text())
            config[key] = value
            (d / "config.json").write_text(json.dumps(config))
        variant(f"config-json-{key}-edited", change)
    for key, value in (("lr", 0.5), ("steps", 3), ("seed", 4), ("batch_size", 8), ("momentum", 0.5),
                       ("weight_decay", 0.0), ("lr_schedule", "constant")):
        edit_config(key, value)

    def payload(d: Path) -> Path:
        marker = d.parent / f"pwned-{d.name}"
        with open(d / shard, "wb") as fh:
            pickle.dump({"format": "abtrain-checkpoint", "x": _Payload(str(marker))}, fh)
        manifest = json.loads((d / "checkpoint/latest.json").read_text())
        manifest["files"]["rank1.pt"] = (d / shard).stat().st_size
        manifest["sha256"]["rank1.pt"] = hashlib.sha256((d / shard).read_bytes()).hexdigest()  # a forged manifest
        (d / "checkpoint/latest.json").write_text(json.dumps(manifest))
        return marker
    variant("code-running-pickle", payload)

    def foreign(d: Path) -> None:
        manifest = json.loads((d / "checkpoint/latest.json").read_text())
        manifest["method"] = "ab"
        (d / "checkpoint/latest.json").write_text(json.dumps(manifest))
    variant("foreign-method", foreign)
    variant("manifest-not-json", lambda d: (d / "checkpoint/latest.json").write_text("{oops"))
    variant("missing-shard", lambda d: (d / shard).unlink())
    variant("config-not-json", lambda d: (d / "config.json").write_text("[1, 2"))
    cases.append(("changing-flag", ["--resume", str(stopped), "--batch-size", "8"], stopped, None))
    cases.append(("bad-lr-on-resume", ["--resume", str(stopped), "--lr", "-1"], stopped, None))
    cases.append(("stop-after-before-checkpoint", ["--resume", str(stopped), "--stop-after", "4"], stopped, None))
    cases.append(("stop-after-at-checkpoint", ["--resume", str(stopped), "--stop-after", "6"], stopped, None))
    cases.append(("fresh-run-into-unfinished", [*JOB, "--out", str(stopped)], stopped, None))
    cases.append(("unknown-flag", ["--resume", str(stopped), "--bogus"], stopped, None))
    cases.append(("bad-value-real-cli", [*JOB, "--lr", "-3"], None, None))
    cases.append(("conflict-real-cli", [*JOB, *METHODS["ab"], "--ab-rank", "2"], None, None))
    return cases


def concurrent_writers(tmp: Path) -> list[dict]:
    """Start a long run, then try to write into its directory while it is alive: every attempt is refused."""
    live = tmp / "live"
    proc = subprocess.Popen(ABTRAIN + ["train", *JOB, "--steps", "100000", "--eval-every", "1000",
                                       "--checkpoint-every", "50", "--out", str(live)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 60/"):
            break
    attempts = [[*JOB, "--out", str(live)], [*JOB, *METHODS["ab"], "--out", str(live)],
                ["--resume", str(live)], ["--resume", str(live), "--max-restarts", "2"],
                ["--resume", str(live), "--lr", "0.01"], ["--resume", str(live), "--stop-after", "99999"]]
    results = []
    for n, argv in enumerate(attempts):
        if n < 2:  # through the real command
            p = subprocess.run(ABTRAIN + ["train", *argv], capture_output=True, text=True, env=env(), timeout=300)
            code, stderr = p.returncode, p.stderr
        else:
            code, stderr = in_process(argv)
        results.append({"path": "cli" if n < 2 else "in-process", "case": f"concurrent-writer-{n}", "argv": argv,
                        "exit": code, "handled": one_clear_line(code, stderr) and "in use" in stderr,
                        "message": stderr.strip()[:300]})
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    alive_ok = proc.returncode == 130 and (live / "checkpoint" / "latest.json").exists()
    for r in results:
        r["handled"] = r["handled"] and alive_ok
    return results


def full_disk(tmp: Path) -> dict | None:
    """A run on a 2 MB tmpfs: the second checkpoint does not fit. Needs root (mount); None otherwise."""
    disk = tmp / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        return None
    try:
        out = disk / "run"
        p = subprocess.run(ABTRAIN + ["train", *JOB, "--steps", "40", "--checkpoint-every", "5", "--out", str(out)],
                           capture_output=True, text=True, env=env(), timeout=300)
        manifest = json.loads((out / "checkpoint" / "latest.json").read_text())
        intact = subprocess.run([sys.executable, "-c", "import sys, torch; from abtrain.run import checkpoint as c; "
                                 "m = c.read_manifest(sys.argv[1]); [c.load_shard(c.shard_path(sys.argv[1], m, r)) "
                                 "for r in range(2)]", str(out)], capture_output=True, env=env()).returncode == 0
        handled = (one_clear_line(p.returncode, p.stderr, EXIT_NO_SPACE) and "no space left on device" in p.stderr
                   and f"the checkpoint of step {manifest['step']} is intact" in p.stderr and intact)
        return {"path": "cli", "case": "full-disk", "argv": ["--out", str(out)], "exit": p.returncode,
                "handled": handled, "saved_data_intact": intact, "message": p.stderr.strip()[:300]}
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="worker kills at a random step")
    ap.add_argument("--checkpoint-kills", type=int, default=4, help="worker kills right after a checkpoint step")
    ap.add_argument("--launcher-runs", type=int, default=8, help="signals to the launcher, then --resume")
    ap.add_argument("--double-ctrl-c", type=int, default=4, help="two Ctrl-C at a random step, then --resume")
    ap.add_argument("--early-kills", type=int, default=16,
                    help="SIGKILL to the launcher 0-100 ms after its first worker is forked")
    ap.add_argument("--early-signals", type=int, default=8,
                    help="SIGTERM, SIGINT, SIGHUP or SIGUSR1 in the command's first seconds")
    ap.add_argument("--signal-runs", type=int, default=12,
                    help="other signals (SIGHUP, SIGUSR1, SIGQUIT, ...) during training, a checkpoint or the shutdown")
    ap.add_argument("--start-faults", type=int, default=4,
                    help="a fork server that hangs (start-up deadline) or is killed while the workers start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fault_injection.json"))
    opts = ap.parse_args()
    rng = random.Random(opts.seed)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="abtrain-faults-"))
    try:
        # -- part 1 --------------------------------------------------------
        refs = {}
        for method in METHODS:
            run_dir = tmp / f"ref-{method}"
            p = subprocess.run(ABTRAIN + ["train", *JOB, *METHODS[method], "--out", str(run_dir)],
                               capture_output=True, text=True, env=env(), timeout=300)
            assert p.returncode == 0, p.stderr
            refs[method] = weights(run_dir)
        runs = []
        for i in range(opts.runs):
            method = list(METHODS)[i % len(METHODS)]
            run_dir = tmp / f"kill-{i}"
            r = kill_run(method, run_dir, rng.randint(2, STEPS - 3), rng)
            r["identical"] = r["status"] == "complete" and same(weights(run_dir), refs[method])
            runs.append(r)
            print(f"run {i + 1:2d}/{opts.runs}: {method:3s} kill worker {r['killed_worker']} after step "
                  f"{r['kill_step']:2d}: exit {r['returncode']}, {r['status']}, identical {r['identical']} "
                  f"({r['seconds']} s)", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        for i in range(opts.checkpoint_kills):
            method = list(METHODS)[i % len(METHODS)]
            run_dir = tmp / f"ckpt-kill-{i}"
            r = kill_run(method, run_dir, 3 * rng.randint(1, (STEPS - 3) // 3), rng)
            r["at_checkpoint"] = True
            r["identical"] = r["status"] == "complete" and same(weights(run_dir), refs[method])
            runs.append(r)
            print(f"checkpoint kill {i + 1}/{opts.checkpoint_kills}: {method:3s} kill worker {r['killed_worker']} "
                  f"after checkpoint step {r['kill_step']:2d}: exit {r['returncode']}, {r['status']}, "
                  f"identical {r['identical']} ({r['seconds']} s)", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        signals = ["SIGINT", "SIGTERM", "SIGINT to the group", "SIGKILL"]
        launcher = []
        for i in range(opts.launcher_runs):
            method = list(METHODS)[i % len(METHODS)]
            run_dir = tmp / f"launcher-{i}"
            r = launcher_run(method, run_dir, rng.randint(4, STEPS - 3), signals[i % len(signals)])
            r["identical"] = (r["status"] == "complete" and r["resume_returncode"] == 0
                              and same(weights(run_dir), refs[method]))
            launcher.append(r)
            print(f"launcher {i + 1}/{opts.launcher_runs}: {method:3s} {r['signal']} after step {r['kill_step']:2d}: "
                  f"exit {r['returncode']} (one line {r['one_line']}), status {r['status_after_signal']}, resume exit "
                  f"{r['resume_returncode']}, identical {r['identical']}, left behind {r['left_behind']} "
                  f"({r['seconds']} s)", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        for i in range(opts.double_ctrl_c):
            method = list(METHODS)[i % len(METHODS)]
            run_dir = tmp / f"double-{i}"
            r = launcher_run(method, run_dir, rng.randint(4, STEPS - 3), "double Ctrl-C")
            r["identical"] = (r["status"] == "complete" and r["resume_returncode"] == 0
                              and same(weights(run_dir), refs[method]))
            launcher.append(r)
            print(f"double Ctrl-C {i + 1}/{opts.double_ctrl_c}: {method:3s} after step {r['kill_step']:2d}: exit "
                  f"{r['returncode']} (one line {r['one_line']}), status {r['status_after_signal']}, resume exit "
                  f"{r['resume_returncode']}, identical {r['identical']}, left behind {r['left_behind']} "
                  f"({r['seconds']} s)", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        signalled = []
        moments = ("training", "checkpoint", "shutdown")
        others = ("SIGHUP", "SIGUSR1", "SIGUSR2 to the group", "SIGQUIT", "SIGALRM", "SIGRTMIN+3")
        for i in range(opts.signal_runs):
            method, moment, how = list(METHODS)[i % len(METHODS)], moments[i % 3], others[i % len(others)]
            step = {"training": rng.randint(4, STEPS - 3), "checkpoint": 3 * rng.randint(2, (STEPS - 3) // 3),
                    "shutdown": STEPS}[moment]
            run_dir = tmp / f"signal-{i}"
            r = launcher_run(method, run_dir, step, how)
            r["moment"] = moment
            # A signal during the last clean-up may find the run complete ("interrupted (SIGHUP) after the run
            # completed"): nothing is left to resume, and the weights are the run's.
            r["identical"] = (r["status"] == "complete" and (r["resume_returncode"] == 0 or r["completed_before_resume"])
                              and same(weights(run_dir), refs[method]))
            signalled.append(r)
            print(f"signal {i + 1}/{opts.signal_runs}: {method:3s} {how} at {moment} (after step {step:2d}): exit "
                  f"{r['returncode']} (one line {r['one_line']}), status {r['status_after_signal']}, resume exit "
                  f"{r['resume_returncode']}, identical {r['identical']}, left behind {r['left_behind']} "
                  f"({r['seconds']} s)", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        faults = []
        for i in range(opts.start_faults):
            method, how = list(METHODS)[i % len(METHODS)], ("deadline", "fork server killed")[i % 2]
            run_dir = tmp / f"start-fault-{i}"
            r = start_fault(method, run_dir, how)
            r["rerun_returncode"], r["identical"] = rerun_identical(method, run_dir, refs[method])
            faults.append(r)
            print(f"start fault {i + 1}/{opts.start_faults}: {method:3s} {how}: exit {r['returncode']}, as documented "
                  f"{r['as_documented']}, left behind {r['left_behind']}, rerun exit {r['rerun_returncode']}, "
                  f"identical {r['identical']} ({r['seconds']} s)", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        early = []
        for i in range(opts.early_kills + opts.early_signals):
            method = list(METHODS)[i % len(METHODS)]
            run_dir = tmp / f"early-{i}"
            argv = ABTRAIN + ["train", *JOB, *METHODS[method], "--checkpoint-every", "3", "--out", str(run_dir)]
            start = time.perf_counter()
            if i < opts.early_kills:
                r = {"how": "SIGKILL after the first fork", **hostile.early_kill(argv, env(), rng)}
                r["as_documented"] = r["returncode"] == -9
            else:
                sig = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)[i % 4]
                r = {"how": f"{sig.name} while starting", **hostile.early_signal(argv, env(), sig, rng)}
                r["as_documented"] = (r["returncode"] == 130 and r["one_line"]) or r["returncode"] == 0
            r["method"] = method
            r["rerun_returncode"], r["identical"] = rerun_identical(method, run_dir, refs[method])
            r["seconds"] = round(time.perf_counter() - start, 1)
            early.append(r)
            print(f"early {i + 1}/{opts.early_kills + opts.early_signals}: {method:3s} {r['how']} "
                  f"+{r['delay_ms']} ms: exit {r['returncode']}, as documented {r['as_documented']}, left behind "
                  f"{r['left_behind']}, rerun exit {r['rerun_returncode']}, identical {r['identical']} "
                  f"({r['seconds']} s)", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        failures = run_failures(tmp)
        for f in failures:
            print(f"failure {f['case']}: exit {f['exit']}, handled {f['handled']}: {f['message'][-160:]}", flush=True)
        # -- part 2 --------------------------------------------------------
        inputs = []
        argvs = bad_argvs(tmp) + bad_files(tmp)
        argvs += hostile.data_shape_cases(tmp, tmp / "fashion-good")  # bad_files made the good copy
        flat = [f.name for f in config_fields()]
        sections = {name: [f.name for f in section_fields(name)] for name in SECTIONS}
        for name, text in hostile.config_texts(flat, sections):
            path = tmp / f"cfg-{name}.toml"
            path.write_text(text)
            argvs.append(["--dataset", "synthetic", "--model", "mlp", "--out", str(tmp / "fuzz-run"), "--config",
                          str(path)])
        for n, argv in enumerate(argvs):
            argv = [str(tmp / f"fuzz-run-{n}") if a == str(tmp / "fuzz-run") else a for a in argv]
            code, stderr = in_process(argv)
            inputs.append({"path": "in-process", "argv": argv, "exit": code, "handled": one_clear_line(code, stderr),
                           "message": stderr.strip()[:300]})
        for n, variables in enumerate(hostile.launcher_variable_cases()):
            out = tmp / f"env-run-{n}"
            with environment(variables):
                code, stderr = in_process([*JOB, "--steps", "2", "--out", str(out)])
            inputs.append({"path": "in-process", "case": f"launcher-variables {variables}", "argv": [], "exit": code,
                           "handled": one_clear_line(code, stderr) and not out.exists(),
                           "message": stderr.strip()[:300]})
        for name, argv, run_dir, marker in checkpoint_cases(tmp):
            before = digest(run_dir) if run_dir else None
            p = subprocess.run(ABTRAIN + ["train", *argv], capture_output=True, text=True, env=env(), timeout=300)
            intact = before is None or digest(run_dir) == before
            safe = marker is None or not marker.exists()
            inputs.append({"path": "cli", "case": name, "argv": argv, "exit": p.returncode,
                           "handled": one_clear_line(p.returncode, p.stderr) and intact and safe,
                           "saved_data_intact": intact, "no_code_ran": safe, "message": p.stderr.strip()[:300]})
        stopped = tmp / "stopped"  # made by checkpoint_cases, unchanged by its refused resumes
        for name, run_dir in hostile.manifest_cases(stopped, tmp):
            before = digest(run_dir)
            p = subprocess.run(ABTRAIN + ["train", "--resume", str(run_dir)], capture_output=True, text=True,
                               env=env(), timeout=300)
            inputs.append({"path": "cli", "case": f"manifest-{name}", "argv": ["--resume", str(run_dir)],
                           "exit": p.returncode, "handled": one_clear_line(p.returncode, p.stderr)
                           and digest(run_dir) == before, "message": p.stderr.strip()[:300]})
        counter = iter(range(10 ** 6))

        def either(argv: list[str]) -> tuple[int, str]:  # every 12th through the real command, else in-process
            if next(counter) % 12:
                return in_process(argv)
            p = subprocess.run(ABTRAIN + ["train", *argv], capture_output=True, text=True, env=env(), timeout=300)
            return p.returncode, p.stderr
        for n, r in enumerate(hostile.run_dir_cases(tmp, stopped, JOB, either)):
            inputs.append({"path": "in-process" if n % 12 else "cli", "case": r["case"], "argv": r["argv"],
                           "exit": r["exit"], "handled": one_clear_line(r["exit"], r["stderr"]) and r["intact"],
                           "message": r["stderr"].strip()[:300]})
        inputs += concurrent_writers(tmp)
        disk = full_disk(tmp)
        if disk is not None:
            inputs.append(disk)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    killed = [r for r in runs if r["killed_worker"] is not None]
    plain = [r for r in launcher if r["signal"] != "double Ctrl-C"]
    double = [r for r in launcher if r["signal"] == "double Ctrl-C"]
    summary = {
        "runs": len(runs),
        "runs_with_a_kill": len(killed),
        "runs_completed": sum(r["status"] == "complete" and r["returncode"] == 0 for r in runs),
        "runs_identical": sum(r["identical"] for r in runs),
        "launcher_runs": len(plain),
        "launcher_signals_sent": sum(r["sent"] for r in plain),
        "launcher_exit_as_documented": sum(r["returncode"] == r["expected_returncode"] and r["one_line"]
                                           for r in plain),
        "launcher_identical_after_resume": sum(r["identical"] for r in plain),
        "double_ctrl_c": len(double),
        "double_ctrl_c_as_documented": sum(r["sent"] and r["returncode"] == 130 and r["one_line"] for r in double),
        "early": len(early),
        "early_as_documented": sum(r["as_documented"] for r in early),
        "early_identical": sum(r["identical"] for r in early),
        "signal_runs": len(signalled),
        "signal_runs_as_documented": sum(r["sent"] and r["returncode"] == 130 and r["one_line"] for r in signalled),
        "signal_runs_identical": sum(r["identical"] for r in signalled),
        "start_faults": len(faults),
        "start_faults_as_documented": sum(r["as_documented"] for r in faults),
        "start_faults_identical": sum(r["identical"] for r in faults),
        "processes_left_behind": sum(r.get("left_behind", 0) for r in launcher + signalled + faults + early + failures),
        "kills_and_signals": len(killed) + sum(r["sent"] for r in launcher + signalled) + len(faults) + len(early),
        "kills_and_signals_identical": sum(r["identical"] for r in runs if r["killed_worker"] is not None)
                                       + sum(r["identical"] for r in launcher + signalled if r["sent"])
                                       + sum(r["identical"] for r in faults + early),
        "failures_after_start": len(failures),
        "failures_classed": sum(f["handled"] for f in failures),
        "bad_inputs": len(inputs),
        "bad_inputs_cli": sum(i["path"] == "cli" for i in inputs),
        "bad_inputs_handled": sum(i["handled"] for i in inputs),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    rows = [("worker killed (SIGKILL), --max-restarts 1", f"{summary['runs_with_a_kill']} / {summary['runs']}"),
            ("runs completed after the restart", f"{summary['runs_completed']} / {summary['runs']}"),
            ("final weights identical to the uninterrupted run", f"{summary['runs_identical']} / {summary['runs']}"),
            ("launcher signalled (SIGINT, SIGTERM, Ctrl-C, SIGKILL)",
             f"{summary['launcher_signals_sent']} / {summary['launcher_runs']}"),
            ("launcher exit as documented (130, one line; -9)",
             f"{summary['launcher_exit_as_documented']} / {summary['launcher_runs']}"),
            ("identical to the uninterrupted run after --resume",
             f"{summary['launcher_identical_after_resume']} / {summary['launcher_runs']}"),
            ("double Ctrl-C: exit 130, one line", f"{summary['double_ctrl_c_as_documented']} / {summary['double_ctrl_c']}"),
            ("other signals at training, checkpoint, shutdown: 130 and one line",
             f"{summary['signal_runs_as_documented']} / {summary['signal_runs']}"),
            ("other signals: identical after --resume (or complete)",
             f"{summary['signal_runs_identical']} / {summary['signal_runs']}"),
            ("start faults (deadline, fork server killed): one line, exit 1",
             f"{summary['start_faults_as_documented']} / {summary['start_faults']}"),
            ("start faults: identical after the rerun", f"{summary['start_faults_identical']} / {summary['start_faults']}"),
            ("early kill / signal: as documented (-9; 130 and one line)",
             f"{summary['early_as_documented']} / {summary['early']}"),
            ("early kill / signal: identical after the rerun", f"{summary['early_identical']} / {summary['early']}"),
            ("processes left behind by a killed or signalled launcher", f"{summary['processes_left_behind']}"),
            ("failures after start in their class (diverged x2, removed run dir)",
             f"{summary['failures_classed']} / {summary['failures_after_start']}"),
            ("all kills and signals: identical at the end",
             f"{summary['kills_and_signals_identical']} / {summary['kills_and_signals']}"),
            ("lost runs (not identical at the end)",
             f"{summary['kills_and_signals'] - summary['kills_and_signals_identical']}"),
            ("bad inputs handled (one line, documented exit code, nothing damaged)",
             f"{summary['bad_inputs_handled']} / {summary['bad_inputs']} ({summary['bad_inputs_cli']} through the real CLI)"),
            ("wall time", f"{summary['seconds']} s")]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for i in inputs:
        if not i["handled"]:
            print("NOT HANDLED:", i.get("case") or " ".join(i["argv"][-4:]), "->", i["exit"], i["message"][:200])
    Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.json).write_text(json.dumps({"summary": summary, "runs": runs, "launcher": launcher,
                                           "signalled": signalled, "start_faults": faults, "early": early,
                                           "failures": failures, "inputs": inputs},
                                          indent=2) + "\n")
    print(f"written {opts.json}")


if __name__ == "__main__":
    main()
