"""DDP with gradients all-reduced in bfloat16, counted at 2 bytes per element.

The semantics of torch's ``bf16_compress_hook``
(``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``): cast the
bucket to bf16, divide by the world size, all-reduce (sum), cast back into the
fp32 bucket. The all-reduce goes through the communicator, so the ledger
records the bf16 tensor that is actually sent.
"""

from __future__ import annotations

from typing import Any

import torch

from .ddp import DDPMethod
from .registry import MethodSpec, register


# No annotations on the hook: DDP compares the ``bucket`` annotation with dist.GradBucket itself.
def _bf16_allreduce_hook(method, bucket):  # type: ignore[no-untyped-def]
    buffer = bucket.buffer()
    # Divide before the sum, as torch's hook does, so that bf16 cannot overflow.
    compressed = buffer.to(torch.bfloat16).div_(method.topo.world.size)
    fut = method.comm.all_reduce_async(compressed, method.topo.world, average=False)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value())  # in place, to keep the peak memory of torch's hook
        return buffer

    return fut.then(decompress)


class BF16DDPMethod(DDPMethod):
    """DDP whose gradient buckets travel as bfloat16 (half the bytes of ``ddp``)."""

    name = "ddp-bf16"

    comm_hook = staticmethod(_bf16_allreduce_hook)

    def extra_results(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.bucket_cap_mb, "gradient_dtype": "bfloat16"}


register(MethodSpec("ddp-bf16", BF16DDPMethod, "DDP in bfloat16", "DDP whose gradient buckets travel as bfloat16",
                    bucket_cap=True, order=30))
