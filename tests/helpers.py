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


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


def launcher_workers(pid: int) -> list[int]:
    """The worker processes of the local launcher ``pid``: the children of its fork server, found through /proc."""
    workers = []
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                if b"forkserver" in fh.read():
                    workers += children(child)
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


# -- the command as a user runs it -------------------------------------------------------------------------
ABTRAIN = ["-m", "abtrain.cli"]  # after sys.executable
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                      "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables (except those in ``extra``), unbuffered."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def one_line(stderr: str) -> str:
    """The one line of ``stderr``; fails when there are more, or a traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a command started with start_new_session and all it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                pids.append(int(entry))
    return pids


def left_behind(sid: int, wait: float = 60.0) -> list[int]:
    """The processes of session ``sid`` still alive once they had ``wait`` seconds to go (killed then)."""
    import signal
    import time
    deadline = time.time() + wait
    while session_pids(sid) and time.time() < deadline:
        time.sleep(0.1)
    left = session_pids(sid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def tree_digest(root: Path, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every entry under ``root`` (links as their text, never followed; files by content), except names in
    ``skip``: what must not change outside a run directory."""
    out: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if any(part in skip for part in path.relative_to(root).parts):
            continue
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_file():
            out[rel] = ("file", path.read_bytes(), path.stat().st_nlink)
        else:
            out[rel] = ("other", path.stat().st_mode)
    return out


# -- small training loops shared by the methods' tests ----------------------------------------------------------
def layered_model() -> torch.nn.Module:
    """4 modules holding 8 tensors: 2-D weights whose dimensions 8 divides or not, vectors, a LayerNorm."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 10), nn.LayerNorm(10), nn.Linear(10, 5))


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def train_snapshots(method: Any, model: torch.nn.Module, steps: int, optimizer: Callable[..., Any], seed: int = 0,
                    clip: float | None = None) -> list[torch.Tensor]:
    """``model`` (6 inputs, 5 classes) trained ``steps`` steps under ``method`` on random batches of 8 drawn from
    ``seed``, with ``optimizer(params)``; the flat parameters after every step. ``clip``: clip the averaged
    gradient, as the trainer does."""
    forward = method.prepare(model)
    opt = optimizer(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    snapshots = []
    with method.attach(opt):
        for _ in range(steps):
            x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
            loss = torch.nn.functional.cross_entropy(forward(x), y)
            opt.zero_grad()
            loss.backward()
            if clip is not None:
                method.reduce_gradients()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            snapshots.append(flat(model.parameters()).clone())
    return snapshots


def stopped_and_resumed(topo: Any, root: str, fashion_dir: Path, method: str, stop: int,
                        keep: Callable[[Any], dict[str, Any]] = lambda trainer: {}, **options: Any) -> dict[str, Any]:
    """The MLP on Fashion-MNIST slices under ``method`` (``options``: TrainConfig fields) for 10 steps, then
    stopped after ``stop`` and resumed: ``{"ref", "stopped_at", "resumed"}``, each run's model state, history
    (without times), wire bytes and step, and what ``keep(trainer)`` adds."""
    from abtrain.config import TrainConfig
    from abtrain.run.train import Trainer

    states = []
    for label, kw, resume in (("ref", {}, False), ("stop", {"stop_after": stop}, False), ("stop", {}, True)):
        cfg = TrainConfig(method=method, model="mlp", dataset="fashion-mnist", data_dir=str(fashion_dir), steps=10,
                          batch_size=16, eval_every=3, limit_test=64, log_every=100, seed=5, group_size=2,
                          checkpoint_every=4, **options, **kw)
        trainer = Trainer(cfg, topo, os.path.join(root, f"{method}-{label}"), resume=resume)
        trainer.run()
        states.append({"state": {k: v.clone() for k, v in trainer.model.state_dict().items()},
                       "history": [{k: v for k, v in r.items() if k not in ("wall_seconds", "eval_seconds")}
                                   for r in trainer.history],
                       "ledger": trainer.ledger.summary()["wire_bytes"], "step": trainer.step, **keep(trainer)})
    return {"ref": states[0], "stopped_at": states[1]["step"], "resumed": states[2]}


class BNNet(torch.nn.Module):
    """A first layer and a BatchNorm1d (``norm``), two hidden Linear layers AB-training factorises (``body``, ``body2``),
    a head: ``inputs`` features, ``classes`` outputs."""

    def __init__(self, inputs: int = 12, classes: int = 5) -> None:
        super().__init__()
        nn = torch.nn
        self.stem, self.norm = nn.Linear(inputs, 48), nn.BatchNorm1d(48)
        self.body, self.body2, self.head = nn.Linear(48, 40), nn.Linear(40, 48), nn.Linear(48, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.stem(x)))
        x = torch.relu(self.body(x))
        return self.head(torch.relu(self.body2(x)))


class Net(torch.nn.Module):
    """A user's small network (16 inputs, 16 classes): three Linear layers, the hidden ones factorisable."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.a, self.b, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        relu = torch.nn.functional.relu
        return self.out(relu(self.b(relu(self.a(x)))))


def net_batch(step: int, rank: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s batch of ``n`` for :class:`Net` at ``step``: its own, the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 16, generator=g), torch.randint(0, 16, (n,), generator=g)


def catches(pid: int, sig: int) -> bool:
    """True once process ``pid`` catches ``sig`` (its handlers are installed)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False
