"""The third round of fault injection's cases (used by fault_injection.py): planted links, FIFOs, sockets and
wrong kinds of files at every run-directory path, data of every wrong shape, half-set launcher variables,
nested and duplicated config keys, manifests without checksums; and through real processes: the launcher
killed in its first moments, a double Ctrl-C, signals while the command starts, a diverging run of each method
and a run directory removed under a live run."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
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
