"""Gradient averaging started during the backward pass, in buckets, as DDP does for its model.

:class:`OverlappedAverage` watches a set of parameters through
``Tensor.register_post_accumulate_grad_hook``. The parameters are cut into
buckets (in reverse order, the order in which backward usually produces their
gradients, at most ``bucket_bytes`` each and one dtype each); when every
gradient of the next bucket has been accumulated, the bucket's flat copy is
all-reduced asynchronously (a sum) while backward goes on. :meth:`finish`,
called before the optimizer step, starts the buckets still waiting (parameters
that got no gradient this step), waits for every handle, divides by the group
size and writes the averages into ``.grad``.

Buckets start strictly in order, so every worker of the group issues the same
collectives in the same order whatever order its backward runs in. A gradient
accumulated again after its bucket left (several backward passes before one
step) marks the step stale: :meth:`finish` then discards the early sums and
averages the accumulated gradients at once, so the result is still the mean.

Sum then divide, in the gradients' dtype: the arithmetic of one flat
all-reduce, element by element; with a group of two (a + b is exact whatever
the order) the bits are those of one flat all-reduce of every gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...comm.communicator import Communicator
from ...comm.group import Group

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class OverlappedAverage:
    """Average the watched parameters' gradients over a group, started as backward produces them."""

    def __init__(self, comm: Communicator, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.comm = comm
        self.bucket_bytes = bucket_bytes
        self.params: list[torch.Tensor] = []
        self.buckets: list[list[torch.Tensor]] = []
        self._handles: list[Any] = []
        self._bucket_of: dict[int, int] = {}
        self._group: Group | None = None  # None: the hooks do nothing
        self._ready: list[set[int]] = []
        self._next = 0  # the bucket that starts next
        self._pending: list[tuple[torch.futures.Future, torch.Tensor, list[torch.Tensor]]] = []
        self._stale = False
        #: inside the user's no_sync(): gradients accumulate locally, no bucket starts
        self.paused = False

    def watch(self, params: Sequence[torch.Tensor]) -> None:
        """Average these parameters' gradients from the next backward on (no change if they are already watched)."""
        if [id(p) for p in params] == [id(p) for p in self.params]:
            return
        self.close()
        self.params = list(params)
        self.buckets = []
        size = 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or size + nbytes > self.bucket_bytes or self.buckets[-1][0].dtype != p.dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]
        self._reset()

    def start(self, group: Group | None) -> None:
        """Average over ``group`` from now on; None stops (the hooks stay, idle)."""
        self._group = group
        self._reset()

    def _reset(self) -> None:
        self._ready = [set() for _ in self.buckets]
        self._next = 0
        self._pending = []
        self._stale = False

    def _accumulated(self, param: torch.Tensor) -> None:
        if self._group is None or self.paused:
            return
        index = self._bucket_of[id(param)]
        if index < self._next:
            self._stale = True  # accumulated again after its bucket left
            return
        self._ready[index].add(id(param))
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next]):
            self._launch()

    def _launch(self) -> None:
        assert self._group is not None
        params = [p for p in self.buckets[self._next] if p.grad is not None]
        self._next += 1
        if params:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            self._pending.append((self.comm.all_reduce_async(flat, self._group, average=False), flat, params))

    @torch.no_grad()
    def finish(self) -> None:
        """Start what is left, wait for every bucket and write the averages into ``.grad``; ready for the next step."""
        group = self._group
        if group is None:
            return
        while self._next < len(self.buckets):
            self._launch()
        for fut, flat, params in self._pending:
            fut.wait()
            if not self._stale:
                flat.div_(group.size)
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        if self._stale:
            self.comm.all_reduce_tensors([p.grad for p in self.params if p.grad is not None], group, average=True)
        self._reset()

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.params = []
        self.buckets = []
