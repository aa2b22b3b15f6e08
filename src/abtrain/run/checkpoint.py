"""Checkpoints in the run directory: one shard per worker, a manifest, atomic writes, safe loading.

Layout::

    RUN_DIR/checkpoint/step-00000120/rank0.pt   # each worker's own state (AB groups and optimizer
    RUN_DIR/checkpoint/step-00000120/rank1.pt   #   states differ between workers)
    RUN_DIR/checkpoint/latest.json              # the manifest: which step is complete, each shard's
                                                #   size and sha256, the run's configuration and its hash

A shard is written to a temporary file, fsynced and renamed. Rank 0 writes
the manifest only after every worker has finished its shard (a barrier), and
removes older step directories only after that. Until the manifest names the
new step, the previous checkpoint stays the one a resume uses, so a crash at
any moment leaves a complete checkpoint (or none) behind.

Shards hold only tensors and plain containers (dict, list, str, int, float,
bool, None) and are read with ``torch.load(weights_only=True)``, which refuses
pickles that would run code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import warnings
import zipfile
from typing import Any

import numpy as np
import torch

from .._version import __version__
from .safefile import (NoSpaceError, RunDirGone, TooLarge, atomic_write, is_no_space, make_dir, open_file,
                       read_text, regular_size, write_json)

FORMAT = "abtrain-checkpoint"
#: the layout of a checkpoint (the manifest, the shards and the method's state in them); an abtrain reads its own
#: version only, and names the abtrain that wrote any other
VERSION = 3
DIRNAME = "checkpoint"
MANIFEST = "latest.json"


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, DIRNAME)


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(run_dir), f"step-{step:08d}")


def shard_name(rank: int) -> str:
    return f"rank{rank}.pt"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_shard(path: str, state: dict[str, Any]) -> None:
    """``torch.save`` through a temporary file in the same directory, fsync, rename."""
    directory = os.path.dirname(os.path.abspath(path))
    make_dir(directory)  # a real directory in an existing parent (never a link, never the run directory made again)
    atomic_write(path, lambda fh: torch.save(state, fh))
    _fsync_dir(directory)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open_file(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of a configuration in a canonical JSON form (key order and whitespace do not count)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(run_dir: str, step: int, world_size: int, meta: dict[str, Any]) -> None:
    """Declare step ``step`` complete (every shard is on disk), then drop older step directories.

    ``meta`` may hold ``config`` (the run's saved configuration, config.json): the manifest keeps it
    with its hash, so that a resume can tell an edited config.json from the one the run used.
    """
    directory = step_dir(run_dir, step)
    files, sha256 = {}, {}
    for rank in range(world_size):
        path = os.path.join(directory, shard_name(rank))
        files[shard_name(rank)] = os.path.getsize(path)
        sha256[shard_name(rank)] = sha256_file(path)
    meta = dict(meta)
    if meta.get("config") is not None:
        meta["config_sha256"] = config_digest(meta["config"])
    write_json(os.path.join(checkpoint_root(run_dir), MANIFEST),
               {"format": FORMAT, "version": VERSION, "abtrain": __version__, "step": step, "world_size": world_size,
                "dir": os.path.basename(directory), "files": files, "sha256": sha256, **meta})
    _fsync_dir(checkpoint_root(run_dir))
    # Only older steps: a newer directory may be a partial write of a run that crashed and is being redone.
    for name in os.listdir(checkpoint_root(run_dir)):
        if name.startswith("step-") and name[5:].isdigit() and int(name[5:]) < step:
            shutil.rmtree(os.path.join(checkpoint_root(run_dir), name), ignore_errors=True)


def read_manifest(run_dir: str) -> dict[str, Any] | None:
    """The manifest of the run's last complete checkpoint, None when there is none; ValueError when unreadable."""
    path = os.path.join(checkpoint_root(run_dir), MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        manifest = json.loads(read_text(path))  # a manifest of gigabytes is refused before it is read
    except TooLarge as exc:
        raise ValueError(f"checkpoint manifest {exc}; the checkpoint cannot be used") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint manifest {path} is unreadable ({exc}); the checkpoint cannot be used") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not an abtrain checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"checkpoint {path} has format version {manifest.get('version')!r}, this abtrain "
                         f"({__version__}) reads version {VERSION}: resume it with the abtrain that wrote it "
                         f"({manifest.get('abtrain') or 'an earlier one'})")
    for key, kind in (("step", int), ("world_size", int), ("dir", str), ("files", dict), ("sha256", dict)):
        if not isinstance(manifest.get(key), kind):
            raise ValueError(f"checkpoint manifest {path} lacks a valid {key!r}; the checkpoint cannot be checked, "
                             f"so it is not used")
    if not re.fullmatch(r"step-\d+", manifest["dir"]):
        raise ValueError(f"checkpoint manifest {path} names {manifest['dir']!r}, not a step directory")
    unsummed = sorted(set(manifest["files"]) - set(manifest["sha256"]))
    if unsummed:
        raise ValueError(f"checkpoint manifest {path} has no sha256 for {', '.join(unsummed)}; the checkpoint "
                         f"cannot be checked, so it is not used")
    _check_values(manifest, path)
    return manifest


def _check_values(manifest: dict[str, Any], path: str) -> None:
    """Every size, checksum and setting as abtrain writes them: a forged value is said to be the manifest's fault,
    not the shard's (a sha256 that is no sha256) or a flag's (an lr that is no number)."""
    settings = manifest.get("settings", {})
    if not isinstance(settings, dict):
        settings = {"": settings}
    wrong = [(f"files.{n}", v, "a size in bytes") for n, v in manifest["files"].items()
             if type(v) is not int or v < 0]
    wrong += [(f"sha256.{n}", v, "64 hexadecimal digits") for n, v in manifest["sha256"].items()
              if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v)]
    wrong += [(f"settings.{n}".rstrip("."), v, "a positive number") for n, v in settings.items()
              if not (type(v) in (int, float) and 0 < v < math.inf) and not (n == "grad_clip" and v is None)]
    if wrong:
        key, value, what = wrong[0]
        raise ValueError(f"checkpoint manifest {path} holds {key} = {value!r}, not {what}: it was changed after "
                         f"abtrain wrote it, so the checkpoint is not used")


