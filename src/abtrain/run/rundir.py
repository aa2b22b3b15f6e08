"""Who owns a run directory, how far its workers got, and what its status really is.

- :class:`RunLock`: an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock``, held by
  the launcher (or rank 0 under torchrun/srun) for the whole run. The kernel
  releases it when the owner dies, whatever the cause, so a lock that can be
  taken means nobody is writing the directory.
- :class:`StepBoard`: one 8-byte slot per worker in a run-private file, the
  number of optimizer steps each worker has completed. The launcher reads it to
  say at which step a worker died.
- :func:`write_status` / :func:`read_status`: ``status.json``, the one reader
  of it reporting a ``running`` that no live process owns as ``interrupted``
  (the launcher was killed with SIGKILL).
- :func:`check_layout`: every path abtrain uses in a run directory is what it
  should be (a regular file, a directory, or nothing), links not followed, and
  the lock, written in place, a file of one name (no hard link).

Exit codes of ``abtrain train`` are defined here, once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import struct
import time
from typing import TYPE_CHECKING, Any

from .interrupt import signal_name  # noqa: F401  (re-exported: the launcher names signals)
from .safefile import WrongKind, check_kind, check_single_link, open_fd, read_text, write_json

if TYPE_CHECKING:
    from ..config import TrainConfig

#: Exit codes of ``abtrain train`` (docs/reliability.md lists them).
EXIT_OK = 0
EXIT_FAILED = 1  # training failed: divergence, a peer that stopped answering, an unexpected error
EXIT_INPUT = 2  # bad input: flags, config files, data, checkpoints, a run directory in use
EXIT_WORKER_DIED = 3  # a worker process died (killed by a signal or exited without a word), no restart left
EXIT_NO_SPACE = 4  # no space left on device (or quota) while writing a checkpoint or results
EXIT_INTERRUPTED = 130  # SIGINT / SIGTERM to the launcher; resumable with --resume

LOCK_NAME = ".lock"


class RunFailed(Exception):
    """The run ended without completing; ``code`` is the exit code of ``abtrain train``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class RunDirInUse(ValueError):
    """Another live abtrain process holds the run directory's lock."""


