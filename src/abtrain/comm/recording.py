"""A communicator that runs in one process: for tests of compression math and byte counts.

:class:`RecordingCommunicator` has the :class:`~abtrain.comm.communicator.Communicator`
interface. On its own (a world of one) it skips every collective, as the real
one does. Given a :class:`LocalWorld` of N simulated workers -- N threads of one
process -- its collectives meet in memory: an all-reduce sums the N workers'
tensors in rank order (so every worker gets the same bits), a broadcast copies
the source's, a gather hands the root every worker's, an all_to_all hands worker ``j`` the ``j``-th chunk of every
worker's tensor. Every collective is recorded in the ledger, with the same wire
model as on a real network, and in :attr:`RecordingCommunicator.calls`.

    world = LocalWorld(2)
    def worker(comm):
        reducer = PowerSGDReducer(comm, rank=2)
        reducer.reduce(grads_of(comm.rank), world.group)
        return comm.calls
    calls_0, calls_1 = world.run(worker)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .communicator import Communicator
from .group import Group
from .ledger import Ledger

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One recorded collective: its op, group, dtype, element count and payload bytes."""

    op: str
    group: str
    group_size: int
    dtype: torch.dtype
    numel: int
    payload_bytes: int


class LocalWorld:
    """N simulated workers in one process; :meth:`run` calls a function once per worker, each in a thread."""

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        if size < 1:
            raise ValueError(f"a world needs at least one worker, got {size}")
        self.size = size
        self.group = Group("world", size, "global", ranks=tuple(range(size)))
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[torch.Tensor | None] = [None] * size

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's ``tensor``, in rank order, once all have called it."""
        self._slots[rank] = tensor.detach().clone()
        self._barrier.wait()
        gathered = [t for t in self._slots if t is not None]
        self._barrier.wait()  # nobody overwrites a slot before every worker has read them
        return gathered

    def run(self, fn: Callable[["RecordingCommunicator"], T]) -> list[T]:
        """``fn(comm)`` for every worker (``comm.rank`` tells which); results in rank order."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def worker(rank: int) -> None:
            try:
                results[rank] = fn(RecordingCommunicator(self, rank))
            except BaseException as exc:  # noqa: BLE001 -- re-raised below, after the other workers stop
                errors.append(exc)
                self._barrier.abort()  # the others would wait for this worker forever

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if errors:
            raise (real or errors)[0]
        return results


class RecordingCommunicator(Communicator):
    """A :class:`~abtrain.comm.communicator.Communicator` whose collectives meet in memory (see the module
    docstring)."""

    def __init__(self, world: LocalWorld | None = None, rank: int = 0, ledger: Ledger | None = None) -> None:
        super().__init__(ledger)
        self.world = world
        self.rank = rank
        self.calls: list[Call] = []

    def _gather(self, op: str, tensor: torch.Tensor, group: Group) -> list[torch.Tensor]:
        if self.world is None or group.size != self.world.size:
            raise ValueError(f"group {group.name} of {group.size} workers is not this communicator's world "
                             f"({self.world.size if self.world else 1} workers): use LocalWorld.group")
        payload, _ = self.ledger.record(op, group, tensor, 0.0)
        self.calls.append(Call(op, group.name, group.size, tensor.dtype, tensor.numel(), payload))
        return self.world.exchange(self.rank, tensor)

    def rank_in(self, group: Group) -> int:
        return self.rank if group.size > 1 else 0

    def barrier(self, group: Group) -> None:
        if group.size > 1 and self.world is not None:
            self.world.exchange(self.rank, torch.zeros(0))

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = "sum", average: bool = False) -> torch.Tensor:
        if group.size <= 1:
            return tensor
        gathered = self._gather("all_reduce", tensor, group)
        out = gathered[0].clone()
        for other in gathered[1:]:
            if op == "sum":
                out.add_(other)
            elif op == "max":
                torch.maximum(out, other, out=out)
            elif op == "min":
                torch.minimum(out, other, out=out)
            else:
                raise ValueError(f"unknown reduction {op!r}")
        tensor.copy_(out)
        if average:
            tensor.div_(group.size)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, group: Group, average: bool = True) -> torch.futures.Future:
        if average and group.size > 1:
            tensor.div_(group.size)  # before the sum, as the real communicator's hook seam does
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.all_reduce(tensor, group))
        return fut

    def broadcast(self, tensor: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
        if group.size <= 1:
            return tensor
        tensor.copy_(self._gather("broadcast", tensor, group)[group.ranks.index(src) if group.ranks else src])
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Group) -> list[torch.Tensor]:
        if group.size <= 1:
            return [tensor]
        return self._gather("all_gather", tensor, group)

    def gather(self, tensor: torch.Tensor, group: Group, sizes: Sequence[int], dst: int = 0
               ) -> list[torch.Tensor] | None:
        if group.size <= 1:
            return [tensor]
        if self.rank == dst:  # the root sends nothing: its own stays
            self.ledger.record("gather", group, tensor[:0], 0.0)
            self.calls.append(Call("gather", group.name, group.size, tensor.dtype, 0, 0))
            gathered = self.world.exchange(self.rank, tensor)
        else:
            gathered = self._gather("gather", tensor, group)
        return gathered if self.rank == dst else None

    def all_to_all(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        if group.size <= 1:
            return tensor
        if tensor.numel() % group.size:
            raise ValueError(f"all_to_all needs numel divisible by {group.size}, got {tensor.numel()}")
        chunks = [t.reshape(group.size, -1)[self.rank] for t in self._gather("all_to_all", tensor, group)]
        return torch.cat(chunks).view_as(tensor)
