"""DDP with gradients all-reduced in bfloat16, counted at 2 bytes per element.

The semantics of torch's ``bf16_compress_hook``
(``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``): cast the
bucket to bf16, divide by the world size, all-reduce (sum), cast back into the
fp32 bucket. :class:`~abtrain.compress.reducer.BF16AllReduce` does it through the
communicator, so the ledger records the bf16 tensor that is actually sent.
"""

from __future__ import annotations

from typing import Any

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.reducer import BF16AllReduce
from .ddp import DDPMethod
from .registry import MethodSpec, register


class BF16DDPMethod(DDPMethod):
    """DDP whose gradient buckets travel as bfloat16 (half the bytes of ``ddp``)."""

    name = "ddp-bf16"

    def __init__(self, comm: Communicator, topo: Topology, bucket_cap_mb: float = 25.0) -> None:
        super().__init__(comm, topo, bucket_cap_mb=bucket_cap_mb)
        self.reducer = BF16AllReduce(comm)

    def extra_results(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.bucket_cap_mb, "gradient_dtype": "bfloat16"}


register(MethodSpec("ddp-bf16", BF16DDPMethod, "DDP in bfloat16", "DDP whose gradient buckets travel as bfloat16",
                    bucket_cap=True, order=30))
