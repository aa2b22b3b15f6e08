"""DeMo: decoupled momentum; only the fast components of each worker's momentum travel, found with a chunked DCT.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization" (2024,
arXiv 2411.19870), Algorithm 1, with the choices of the authors' public
optimizer (chunk 64, top-32 per chunk, decay 0.999, sign of the decoded
average). Every step, on every worker, with ``g`` its own gradient::

    m = beta * m + g                          the momentum stays local, never averaged
    c = DCT(m)                                per chunk (a 2-D block of each weight matrix)
    q = the k entries of c largest in |.| per chunk
    m = m - IDCT(q)                           what is sent leaves the momentum; the residual stays
    Q = mean over the workers that sent each (chunk, index) of their q     all-gather of every q
    grad = sign(IDCT(Q))                      the user's plain SGD then steps p -= lr * grad

Chunks: a tensor is seen as a matrix (rows = its first dimension, columns
the rest; a vector as one row); each dimension is cut into chunks of its
largest divisor not above ``chunk`` and every chunk gets an orthonormal
2-D DCT-II. The authors' code indexes 2-D tensors only; conv kernels are
flattened here. What travels: per worker and step one all-gather of one
uint8 buffer of ``6K`` bytes, ``K = sum over tensors of chunks * min(topk,
chunk elements)``: the ``K`` float32 values (their bits) and ``K`` int16
indices inside the chunk (a chunk holds at most ``chunk**2`` <= 32,768
entries; the chunk itself is implied by the position in the message).
Payload ``6K`` bytes, wire ``(p - 1) * 6K`` bytes. The authors' code sends
int64 indices (12 bytes a component in float32); the information is the same.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.dct import ChunkedDCT, extract, scatter_mean
from ..validate import Options, opt
from .base import Method
from .registry import MethodSpec, register

#: Indices inside a chunk travel as int16: a chunk may hold at most this many entries.
MAX_CHUNK_ELEMENTS = 2 ** 15


@dataclass
class DeMoConfig(Options):
    """Options of DeMo; the CLI exposes each as ``--demo-<name>``."""

    section = "demo"
    topk: int = opt(32, "DCT components each worker sends per chunk (the authors' compression_topk)")
    chunk: int = opt(64, "chunk length per dimension: each dimension is cut into chunks of its largest divisor <= this (compression_chunk)")
    decay: float = opt(0.999, "decay beta of the local momentum m = beta * m + grad (compression_decay)")

    def check(self) -> None:
        self.require("topk", self.topk >= 1, "a positive integer")
        self.require("chunk", 1 <= self.chunk and self.chunk ** 2 <= MAX_CHUNK_ELEMENTS,
                     f"an integer in [1, {math.isqrt(MAX_CHUNK_ELEMENTS)}] (indices inside a chunk travel as int16)")
        self.require("decay", 0 <= self.decay < 1, "in [0, 1)")


class DeMo(Method):
    """Local momentum, top-k DCT components all-gathered, sign of their decoded mean as the gradient (phase ``train``).

    The user's optimizer must be plain SGD (no momentum): DeMo's momentum is
    its own, and SGD's step ``p -= lr * (sign + weight_decay * p)`` is the
    authors' decoupled weight decay followed by their sign step.
    """

    name = "demo"

    def __init__(self, comm: Communicator, topo: Topology, config: DeMoConfig | None = None,
                 **options: Any) -> None:
        super().__init__(comm, topo)
        self.cfg = config if config is not None else DeMoConfig(**options)
        self.t = 0  # optimizer steps taken
        self.params: list[nn.Parameter] = []
        self.transforms: list[ChunkedDCT] = []
        self.ks: list[int] = []
        self.momentum: list[torch.Tensor] = []

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.transforms = [ChunkedDCT(p.shape, self.cfg.chunk, device=p.device) for p in self.params]
        self.ks = [min(self.cfg.topk, t.elements) for t in self.transforms]
        self.momentum = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        return model

    @property
    def components(self) -> int:
        """K: the DCT components each worker sends per step."""
        return sum(t.chunks * k for t, k in zip(self.transforms, self.ks))

    @property
    def message_bytes(self) -> int:
        """Bytes of one worker's message: K float32 values and K int16 indices."""
        return 6 * self.components

    def start(self, optimizer: torch.optim.Optimizer) -> None:
        plain = isinstance(optimizer, torch.optim.SGD) and all(
            g.get("momentum", 0) == 0 and not g.get("nesterov", False) for g in optimizer.param_groups)
        if not plain:
            raise ValueError("DeMo keeps its own momentum and hands the optimizer sign(...): give it plain SGD, "
                             "--optimizer sgd --momentum 0 (torch.optim.SGD(params, lr, momentum=0))")

    @torch.no_grad()
    def exchange(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fold ``grads`` into the momentum, send its fast components, return sign(decoded mean) per parameter."""
        values, indices = [], []
        for m, g, transform, k in zip(self.momentum, grads, self.transforms, self.ks):
            m.mul_(self.cfg.decay).add_(g)
            coef = transform.encode(m)
            v, i = extract(coef, k)
            m.sub_(transform.decode(torch.zeros_like(coef).scatter_(-1, i, v)))
            values.append(v.reshape(-1))
            indices.append(i.reshape(-1))
        value, index = torch.cat(values), torch.cat(indices)
        # Bytes, because gloo gathers no int16: 4K bytes of float32 values, then 2K bytes of int16 indices.
        message = torch.cat([value.view(torch.uint8), index.to(torch.int16).view(torch.uint8)])
        gathered = self.comm.all_gather(message, self.topo.world)
        k_total = value.numel()
        # Copies first: viewing bytes as wider types needs an aligned start.
        received = [(m[:4 * k_total].clone().view(torch.float32), m[4 * k_total:].clone().view(torch.int16).long())
                    for m in gathered]
        out, offset = [], 0
        for transform, k in zip(self.transforms, self.ks):
            n = transform.chunks * k
            vs = [v[offset:offset + n].view(transform.chunks, k) for v, _ in received]
            ids = [i[offset:offset + n].view(transform.chunks, k) for _, i in received]
            mean = scatter_mean(vs, ids, transform.chunks, transform.elements)
            out.append(transform.decode(mean).sign_())
            offset += n
        return out

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).float() for p in self.params]
        with torch.profiler.record_function("abtrain::demo::train"), self.comm.ledger.in_phase("train"):
            update = self.exchange(grads)
        with torch.no_grad():
            for p, u in zip(self.params, update):
                if p.grad is None:
                    p.grad = u.to(p.dtype)
                else:
                    p.grad.copy_(u)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.t += 1

    def extra_results(self) -> dict[str, Any]:
        numel = sum(p.numel() for p in self.params)
        return {"demo": {**asdict(self.cfg), "components": self.components, "numel": numel,
                         "message_bytes": self.message_bytes}}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "momentum": [m.clone() for m in self.momentum]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if [m.shape for m in state["momentum"]] != [m.shape for m in self.momentum]:
            raise ValueError("checkpoint's DeMo momentum does not fit this model")
        self.t = state["t"]
        for m, saved in zip(self.momentum, state["momentum"]):
            m.copy_(saved)


register(MethodSpec("demo", DeMo, "DeMo", "decoupled momentum: each worker's momentum stays local, its top-k DCT "
                    "components per chunk are all-gathered and the sign of their mean is the step (plain SGD)",
                    options=DeMoConfig, order=85, bench=6, bench_args=("--optimizer", "sgd", "--momentum", "0",
                                                                       "--lr", "3e-3")))