def check_manifest(manifest: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint written by another model, method, dataset or world size (one line)."""
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise ValueError(f"checkpoint in {where} was written for {key.replace('_', ' ')} {manifest.get(key)!r}, "
                             f"this run has {value!r}; it cannot be continued with these settings")


def shard_path(run_dir: str, manifest: dict[str, Any], rank: int) -> str:
    """Path of ``rank``'s shard, checked against the manifest: presence, size (a truncated file is refused)
    and sha256 (a shard whose bytes changed is refused as corrupt)."""
    path = os.path.join(checkpoint_root(run_dir), manifest["dir"], shard_name(rank))
    expected = manifest["files"].get(shard_name(rank))
    if expected is None:
        raise ValueError(f"checkpoint of step {manifest['step']} has no shard for worker {rank}")
    try:
        size = regular_size(path)  # a link, FIFO or directory in its place: WrongKind
    except OSError:
        raise ValueError(f"checkpoint shard {path} is missing") from None
    if size != expected:
        raise ValueError(f"checkpoint shard {path} is {size} bytes, the manifest says {expected}: "
                         f"the file is truncated or was replaced")
    digest = manifest["sha256"].get(shard_name(rank))  # read_manifest refuses a manifest without every sum
    if sha256_file(path) != digest:
        raise ValueError(f"checkpoint shard {path} is corrupt: its sha256 differs from the manifest's "
                         f"(same size, changed bytes); the checkpoint of step {manifest['step']} cannot be used")
    return path


def check_config(manifest: dict[str, Any], saved: dict[str, Any], path: str) -> None:
    """Refuse a config.json that differs from the configuration the checkpoint was written with."""
    recorded = manifest.get("config")
    if not isinstance(recorded, dict) or config_digest(saved) == manifest.get("config_sha256"):
        return
    keys = sorted(k for k in set(recorded) | set(saved) if recorded.get(k) != saved.get(k))
    raise ValueError(f"{path} differs from the configuration the checkpoint of step {manifest['step']} was "
                     f"written with ({', '.join(keys) or 'its hash'}); restore it, or start a new run with "
                     f"another --out (a resume may change only its documented options)")


def load_shard(path: str) -> dict[str, Any]:
    """Read one shard with ``weights_only=True``; any problem is one ValueError line."""
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickle protocols before refusing them
            warnings.simplefilter("ignore")
            with open_file(path, "rb") as fh:
                state = torch.load(fh, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"checkpoint {path} holds objects that a safe load refuses ({_refusal(str(exc))}): "
                         f"loading it could run code, so abtrain does not load it") from None
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile, KeyError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"checkpoint {path} is corrupt or truncated: {first[:200]}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not an abtrain checkpoint")
    return state


def _refusal(text: str) -> str:
    """What torch's safe unpickler refused, without its advice to load the file unsafely."""
    m = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n\n|$)", text, re.S)
    return " ".join(m.group(1).split())[:200] if m else "objects other than tensors and plain containers"


