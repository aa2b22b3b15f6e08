"""Gradient reducers: how a list of gradients is averaged over a group of workers.

One seam (``reduce(named_grads, group)``), implemented by the uncompressed
averages here and by the compressors of this package (:mod:`.powersgd`), each
sending its traffic through the :class:`~abtrain.comm.communicator.Communicator`
so the ledger counts exactly what travels:

* :class:`AllReduce` -- one flat all-reduce, summed then divided by the group size.
* :class:`BF16AllReduce` -- the same buffer sent as bfloat16 (half the bytes).

Every worker ends a ``reduce`` with the same gradients. ``reduce_async`` is the
same reduction returning a future (DDP's communication hook waits on it, see
:mod:`abtrain.compress.ddp_hook`). Reducers hold state (error memories, warm-start Qs)
keyed by parameter name, so it checkpoints. Policy -- when to compress, which
phase uses which reducer -- belongs to the methods, not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.group import Group

NamedGrads = Sequence[tuple[str, torch.Tensor]]


def _done() -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    return fut


class Reducer:
    """Average ``grads`` (name, tensor) in place over ``group``."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def reduce(self, grads: NamedGrads, group: Group) -> None:
        raise NotImplementedError

    def reduce_async(self, grads: NamedGrads, group: Group) -> torch.futures.Future:
        """:meth:`reduce`, as a future that completes when ``grads`` hold the average (here: at once)."""
        self.reduce(grads, group)
        return _done()

    def reset(self) -> None:
        """Forget memories that belong to the gradients of an earlier phase."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the consecutive pieces of ``flat`` back into ``tensors`` (the inverse of a ``torch.cat`` of them)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class NoReduce(Reducer):
    """Leaves every worker's gradients as they are: steps that each worker takes alone, whose model the method
    averages itself when the phase ends (AB-training's ``--ab-dense-comm local``). Sends nothing, holds nothing."""

    def reduce(self, grads: NamedGrads, group: Group) -> None:
        return None


class AllReduce(Reducer):
    """Plain averaging: one flat all-reduce per dtype (sum, then divide by the group size)."""

    def reduce(self, grads: NamedGrads, group: Group) -> None:
        self.comm.all_reduce_tensors([g for _, g in grads], group, average=True)

    def reduce_async(self, grads: NamedGrads, group: Group) -> torch.futures.Future:
        tensors = [g for _, g in grads]
        if group.size <= 1 or not tensors or len({t.dtype for t in tensors}) > 1:
            return super().reduce_async(grads, group)
        flat = torch.cat([t.reshape(-1) for t in tensors])

        def average(fut: torch.futures.Future) -> None:
            unpack(fut.value().div_(group.size), tensors)

        return self.comm.all_reduce_async(flat, group, average=False).then(average)


class BF16AllReduce(Reducer):
    """Averaging with the buffer sent as bfloat16 (divided by the group size before the sum, against overflow)."""

    def reduce(self, grads: NamedGrads, group: Group) -> None:
        self.comm.all_reduce_tensors([g for _, g in grads], group, average=True, wire_dtype=torch.bfloat16)

    def reduce_async(self, grads: NamedGrads, group: Group) -> torch.futures.Future:
        tensors = [g for _, g in grads]
        if group.size <= 1 or not tensors or len({t.dtype for t in tensors}) > 1:
            return super().reduce_async(grads, group)
        sent = torch.cat([t.reshape(-1) for t in tensors]).to(torch.bfloat16).div_(group.size)
        return self.comm.all_reduce_async(sent, group, average=False).then(lambda fut: unpack(fut.value(), tensors))
