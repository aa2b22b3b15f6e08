"""DeMo: decoupled momentum; only the fast components of each worker's momentum travel, found with a chunked DCT.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization" (2024,
arXiv 2411.19870), Algorithm 1, with the choices of the authors' public
optimizer (chunk 64, top-32 per chunk, decay 0.999, sign of the decoded
average). Every step, on every worker, with ``g`` its own gradient::

    m = beta * m + g                          the momentum stays local, never averaged (the paper's rule;
                                              the authors' code adds lr * g: ``momentum_rule="reference"``)
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

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.dct import MAX_CHUNK_ELEMENTS, DCTTopKCodec, scatter_mean
from ..validate import Options, opt
from .gradient import GradientMethod
from .registry import MethodSpec, register
from .resume import Writer


MOMENTUM_RULES = ("paper", "reference")


@dataclass
class DeMoConfig(Options):
    """Options of DeMo; the CLI exposes each as ``--demo-<name>``."""

    section = "demo"
    topk: int = opt(32, "DCT components each worker sends per chunk (the authors' compression_topk)")
    chunk: int = opt(64, "chunk length per dimension: each dimension is cut into chunks of its largest divisor <= this (compression_chunk)")
    decay: float = opt(0.999, "decay beta of the local momentum m = beta * m + grad (compression_decay)")
    momentum_rule: str = opt("paper", "what enters the momentum: paper (m = beta * m + grad, the paper's Algorithm 1) or reference (m = beta * m + lr * grad, the authors' optimizer; under a learning rate that changes every step the two step differently)", choices=MOMENTUM_RULES)

    def check(self) -> None:
        self.require("topk", self.topk >= 1, "a positive integer")
        self.require("chunk", 1 <= self.chunk and self.chunk ** 2 <= MAX_CHUNK_ELEMENTS,
                     f"an integer in [1, {math.isqrt(MAX_CHUNK_ELEMENTS)}] (indices inside a chunk travel as int16)")
        self.require("decay", 0 <= self.decay < 1, "in [0, 1)")


class DeMo(GradientMethod):
    """Local momentum, top-k DCT components all-gathered, sign of their decoded mean as the gradient (phase ``train``).

    The user's optimizer must be plain SGD (no momentum): DeMo's momentum is
    its own, and SGD's step ``p -= lr * (sign + weight_decay * p)`` is the
    authors' decoupled weight decay followed by their sign step. What DeMo
    hands the optimizer is a step direction, not an averaged gradient, so the
    exchange runs in the optimizer step (``averages_gradients`` False) as the
    authors' optimizer does: clipping before the step clips this worker's own
    gradient, which then enters the momentum.
    """

    name = "demo"
    averages_gradients = False
    own_state = ("momentum",)

    def __init__(self, comm: Communicator, topo: Topology, config: DeMoConfig | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else DeMoConfig(**options)
        super().__init__(comm, topo, warmup_steps=0)
        self.codec: DCTTopKCodec | None = None
        self.momentum = torch.zeros(0)  # m, flat, the parameters in model.parameters() order
        self._lr_scale: torch.Tensor | float = 1.0  # momentum_rule="reference": the step's lr, by element

    def build(self, numel: int) -> None:
        device = self.topo.device
        self.codec = DCTTopKCodec([p.shape for p in self.params], self.cfg.chunk, self.cfg.topk, device=device)
        self.momentum = torch.zeros(numel, dtype=torch.float32, device=device)

    @property
    def components(self) -> int:
        """K: the DCT components each worker sends per step."""
        return self.codec.k if self.codec is not None else 0

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

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.cfg.momentum_rule == "reference":  # each parameter's gradient enters the momentum times its lr
            lr = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
            lrs = [float(lr.get(id(p), 0.0)) for p in self.params]
            self._lr_scale = lrs[0] if len(set(lrs)) == 1 else torch.repeat_interleave(
                torch.tensor(lrs, device=self.momentum.device), torch.tensor(self.numels, device=self.momentum.device))
        super().before_step(optimizer)

    @torch.no_grad()
    def exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """Fold ``flat`` (times the step's lr under ``momentum_rule="reference"``) into the momentum, send its fast
        components, return sign(decoded mean)."""
        assert self.codec is not None, "prepare() first"
        self.momentum.mul_(self.cfg.decay).add_(flat if self.cfg.momentum_rule == "paper" else flat * self._lr_scale)
        message = self.codec.encode(self.momentum)
        self.momentum.sub_(self.codec.decode(message))  # what is sent leaves the momentum
        entries = [self.codec.entries(m) for m in self.comm.all_gather(message, self.topo.world)]
        mean = scatter_mean([v for v, _ in entries], [i for _, i in entries], self.codec.coefficients)
        return self.codec.synthesize(mean).sign_()

    def extra_results(self) -> dict[str, Any]:
        return {"demo": {**asdict(self.cfg), "components": self.components, "numel": sum(self.numels),
                         "message_bytes": self.message_bytes}}

    def state_dict(self) -> dict[str, Any]:
        # One tensor per parameter, of its shape: the momentum as the authors' optimizer holds it.
        return {"t": self.t, "momentum": [m.view_as(p).clone() for m, p in zip(self.momentum.split(self.numels),
                                                                                  self.params)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if [m.shape for m in state["momentum"]] != [p.shape for p in self.params]:
            raise ValueError("checkpoint's DeMo momentum does not fit this model")
        self.t = state["t"]
        for m, saved in zip(self.momentum.split(self.numels), state["momentum"]):
            m.copy_(saved.reshape(-1))

    def adopt_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> None:
        """Another worker's state: its momentum (what it has not sent of its own gradients) is its own; this
        worker's starts at zero."""
        self.t = state["t"]
        self.momentum.zero_()

    def given_up(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
        return ["every other worker's DeMo momentum"] if state["t"] else []


register(MethodSpec("demo", DeMo, "DeMo", "decoupled momentum: each worker's momentum stays local, its top-k DCT "
                    "components per chunk are all-gathered and the sign of their mean is the step (plain SGD)",
                    options=DeMoConfig, order=85, bench=6, bench_args=("--optimizer", "sgd", "--momentum", "0",
                                                                       "--lr", "3e-3")))
