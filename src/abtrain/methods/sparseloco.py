"""SparseLoCo: DiLoCo whose outer step applies the average of each worker's top-k of an error-feedback
accumulator, in 2 bits, with no outer momentum.

Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo" (2025,
arXiv 2508.15706), Algorithm 1, with the choices of the authors' public code. The user's optimizer is the
inner one (the paper's AdamW); every ``H`` steps each worker ``r``, from the global copy ``theta`` that all
hold (:class:`.diloco.OuterStep`, plain SGD)::

    delta_r = theta - local_r                      the pseudo-gradient
    e_r = beta * e_r + delta_r                     the error-feedback accumulator, decayed
    m_r = Q(TopK(e_r))                             per chunk the top-k, values in 2 bits
    e_r = e_r - decode(m_r)                        what is sent leaves the accumulator; the rest stays
    u = per entry, the mean of the decoded m_r     all-gather of every m_r
    theta = theta - alpha * u;  local_r = theta    every worker takes the same global model

The accumulator stands in for DiLoCo's outer momentum. Formats: :class:`~abtrain.compress.chunked_topk.
ChunkedTopKCodec` (chunks of 64 x 64, 64 entries each, 12-bit positions) with :class:`~abtrain.compress.
twobit.TwoBitCodec` values. Every message has the same size, so gloo all-gathers it as it is: per outer step
and worker, payload ``m = ceil(sum_t K_t * ceil(log2 E_t) / 8) + ceil(2K / 8) + 20 T`` bytes (``K`` entries,
``T`` tensors), wire ``(p - 1) * m``. Floating-point buffers stay per worker between evaluations (averaged
before each one, as for Streaming DiLoCo). The authors' code averages an entry over the workers that sent it
(``scatter_reduce(mean, include_self=False)``, ``mean = "senders"``); the paper's formula divides by all
``p`` (``mean = "workers"``).

The period: the authors' 512M-parameter run takes ``H = 15`` inner steps 163 times (2,445 inner steps). A
shorter run keeps those 163 outer steps: ``H = min(15, max(1, round(15 * total_steps / 2445)))`` unless
``sync_every`` is given (the bench's 702-step runs: H = 4; 2000 steps: H = 12); without a step budget, 15.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.chunked_topk import VALUE_FORMATS, ChunkedTopKCodec
from ..compress.dct import scatter_mean
from ..validate import Options, opt
from .diloco import DiLoCo
from .registry import MethodSpec, register
from .resume import Writer

#: The authors' period and the inner steps of their 512M-parameter run (163 outer steps of 15).
PAPER_SYNC_EVERY = 15
PAPER_STEPS = 2445
MEANS = ("senders", "workers")


def sync_every_for(total_steps: int | None) -> int:
    """H for a run of ``total_steps``: the paper's 15, or fewer so that a shorter run keeps its 163 outer steps."""
    if not total_steps:
        return PAPER_SYNC_EVERY
    return min(PAPER_SYNC_EVERY, max(1, round(PAPER_SYNC_EVERY * total_steps / PAPER_STEPS)))


@dataclass
class SparseLoCoConfig(Options):
    """Options of SparseLoCo; the CLI exposes each as ``--sparseloco-<name>``."""

    section = "sparseloco"
    sync_every: int | None = opt(None, "inner steps between two outer steps (H); default: the paper's 15, fewer in a run shorter than its 2445 steps so that the run keeps 163 outer steps: min(15, max(1, round(15 * steps / 2445)))")
    outer_lr: float = opt(1.0, "learning rate alpha of the outer step theta -= alpha * (mean of the sparse updates)")
    decay: float = opt(0.95, "decay beta of the error-feedback accumulator e = beta * e + (global - local)")
    chunk: int = opt(64, "chunk length per dimension: each dimension is cut into chunks of its largest divisor <= this")
    topk: int = opt(64, "entries sent per full chunk of chunk**2 (64 of 4096, a density of 1/64; the paper's other density is 128 of 4096); a smaller chunk sends the same share")
    quantize: str = opt("2bit", "the sent values: 2bit (4 bins of the tensor's spread, their means sent along) or fp32", choices=VALUE_FORMATS)
    mean: str = opt("senders", "an entry of the outer step: the mean over the workers that sent it (senders, the authors' code) or over all workers (workers, the paper's 1/p sum)", choices=MEANS)

    def check(self) -> None:
        self.require("sync_every", self.sync_every is None or self.sync_every >= 1, "a positive integer")
        self.require("outer_lr", self.outer_lr > 0, "> 0")
        self.require("decay", 0 <= self.decay <= 1, "in [0, 1]")
        self.require("chunk", self.chunk >= 1, "a positive integer")
        self.require("topk", 1 <= self.topk <= self.chunk ** 2, f"in [1, chunk**2 = {self.chunk ** 2}]")


