"""Rank, world, groups of workers and their process groups, in one object.

Models and methods never build process groups themselves: they ask the
:class:`Topology` for a named :class:`~abtrain.comm.group.Group`, whose ``scope``
tells the ledger whether its traffic stays inside one group of workers
(``group``; one node in the intended deployment) or crosses groups
(``global``).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import logging
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .group import Group

log = logging.getLogger(__name__)


#: torch modules that evaluate ``group.WORLD`` into default arguments when first imported (``torch.compile``
#: imports them with torch._dynamo). Imported while a default process group exists, they hold it for the rest of
#: the process: ``destroy_process_group()`` no longer frees it, and its gloo threads, still holding their last
#: tensors, meet the interpreter's shutdown, which can abort a run that succeeded ("terminate called without an
#: active exception"). :func:`import_unbound` imports them while no default group shows.
BIND_WORLD_AT_IMPORT = ("torch.distributed.nn", "torch.distributed._shard")


def import_unbound() -> None:
    """Import :data:`BIND_WORLD_AT_IMPORT` so that their defaults hold None (the default group, looked up at
    each call), not the process group of this moment: before the world exists, or with it hidden meanwhile."""
    if not dist.is_available():
        return
    missing = [name for name in BIND_WORLD_AT_IMPORT if name not in sys.modules]
    if not missing:
        return
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not None:
        dist.GroupMember.WORLD = None
    try:
        for name in missing:
            try:
                importlib.import_module(name)
            except ImportError:  # a torch build without it: nothing of it can hold the world either
                pass
    finally:
        if world is not None:
            dist.GroupMember.WORLD = world


#: Every topology made by :meth:`Topology.from_env`, weakly: at exit, what they still reference is released
_open: list[weakref.ref] = []


@atexit.register
def _release_at_exit() -> None:
    """A script that destroyed its world without ``method.close()``: free the process groups abtrain still
    references while the interpreter is whole (atexit runs before its shutdown; see :data:`BIND_WORLD_AT_IMPORT`)."""
    for ref in _open:
        topo = ref()
        if topo is not None:
            topo.release()
    _open.clear()
    gc.collect()


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _restart_store(timeout: datetime.timedelta) -> dist.Store | None:
    """After an elastic restart, the agent's store under a prefix of its own for this attempt.

    The agent hands restarted workers the same store as the attempt before;
    the backend's connection keys of the dead workers are still in it, and a
    worker that reads one before its peer has overwritten it connects to a
    closed port. A fresh prefix per attempt keeps attempts apart.
    """
    restarts = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if not restarts or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"abtrain/attempt{restarts}", store)


#: What ``backend=`` and ``device=`` accept (auto: nccl with CUDA, else gloo; cuda when available, else cpu).
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
#: The longest wait a collective may be given (seconds): a week; a timedelta of more overflows in torch's C++.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int (a NumPy integer too): a TypeError naming ``name`` for a bool, float or string, a
    ValueError outside [``low``, ``high``] when given."""
    span = f" from {low:,} to {high:,}" if low is not None and high is not None else ""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer{span}, got {value!r}")
    number = int(value)  # type: ignore[call-overload]
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name} must be an integer{span}, got {number}")
    return number


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    """A collective's timeout in seconds: a number in (0, one week] (TypeError / ValueError naming ``name``)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {timeout_s!r}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
    return float(timeout_s)


def resolve_backend(backend: str = "auto", device: str = "auto") -> tuple[str, bool]:
    """``(backend, use_cuda)`` for the asked ``--backend`` / ``--device``; ValueError when this machine cannot
    provide them (the launcher calls this before starting any worker)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ValueError("the nccl backend needs CUDA devices; use --backend gloo on CPU")
    return backend, use_cuda


