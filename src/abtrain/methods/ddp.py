"""Ordinary data parallelism: torch's DistributedDataParallel, its buckets averaged by a counted reducer."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.ddp_hook import ReducerHook
from ..compress.reducer import AllReduce, Reducer
from .base import Method
from .registry import MethodSpec, register


# torch 2.13 renamed broadcast_buffers to forward_sync_buffers; older releases only know the former.
_no_buffer_broadcast = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class DDPMethod(Method):
    """torch DDP with its bucketing and overlap kept; every bucket goes through a reducer and the ledger.

    DDP's own collectives outside the hook are switched off and replaced by
    counted ones: the initial parameter/buffer broadcast (``init_sync=False``,
    done by :meth:`Method.prepare`) and the per-forward buffer broadcast
    (``forward_sync_buffers=False``; buffers are averaged before evaluation
    instead, see :meth:`Method.sync_buffers`).
    """

    name = "ddp"

    def __init__(self, comm: Communicator, topo: Topology, bucket_cap_mb: float = 25.0) -> None:
        super().__init__(comm, topo)
        self.bucket_cap_mb = bucket_cap_mb
        self.reducer: Reducer = AllReduce(comm)

    def bucket_reducer(self) -> Reducer:
        """The reducer of the next bucket; subclasses with another compression swap :attr:`reducer`."""
        return self.reducer

    def after_backward(self) -> None:
        """Called when DDP has handed over the last bucket of a backward pass."""

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        if not self.topo.is_distributed:
            return model
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.topo.device] if self.topo.device.type == "cuda" else None,
            init_sync=False,
            bucket_cap_mb=self.bucket_cap_mb,
            process_group=self.topo.world.pg,
            **_no_buffer_broadcast,
        )
        ReducerHook(model, self.bucket_reducer, self.topo.world, self.after_backward).register(ddp)
        self.ddp = ddp
        return ddp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's own ``no_sync()``: its buckets wait for the first backward after the block."""
        with super().no_sync(), (self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()):
            yield

    def extra_results(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.bucket_cap_mb}


register(MethodSpec("ddp", DDPMethod, "DDP", "torch's DistributedDataParallel, every gradient bucket all-reduced "
                    "in float32", bucket_cap=True, order=10, bench=1))