class SparseLoCo(DiLoCo):
    """The user's optimizer for ``H`` inner steps, then a sparse, 2-bit outer step (phases ``inner`` / ``outer``):
    DiLoCo's global copy, schedule and resume, another outer step."""

    own_state = ("accumulators",)  # each worker's error feedback: what its own top-k did not send

    name = "sparseloco"
    syncs_buffers = False  # an outer step carries parameters only: consensus averages the buffers
    config_class = SparseLoCoConfig

    def __init__(self, comm: Communicator, topo: Topology, config: SparseLoCoConfig | None = None,
                 **options: Any) -> None:
        super().__init__(comm, topo, config, **options)
        self.codec: ChunkedTopKCodec | None = None
        self.accumulator = torch.zeros(0)  # e, flat, the parameters in model.parameters() order
        self.numels: list[int] = []

    def first_sync_every(self) -> int:
        return self.cfg.sync_every or PAPER_SYNC_EVERY

    def outer_momentum(self) -> float:
        return 0.0  # the accumulator stands in for it

    def set_total_steps(self, total_steps: int | None) -> None:
        if self.cfg.sync_every is None:
            self.sync_every = sync_every_for(total_steps)

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        params = list(model.parameters())
        self.numels = [p.numel() for p in params]
        self.codec = ChunkedTopKCodec([p.shape for p in params], self.cfg.chunk, self.cfg.topk, self.cfg.quantize,
                                      device=self.topo.device)
        self.accumulator = torch.zeros(sum(self.numels), dtype=torch.float32, device=self.topo.device)
        return model

    @torch.no_grad()
    def synchronize(self) -> None:
        """Fold the pseudo-gradient into the accumulator, all-gather its top-k, step the global copy, load it."""
        assert self.module is not None and self.outer is not None and self.codec is not None, "prepare() first"
        params = list(self.module.parameters())
        pseudo = torch.cat([d.reshape(-1).float() for d in self.outer.pseudo_gradients(params)])
        self.accumulator.mul_(self.cfg.decay).add_(pseudo)
        message = self.codec.encode(self.accumulator)
        self.accumulator.sub_(self.codec.decode(message))  # what is sent leaves the accumulator, as decoded
        with torch.profiler.record_function("abtrain::sparseloco::outer"), self.comm.ledger.in_phase("outer"):
            gathered = self.comm.all_gather(message, self.topo.world)
        self.outer.step(self.combine(gathered).split(self.numels))
        self.outer.merge(params)

    def combine(self, messages: list[torch.Tensor]) -> torch.Tensor:
        """The dense update of every worker's message, decoded in rank order (the same bits everywhere)."""
        assert self.codec is not None
        entries = [self.codec.entries(m) for m in messages]
        values, indices = [v for v, _ in entries], [i for _, i in entries]
        if self.cfg.mean == "senders":
            return scatter_mean(values, indices, self.codec.coefficients)
        total = torch.zeros(self.codec.coefficients, dtype=torch.float32, device=values[0].device)
        for v, i in zip(values, indices):
            total.index_add_(0, i, v)
        return total.div_(len(messages))

    # -- results and checkpoints ---------------------------------------------------------------------
    def extra_results(self) -> dict[str, Any]:
        numel = sum(self.numels)
        codec = self.codec
        return {"sparseloco": {**asdict(self.cfg), "sync_every": self.sync_every, "syncs": self.syncs, "numel": numel,
                               "entries": codec.k if codec else 0,
                               "density": codec.k / numel if codec and numel else 0.0,
                               "message_bytes": codec.message_bytes(numel) if codec else 0,
                               "index_bytes": codec.index_bytes if codec else 0}}

    def state_dict(self) -> dict[str, Any]:
        assert self.outer is not None, "prepare() first"
        # One tensor per parameter, of its shape, as the authors' optimizer holds its error buffers.
        accumulators = [e.view_as(p).clone() for e, p in zip(self.accumulator.split(self.numels), self.outer.params)]
        return {**super().state_dict(), "accumulators": accumulators}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.outer is not None, "prepare() first"
        if [e.shape for e in state["accumulators"]] != [p.shape for p in self.outer.params]:
            raise ValueError("checkpoint's SparseLoCo accumulators do not fit this model")
        super().load_state_dict(state)
        for e, saved in zip(self.accumulator.split(self.numels), state["accumulators"]):
            e.copy_(saved.reshape(-1))

    def given_up(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
        return super().given_up(state, optimizer, writer) + [
            f"every other worker's error-feedback accumulator (they take rank {writer.rank}'s)"]


register(MethodSpec("sparseloco", SparseLoCo, "SparseLoCo",
                    "H inner steps of the chosen optimizer (AdamW recommended), then an outer step on the mean of "
                    "every worker's top-k per chunk of an error-feedback accumulator, in 2 bits (all-gathered)",
                    options=SparseLoCoConfig, order=67, bench=4,
                    short_run_args=("--sparseloco-sync-every", "2")))