class RunLock:
    """Exclusive ownership of a run directory, released by the kernel when the owner dies."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise :class:`RunDirInUse` naming the owner's pid."""
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            fd = open_fd(self.path, os.O_RDWR | os.O_CREAT)  # a link planted at .lock is refused, not truncated
        except OSError as exc:
            raise ValueError(f"cannot write to run directory {self.run_dir}: {exc.strerror}; pass --out with a "
                             f"writable directory") from None
        try:
            # Written in place (a lock replaced by rename would let two owners lock two files): never one with
            # other names, whose file outside the run directory would get the pid.
            check_single_link(self.path, fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (OSError, WrongKind) as exc:
            os.close(fd)
            if isinstance(exc, WrongKind) or exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            owner = _read_owner(self.path)
            raise RunDirInUse(f"run directory {self.run_dir} is in use by another abtrain process"
                              f"{f' (pid {owner})' if owner else ''}; wait for it to end, stop it, "
                              f"or pass another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_owner(path: str) -> str | None:
    try:
        text = read_text(path, limit=32).strip()  # a pid and a newline
    except (OSError, ValueError):
        return None
    return text if text.isdigit() else None


def is_locked(run_dir: str) -> bool:
    """True when a live process holds ``run_dir``'s lock (probes without keeping it)."""
    path = os.path.join(run_dir, LOCK_NAME)
    try:
        fd = open_fd(path, os.O_RDONLY)
    except (OSError, WrongKind):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def write_status(run_dir: str, status: str, **extra: Any) -> None:
    """``status.json``: running / complete / failed (with the error). results.json exists only when complete."""
    write_json(os.path.join(run_dir, "status.json"), {"status": status, **extra})


def read_status(run_dir: str) -> dict[str, Any] | None:
    """``status.json`` (None when it is missing, unreadable, or not a regular file: a link is not followed);
    a ``running`` status whose owner is gone reads as ``interrupted``."""
    try:
        status = json.loads(read_text(os.path.join(run_dir, "status.json")))
    except (OSError, ValueError):
        return None
    if isinstance(status, dict) and status.get("status") == "running" and not is_locked(run_dir):
        status = {**status, "status": "interrupted",
                  "reason": "the process that ran it is gone (killed, or its machine stopped)"}
    return status


#: What abtrain keeps in a run directory and the kind each must be (file: regular file, dir: directory).
LAYOUT = {LOCK_NAME: "file", "status.json": "file", "config.json": "file", "results.json": "file",
          "metrics.csv": "file", "model.pt": "file", "checkpoint": "dir", "tensorboard": "dir"}
_CHECKPOINT_ENTRY = re.compile(r"(latest\.json)|(step-\d+)")


def check_layout(run_dir: str) -> None:
    """Refuse (ValueError, one line) a run directory where any path abtrain reads or writes is of the wrong kind:
    a link, FIFO, socket or device instead of a regular file, a file where a directory belongs or the reverse.
    The run directory itself must be a real directory (or not exist yet)."""
    try:
        mode = os.lstat(run_dir).st_mode
    except OSError:
        return  # not there yet (or not reachable: creating it says why)
    if not stat.S_ISDIR(mode):
        check_kind(run_dir, "dir")  # raises, naming what is there
    for name, kind in LAYOUT.items():
        check_kind(os.path.join(run_dir, name), kind)
    check_single_link(os.path.join(run_dir, LOCK_NAME))  # the one file written in place (the others: by rename)
    root = os.path.join(run_dir, "checkpoint")
    for name in _listdir(root):
        m = _CHECKPOINT_ENTRY.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(root, name)
        check_kind(path, "file" if m.group(1) else "dir")
        if m.group(2):
            for shard in _listdir(path):
                if re.fullmatch(r"rank\d+\.pt", shard):
                    check_kind(os.path.join(path, shard), "file")
    for name in _listdir(os.path.join(run_dir, "tensorboard")):
        check_kind(os.path.join(run_dir, "tensorboard", name), "file")


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path)) if os.path.isdir(path) and not os.path.islink(path) else []
    except OSError:
        return []


class StepBoard:
    """Completed optimizer steps per worker in a small shared file (one pwrite per step, no fsync)."""

    SLOT = struct.Struct("<q")

    def __init__(self, path: str, rank: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.offset = rank * self.SLOT.size

    def set(self, step: int) -> None:
        os.pwrite(self.fd, self.SLOT.pack(step), self.offset)

    def close(self) -> None:
        os.close(self.fd)

    @classmethod
    def read(cls, path: str, rank: int) -> int | None:
        """Worker ``rank``'s last completed step, None when it never reported one."""
        try:
            with open(path, "rb") as fh:
                fh.seek(rank * cls.SLOT.size)
                data = fh.read(cls.SLOT.size)
        except OSError:
            return None
        if len(data) != cls.SLOT.size:
            return None
        return cls.SLOT.unpack(data)[0]


def launch_id(environ: dict[str, str] | None = None) -> str | None:
    """An id every worker of this launch shares: torchrun's rendezvous id, else Slurm's job and step ids."""
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":  # torchrun's default --rdzv-id is the string "none"
        return run_id
    if env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"] + (f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else "")
    return None


def default_run_dir(cfg: TrainConfig, environ: dict[str, str] | None = None) -> str:
    """``runs/<method>-<model>-<dataset>-<id>``, the same on every worker of a launch.

    The id is the launch's (:func:`launch_id`); without one, a time stamp, which
    workers started by torchrun share through the elastic agent's store (each
    computing its own could straddle a second, or differ between nodes).
    """
    env = os.environ if environ is None else environ
    tag = launch_id(env)
    if tag is None:
        tag = time.strftime("%Y%m%d-%H%M%S")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR"):
            import datetime

            import torch.distributed as dist
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=cfg.timeout))
            # The first worker to get here sets it; a restarted worker finds the same one.
            tag = store.compare_set("abtrain/run_dir_stamp", "", tag).decode()
    return os.path.join("runs", f"{cfg.method}-{cfg.model}-{cfg.dataset}-{tag}")
