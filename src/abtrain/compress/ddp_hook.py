"""The one adapter from a gradient reducer to DDP's communication hook.

DDP keeps what it is good at -- bucketing, overlap with the backward pass,
copying the reduced bucket into ``.grad`` -- and hands each bucket to
:meth:`ReducerHook.hook`, which passes the bucket's per-parameter gradients
(views into the bucket's flat buffer, ``GradBucket.gradients()``) with their
names to the method's :class:`~abtrain.compress.reducer.Reducer`. The reducer writes the
averages into those views; the hook's future returns the buffer.

No ``from __future__ import annotations`` here: DDP compares the hook's
``bucket`` annotation with ``dist.GradBucket`` itself, which a postponed
(string) annotation fails.
"""

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm.group import Group
from .reducer import Reducer


class ReducerHook:
    """State of the hook: which reducer serves the next bucket, over which group, and the parameters' names.

    ``reducer()`` is asked once per bucket (a method may switch reducers between
    steps, e.g. PowerSGD's uncompressed warm-up); ``on_last_bucket()`` runs when
    the last bucket of a backward pass has been handed over.
    """

    def __init__(self, module: nn.Module, reducer: Callable[[], Reducer], group: Group,
                 on_last_bucket: Callable[[], None] = lambda: None) -> None:
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.reducer = reducer
        self.group = group
        self.on_last_bucket = on_last_bucket

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self, ReducerHook.hook)

    @staticmethod
    def hook(state: "ReducerHook", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        grads = [(state.names[id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients())]
        fut = state.reducer().reduce_async(grads, state.group)
        if bucket.is_last():
            state.on_last_bucket()
        return fut.then(lambda _: buffer)
