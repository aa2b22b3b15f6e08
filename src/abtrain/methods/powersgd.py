"""PowerSGD: DDP whose gradient buckets are compressed to rank-r factors P and Q before the all-reduce.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), with the arithmetic of torch's DDP
communication hook (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``,
``PowerSGDState`` and ``powerSGD_hook``, without the optional same-shape
batching): error feedback, warm start, seeded random Qs, the same
compression rule, orthogonalisation and order of operations, so the same bits.
The math is :class:`~abtrain.reducers.PowerSGDReducer`, handed each DDP bucket by
:class:`~abtrain.ddp_hook.ReducerHook`; its three all-reduces (uncompressed
tensors, the Ps, the Qs) go through the communicator, so the ledger holds, per
compressed step, exactly the ``numel_after_compression`` elements: the
uncompressed tensors plus every P and Q. The first ``start_iter`` steps are
plain averaged all-reduces of the buckets (phase ``warmup``); compressed steps
are phase ``train``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..comm import Communicator
from ..reducers import PowerSGDReducer, Reducer
from ..topology import Topology
from ..validate import check_types
from .ddp import DDPMethod


@dataclass
class PowerSGDConfig:
    """Options of PowerSGD; the CLI exposes each as ``--powersgd-<name>``."""

    rank: int = field(default=4, metadata={"help": "rank r of the P and Q factors of each compressed gradient matrix (matrix_approximation_rank)"})
    start_iter: int = field(default=10, metadata={"help": "plain all-reduce for the first steps, PowerSGD from this step on (start_powerSGD_iter, > 1)"})
    min_compression_rate: float = field(default=2.0, metadata={"help": "compress a matrix only when (rows + cols) * r * this < rows * cols"})
    orthogonalization_epsilon: float = field(default=0.0, metadata={"help": "added to column norms in the orthogonalisation (e.g. 1e-8 against all-zero gradients)"})
    seed: int = field(default=0, metadata={"help": "seed of the random initial Qs (the same on every worker)"})

    def __post_init__(self) -> None:
        check_types(self, "--powersgd-")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"--powersgd-rank must be a positive integer, got {self.rank!r}")
        # As torch's PowerSGDState: DDP rebuilds its buckets after the first step, and the random Qs
        # are drawn per bucket, so compression starts once the buckets are final.
        if isinstance(self.start_iter, bool) or not isinstance(self.start_iter, int) or self.start_iter < 2:
            raise ValueError(f"--powersgd-start-iter must be an integer >= 2 (DDP rebuilds its buckets after "
                             f"the first step), got {self.start_iter!r}")
        if not self.min_compression_rate > 0:
            raise ValueError(f"--powersgd-min-compression-rate must be > 0, got {self.min_compression_rate}")
        if not self.orthogonalization_epsilon >= 0:
            raise ValueError(f"--powersgd-orthogonalization-epsilon must be >= 0, got {self.orthogonalization_epsilon}")


class PowerSGD(DDPMethod):
    """torch DDP with PowerSGD-compressed buckets, every all-reduce counted (phases ``warmup`` then ``train``).

    ``use_error_feedback`` and ``warm_start`` (both on, as torch recommends)
    are keyword arguments of the Python API only.
    """

    name = "powersgd"

    def __init__(self, comm: Communicator, topo: Topology, config: PowerSGDConfig | None = None,
                 bucket_cap_mb: float = 25.0, use_error_feedback: bool = True, warm_start: bool = True,
                 **options: Any) -> None:
        super().__init__(comm, topo, bucket_cap_mb=bucket_cap_mb)
        self.cfg = config if config is not None else PowerSGDConfig(**options)
        self.compressor = PowerSGDReducer(
            comm, self.cfg.rank, min_compression_rate=self.cfg.min_compression_rate,
            error_feedback=use_error_feedback, warm_start=warm_start,
            orthogonalization_epsilon=self.cfg.orthogonalization_epsilon, seed=self.cfg.seed)
        self.iter = 0  # backward passes whose buckets were all reduced

    @property
    def phase(self) -> str:
        return "warmup" if self.iter < self.cfg.start_iter else "train"

    def bucket_reducer(self) -> Reducer:
        return self.reducer if self.phase == "warmup" else self.compressor

    def after_backward(self) -> None:
        self.iter += 1

    def after_step(self, optimizer: Any) -> None:
        # The hook has counted this step (iter): label the next step's traffic.
        self.comm.ledger.phase = self.phase

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