def world_from_env() -> tuple[int, int]:
    """(world size, workers on this node): the initialised default process group's, else torchrun's variables."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = _env_int("WORLD_SIZE", 1)
    return world, _env_int("LOCAL_WORLD_SIZE", world)


def node_group_size(world_size: int, local_world_size: int) -> int:
    """One group per node: the workers of a node, or the whole world when nodes of that size do not divide it."""
    return local_world_size if world_size % max(1, local_world_size) == 0 else world_size


def check_group_size(world_size: int, group_size: int, choose: str = "--group-size") -> None:
    """ValueError unless ``group_size`` workers split ``world_size`` into whole groups (``choose``: how the user
    sets it, the flag or ``group_size=``)."""
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    if world_size % group_size:
        raise ValueError(f"{world_size} workers cannot be split into groups of {group_size}: "
                         f"choose a {choose} that divides the number of workers")


def group_layout(world_size: int, local_world_size: int, group_size: int | None = None,
                 preferred: Callable[[int, int], tuple[int, str | None]] | None = None,
                 choose: str = "--group-size") -> tuple[int, str | None]:
    """The group size of a run, and a line for rank 0 to print when a method chose it (None otherwise).

    ``group_size``, when given; else the method's ``preferred(world_size, local_world_size)`` (a size and
    a line saying why, or None), the line ending with how to choose another (``choose``: the flag, or
    ``set group_size=`` for :func:`abtrain.setup`); else one group per node.
    """
    if group_size is not None:
        return group_size, None
    if preferred is None:
        return node_group_size(world_size, local_world_size), None
    size, note = preferred(world_size, local_world_size)
    return size, None if note is None else f"{note} ({choose} to choose)"


@dataclass
class Topology:
    """Where this worker sits: rank, world size, its group, device and backend.

    ``group_size`` workers form one group (default: the workers of one node,
    :func:`node_group_size`). Groups are contiguous ranks: group ``k`` holds ranks
    ``k*g .. k*g+g-1``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_size: int | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    #: True when abtrain initialised the default process group (then :meth:`close` destroys it).
    owns_world: bool = False
    _groups: dict[str, Group] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size"):
            setattr(self, name, check_int(name, getattr(self, name)))
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Topology(rank={self.rank}, world_size={self.world_size}): world_size must be >= 1 and "
                             f"rank in [0, world_size)")
        if not 1 <= self.local_world_size <= self.world_size or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"Topology(local_rank={self.local_rank}, local_world_size={self.local_world_size}): "
                             f"local_world_size must be in [1, world_size={self.world_size}] and local_rank in "
                             f"[0, local_world_size)")
        if self.group_size is None:
            self.group_size = node_group_size(self.world_size, self.local_world_size)
        check_group_size(self.world_size, check_int("group_size", self.group_size))

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    @property
    def group_index(self) -> int:
        return self.rank // self.group_size

    @property
    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

    @property
    def world(self) -> Group:
        """Every worker. Scope ``global`` as soon as there is more than one group."""
        if "world" not in self._groups:
            scope = "global" if self.num_groups > 1 else "group"
            pg = dist.group.WORLD if self.is_distributed else None
            self._groups["world"] = Group("world", self.world_size, scope, pg, tuple(range(self.world_size)))
        return self._groups["world"]

    @property
    def group(self) -> Group:
        """The workers of this worker's group (scope ``group``)."""
        if "group" not in self._groups:
            self._build_subgroups()
        return self._groups["group"]

    def _build_subgroups(self) -> None:
        g = self.group_size
        ranks = tuple(range(self.group_index * g, self.group_index * g + g))
        if g == self.world_size:
            pg = dist.group.WORLD if self.is_distributed else None
        elif g == 1 or not self.is_distributed:
            pg = None
        else:
            # new_subgroups is collective: every rank creates every subgroup, in order.
            pg, _ = dist.new_subgroups(group_size=g)
        self._groups["group"] = Group("group", g, "group", pg, ranks)

    # -- construction ------------------------------------------------------
    @classmethod
    def from_env(cls, backend: str = "auto", device: str = "auto", group_size: int | None = None,
                 timeout_s: float = 300.0) -> "Topology":
        """Join the world of this process.

        When the default process group is already initialised (the user's script
        called ``init_process_group``), its rank, size and backend are used and
        it stays the user's. Otherwise the world described by torchrun's
        variables (RANK, WORLD_SIZE, ...) is joined by initialising the default
        process group when there is more than one worker; a world of one runs
        without any process group.
        """
        timeout_s = check_timeout(timeout_s)
        for name, value, choices in (("backend", backend, BACKENDS), ("device", device, DEVICES)):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")
        import_unbound()
        joined = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if joined else _env_int("RANK", 0)
        world, local_world = world_from_env()
        local_rank = _env_int("LOCAL_RANK", rank % max(1, local_world))
        if joined and backend == "auto":
            backend = str(dist.get_backend())
            device = "cuda" if backend == "nccl" and device == "auto" else device
        backend, use_cuda = resolve_backend(backend, device)
        dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count())) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(dev)
        if world > 1 and not dist.is_initialized():
            kwargs: dict = {"device_id": dev} if backend == "nccl" else {}
            timeout = datetime.timedelta(seconds=timeout_s)
            store = _restart_store(timeout)
            if store is not None:
                kwargs.update(store=store, rank=rank, world_size=world)
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        topo = cls(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   group_size=group_size, device=dev, backend=backend,
                   owns_world=not joined and dist.is_available() and dist.is_initialized())
        # Subgroup creation is collective: build them now, on every rank, in one order.
        topo.world, topo.group
        _open[:] = [ref for ref in _open if ref() is not None] + [weakref.ref(topo)]
        return topo

    def close(self) -> None:
        """Destroy the process groups abtrain created, then free every object that still holds one.

        The default process group is destroyed only when :meth:`from_env`
        initialised it; a world the user's script set up stays usable.

        A process group still referenced when the interpreter shuts down (a
        reference cycle of DDP and its hooks, a Group kept by the method) is
        destructed then, when gloo's worker threads can no longer take the GIL:
        the process aborts ("terminate called without an active exception")
        after a run that succeeded. So every Group this topology made lets go
        of its process group here, whoever holds the Group.
        """
        if dist.is_available() and dist.is_initialized():
            if self.owns_world:
                dist.destroy_process_group()
            else:
                for group in self._groups.values():
                    if group.pg is not None and group.pg is not dist.group.WORLD:
                        dist.destroy_process_group(group.pg)  # a subgroup abtrain made
        self.release()
        gc.collect()

    def release(self) -> None:
        """Let go of the process groups (each Group's reference), destroying none."""
        for group in self._groups.values():
            group.release()
        self._groups.clear()
