"""What every part of AB-training shares: its state, built once, the schedule it reads and the roles.

:class:`ABCore` is the base of the parts that :class:`~.method.ABTraining` puts
together (:mod:`.decomposition`, :mod:`.sync`, :mod:`.consensus`); every
attribute any of them reads or writes is created in its ``__init__``.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch
from torch import nn

from . import lowrank
from ...comm.communicator import Communicator
from ...comm.topology import Topology
from .dense import build_dense_reducer
from ...compress.powersgd import PowerSGDReducer
from ...compress.wire import WIRE_DTYPES
from ..base import Method, optimizer_moments
from .buckets import OverlappedAverage
from .config import ABConfig, check_topology
from .schedule import Schedule

log = logging.getLogger(__name__)

LOSS_JUMP = 1.5  # a truncation that lifts the training loss by this factor is reported
LOSS_WINDOW = 10  # steps of training loss compared before and after a truncation


class ABCore(Method):
    """AB-training's state and schedule; :class:`~.method.ABTraining` is the method."""

    def __init__(self, comm: Communicator, topo: Topology, config: ABConfig | None = None, **options: Any) -> None:
        super().__init__(comm, topo)
        self.cfg = config if config is not None else ABConfig(**options)
        self.verbose = not self.cfg.quiet
        check_topology(self.cfg, topo.world_size, topo.group_size, cli=config is not None)
        only_b = self.cfg.sync == "only-b"
        # only-b over "world": one group of all workers, low-rank DP on B every step. The ledger's
        # scopes still follow the physical groups (topo.world crosses them); only the reduction widens.
        self.train_group = topo.world if only_b and self.cfg.only_b_groups == "world" else topo.group
        self.dense = build_dense_reducer(self.cfg.dense_comm, comm, rank=self.cfg.powersgd_rank,
                                   powersgd_dtype=self.cfg.powersgd_dtype)
        self.overlap = OverlappedAverage(comm)  # AB steps: in-group averaging started during backward
        self.wire_dtype = WIRE_DTYPES[self.cfg.sync_dtype]
        num_a_groups = max(1, topo.num_groups // 2)
        self.role = "B" if only_b else ("A" if topo.group_index < num_a_groups else "B")
        self.a_ranks = list(range(num_a_groups * topo.group_size))
        self.records: list[lowrank.FactorizedParam] = []
        self.kept: list[str] = []  # layers kept full rank because they produce the model's output
        self.excluded: list[tuple[str, str]] = []  # weights never factorised, and why (prepare_model)
        self.others = 0  # parameters below 2 dims (biases, norms): trained as they are
        self.t = 0  # optimizer steps taken
        self.schedule: Schedule | None = None
        self._switch_step: int | None = None  # step of the last phase switch, for the LR rebound
        self._saved_lrs: list[float] = []
        self._output_hook: Any = None
        self.output_searched = False  # the first training forward looked for the output layer
        self._losses: collections.deque[float] = collections.deque(maxlen=LOSS_WINDOW)
        self._cut: tuple[int, float] | None = None  # (step, loss level) of the last truncation, while watched
        self._said_lines: list[str] = []  # the per-layer decisions rank 0 printed last
        self._capped_said: set[str] = set()  # layers whose rank cap rank 0 has explained
        self._said_same = False  # rank 0 said that a decomposition left every layer as before, and since then none changed
        self._agreed_at: int | None = None  # step at which consensus() last brought the workers together
        self._optimizer: torch.optim.Optimizer | None = None  # the attached one (consensus() syncs its moments)
        self.ranks: list[dict[str, Any]] = []
        self.svd_seconds = 0.0
        self.sync_seconds = 0.0
        self.syncs = 0  # syncs so far, consensus() and the last one included
        self.ratio: float | None = None
        # optimizer_state="map": this worker's frozen factors as they were at the last sync, by layer
        self._frozen: dict[str, torch.Tensor] = {}
        # split="tangent": each low-rank layer's singular vectors its frozen factor does not hold (U or Vᵀ), and σ
        self._bases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # sync_payload="lowrank": PowerSGD on the summed change of W, its error memories and warm-start Qs
        self._compressor = (PowerSGDReducer(comm, rank=self.cfg.sync_rank, min_compression_rate=1.0,
                                            orthogonalization_epsilon=1e-8, wire_dtype=self.wire_dtype,
                                            keep_factors=self.cfg.svd == "update",
                                            error_dtype=WIRE_DTYPES[self.cfg.sync_memory_dtype])
                            if self.cfg.sync_payload == "lowrank" else None)
        # svd="update": each layer's W as the SVD its phase started from plus the sync's rank-q change, from the
        # sync to the decomposition that follows it in the same step (never across a step, so never checkpointed)
        self._parts: dict[str, lowrank.LowRankSum] = {}
        self.svd_counts = {"full": 0, "updated": 0}
        if not self.cfg.needs_budget:
            self.set_total_steps(None)

    def set_total_steps(self, total_steps: int | None) -> None:
        """Fix the schedule for a run of ``total_steps`` optimizer steps (None: absolute options only)."""
        self.schedule = Schedule.from_config(self.cfg, total_steps)
        self.say(f"AB-training schedule: {self.schedule.describe()} ({self.topo.num_groups} groups of "
                 f"{self.topo.group_size} workers)")
        if self.topo.rank == 0 and total_steps is not None:
            sched = self.schedule
            if sched.warmup >= total_steps:
                log.warning("AB-training: the warm-up (%d steps) fills the whole run of %d steps: no AB phase",
                            sched.warmup, total_steps)
            elif sched.syncs() < 3:
                log.warning("AB-training: %s (fewer than 3 syncs: little of the method runs)", sched.describe())

    def _sched(self) -> Schedule:
        if self.schedule is None:
            self.schedule = Schedule.from_config(self.cfg, None)  # raises with what to do
        return self.schedule

    def phase_at(self, t: int) -> str:
        """Phase of optimizer step ``t`` (0-based)."""
        return self._sched().phase_at(t)

    @property
    def phase(self) -> str:
        return self.phase_at(self.t)

    def ends_local_phase(self) -> bool:
        """dense_comm="local": the step just taken (``t - 1``) was a full-rank step each worker took alone."""
        return self.cfg.dense_comm == "local" and self.t > 0 and self.phase_at(self.t - 1) != "ab"

    def apart_locally(self) -> bool:
        """dense_comm="local", inside a warm-up or rebound after its first step: each worker's steps were its own,
        and no average (:meth:`_average_local`) has brought the workers together since."""
        return self.ends_local_phase() and self.phase != "ab" and self._agreed_at != self.t

    @torch.no_grad()
    def _average_local(self, optimizer: torch.optim.Optimizer) -> None:
        """dense_comm="local": the full-rank steps since the last sync were each worker's own. One all-reduce over
        every worker averages the model (parameters and floating-point buffers, in the sync's wire dtype), one
        inside each group the optimizer's moments, so that the decomposition that follows starts from one W and
        the workers of a group, which average their gradients from then on, step alike."""
        with torch.profiler.record_function("abtrain::ab::average_local"), self.comm.ledger.in_phase("sync"):
            params = full_rank_tensors(self.module, self.records)  # a full-rank phase trains no factor
            buffers = [b for b in self.module.buffers() if b.is_floating_point()]
            self.comm.all_reduce_tensors(params + buffers, self.topo.world, wire_dtype=self.wire_dtype)
            moments = optimizer_moments(optimizer, params)
            if moments and self.train_group.size > 1:
                self.comm.all_reduce_tensors(moments, self.train_group, wire_dtype=self.wire_dtype)
        self._agreed_at = self.t
        self.note_state_change()

    def _trained_role(self) -> str:
        return "B" if self.cfg.sync == "only-b" else self.role

    def _basis(self, fp: lowrank.FactorizedParam) -> lowrank.SVD:
        """The SVD the layer's phase started from, (U, σ, Vᵀ), from the kept singular vectors and the frozen
        factor (copied: the sync overwrites the factors before the merge reads the basis)."""
        vectors, sigma = self._bases[fp.name]
        if self._trained_role() == "A":
            return lowrank.SVD(vectors, sigma, fp.B.detach().clone())
        return lowrank.SVD(fp.A.detach().clone(), sigma, vectors)


def full_rank_tensors(module: nn.Module, records: list[lowrank.FactorizedParam]) -> list[torch.Tensor]:
    """Parameters not represented by factors this phase (full-mode W, biases, norms, kept layers)."""
    factor_ids = {id(t) for fp in records for t in (fp.A, fp.B)}
    low_ids = {id(fp.weight) for fp in records if fp.mode == "lowrank"}
    return [p for p in module.parameters() if id(p) not in factor_ids and id(p) not in low_ids]
