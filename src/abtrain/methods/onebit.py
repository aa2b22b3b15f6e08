"""1-bit compression with error feedback: each gradient element travels as its sign, plus one scale per tensor or chunk.

In the manner of 1-bit SGD (Seide et al., Interspeech 2014) and of 1-bit
Adam's compressed all-reduce (Tang et al., ICML 2021; DeepSpeed's
``compressed_allreduce``): after ``warmup_steps`` full-precision all-reduces
(phase ``warmup``), every step (phase ``train``) runs two compressions with
error feedback and two collectives over all ``p`` workers:

1. **worker**: ``x = grad + e_w`` (the flat gradient, zero-padded to
   ``p * L`` elements, ``L`` a multiple of 8) is compressed to ``s * sign(x)``
   with one scale ``s = mean |x|`` per segment (the value minimising
   ``||x - s sign(x)||``); ``e_w = x - s sign(x)``. Signs are packed 8 to a
   byte. An **all_to_all** sends slice ``j`` (``L/8`` bytes of signs and the
   ``M`` float32 scales of its segments) to worker ``j``.
2. **server**: worker ``j`` decompresses the ``p`` versions of its slice,
   averages them, adds its own error ``e_s``, compresses again (same
   segments) and keeps ``e_s``. An **all_gather** hands every worker all
   ``p`` compressed slices; every worker decompresses the same bytes the same
   way, so every optimizer sees the same averaged gradient.

Segments are the tensors (``chunk_size = 0``) or chunks of ``chunk_size``
elements of each tensor, cut further at slice boundaries; ``M`` is the
largest number of segments in a slice (slices with fewer pad with zeros).
Bytes per compressed step and worker, with ``m = L/8 + 4M`` (one message):
all_to_all payload ``p*m``, wire ``(p-1)*m``; all_gather payload ``m``, wire
``(p-1)*m``; together ``2(p-1)*m`` ≈ ``2(p-1)/p * numel/8``, 1/32 of a ring
all-reduce of the float32 gradient.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.sign import segment_ids, sign_compress, sign_decompress
from ..compress.wire import as_floats
from ..validate import Options, opt
from .gradient import GradientMethod
from .registry import MethodSpec, register


@dataclass
class OneBitConfig(Options):
    """Options of 1-bit compression; the CLI exposes each as ``--onebit-<name>``."""

    section = "onebit"
    warmup_steps: int = opt(4, "full-precision all-reduce steps before 1-bit compression starts (1-bit Adam, with AdamW, warms up for ~15 percent of the run)")
    chunk_size: int = opt(0, "elements sharing one scale; 0: one scale per tensor")

    def check(self) -> None:
        self.require("warmup_steps", self.warmup_steps >= 0, "an integer >= 0")
        self.require("chunk_size", self.chunk_size >= 0, ">= 0 (0: one scale per tensor)")


class OneBit(GradientMethod):
    """1-bit gradients with worker and server error feedback (phases ``warmup`` then ``train``)."""

    name = "onebit"

    def __init__(self, comm: Communicator, topo: Topology, config: OneBitConfig | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else OneBitConfig(**options)
        super().__init__(comm, topo, self.cfg.warmup_steps)
        self.numel = 0  # N, the trainable parameters
        self.slice = 0  # L, elements per slice (p * L >= N, L a multiple of 8)
        self.segments = 0  # M, scales per slice
        self.worker_error = torch.zeros(0)  # e_w, p * L elements
        self.server_error = torch.zeros(0)  # e_s, this worker's slice

    def build(self, numel: int) -> None:
        p = self.topo.world.size
        self.numel = numel
        self.slice = -(-numel // (8 * p)) * 8  # L: a whole number of bytes of signs per slice
        padded = p * self.slice
        starts, offset = [], 0
        for n in self.numels:
            step = self.cfg.chunk_size or n
            starts += list(range(offset, offset + n, step))
            offset += n
        if numel < padded:
            starts.append(numel)  # the padding: a segment of its own, scale 0
        ids, self.segments = segment_ids(starts, padded, p)
        device = self.topo.device
        self.ids = ids.to(device)
        self.counts = torch.bincount(ids, minlength=p * self.segments).to(device=device, dtype=torch.float32)
        j = self.topo.rank  # this worker's slice
        self.slice_ids = (ids[j * self.slice:(j + 1) * self.slice] - j * self.segments).to(device)
        self.slice_counts = self.counts[j * self.segments:(j + 1) * self.segments]
        self.all_slice_ids = (ids.view(p, self.slice) - torch.arange(p).view(p, 1) * self.segments).to(device)
        self.worker_error = torch.zeros(padded, device=device)
        self.server_error = torch.zeros(self.slice, device=device)

    @property
    def message_bytes(self) -> int:
        """Bytes of one slice's message: L/8 of signs and M float32 scales."""
        return self.slice // 8 + 4 * self.segments

    def exchange(self, flat: torch.Tensor) -> torch.Tensor:
        p, n, length, m = self.topo.world.size, self.numel, self.slice, self.segments
        x = self.worker_error.clone()
        x[:n] += flat
        packed, scales = sign_compress(x, self.ids, self.counts)
        self.worker_error = x.sub_(sign_decompress(packed, scales, self.ids))
        send = torch.cat([packed.view(p, length // 8), scales.view(p, m).view(torch.uint8)], dim=1)
        received = self.comm.all_to_all(send.reshape(-1), self.topo.world).view(p, -1)

        # This worker's slice: the mean of the p workers' compressed versions, compressed again with error feedback.
        total = torch.zeros(length, device=flat.device)
        for row in received:
            total += sign_decompress(row[:length // 8], as_floats(row[length // 8:]), self.slice_ids)
        y = total.div_(p).add_(self.server_error)
        packed, scales = sign_compress(y, self.slice_ids, self.slice_counts)
        self.server_error = y.sub_(sign_decompress(packed, scales, self.slice_ids))
        message = torch.cat([packed, scales.view(torch.uint8)])
        gathered = self.comm.all_gather(message, self.topo.world)

        average = torch.cat([sign_decompress(g[:length // 8], as_floats(g[length // 8:]), ids)
                             for g, ids in zip(gathered, self.all_slice_ids)])
        return average[:n]

    def extra_results(self) -> dict[str, Any]:
        return {"onebit": {**asdict(self.cfg), "numel": self.numel, "padded_numel": self.slice * self.topo.world.size,
                           "scales_per_slice": self.segments, "message_bytes": self.message_bytes}}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["worker_error"].shape != self.worker_error.shape or state["server_error"].shape != self.server_error.shape:
            raise ValueError("checkpoint's 1-bit error memories do not fit this model and number of workers")
        self.t = state["t"]
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])


register(MethodSpec("onebit", OneBit, "1-bit", "sign compression with worker and server error feedback and one scale "
                    "per tensor or chunk, after a full-precision warm-up", options=OneBitConfig, order=80, bench=6))