# -- the run's good checkpoints ------------------------------------------
#: A checkpoint is "good" when the training loss since the previous one is finite and at most this many
#: times the smaller of the best earlier checkpoint's loss and the loss of guessing (ln of the classes).
DIVERGENCE_FACTOR = 3.0


class LossGuard:
    """Judges each checkpoint by this worker's training loss since the previous one (rank 0's decides)."""

    def __init__(self, num_classes: int) -> None:
        self.guess = math.log(max(2, num_classes))  # the loss of guessing uniformly
        self.interval = [0.0, 0]  # loss sum and count since the last checkpoint
        self.best: float | None = None  # training loss of the best good checkpoint so far

    def add(self, loss: float) -> None:
        self.interval[0] += loss
        self.interval[1] += 1

    def judge(self) -> tuple[bool, float | None]:
        """Is a checkpoint now good, and at which interval loss? Starts the next interval."""
        total, count = self.interval
        self.interval = [0.0, 0]
        if not count:
            return True, None
        loss = total / count
        good = loss <= DIVERGENCE_FACTOR * (self.guess if self.best is None else min(self.best, self.guess))
        if good:
            self.best = loss if self.best is None else min(self.best, loss)
        return good, loss

    def state_dict(self) -> dict[str, Any]:
        return {"interval_loss": list(self.interval), "best_loss": self.best}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.interval = list(state.get("interval_loss", [0.0, 0]))
        self.best = state.get("best_loss")


def last_good(run_dir: str) -> tuple[int, float | None] | None:
    """Step and training loss of the run's last good checkpoint (the one the manifest names), if any."""
    try:
        manifest = read_manifest(run_dir)
    except ValueError:
        return None
    return None if manifest is None else (manifest["step"], manifest.get("train_loss"))


class Diverged(FloatingPointError):
    """Training diverged (a non-finite loss or weight); the message ends with :func:`divergence_advice`."""


def divergence_advice(run_dir: str, lr: float) -> str:
    """How to continue after a divergence: resume the last good checkpoint with a lower LR or a clip."""
    good = last_good(run_dir)
    if good is None:
        return "; lower --lr or set --grad-clip"
    loss = f" (training loss {good[1]:.4g})" if isinstance(good[1], float) else ""
    return (f"; the last good checkpoint, of step {good[0]}{loss}, is kept: continue with a lower learning "
            f"rate, 'abtrain train --resume {run_dir} --lr {lr / 10:g}', or with --grad-clip")


