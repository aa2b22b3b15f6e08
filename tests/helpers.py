"""Real multi-process worlds on localhost (gloo) and small generated datasets for the tests."""

from __future__ import annotations

import gc
import gzip
import os
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.multiprocessing as mp


#: AB options an earlier abtrain had (removed after commit 92780e8), each at the default it had: a run directory
#: written then lists them in its config.json, which this abtrain refuses as holding unknown keys.
OLD_AB_DEFAULTS: dict[str, Any] = {"independent": False, "energy": None, "min_compression": None,
                                   "truncate_first": False, "sync_flush": False, "final_rebound_steps": 0,
                                   "dense_start_steps": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


def launcher_workers(pid: int) -> list[int]:
    """The worker processes of the local launcher ``pid``: the children of its fork server, found through /proc."""
    workers = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                if b"forkserver" in fh.read():
                    workers += _children(child)
        except OSError:
            pass
    return workers


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = fn(*args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    del result
    gc.collect()  # free what holds a process group while the interpreter is alive (see Topology.close)


#: Imported once by the fork server that starts the workers, so each worker begins with them loaded
#: (a fresh interpreter importing torch costs more than most of these worlds spend training).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "abtrain.run.train", "abtrain.methods", "helpers"]


def run_world(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` in ``world`` new processes forming a torch.distributed world; return each rank's result.

    The processes are forked from a fork server (started once per test session, holding nothing but the
    modules above), not from the test process: each worker is a separate process with its own gloo world,
    as with spawn, without paying for the imports again.
    """
    mp.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(fn, world, free_port(), out_dir, args), nprocs=world, join=True,
                           start_method="forkserver")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as a gzip-compressed IDX file."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def make_fake_fashion(directory: Path, n_train: int = 512, n_test: int = 128, seed: int = 0) -> Path:
    """A learnable 28x28 ten-class problem in Fashion-MNIST's file format: class k lights rows 2k..2k+5."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images = rng.integers(0, 80, size=(n, 28, 28)).astype(np.uint8)
        for i, k in enumerate(labels):
            images[i, 2 * k:2 * k + 6, 4:24] = 220
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return directory
