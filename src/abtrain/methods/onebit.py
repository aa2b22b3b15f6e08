"""1-bit compression with error feedback: each gradient element travels as its sign, plus one scale per tensor or chunk.

In the manner of 1-bit SGD (Seide et al., Interspeech 2014) and of 1-bit
Adam's compressed all-reduce (Tang et al., ICML 2021; DeepSpeed's
``compressed_allreduce``): after ``warmup_steps`` full-precision all-reduces
(phase ``warmup``), every step (phase ``train``) runs two compressions with
error feedback and two collectives over all ``p`` workers
(:func:`~abtrain.compress.allreduce.compressed_all_reduce` with a
:class:`~abtrain.compress.sign.SignCodec`):

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

Segments are the tensors (``scale_block = 0``) or chunks of ``scale_block``
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
from ..compress.allreduce import compressed_all_reduce, slice_length
from ..compress.sign import SignCodec
from ..validate import Options, opt
from .gradient import GradientMethod
from .registry import MethodSpec, register
from .resume import Writer


@dataclass
class OneBitConfig(Options):
    """Options of 1-bit compression; the CLI exposes each as ``--onebit-<name>``."""

    section = "onebit"
    warmup_steps: int = opt(4, "full-precision all-reduce steps before 1-bit compression starts (1-bit Adam, with AdamW, warms up for ~15 percent of the run)")
    scale_block: int = opt(0, "elements sharing one scale; 0: one scale per tensor")

    def check(self) -> None:
        self.require("warmup_steps", self.warmup_steps >= 0, "an integer >= 0")
        self.require("scale_block", self.scale_block >= 0, ">= 0 (0: one scale per tensor)")


class OneBit(GradientMethod):
    """1-bit gradients with worker and server error feedback (phases ``warmup`` then ``train``)."""

    name = "onebit"
    own_state = ("worker_error", "server_error")

    def __init__(self, comm: Communicator, topo: Topology, config: OneBitConfig | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else OneBitConfig(**options)
        super().__init__(comm, topo, self.cfg.warmup_steps)
        self.numel = 0  # N, the trainable parameters
        self.slice = 0  # L, elements per slice (p * L >= N, L a multiple of 8)
        self.segments = 0  # M, scales per slice
        self.codec: SignCodec | None = None  # the padded buffer's segments
        self.worker_error = torch.zeros(0)  # e_w, p * L elements
        self.server_error = torch.zeros(0)  # e_s, this worker's slice

    def build(self, numel: int) -> None:
        p = self.topo.world.size
        self.numel = numel
        self.slice = slice_length(numel, p, SignCodec.align)  # L: a whole number of bytes of signs per slice
        padded = p * self.slice
        starts, offset = [], 0
        for n in self.numels:
            step = self.cfg.scale_block or n
            starts += list(range(offset, offset + n, step))
            offset += n
        if numel < padded:
            starts.append(numel)  # the padding: a segment of its own, scale 0
        device = self.topo.device
        self.codec = SignCodec(padded, starts, device=device)
        self.segments = self.codec.for_slices(self.slice, p)[0].scales
        self.worker_error = torch.zeros(padded, device=device)
        self.server_error = torch.zeros(self.slice, device=device)

    @property
    def message_bytes(self) -> int:
        """Bytes of one slice's message: L/8 of signs and M float32 scales."""
        return self.slice // 8 + 4 * self.segments

    def exchange(self, flat: torch.Tensor) -> torch.Tensor:
        assert self.codec is not None, "prepare() first"
        return compressed_all_reduce(self.comm, self.topo.world, flat, self.codec, worker_error=self.worker_error,
                                     server_error=self.server_error)

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

    def adopt_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> None:
        """Another worker's state: its error memories are its own (and sized for its world); this worker's start
        at zero, as at the end of the warm-up."""
        self.t = state["t"]
        self.worker_error.zero_()
        self.server_error.zero_()

    def given_up(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
        return ["every other worker's 1-bit error memories"] if state["t"] > self.cfg.warmup_steps else []


register(MethodSpec("onebit", OneBit, "1-bit", "sign compression with worker and server error feedback and one scale "
                    "per tensor or chunk, after a full-precision warm-up", options=OneBitConfig, order=80, bench=6))
