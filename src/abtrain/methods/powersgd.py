"""PowerSGD: DDP whose gradient buckets are compressed to rank-r factors P and Q before the all-reduce.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), with the arithmetic of torch's DDP
communication hook (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``,
``PowerSGDState`` and ``powerSGD_hook``, without the optional same-shape
batching): error feedback, warm start, seeded random Qs, the same
compression rule, orthogonalisation and order of operations. The one
difference: the uncompressed tensors ride in the Ps' all-reduce instead of one
of their own (two collectives per bucket instead of three, the same elements).
Each element is still summed and then divided as there, so two workers get
torch's bits (the test compares them); with more, a sum over the longer buffer may
add in another order and round differently.
The math is :class:`~abtrain.compress.powersgd.PowerSGDReducer`, handed each DDP bucket by
:class:`~abtrain.compress.ddp_hook.ReducerHook`; its two all-reduces (the Ps with the
uncompressed tensors, the Qs) go through the communicator, so the ledger holds, per
compressed step, exactly the ``numel_after_compression`` elements: the
uncompressed tensors plus every P and Q. The first ``warmup_steps`` steps are
plain averaged all-reduces of the buckets (phase ``warmup``); compressed steps
are phase ``train``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.powersgd import PowerSGDReducer
from ..compress.reducer import Reducer
from ..compress.wire import WIRE_DTYPES
from ..validate import Options, opt
from .ddp import DDPMethod
from .registry import MethodSpec, register
from .resume import Writer


@dataclass
class PowerSGDConfig(Options):
    """Options of PowerSGD; the CLI exposes each as ``--powersgd-<name>``."""

    section = "powersgd"
    rank: int = opt(4, "rank r of the P and Q factors of each compressed gradient matrix (matrix_approximation_rank)")
    warmup_steps: int = opt(10, "plain all-reduce steps before PowerSGD compresses (torch's start_powerSGD_iter, > 1)")
    min_compression_rate: float = opt(2.0, "compress a matrix only when (rows + cols) * r * this < rows * cols")
    orthogonalization_epsilon: float = opt(0.0, "added to column norms in the orthogonalisation (e.g. 1e-8 against all-zero gradients)")
    seed: int = opt(0, "seed of the random initial Qs (the same on every worker)")
    dtype: str = opt("fp32", "dtype of P, Q and the uncompressed tensors on the wire (bf16: half the bytes of the compressed steps; error feedback keeps the rounding)", choices=tuple(WIRE_DTYPES))

    def check(self) -> None:
        self.require("rank", self.rank >= 1, "a positive integer")
        # torch's PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start:
        # DDP rebuilds its buckets after the first step, which would invalidate the memorised errors and Qs.
        self.require("warmup_steps", self.warmup_steps >= 2,
                     "an integer >= 2 (DDP rebuilds its buckets after the first step)")
        self.require("min_compression_rate", self.min_compression_rate > 0, "> 0")
        self.require("orthogonalization_epsilon", self.orthogonalization_epsilon >= 0, ">= 0")


class PowerSGD(DDPMethod):
    """torch DDP with PowerSGD-compressed buckets, every all-reduce counted (phases ``warmup`` then ``train``).

    ``use_error_feedback`` and ``warm_start`` (both on, as torch recommends)
    are keyword arguments of the Python API only.
    """

    name = "powersgd"
    own_state = ("compressor.errors",)

    def __init__(self, comm: Communicator, topo: Topology, config: PowerSGDConfig | None = None,
                 bucket_cap_mb: float = 25.0, use_error_feedback: bool = True, warm_start: bool = True,
                 **options: Any) -> None:
        super().__init__(comm, topo, bucket_cap_mb=bucket_cap_mb)
        self.cfg = config if config is not None else PowerSGDConfig(**options)
        self.compressor = PowerSGDReducer(
            comm, self.cfg.rank, min_compression_rate=self.cfg.min_compression_rate,
            error_feedback=use_error_feedback, warm_start=warm_start,
            orthogonalization_epsilon=self.cfg.orthogonalization_epsilon, seed=self.cfg.seed,
            wire_dtype=WIRE_DTYPES[self.cfg.dtype])
        self.iter = 0  # backward passes whose buckets were all reduced

    @property
    def phase(self) -> str:
        return "warmup" if self.iter < self.cfg.warmup_steps else "train"

    def bucket_reducer(self) -> Reducer:
        return self.reducer if self.phase == "warmup" else self.compressor

    def after_backward(self) -> None:
        self.iter += 1  # the ledger reads the phase live: the next step's traffic gets the new label

    def extra_results(self) -> dict[str, Any]:
        c = self.compressor
        return {"bucket_cap_mb": self.bucket_cap_mb,
                "powersgd": {**asdict(self.cfg), "use_error_feedback": c.error_feedback, "warm_start": c.warm_start,
                             "compression_rate": c.compression_rate, "numel_before_compression": c.numel_before,
                             "numel_after_compression": c.numel_after}}

    def state_dict(self) -> dict[str, Any]:
        return {"iter": self.iter, "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = state["iter"]
        self.compressor.load_state_dict(state["compressor"])

    def adopt_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> None:
        """Another worker's state: the warm-start Qs and the random stream are everyone's; the error memories
        (what its own gradients lost) are its own: this worker's start empty."""
        self.load_state_dict({**state, "compressor": {**state["compressor"], "errors": {}}})

    def given_up(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
        return ["every other worker's PowerSGD error memories"] if state["compressor"]["errors"] else []


register(MethodSpec("powersgd", PowerSGD, "PowerSGD", "PowerSGD on DDP's gradient buckets: rank-r compression with "
                    "error feedback and warm start", options=PowerSGDConfig, bucket_cap=True, order=40, bench=2,
                    short_run_args=("--powersgd-warmup-steps", "2")))
