"""Hostile cases, through real processes. Used by fault_injection.py: planted links, FIFOs, sockets and wrong kinds
of files at every run-directory path, data of every wrong shape, half-set launcher variables, nested and duplicated
config keys, manifests without checksums, the launcher killed in its first moments, signals while the command
starts. Run on its own, every attempt goes through the real launcher (``abtrain train`` in a process of its own):

- every numeric flag, and every numeric option in a TOML file, at 0, -1, nan, inf, 1e308, a 30-digit integer
  (and on the command line also -inf, 1e-308, a negative 30-digit integer and 2**32): each attempt must end
  with one ``abtrain: error:`` line naming the option, exit code 2 and nothing written, before any worker
  starts; or, for a value the run can use, complete (exit 0, no traceback);
- temporary directories planted in $TMPDIR for the clean-up of a killed launcher to delete (it must remove only
  what a launcher of this user made), hard links in the run directory (nothing outside it may change), a fork
  server that hangs (the start-up deadline) or dies while the workers start, signals during that start-up, a
  worker with no rank 0 and an address that does not resolve, the library's arguments out of range, every
  signal that ends a run at start-up and mid-run, an AB-training divergence at its first sync, a SIGKILLed
  launcher (it prints nothing), ``abtrain bench --extra`` with flags no run takes, config paths that are no file,
  NUL characters in config strings, forged manifest values, launcher variables beyond any world, a checkpoint of
  nan weights, and sparse files of gigabytes where abtrain reads JSON or TOML.

Each case must end as docs/reliability.md says: one line on stderr, the documented exit code, no traceback,
nothing outside the run directory created, changed or deleted, no process left.

    .venv/bin/python benchmarks/hostile_cases.py [--jobs 2] [--json benchmarks/results/hostile_cases.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gzip
import hashlib
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: Paths abtrain reads or writes in a run directory, and what belongs there.
FRESH_PATHS = {".lock": "file", "status.json": "file", "config.json": "file", "results.json": "file",
               "metrics.csv": "file", "model.pt": "file", "checkpoint": "dir", "tensorboard": "dir"}
RESUME_PATHS = {".lock": "file", "status.json": "file", "config.json": "file", "results.json": "file",
                "metrics.csv": "file", "model.pt": "file", "checkpoint": "dir", "checkpoint/latest.json": "file",
                "checkpoint/step-00000006": "dir", "checkpoint/step-00000006/rank0.pt": "file",
                "checkpoint/step-00000006/rank1.pt": "file", "tensorboard": "dir"}
PLANTS = ("link-to-file", "link-to-dir", "dangling-link", "fifo", "socket", "wrong-kind")


def tree_digest(root: Path) -> str:
    """Every regular file and link under ``root`` (links read as their text, never followed)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_symlink():
            h.update(os.readlink(path).encode())
        elif path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def plant(path: Path, how: str, kind: str, outside: Path) -> socket.socket | None:
    """Put ``how`` at ``path`` (after moving whatever was there into ``outside``); a socket is returned open."""
    if path.exists() or path.is_symlink():
        shutil.move(str(path), str(outside / f"moved-{path.name}"))
    if how == "link-to-file":
        path.symlink_to(outside / "precious.txt")
    elif how == "link-to-dir":
        path.symlink_to(outside / "precious-dir", target_is_directory=True)
    elif how == "dangling-link":
        path.symlink_to(outside / "nothing-here")
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "socket":
        s = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(path.parent)  # a socket's path holds at most 107 bytes: bind it by its name alone
        try:
            s.bind(path.name)
        finally:
            os.chdir(cwd)
        return s
    elif kind == "file":
        path.mkdir()
    else:
        path.write_text("a file where a directory belongs\n")
    return None


def outside_dir(tmp: Path, name: str) -> Path:
    """Files outside the run directory that a planted link points at: they must never change."""
    outside = tmp / name
    (outside / "precious-dir").mkdir(parents=True)
    (outside / "precious.txt").write_text("precious\n")
    (outside / "precious-dir" / "latest.json").write_text("{}\n")
    return outside


def run_dir_cases(tmp: Path, stopped: Path, job: list[str],
                  run: Callable[[list[str]], tuple[int, str]]) -> list[dict]:
    """Every plant at every path, for a fresh run and for a resume; each must be refused in one line with exit
    2 and touch nothing, inside the run directory or outside it."""
    results = []
    for mode, paths in (("fresh", FRESH_PATHS), ("resume", RESUME_PATHS)):
        for rel, kind in paths.items():
            for how in PLANTS:
                name = f"{mode}-{rel.replace('/', '_')}-{how}"
                outside = outside_dir(tmp, f"outside-{name}")
                d = tmp / f"rd-{name}"
                if mode == "resume":
                    shutil.copytree(stopped, d)
                else:
                    d.mkdir()
                if mode == "resume" and rel.count("/") and not (d / rel).parent.exists():
                    continue
                sock = plant(d / rel, how, kind, outside)
                before, outside_before = tree_digest(d), tree_digest(outside)
                argv = ["--resume", str(d)] if mode == "resume" else [*job, "--steps", "2", "--out", str(d)]
                code, stderr = run(argv)
                if sock is not None:
                    sock.close()
                intact = tree_digest(d) == before and tree_digest(outside) == outside_before
                results.append({"case": f"run-dir-{name}", "argv": argv, "exit": code, "intact": intact,
                                "stderr": stderr})
    # The run directory itself: a link to a directory elsewhere, a FIFO, a regular file.
    for how in ("link-to-dir", "fifo", "wrong-kind"):
        outside = outside_dir(tmp, f"outside-self-{how}")
        d = tmp / f"rd-self-{how}"
        plant(d, how, "dir", outside)
        outside_before = tree_digest(outside)
        argv = [*job, "--steps", "2", "--out", str(d)]
        code, stderr = run(argv)
        results.append({"case": f"run-dir-itself-{how}", "argv": argv, "exit": code,
                        "intact": tree_digest(outside) == outside_before, "stderr": stderr})
    return results