def check_finite(model: torch.nn.Module, run_dir: str, lr: float, when: str) -> None:
    """Raise :class:`Diverged` naming the first parameter or buffer of ``model`` that holds inf or nan ``when``
    (e.g. "at the end of training")."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise Diverged(f"{name} holds inf or nan {when}{divergence_advice(run_dir, lr)}")


def save(run_dir: str, step: int, rank: int, state: dict[str, Any], barrier: Any,
         manifest: dict[str, Any] | None, world_size: int, good: bool, loss: float | None) -> None:
    """Write this worker's shard of step ``step``; collective (``barrier()`` waits for every worker's).

    Rank 0 passes ``manifest`` (the meta data it records): a good checkpoint is then
    declared complete; a bad one (``good`` False) is removed with a warning.
    """
    directory = step_dir(run_dir, step)
    try:
        make_dir(checkpoint_root(run_dir))
        save_shard(os.path.join(directory, shard_name(rank)), state)
        # A plain barrier (no data, not in the ledger): the manifest may only name shards that exist.
        barrier()
        if manifest is not None and good:
            write_manifest(run_dir, step, world_size, manifest)
    except (OSError, RuntimeError) as exc:
        # A worker whose disk filled removes the step's directory; another one still writing there then finds
        # its file gone: the same full disk, said the same way (whichever worker's error the launcher reports).
        if not os.path.isdir(run_dir):
            raise RunDirGone(f"run directory {run_dir} was removed while the run was going on (at the checkpoint "
                             f"of step {step})") from None
        vanished = isinstance(exc, (FileNotFoundError, RunDirGone)) and not os.path.isdir(directory)
        if not (is_no_space(exc) or vanished):
            raise
        shutil.rmtree(directory, ignore_errors=True)  # never named by the manifest: free the space
        previous = last_good(run_dir)
        raise NoSpaceError(f"no space left on device while writing the checkpoint of step {step} in "
                           f"{checkpoint_root(run_dir)}; " + (f"the checkpoint of step {previous[0]} is intact"
                                                              if previous else "no earlier checkpoint exists")) from None
    if manifest is not None and not good:
        shutil.rmtree(directory, ignore_errors=True)
        previous = last_good(run_dir)
        print(f"abtrain: warning: training loss {loss:.4g} since the previous checkpoint is far above the "
              f"run's best; the checkpoint of step {step} is not kept as good"
              + (f" (the last good one is of step {previous[0]})" if previous else ""), flush=True)


def load(run_dir: str, rank: int, expected: dict[str, Any]) -> dict[str, Any]:
    """This worker's shard of the run directory's last complete checkpoint, checked against ``expected`` meta."""
    manifest = read_manifest(run_dir)
    if manifest is None:
        raise ValueError(f"run directory {run_dir} has no complete checkpoint to continue from")
    check_manifest(manifest, expected, checkpoint_root(run_dir))
    path = shard_path(run_dir, manifest, rank)
    state = load_shard(path)
    if state.get("step") != manifest["step"]:
        raise ValueError(f"checkpoint shard of worker {rank} is for step {state.get('step')}, "
                         f"the manifest for step {manifest['step']}")
    # Never written by abtrain (check_finite runs before every save): training from it would only diverge again.
    for part in ("model", "optimizer"):
        name = _first_non_finite(state.get(part), part)
        if name is not None:
            raise ValueError(f"checkpoint {path} holds inf or nan in {name}: it cannot be continued (abtrain never "
                             f"writes one); start the run again")
    return state


def _first_non_finite(tree: Any, name: str) -> str | None:
    """The path of the first floating-point tensor in nested dicts and lists ``tree`` that holds inf or nan."""
    if torch.is_tensor(tree):
        return name if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = _first_non_finite(value, f"{name}.{key}")
        if found is not None:
            return found
    return None


# -- random number generators ---------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every generator a worker may draw from, as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