# ---------------------------------------------------------------- data of every wrong shape
def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


SHAPES = ((28, 27), (27, 28), (1, 1), (1, 28), (28, 1), (14, 14), (27, 27), (29, 29), (32, 32), (28, 56), (56, 28),
          (0, 28))


def data_shape_cases(tmp: Path, good: Path) -> list[list[str]]:
    """Fashion-MNIST images of every wrong size, in the training or the test split, for the MLP and the CNN."""
    cases = []
    for split, n in (("train", 256), ("t10k", 64)):
        for shape in SHAPES:
            d = tmp / f"shape-{split}-{shape[0]}x{shape[1]}"
            shutil.copytree(good, d)
            (d / f"{split}-images-idx3-ubyte.gz").write_bytes(_idx(np.zeros((n, *shape), dtype=np.uint8)))
            for model in ("mlp", "cnn"):
                cases.append(["--workers", "2", "--model", model, "--dataset", "fashion-mnist", "--data-dir", str(d),
                              "--steps", "2", "--out", str(tmp / "fuzz-run")])
    return cases


# ---------------------------------------------------------------- half-set launcher variables
def launcher_variable_cases() -> list[dict[str, str]]:
    """Environments whose torchrun or Slurm variables are half set or do not describe one world."""
    addr = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    envs: list[dict[str, str]] = [{"RANK": v} for v in ("0", "1", "", "x")]
    envs += [{"WORLD_SIZE": v} for v in ("1", "2", "", "x")]
    for world in ("0", "-1", "-3", "", "x", "1.5", "2e1"):
        envs += [{"RANK": "0", "WORLD_SIZE": world, **addr}]
    for rank in ("2", "3", "-1", "", "x", "1.0"):
        envs += [{"RANK": rank, "WORLD_SIZE": "2", **addr}]
    for local_rank, local_world in (("2", "2"), ("0", "3"), ("-1", "2"), ("1", "1"), ("0", "0"), ("x", "2"),
                                    ("0", "x")):
        envs += [{"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world, **addr}]
    envs += [{"RANK": "1", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": ""},
             {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}]
    envs += [{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": p}
             for p in ("", "0", "65536", "99999", "x", "-5")]
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", **addr}
    envs += [{**slurm, "SLURM_NTASKS": n} for n in ("x", "-2", "0")]
    envs += [{**slurm, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": v} for v in ("0", "x", "3")]
    envs += [{**slurm, "SLURM_PROCID": v, "SLURM_NTASKS": "2"} for v in ("2", "-1", "x")]
    envs += [{**slurm, "SLURM_NTASKS": "2", "SLURM_LOCALID": v} for v in ("5", "x")]
    return envs


# ---------------------------------------------------------------- nested and duplicated config keys
def config_texts(flat_keys: list[str], sections: dict[str, list[str]]) -> list[tuple[str, str]]:
    """TOML files that nest too deeply or give one option twice (two spellings, or a prefixed key and a table)."""
    texts = []
    for depth in (4, 5, 8, 50, 500, 5000):
        texts.append((f"nested-array-{depth}", "lr = " + "[" * depth + "1" + "]" * depth + "\n"))
        texts.append((f"nested-table-{depth}", "ab = " + "{a = " * depth + "1" + "}" * depth + "\n"))
    texts.append(("nested-in-section", "[ab]\nfull_rank = [[[[\"x\"]]]]\n"))
    for key in flat_keys:
        if "_" in key:
            texts.append((f"dup-{key}", f"{key} = 1\n{key.replace('_', '-')} = 2\n"))
    for section, keys in sections.items():
        for key in keys:
            texts.append((f"dup-{section}-{key}-table", f"{section}-{key.replace('_', '-')} = 1\n[{section}]\n{key} = 2\n"))
            if "_" in key:
                texts.append((f"dup-{section}-{key}-spelling",
                              f"{section}_{key} = 1\n{section}-{key.replace('_', '-')} = 2\n"))
    return texts


# ---------------------------------------------------------------- manifests without checksums
def manifest_cases(stopped: Path, tmp: Path) -> list[tuple[str, Path]]:
    cases = []
    for name in ("no-sha256", "one-sum-missing", "sha256-not-a-table", "sha256-empty"):
        d = tmp / f"manifest-{name}"
        shutil.copytree(stopped, d)
        path = d / "checkpoint" / "latest.json"
        manifest = json.loads(path.read_text())
        if name == "no-sha256":
            del manifest["sha256"]
        elif name == "one-sum-missing":
            del manifest["sha256"]["rank1.pt"]
        elif name == "sha256-not-a-table":
            manifest["sha256"] = "none"
        else:
            manifest["sha256"] = {}
        path.write_text(json.dumps(manifest))
        shard = d / "checkpoint" / "step-00000006" / "rank1.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        cases.append((name, d))
    return cases


# ---------------------------------------------------------------- real processes
def session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a launcher started in a session of its own and everything it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                pids.append(int(entry))
    return pids


def left_behind(sid: int, wait: float = 60.0) -> list[int]:
    deadline = time.time() + wait
    while session(sid) and time.time() < deadline:
        time.sleep(0.1)
    return session(sid)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _first_worker_forked(pid: int) -> bool:
    for child in _children(pid):
        try:
            if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes() and _children(child):
                return True
        except OSError:
            pass
    return False


def early_kill(argv: list[str], env: dict[str, str], rng: random.Random) -> dict:
    """SIGKILL the launcher 0-100 ms after its first worker is forked: nothing of it may stay alive."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    while proc.poll() is None and not _first_worker_forked(proc.pid):
        time.sleep(0.002)
    delay = rng.uniform(0.0, 0.1)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = left_behind(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return {"delay_ms": round(1000 * delay, 1), "returncode": proc.returncode, "left_behind": len(left)}


def handles_sigterm(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


def early_signal(argv: list[str], env: dict[str, str], sig: signal.Signals, rng: random.Random) -> dict:
    """A signal 0-2 s after the command can catch it (while torch imports, the preflight, the first fork)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    while proc.poll() is None and not handles_sigterm(proc.pid):
        time.sleep(0.002)
    delay = rng.uniform(0.0, 2.0)
    time.sleep(delay)
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=300)
    lines = stderr.strip().splitlines()
    left = left_behind(proc.pid)
    return {"signal": sig.name, "delay_ms": round(1000 * delay), "returncode": proc.returncode,
            "one_line": len(lines) == 1 and lines[0].startswith(f"abtrain: interrupted ({sig.name})")
            and "Traceback" not in stderr, "left_behind": len(left), "stderr": stderr.strip()[-300:]}


# ================================================================ run on its own: every attempt through the launcher
ROOT = Path(__file__).resolve().parent.parent
ABTRAIN = [sys.executable, "-m", "abtrain.cli"]
#: A run that takes seconds: 2 workers, the MLP on synthetic data, 4 steps.
FUZZ_JOB = ["--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--steps", "4", "--batch-size", "8",
            "--log-every", "100"]
#: The job of the signal and kill cases: long enough to be signalled mid-run, a checkpoint every 2 steps.
LONG_JOB = ["--method", "ddp", "--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "16",
            "--log-every", "1", "--seed", "3", "--checkpoint-every", "2"]
#: Values of every numeric option, on the command line and in a TOML file.
FUZZ_VALUES = ("0", "-1", "nan", "inf", "1e308", "1" * 30)
#: ... and on the command line only (TOML has no such literals, or they add nothing there).
CLI_ONLY_VALUES = ("-inf", "1e-308", "-" + "1" * 30, str(2 ** 32))
#: A fork server that hangs while it imports the workers' code (a plugin module that sleeps there).
SERVER_HANGS = "import sys, time\nif 'abtrain.run.fork_server_tie' in sys.modules:\n    time.sleep(3600)\n"
#: The real command with its start-up deadline set (seconds, the first argument) instead of 60 s at least.
PATCHED_DEADLINE = ("import sys; import abtrain.run.launch as launch; launch.MIN_START_S = float(sys.argv.pop(1)); "
                    "from abtrain.cli import main; sys.exit(main())")


def clean_env(**extra: str) -> dict[str, str]:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT",
             "MASTER_ADDR", "MASTER_PORT", "ABTRAIN_METHOD_MODULES")
    return {**{k: v for k, v in os.environ.items() if k not in names}, "PYTHONUNBUFFERED": "1", **extra}


def one_error_line(code: int, stderr: str, expected: int = 2) -> bool:
    lines = stderr.strip().splitlines()
    return (code == expected and len(lines) == 1 and lines[0].startswith("abtrain: error:")
            and "Traceback" not in stderr)


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env or clean_env(), timeout=timeout,
                           start_new_session=True)
        code, stderr = p.returncode, p.stderr
    except subprocess.TimeoutExpired as exc:
        code, stderr = -999, f"timed out after {timeout} s: {exc.stderr!r}"
    return code, stderr, round(time.perf_counter() - start, 1)


def _result(kind: str, case: str, handled: bool, code: int, stderr: str, seconds: float, **extra) -> dict:
    return {"kind": kind, "case": case, "handled": bool(handled), "exit": code, "seconds": seconds,
            "message": stderr.strip()[-300:], **extra}


# ---------------------------------------------------------------- 3: every numeric option, through the launcher
def numeric_options() -> list[tuple[str, str, str, str | None]]:
    """(method, flag, option name, method's section or None) of every int and float option."""
    from abtrain.config import SECTIONS, config_fields
    from abtrain.methods import registry

    def numeric(f: dataclasses.Field) -> bool:
        return str(f.type).split(" ")[0] in ("int", "float")
    out = [("ddp", "--" + f.name.replace("_", "-"), f.name, None) for f in config_fields() if numeric(f)]
    for spec in registry.with_options():
        out += [(spec.name, f"--{spec.name}-{f.name.replace('_', '-')}", f.name, spec.section)
                for f in dataclasses.fields(SECTIONS[spec.section]) if numeric(f)]
    return out


#: What a method needs besides FUZZ_JOB to run on it: AB-training two groups of one worker, DeMo plain SGD,
#: Streaming DiLoCo no more fragments than the MLP's three layers.
METHOD_FLAGS = {"ab": ["--group-size", "1"], "demo": ["--momentum", "0"],
                "streaming-diloco": ["--streaming-diloco-fragments", "2"]}


def _fuzz_base(method: str, drop: str | None = None) -> list[str]:
    """FUZZ_JOB for ``method``, without flag ``drop`` (the option a TOML file gives: a flag would override it)."""
    job = FUZZ_JOB + ["--method", method] + METHOD_FLAGS.get(method, [])
    if drop is not None and drop in job:
        i = job.index(drop)
        job = job[:i] + job[i + 2:]
    return job


def fuzz_attempts(tmp: Path) -> list[dict]:
    """Every numeric option at every hostile value: as a flag, and as a value in a TOML file."""
    attempts = []
    for method, flag, name, section in numeric_options():
        for value in FUZZ_VALUES + CLI_ONLY_VALUES:
            out = tmp / f"fuzz-{len(attempts)}"
            attempts.append({"case": f"{flag}={value}", "option": flag, "name": name, "out": str(out),
                             "argv": ["train", *_fuzz_base(method), f"{flag}={value}", "--out", str(out)]})
        for value in FUZZ_VALUES:
            out = tmp / f"fuzz-{len(attempts)}"
            path = tmp / f"fuzz-{len(attempts)}.toml"
            path.write_text(f"method = {json.dumps(method)}\n" + (f"[{section}]\n" if section else "")
                            + f"{name} = {value}\n")
            attempts.append({"case": f"toml {section + '.' if section else ''}{name} = {value}", "option": flag,
                             "name": name, "out": str(out),
                             "argv": ["train", *_fuzz_base(method, flag), "--config", str(path), "--out", str(out)]})
    return attempts


def judge_fuzz(attempt: dict, code: int, stderr: str, seconds: float) -> dict:
    """Refused before any worker (one line naming the option, exit 2, nothing written) or run to completion."""
    out = Path(attempt["out"])
    message = stderr.strip().splitlines()[0] if stderr.strip() else ""
    # AB-training's rank rules name an option by its rule ("fraction must be in (0, 1]").
    named = attempt["option"] in message or f"{attempt['name'].split('_')[-1]} must be" in message
    if code == 0:
        outcome = "completed"
        handled = (out / "results.json").exists() and "Traceback" not in stderr
    else:
        outcome = "refused"
        handled = one_error_line(code, stderr) and named and not out.exists()
    shutil.rmtree(out, ignore_errors=True)
    return _result("3 numeric values", attempt["case"], handled, code, stderr, seconds, outcome=outcome)


def run_fuzz(tmp: Path, jobs: int) -> list[dict]:
    attempts = fuzz_attempts(tmp)
    results: list[dict] = []

    def one(attempt: dict) -> dict:
        code, stderr, seconds = _run(ABTRAIN + attempt["argv"], timeout=300)
        return judge_fuzz(attempt, code, stderr, seconds)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for n, r in enumerate(pool.map(one, attempts)):
            results.append(r)
            if not r["handled"] or (n + 1) % 100 == 0:
                print(f"fuzz {n + 1}/{len(attempts)}: {r['case']}: exit {r['exit']} {r['outcome']}, handled "
                      f"{r['handled']}" + ("" if r["handled"] else f": {r['message'][-200:]}"), flush=True)
    return results


# ---------------------------------------------------------------- 1: the clean-up of a killed launcher's temp dirs
DEAD = 4_194_400  # above any pid Linux hands out (pid_max <= 2**22)


def _digest(root: Path) -> str:
    return tree_digest(root) if root.exists() else "missing"


def tmp_cleanup_cases(tmp: Path) -> list[dict]:
    """One real run per plant in its $TMPDIR: what a dead launcher of this user made goes, nothing else."""
    results = []
    variants = ["record-elsewhere", "record-link", "private-is-link", "record-is-link", "record-dotdot",
                "record-sparse", "private-open-to-others", "private-live-pid", "name-too-long"]
    if os.geteuid() == 0:
        variants.append("private-of-another-user")
    for n, how in enumerate(variants):
        root, victim = tmp / f"tmp-{n}", tmp / f"victim-{n}"
        root.mkdir()
        (victim / "pymp-abcdefgh").mkdir(parents=True)
        (victim / "pymp-abcdefgh" / "keep").write_text("precious\n")
        (victim / "record").write_text(str(victim / "pymp-abcdefgh"))
        pid = os.getpid() if how == "private-live-pid" else DEAD + n
        private = root / (f"abtrain-{pid}-plantxxxx" if how == "name-too-long" else f"abtrain-{pid}-plantxxx")
        stays = {private.name}
        recorded: str = str(victim / "pymp-abcdefgh")
        if how == "private-is-link":
            private.symlink_to(victim)
        else:
            private.mkdir(mode=0o700)
            if how == "record-link":
                (root / "pymp-linkxxxx").symlink_to(victim / "pymp-abcdefgh")
                recorded = str(root / "pymp-linkxxxx")
                stays = {"pymp-linkxxxx"}
            elif how == "record-dotdot":
                (root / "pymp-dotdotxx").mkdir(mode=0o700)
                recorded = str(root / ".." / root.name / "pymp-dotdotxx")
                stays = {"pymp-dotdotxx"}
            if how == "record-is-link":
                (private / "fork-server-dir").symlink_to(victim / "record")
            elif how == "record-sparse":
                with open(private / "fork-server-dir", "wb") as fh:
                    fh.write(recorded.encode())
                    fh.truncate(2 << 30)
            else:
                (private / "fork-server-dir").write_text(recorded)
            if how == "private-open-to-others":
                os.chmod(private, 0o755)
            elif how == "private-of-another-user":
                os.chown(private, 12345, 12345)
            if how in ("record-elsewhere", "record-link", "record-is-link", "record-dotdot", "record-sparse"):
                stays = stays - {private.name}  # this user's dead launcher's directory: removed, but not what it names
        before = _digest(victim)
        others = {e: _digest(root / e) if (root / e).is_dir() and not (root / e).is_symlink() else "x"
                  for e in stays}
        code, stderr, seconds = _run(ABTRAIN + ["train", *FUZZ_JOB, "--method", "ddp",
                                                "--out", str(tmp / f"tmprun-{n}")], env=clean_env(TMPDIR=str(root)))
        left = {e.name for e in root.iterdir()}
        handled = (code == 0 and _digest(victim) == before and stays <= left
                   and all(_digest(root / e) == d for e, d in others.items() if d != "x")
                   and not any(e.startswith("abtrain-") and e not in stays for e in left))
        results.append(_result("1 temp clean-up", how, handled, code, stderr, seconds, left=sorted(left)))
    return results


# ---------------------------------------------------------------- 2: hard links in the run directory
def hard_link_cases(tmp: Path, stopped: Path) -> list[dict]:
    results = []
    for mode in ("fresh", "resume"):
        parent = tmp / f"hl-lock-{mode}"
        parent.mkdir()
        run = parent / "run"
        if mode == "resume":
            shutil.copytree(stopped, run)
            (run / ".lock").unlink(missing_ok=True)
        else:
            run.mkdir()
        (parent / "outside").write_text("precious\n")
        os.link(parent / "outside", run / ".lock")
        argv = ["--resume", str(run)] if mode == "resume" else [*FUZZ_JOB, "--out", str(run)]
        code, stderr, seconds = _run(ABTRAIN + ["train", *argv])
        handled = (one_error_line(code, stderr) and "hard links" in stderr
                   and (parent / "outside").read_text() == "precious\n")
        results.append(_result("2 hard links", f".lock ({mode} run)", handled, code, stderr, seconds))
    names = {"fresh": ("status.json", "config.json", "metrics.csv", "model.pt"),
             "resume": ("status.json", "config.json", "checkpoint/latest.json", "checkpoint/step-00000006/rank0.pt")}
    for mode, files in names.items():
        for name in files:
            parent = tmp / f"hl-{mode}-{name.replace('/', '_')}"
            parent.mkdir()
            run = parent / "run"
            if mode == "resume":
                shutil.copytree(stopped, run)
                (parent / "outside").write_bytes((run / name).read_bytes())
                (run / name).unlink()
            else:
                run.mkdir()
                (parent / "outside").write_text("precious\n")
            os.link(parent / "outside", run / name)
            before = (parent / "outside").read_bytes()
            argv = ["--resume", str(run)] if mode == "resume" else [*FUZZ_JOB, "--method", "ddp", "--out", str(run)]
            code, stderr, seconds = _run(ABTRAIN + ["train", *argv])
            handled = code == 0 and (parent / "outside").read_bytes() == before and (run / "results.json").exists()
            results.append(_result("2 hard links", f"{name} ({mode} run, replaced by rename)", handled, code, stderr,
                                   seconds))
    return results


# ---------------------------------------------------------------- 4: the start-up deadline, and signals during it
def _hanging(tmp: Path, name: str, deadline_s: float) -> tuple[subprocess.Popen, Path]:
    plugin = tmp / "plugins"
    plugin.mkdir(exist_ok=True)
    (plugin / "hang_in_server.py").write_text(SERVER_HANGS)
    out = tmp / f"start-{name}"
    env = clean_env(ABTRAIN_METHOD_MODULES="hang_in_server",
                    PYTHONPATH=os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", PATCHED_DEADLINE, str(deadline_s), "train", *FUZZ_JOB,
                             "--method", "ddp", "--timeout", "1", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    return proc, out


def _server_of(pid: int) -> int | None:
    for child in _children(pid):
        try:
            if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            pass
    return None


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        stderr += "\n(hung: killed)"
    return stderr


def _status(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def startup_cases(tmp: Path) -> list[dict]:
    results = []
    for n, deadline_s in enumerate((3, 5)):
        start = time.perf_counter()
        proc, out = _hanging(tmp, f"deadline-{n}", deadline_s)
        stderr = _finish(proc)
        left = left_behind(proc.pid)
        handled = (one_error_line(proc.returncode, stderr, 1) and f"did not start within {deadline_s} s" in stderr
                   and _status(out).get("kind") == "start" and not left)
        results.append(_result("4 start-up", f"fork server hangs, deadline {deadline_s} s", handled, proc.returncode,
                               stderr, round(time.perf_counter() - start, 1), left_behind=len(left)))
    for how in ("fork server killed", "Ctrl-C then SIGTERM", "SIGHUP", "SIGUSR1 to the group", "SIGTERM"):
        start = time.perf_counter()
        proc, out = _hanging(tmp, how.replace(" ", "-"), 600)
        deadline = time.time() + 120
        while _server_of(proc.pid) is None and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the launcher now waits for its fork server
        if how == "fork server killed":
            server = _server_of(proc.pid)
            if server is not None:
                os.kill(server, signal.SIGKILL)
        elif how == "Ctrl-C then SIGTERM":
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.3)
            os.kill(proc.pid, signal.SIGTERM)
        elif how == "SIGUSR1 to the group":
            os.killpg(proc.pid, signal.SIGUSR1)
        else:
            os.kill(proc.pid, getattr(signal, how))
        stderr = _finish(proc)
        left = left_behind(proc.pid)
        if how == "fork server killed":
            handled = (one_error_line(proc.returncode, stderr, 1) and "was killed by SIGKILL" in stderr
                       and _status(out).get("status") == "failed")
        else:
            name = {"Ctrl-C then SIGTERM": "SIGINT", "SIGUSR1 to the group": "SIGUSR1"}.get(how, how)
            lines = stderr.strip().splitlines()
            handled = (proc.returncode == 130 and len(lines) == 1
                       and lines[0].startswith(f"abtrain: interrupted ({name})")
                       and _status(out).get("status") == "interrupted")
        results.append(_result("4 start-up", f"fork server hangs, {how}", handled and not left, proc.returncode,
                               stderr, round(time.perf_counter() - start, 1), left_behind=len(left)))
    return results


# ---------------------------------------------------------------- 5: a worker that cannot join
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_cases(tmp: Path) -> list[dict]:
    results = []
    world = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for n, (case, variables, code_expected, words) in enumerate([
            ("rank 1 without rank 0", {"RANK": "1", "MASTER_ADDR": "127.0.0.1"}, 1, "could not join"),
            ("rank 0 without rank 1", {"RANK": "0", "MASTER_ADDR": "127.0.0.1"}, 1, "could not join"),
            ("MASTER_ADDR no-such-host.invalid", {"RANK": "1", "MASTER_ADDR": "no-such-host.invalid"}, 2,
             "does not resolve"),
            ("MASTER_ADDR a..b", {"RANK": "0", "MASTER_ADDR": "a..b"}, 2, "does not resolve"),
            ("MASTER_ADDR 999.1.1.1", {"RANK": "1", "MASTER_ADDR": "999.1.1.1"}, 2, "does not resolve")]):
        env = clean_env(**world, **variables, MASTER_PORT=str(_free_port()))
        env.pop("TORCH_CPP_LOG_LEVEL", None)
        out = tmp / f"join-{n}"
        code, stderr, seconds = _run(ABTRAIN + ["train", *FUZZ_JOB, "--method", "ddp", "--timeout", "2",
                                                "--out", str(out)], env=env)
        handled = one_error_line(code, stderr, code_expected) and words in stderr
        if code_expected == 2:
            handled = handled and not out.exists()
        results.append(_result("5 join failures", case, handled, code, stderr, seconds))
    return results


# ---------------------------------------------------------------- 6: the library's arguments
API_CASES = [
    ("setup('ab', total_steps=10**30, sync='only-b')", "ValueError", "total_steps"),
    ("setup('ab', total_steps=float('nan'))", "TypeError", "total_steps"),
    ("setup('ab', total_steps='10')", "TypeError", "total_steps"),
    ("setup('ab', total_steps=0)", "ValueError", "total_steps"),
    ("setup('ab', total_steps=-5)", "ValueError", "total_steps"),
    ("setup('ab', total_steps=True)", "TypeError", "total_steps"),
    ("setup('ab', total_steps=2.5)", "TypeError", "total_steps"),
    ("setup('ddp', timeout_s=-1)", "ValueError", "timeout_s"),
    ("setup('ddp', timeout_s=0)", "ValueError", "timeout_s"),
    ("setup('ddp', timeout_s=float('inf'))", "ValueError", "timeout_s"),
    ("setup('ddp', timeout_s=1e30)", "ValueError", "timeout_s"),
    ("setup('ddp', timeout_s='5')", "TypeError", "timeout_s"),
    ("setup('ddp', backend='mpi2')", "ValueError", "backend"),
    ("setup('ddp', device='tpu')", "ValueError", "device"),
    ("setup('ddp', group_size='2')", "TypeError", "group_size"),
    ("Topology(rank=5, world_size=2)", "ValueError", "rank"),
    ("Topology(world_size=0)", "ValueError", "world_size"),
    ("Topology(rank=-1, world_size=2)", "ValueError", "rank"),
    ("Topology(world_size=2.0)", "TypeError", "world_size"),
    ("Topology(world_size='2')", "TypeError", "world_size"),
    ("Topology(world_size=2, local_world_size=3)", "ValueError", "local_world_size"),
    ("Topology(world_size=2, local_world_size=2, local_rank=2)", "ValueError", "local_rank"),
]


def api_cases() -> list[dict]:
    results = []
    for call, error, argument in API_CASES:
        code = (f"import abtrain\nfrom abtrain import setup, Topology\ntry:\n    {call}\nexcept {error} as e:\n"
                f"    print('refused:', e)\nelse:\n    print('accepted')\n")
        start = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
        seconds = round(time.perf_counter() - start, 1)
        line = p.stdout.strip()
        handled = p.returncode == 0 and line.startswith("refused:") and argument in line and seconds < 60
        results.append(_result("6 library API", call, handled, p.returncode, line or p.stderr, seconds))
    return results


# ---------------------------------------------------------------- 7: every signal that ends a run
def handles(pid: int, sig: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def signal_run(tmp: Path, name: str, sig: int, moment: str, group: bool = False) -> dict:
    """``sig`` to the launcher (or its process group) at ``moment`` ("start": once the command catches signals;
    "step N": after step N's line): exit 130, one line naming the signal, status interrupted, no process left."""
    from abtrain.run.interrupt import signal_name
    out = tmp / f"sig-{name}"
    start = time.perf_counter()
    proc = subprocess.Popen(ABTRAIN + ["train", *LONG_JOB, "--steps", "100000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)
    assert proc.stdout is not None
    if moment == "start":
        while not handles(proc.pid, signal.SIGTERM) and proc.poll() is None:
            time.sleep(0.002)
    else:
        for line in proc.stdout:
            if line.startswith(f"{moment}/"):
                break
    (os.killpg if group else os.kill)(proc.pid, sig)
    stderr = _finish(proc)
    left = left_behind(proc.pid)
    lines = stderr.strip().splitlines()
    handled = (proc.returncode == 130 and len(lines) == 1
               and lines[0].startswith(f"abtrain: interrupted ({signal_name(sig)})") and "Traceback" not in stderr
               and not left and (moment == "start" or _status(out).get("status") == "interrupted"))
    return _result("7 signals", f"{signal_name(sig)}{' to the group' if group else ''} at {moment}", handled,
                   proc.returncode, stderr, round(time.perf_counter() - start, 1), left_behind=len(left))


def signal_cases(tmp: Path) -> list[dict]:
    sigs = [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT, signal.SIGALRM, signal.SIGVTALRM,
            signal.SIGXCPU, signal.SIGPWR, signal.SIGRTMIN + 3, signal.SIGRTMAX]
    results = []
    for n, sig in enumerate(sigs):
        for moment in ("start", f"step {3 + n % 4}"):
            results.append(signal_run(tmp, f"{n}-{moment.replace(' ', '')}", sig, moment, group=n % 3 == 1))
    return results


# ---------------------------------------------------------------- 8: one line, and nothing after a kill
def one_line_cases(tmp: Path) -> list[dict]:
    results = []
    for n, (lr, split) in enumerate([("1e6", "tangent"), ("1e4", "tangent"), ("1e6", "sigma"), ("1e8", "sqrt")]):
        extra = ["--ab-sync", "with-stale"] if split != "tangent" else []
        code, stderr, seconds = _run(ABTRAIN + ["train", *FUZZ_JOB, "--method", "ab", "--group-size", "1",
                                                "--steps", "12", "--ab-warmup-steps", "0", "--ab-sync-every", "3",
                                                "--ab-split", split, *extra, "--lr", lr,
                                                "--out", str(tmp / f"div-{n}")])
        handled = one_error_line(code, stderr, 1) and ("inf or nan" in stderr or "became nan" in stderr)
        results.append(_result("8 one line", f"AB divergence at its first sync (--lr {lr}, split {split})", handled,
                               code, stderr, seconds))
    for n, step in enumerate((2, 5, 9)):
        start = time.perf_counter()
        proc = subprocess.Popen(ABTRAIN + ["train", *LONG_JOB, "--steps", "100000", "--out", str(tmp / f"k9-{n}")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                                start_new_session=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(f"step {step}/"):
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left = left_behind(proc.pid)
        stderr = proc.stderr.read() if proc.stderr else ""
        results.append(_result("8 one line", f"SIGKILL after step {step}: nothing printed", stderr == "" and not left,
                               proc.returncode, stderr, round(time.perf_counter() - start, 1), left_behind=len(left)))
    for n, flags in enumerate([["--extra", "--frobnicate 3"], ["--extra", "--lr abc"], ["--extra", "--help"],
                               ["--method-args", "ab:--bogus"], ["--method-args", "ddp:--steps 1.5"]]):
        out = tmp / f"bench-{n}"
        code, stderr, seconds = _run(ABTRAIN + ["bench", "--quick", *flags, "--out", str(out)])
        handled = one_error_line(code, stderr) and flags[0] in stderr and not out.exists()
        results.append(_result("8 one line", f"bench {' '.join(flags)}", handled, code, stderr, seconds))
    return results


# ---------------------------------------------------------------- 9: lines that say what is wrong
def _forge(run: Path, change: Callable[[dict], None]) -> None:
    path = run / "checkpoint" / "latest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _nan_checkpoint(run: Path, part: str) -> None:
    import torch
    manifest = json.loads((run / "checkpoint" / "latest.json").read_text())
    for rank in (0, 1):
        shard = run / "checkpoint" / manifest["dir"] / f"rank{rank}.pt"
        state = torch.load(shard, weights_only=True)
        if part == "model":
            for tensor in state["model"].values():
                if tensor.is_floating_point():
                    tensor.fill_(math.inf if rank else math.nan)
        else:
            for entry in state["optimizer"]["state"].values():
                for tensor in entry.values():
                    if torch.is_tensor(tensor) and tensor.is_floating_point():
                        tensor.fill_(math.nan)
        torch.save(state, shard)
        manifest["files"][shard.name] = shard.stat().st_size
        manifest["sha256"][shard.name] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (run / "checkpoint" / "latest.json").write_text(json.dumps(manifest))


def wrong_line_cases(tmp: Path, stopped: Path) -> list[dict]:
    results = []
    fifo = tmp / "a-fifo.toml"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp / "a-socket.toml"))
    for path, kind in (("/dev/zero", "a device"), ("/dev/null", "a device"), ("/dev/urandom", "a device"),
                       (str(fifo), "a FIFO"), (str(tmp / "a-socket.toml"), "a socket")):
        out = tmp / f"cfg-{len(results)}"
        code, stderr, seconds = _run(ABTRAIN + ["train", "--config", path, "--out", str(out)])
        handled = one_error_line(code, stderr) and f"is {kind}, not a regular file" in stderr and not out.exists()
        results.append(_result("9 wrong lines", f"--config {path}", handled, code, stderr, seconds))
    sock.close()
    for key, flag in (("data_dir", "--data-dir"), ("out", "--out"), ("[ab]\nfull_rank", "--ab-full-rank"),
                      ("method", "--method"), ("[streaming_diloco]\nquantize", "--streaming-diloco-quantize")):
        path = tmp / f"nul-{len(results)}.toml"
        path.write_text('workers = 2\nmodel = "mlp"\ndataset = "synthetic"\nsteps = 1\n' + f'{key} = "x\\u0000y"\n')
        out = [] if key == "out" else ["--out", str(tmp / f"nul-run-{len(results)}")]
        code, stderr, seconds = _run(ABTRAIN + ["train", "--config", str(path), *out])
        handled = one_error_line(code, stderr) and flag in stderr and "embedded null byte" not in stderr
        results.append(_result("9 wrong lines", f"NUL in {key.split()[-1]}", handled, code, stderr, seconds))
    forgeries = [("settings.lr = 'fast'", lambda m: m["settings"].update(lr="fast")),
                 ("settings.lr = -1", lambda m: m["settings"].update(lr=-1)),
                 ("settings.grad_clip = 'x'", lambda m: m["settings"].update(grad_clip="x")),
                 ("settings not a table", lambda m: m.update(settings=[1])),
                 ("sha256 an integer", lambda m: m["sha256"].update({"rank1.pt": 123})),
                 ("sha256 too short", lambda m: m["sha256"].update({"rank1.pt": "ab12"})),
                 ("sha256 upper case", lambda m: m["sha256"].update({"rank0.pt": m["sha256"]["rank0.pt"].upper()})),
                 ("size a string", lambda m: m["files"].update({"rank1.pt": "big"})),
                 ("size negative", lambda m: m["files"].update({"rank0.pt": -1}))]
    for name, change in forgeries:
        run = tmp / f"forged-{len(results)}"
        shutil.copytree(stopped, run)
        _forge(run, change)
        before = tree_digest(run)
        code, stderr, seconds = _run(ABTRAIN + ["train", "--resume", str(run)])
        handled = (one_error_line(code, stderr) and "checkpoint manifest" in stderr and "--lr" not in stderr
                   and "changed bytes" not in stderr and tree_digest(run) == before)
        results.append(_result("9 wrong lines", f"manifest {name}", handled, code, stderr, seconds))
    for name, value in (("WORLD_SIZE", "9" * 20), ("WORLD_SIZE", str(2 ** 63)), ("RANK", "9" * 20),
                        ("LOCAL_WORLD_SIZE", "9" * 20), ("SLURM_NTASKS", "9" * 20)):
        variables = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", name: value}
        if name == "SLURM_NTASKS":
            variables = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": value,
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
        out = tmp / f"world-{len(results)}"
        code, stderr, seconds = _run(ABTRAIN + ["train", *FUZZ_JOB, "--method", "ddp", "--out", str(out)],
                                     env=clean_env(**variables))
        handled = one_error_line(code, stderr) and f"{name}={value}" in stderr and not out.exists()
        results.append(_result("9 wrong lines", f"{name}={value}", handled, code, stderr, seconds))
    for part in ("model", "optimizer"):
        run = tmp / f"nan-{part}"
        shutil.copytree(stopped, run)
        _nan_checkpoint(run, part)
        code, stderr, seconds = _run(ABTRAIN + ["train", "--resume", str(run)])
        handled = (one_error_line(code, stderr) and f"holds inf or nan in {part}." in stderr
                   and "--lr" not in stderr and "--resume" not in stderr)
        results.append(_result("9 wrong lines", f"checkpoint of nan {part} state", handled, code, stderr, seconds))
    return results


# ---------------------------------------------------------------- 10: sizes before reading
def size_cases(tmp: Path, stopped: Path) -> list[dict]:
    results = []
    for rel, expect in (("checkpoint/latest.json", "refused"), ("config.json", "refused"),
                        ("status.json", "ignored")):
        run = tmp / f"sparse-{len(results)}"
        shutil.copytree(stopped, run)
        with open(run / rel, "r+b") as fh:
            fh.truncate(2 << 30)  # sparse: costs nothing to make, seconds to read
        code, stderr, seconds = _run(ABTRAIN + ["train", "--resume", str(run)])
        if expect == "refused":
            handled = one_error_line(code, stderr) and "2,147,483,648 bytes" in stderr
        else:  # a status that cannot be read is none: the resume goes on, and writes a new one
            handled = code == 0 and (run / "results.json").exists() and (run / rel).stat().st_size < 1 << 20
        results.append(_result("10 sizes", f"sparse 2 GB {rel} ({expect})", handled, code, stderr, seconds))
    for name in ("c.toml", "c.json"):
        path = tmp / f"sparse-{name}"
        with open(path, "wb") as fh:
            fh.truncate(2 << 30)
        out = tmp / f"sparse-run-{name}"
        code, stderr, seconds = _run(ABTRAIN + ["train", "--config", str(path), "--out", str(out)])
        handled = one_error_line(code, stderr) and "2,147,483,648 bytes" in stderr and not out.exists()
        results.append(_result("10 sizes", f"sparse 2 GB --config {name}", handled, code, stderr, seconds))
    return results


def _private_dirs(root: Path) -> set[str]:
    """The launchers' private temporary directories under ``root`` whose launcher is gone."""
    from abtrain.run.private_tmp import PRIVATE_NAME
    out = set()
    for entry in root.iterdir():
        m = PRIVATE_NAME.fullmatch(entry.name)
        if m is not None and not Path(f"/proc/{m.group(1)}").exists():
            out.add(entry.name)
    return out


def make_stopped(tmp: Path) -> Path:
    """A run stopped after step 6 of 30 (a complete checkpoint, config.json, status 'stopped')."""
    stopped = tmp / "stopped"
    code, stderr, _ = _run(ABTRAIN + ["train", *LONG_JOB, "--steps", "30", "--checkpoint-every", "3", "--stop-after",
                                      "6", "--out", str(stopped)])
    assert code == 0, stderr
    return stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="fuzz attempts run at once")
    ap.add_argument("--no-fuzz", action="store_true", help="only the cases of each kind, not the numeric fuzz")
    ap.add_argument("--only", default="", help="comma-separated kind numbers to run (default: all), e.g. 2,4")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "hostile_cases.json"))
    opts = ap.parse_args()
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="abtrain-hostile-"))
    results: list[dict] = []
    try:
        stopped = make_stopped(tmp)
        parent_before = _private_dirs(tmp.parent)
        parts = {"1 temp clean-up": lambda: tmp_cleanup_cases(tmp), "2 hard links": lambda: hard_link_cases(tmp, stopped),
                 "4 start-up": lambda: startup_cases(tmp), "5 join failures": lambda: join_cases(tmp),
                 "6 library API": api_cases, "7 signals": lambda: signal_cases(tmp),
                 "8 one line": lambda: one_line_cases(tmp), "9 wrong lines": lambda: wrong_line_cases(tmp, stopped),
                 "10 sizes": lambda: size_cases(tmp, stopped)}
        for kind, part in parts.items():
            if opts.only and kind.split()[0] not in opts.only.split(","):
                continue
            try:
                found = part()
            except Exception as exc:  # the harness's own failure: counted, and the other kinds still run
                found = [_result(kind, "harness error", False, -1, f"{type(exc).__name__}: {exc}", 0.0)]
            for r in found:
                results.append(r)
                print(f"{r['kind']}: {r['case']}: exit {r['exit']}, handled {r['handled']} ({r['seconds']} s)"
                      + ("" if r["handled"] else f": {r['message'][-240:]}"), flush=True)
        if not opts.no_fuzz and (not opts.only or "3" in opts.only.split(",")):
            results += run_fuzz(tmp, opts.jobs)
        # No private temporary directory of a launcher that is gone left in $TMPDIR: each launcher removes its own,
        # and the next one a killed launcher's.
        stray = sorted(_private_dirs(tmp.parent) - parent_before)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    kinds = sorted({r["kind"] for r in results}, key=lambda k: int(k.split()[0]))
    rows = [(kind, f"{sum(r['handled'] for r in results if r['kind'] == kind)} / "
                   f"{sum(r['kind'] == kind for r in results)}") for kind in kinds]
    fuzz = [r for r in results if r["kind"] == "3 numeric values"]
    launcher = [r for r in results if r["kind"] != "6 library API"]
    summary = {"attempts": len(results), "handled": sum(r["handled"] for r in results),
               "failures": sum(not r["handled"] for r in results), "through_the_launcher": len(launcher),
               "fuzz_attempts": len(fuzz), "fuzz_refused": sum(r.get("outcome") == "refused" for r in fuzz),
               "fuzz_completed": sum(r.get("outcome") == "completed" for r in fuzz),
               "stray_temporary_directories": len(stray), "seconds": round(time.perf_counter() - t0, 1)}
    rows += [("numeric fuzz: refused before any worker / run to completion",
              f"{summary['fuzz_refused']} / {summary['fuzz_completed']}"),
             ("attempts through the real launcher", f"{summary['through_the_launcher']}"),
             ("failures (not as documented)", f"{summary['failures']}"),
             ("temporary directories left next to the runs' own", f"{summary['stray_temporary_directories']}"),
             ("wall time", f"{summary['seconds']} s")]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for r in results:
        if not r["handled"]:
            print("NOT HANDLED:", r["kind"], r["case"], "->", r["exit"], r["message"][-200:])
    Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.json).write_text(json.dumps({"summary": summary, "results": results}, indent=2) + "\n")
    print(f"written {opts.json}")


if __name__ == "__main__":
    main()
