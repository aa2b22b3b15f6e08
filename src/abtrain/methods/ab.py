"""AB-training: independent groups train low-rank factors A or B, periodic sync, full-rank rebound.

A context manager around the user's optimizer. The schedule is counted in
optimizer steps ``t`` and, by default, scales with the run (the fractions of
:class:`ABConfig`; absolute steps are options):

* ``t < T_w``: full-rank DP over all workers (phase ``warmup``).
* ``t == T_w``: every factorisable weight is split by SVD into A·B (full rank
  the first time), phase ``ab`` starts: A-groups train A, B-groups train B,
  gradients averaged inside the group only.
* at every multiple of K after ``T_w``: sync (phase ``sync``: factors and
  full-rank parameters averaged over all workers, W = Ā·B̄), then F steps of
  full-rank DP (phase ``rebound``), then a truncated decomposition and AB
  steps until the next multiple of K. With F = 0 the sync and the truncated
  decomposition follow each other at once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .. import lowrank
from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.dense import build_reducer
from ..compress.powersgd import PowerSGDReducer
from ..compress.wire import WIRE_DTYPES
from ..grad_buckets import OverlappedAverage
from .ab_config import TANGENT_CORES, ABConfig, check_topology, default_group_size, group_layout
from .ab_schedule import Schedule, check_run
from .ab_sync import average_models, full_rank_tensors
from .base import Method, optimizer_moments
from .memory import moments_per_element
from .registry import MethodSpec, register

log = logging.getLogger(__name__)

__all__ = ["ABConfig", "ABTraining", "Schedule", "check_topology", "default_group_size"]

LOSS_JUMP = 1.5  # a truncation that lifts the training loss by this factor is reported
LOSS_WINDOW = 10  # steps of training loss compared before and after a truncation


class ABTraining(Method):
    """AB-training around the user's optimizer. See the module docstring for the schedule."""

    name = "ab"
    averages_gradients = True

    def __init__(self, comm: Communicator, topo: Topology, config: ABConfig | None = None, **options: Any) -> None:
        super().__init__(comm, topo)
        self.cfg = config if config is not None else ABConfig(**options)
        self.verbose = not self.cfg.quiet
        check_topology(self.cfg, topo.world_size, topo.group_size, cli=config is not None)
        only_b = self.cfg.sync == "only-b"
        # only-b over "world": one group of all workers, low-rank DP on B every step. The ledger's
        # scopes still follow the physical groups (topo.world crosses them); only the reduction widens.
        self.train_group = topo.world if only_b and self.cfg.only_b_groups == "world" else topo.group
        self.rule = self.cfg.rank_rule()
        self.dense = build_reducer(self.cfg.dense_comm, comm, rank=self.cfg.powersgd_rank,
                                   powersgd_dtype=self.cfg.powersgd_dtype)
        self.plain = build_reducer("fp32", comm)  # the first dense_start_steps steps
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
                                            keep_factors=self.cfg.svd == "update")
                            if self.cfg.sync_payload == "lowrank" else None)
        # svd="update": each layer's W as the SVD its phase started from plus the sync's rank-q change, from the
        # sync to the decomposition that follows it in the same step (never across a step, so never checkpointed)
        self._parts: dict[str, lowrank.LowRankSum] = {}
        self.svd_counts = {"full": 0, "updated": 0}
        if not self.cfg.needs_budget:
            self.set_total_steps(None)

    # -- schedule --------------------------------------------------------
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

    # -- preparation -------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        model = self.unwrap(model)  # torch.compile's or DDP's wrapper: its module is factorised
        self.records = lowrank.prepare_model(model, full_rank_patterns=self.cfg.patterns, min_rank=self.cfg.min_rank,
                                             apply=self.cfg.linear_apply, excluded=self.excluded)
        factorisable = {id(p) for fp in self.records for p in (fp.weight, fp.A, fp.B)} | {
            id(p) for name, p in model.named_parameters() if any(name == e for e, _ in self.excluded)}
        self.others = sum(1 for p in model.parameters() if id(p) not in factorisable)
        if self.cfg.init == "ortho-sigma":
            lowrank.ortho_sigma_init(self.records)
        lowrank.set_trainable(self.records, "full")
        if self.cfg.keep_output:
            self._output_hook = model.register_forward_hook(self._find_output_layer)
        return super().prepare(model)

    def _find_output_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        """At the first training forward: keep the layer(s) producing the output full rank from now on."""
        if not (module.training and torch.is_grad_enabled()):
            return
        self._stop_output_search()
        found = lowrank.output_weights(output, self.records)
        self.kept = [fp.name for fp in found]
        for fp in found:
            fp.param.note = "produces the model's output"
        if found:
            self.say(f"AB-training: keeping {', '.join(self.kept)} full rank: "
                     f"{'it produces' if len(found) == 1 else 'they produce'} the model's output "
                     f"(keep_output=False / --ab-no-keep-output factorises it)")

    def _stop_output_search(self) -> None:
        self.output_searched = True
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None

    def _kept_records(self) -> list[lowrank.FactorizedParam]:
        return [fp for fp in self.records if fp.name in self.kept]

    # -- the hooks ----------------------------------------------------------
    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """A warm-up of 0 steps: decompose before the first forward."""
        self._sched()
        self._optimizer = optimizer
        if self.t == 0 and self.phase_at(0) == "ab" and not self.ranks:
            self._decompose(optimizer, truncate=self.cfg.truncate_first)
            self._switch_step = 0
        self._watch_gradients()

    def reduce_gradients(self) -> None:
        """Average this step's gradients over the workers the phase requires (idempotent per step)."""
        if self._reduced:
            return
        self._reduced = True
        if self.phase == "ab":
            self.overlap.finish()  # idle when the workers train alone (independent)
        else:
            reducer = self.plain if self.t < self.cfg.dense_start_steps else self.dense
            reducer.reduce([(n, p.grad) for n, p in self.module.named_parameters() if p.grad is not None],
                           self.topo.world)

    def _watch_gradients(self) -> None:
        """Arm the in-group averaging for the coming step when it is an AB step (its trained tensors may be new)."""
        in_group = self.phase == "ab" and not self.cfg.independent and self.train_group.size > 1
        if in_group and self.module is not None:
            self.overlap.watch([p for p in self.module.parameters() if p.requires_grad])
        self.overlap.start(self.train_group if in_group else None)

    def _unhook(self) -> None:
        super()._unhook()
        self.overlap.close()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside the block: no bucket of the in-group averaging starts."""
        with super().no_sync():
            self.overlap.paused = True
            try:
                yield
            finally:
                self.overlap.paused = False

    def _resumed(self) -> None:
        if self._attached is not None:  # the restored step may be an AB step: arm its in-group averaging
            self._optimizer = self._attached[0]
            self._watch_gradients()

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.reduce_gradients()
        self._saved_lrs = [g["lr"] for g in optimizer.param_groups]
        scale = self.lr_scale()
        if scale < 1.0:
            for g in optimizer.param_groups:
                g["lr"] = self.cfg.lr_floor + (g["lr"] - self.cfg.lr_floor) * scale

    def lr_scale(self) -> float:
        """Linear ramp from the floor back to the scheduled LR over R steps after each phase switch."""
        R = self._sched().lr_rebound
        if R == 0 or self._switch_step is None:
            return 1.0
        return min(1.0, (self.t - self._switch_step + 1) / R)

    def observe_loss(self, value: float) -> None:
        """Watch the training loss around truncations; rank 0 reports a cut that lifts it well above its level."""
        self._losses.append(value)
        if self._cut is None or self.t - self._cut[0] < LOSS_WINDOW:
            return
        step, level = self._cut
        after = sum(self._losses) / len(self._losses)
        self._cut = None
        if self.topo.rank == 0 and after > LOSS_JUMP * level:
            log.warning("AB-training: the training loss rose from %.4f to %.4f over the %d steps after the truncation "
                        "at step %d (compression %s); a smaller --ab-tau or a larger --ab-min-rank cuts less",
                        level, after, LOSS_WINDOW, step, lowrank.format_ratio(self.ratio or 1.0))

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        for g, lr in zip(optimizer.param_groups, self._saved_lrs):
            g["lr"] = lr  # the user's schedule continues from its own value
        self.t += 1
        if any(fp.mode == "lowrank" for fp in self._kept_records()):
            self._keep_output_full()
        sync, decompose = self._sched().events(self.t)
        decompose = decompose and self._sched().decomposes_at(self.t)
        if sync:
            self._sync(optimizer)
        if decompose:
            self._decompose(optimizer, truncate=self.cfg.truncate_first or bool(self.ranks))
        self._parts = {}  # W changes at the next step
        if sync or decompose or self.phase_at(self.t) != self.phase_at(self.t - 1):
            self._switch_step = self.t
        self._watch_gradients()

    @torch.no_grad()
    def _keep_output_full(self) -> None:
        """Warm-up 0 found the output layer after decomposing it: W = A·B (exact at full rank), trained full."""
        for fp in self._kept_records():
            if fp.mode == "lowrank":
                lowrank.recompose(fp)
                fp.param.note = "produces the model's output"
        lowrank.set_trainable(self.records, self._trained_role())

    def _sigma_in(self) -> str:
        """split="sigma": the factor that holds the singular values, the same on every worker.

        The sync multiplies one group's A by another group's B, so every group must
        split W the same way: σ in A (the factor the A-groups train), or in B with
        only-b, where B is the factor every worker trains. split="tangent" does the
        opposite on purpose: σ in the factor this worker trains, the sync merging
        the two splits through the kept SVD (:meth:`_keep_bases`).
        """
        if self.cfg.split == "tangent":
            return self._trained_role()
        return "B" if self.cfg.sync == "only-b" else "A"

    def _split(self) -> str:
        """The split handed to the decomposition: tangent is sigma with σ in the factor this worker trains."""
        return "sigma" if self.cfg.split == "tangent" else self.cfg.split

    def _keep_bases(self, records: list[lowrank.FactorizedParam], svds: list[lowrank.SVD]) -> None:
        """split="tangent": what the next sync's merge needs of the SVD (U, σ, Vᵀ) each low-rank layer started from.

        The frozen factor already is Vᵀ (A-workers) or U (B-workers), so only the other singular vectors and σ
        are kept: a copy of one factor, not of the whole SVD (:meth:`_basis` puts the three together at the
        sync). Every worker then holds the same U, σ and Vᵀ bit for bit, so every merge gives the same W."""
        if self.cfg.split == "tangent":
            a_role = self._trained_role() == "A"
            self._bases = {fp.name: ((s.U[:, :fp.rank] if a_role else s.Vh[:fp.rank]).clone(), s.S[:fp.rank].clone())
                           for fp, s in zip(records, svds) if fp.mode == "lowrank"}

    def _basis(self, fp: lowrank.FactorizedParam) -> lowrank.SVD:
        """The SVD the layer's phase started from, (U, σ, Vᵀ), from the kept singular vectors and the frozen
        factor (copied: the sync overwrites the factors before the merge reads the basis)."""
        vectors, sigma = self._bases[fp.name]
        if self._trained_role() == "A":
            return lowrank.SVD(vectors, sigma, fp.B.detach().clone())
        return lowrank.SVD(fp.A.detach().clone(), sigma, vectors)

    def _svd(self, fp: lowrank.FactorizedParam) -> lowrank.SVD:
        """W's SVD: updated from the parts the sync left (svd="update") where they hold and check out, else full.

        An updated SVD holds r+q singular vectors, enough for every cut that can follow: a rank rule finds no more
        than r+q nonzero singular values, agree() keeps r, and the untruncated first decomposition has no parts."""
        parts = self._parts.pop(fp.name, None)
        if parts is not None:
            usv = lowrank.svd_update(fp, parts)
            if usv is not None:
                self.svd_counts["updated"] += 1
                return usv
        self.svd_counts["full"] += 1
        return lowrank.svd(fp)

    def _cap_ranks(self, records: list[lowrank.FactorizedParam], chosen: list[int | None],
                   optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Lower each chosen rank (None: full) to --ab-rank-cap's bound, in place; the rank each capped layer's
        rule chose, by name. The bound depends on the shape and the optimizer only, so every worker agrees."""
        if self.cfg.rank_cap == "none":
            return {}
        moments = moments_per_element(optimizer)
        capped = {}
        for i, fp in enumerate(records):
            wanted = chosen[i] if chosen[i] is not None else min(fp.m, fp.n)
            cap = self._rank_cap(fp, moments)
            if wanted > cap:
                chosen[i], capped[fp.name] = cap, wanted
        return capped

    def _rank_cap(self, fp: lowrank.FactorizedParam, moments: int) -> int:
        """The most rank --ab-rank-cap lets the layer keep (never below the rank floor)."""
        if self.cfg.rank_cap == "pays":
            cap = lowrank.paying_rank(fp.m, fp.n)
        else:  # the warm-start Qs the layer keeps too: the sync compressor's and the full-rank phases' PowerSGD's
            qs = [(self.cfg.sync_rank, self._compressor is not None),
                  (self.cfg.powersgd_rank, self.cfg.dense_comm == "powersgd")]
            cap = lowrank.state_rank(fp.m, fp.n, moments, memory=self._compressor is not None,
                                     extra=sum(q * fp.n for q, used in qs if used))
        return max(cap, min(self.cfg.min_rank, fp.m, fp.n))

    def _say_capped(self, records: list[lowrank.FactorizedParam], capped: dict[str, int]) -> None:
        """Rank 0 says, once per layer, the first time the cap lowers its rank, and why."""
        for fp in records:
            wanted = capped.get(fp.name)
            if wanted is None or fp.mode != "lowrank" or fp.name in self._capped_said:
                continue
            self._capped_said.add(fp.name)
            why = (f"factors of rank {wanted} would hold {wanted * (fp.m + fp.n)} numbers, W {fp.m * fp.n}"
                   if self.cfg.rank_cap == "pays" else
                   "a higher rank would hold more training state than DDP holds for W")
            self.say(f"AB-training: {fp.name} at rank {fp.rank}, not the {wanted} its rule chose: {why} "
                     "(--ab-rank-cap)")

    def _trained_role(self) -> str:
        return "B" if self.cfg.sync == "only-b" else self.role

    # -- decomposition and sync -----------------------------------------
    def _decompose(self, optimizer: torch.optim.Optimizer, truncate: bool) -> None:
        start = time.perf_counter()
        records = [fp for fp in self.records if fp.name not in self.kept]
        with torch.profiler.record_function("abtrain::ab::decompose"), self.comm.ledger.in_phase("sync"):
            svds = [self._svd(fp) for fp in records]
            if truncate:
                floor = [min(self.cfg.min_rank, int(s.S.numel())) for s in svds]
                ranks = torch.tensor([max(f, self.rule.choose(s.S)) for f, s in zip(floor, svds)],
                                     dtype=torch.int64, device=self.topo.device)
                # Every worker must use the same rank per layer.
                self.comm.all_reduce(ranks, self.topo.world, op="max")
                chosen: list[int | None] = [int(r) for r in ranks.tolist()]
                min_compression = self.cfg.min_compression
            else:
                chosen = [None] * len(records)
                min_compression = None
            capped = self._cap_ranks(records, chosen, optimizer)
            if self.cfg.optimizer_state == "reset":
                lowrank.reset_state(optimizer, [t for fp in records for t in (fp.A, fp.B)])
            self._factorise(records, chosen, svds, optimizer, min_compression)
            self._say_capped(records, capped)
        self.svd_seconds += time.perf_counter() - start
        self.ratio = lowrank.compression_ratio(self.module, self.records)
        self.ranks.append({"step": self.t, "layers": {fp.name: (fp.rank if fp.mode == "lowrank" else None)
                                                      for fp in self.records},
                           "compression_ratio": self.ratio,
                           "model_params": lowrank.ab_param_count(self.module, self.records)})
        fell = len(self.ranks) > 1 and any((r or 0) < (self.ranks[-2]["layers"].get(name) or 0)
                                           for name, r in self.ranks[-1]["layers"].items())
        if truncate and fell and self._losses:  # a loss that rises after a cut that dropped nothing is not the cut's
            self._cut = (self.t, sum(self._losses) / len(self._losses))
            self._losses.clear()
        # The per-layer lines when they change (the first decomposition, a new rank); else one line, once, until
        # something changes again (a sync every few steps would otherwise print a line each time).
        head = f"AB-training: decomposition at step {self.t} (compression {lowrank.format_ratio(self.ratio)})"
        lines = lowrank.decision_lines(self.records) + [f"{name}: full rank: {why}" for name, why in self.excluded]
        if self.others:
            lines.append(f"{self.others} parameter{'s' if self.others > 1 else ''} of fewer than 2 dims (biases, "
                         f"norms): trained as they are")
        if lines == self._said_lines:
            if not self._said_same:
                self.say(head + ", every layer as before (the next decompositions that change nothing are not "
                                "printed; results.json lists every one)")
                self._said_same = True
        else:
            self.say(head)
            for line in lines:
                self.say("  " + line)
            self._said_lines = lines
            self._said_same = False

    def _factorise(self, records: list[lowrank.FactorizedParam], ranks: list[int | None], svds: list[lowrank.SVD],
                   optimizer: torch.optim.Optimizer, min_compression: float | None) -> None:
        """Split each layer at its agreed rank, this worker's factor trainable, the tangent bases kept."""
        lowrank.decompose_all(records, ranks, svds, min_compression=min_compression, split=self._split(),
                              sigma_in=self._sigma_in(), optimizer=optimizer, moments_against=self._take_frozen(),
                              # the tangent split's frozen factor is U or Vᵀ, its own pseudo-inverse; only svd="update"
                              # (which needs that split) skips the pinv, so that full-SVD runs keep their rounding
                              frozen_orthonormal=self.cfg.svd == "update")
        lowrank.set_trainable(self.records, self._trained_role())
        self._keep_bases(records, svds)
        self.note_state_change()
        sched = self._sched()
        if sched.rebound == 0 and sched.final_rebound == 0:
            # No full-rank step follows: W's optimizer state (from the warm-up) would never be read again.
            # A layer that later trains W again (a gate keeps it full rank) starts its moments afresh.
            lowrank.reset_state(optimizer, [fp.weight for fp in records if fp.mode == "lowrank"])
        self.dense.reset()  # the full-rank phase's error memories: the next one starts afresh after a sync anyway

    def _take_frozen(self) -> dict[str, tuple[str, torch.Tensor]]:
        """For optimizer_state="map": the factor each layer trained and the frozen one it was trained against,
        handed to the decomposition that follows the sync and forgotten here."""
        role = self._trained_role()
        against = {name: (role, frozen) for name, frozen in self._frozen.items()}
        self._frozen = {}
        return against

    @torch.no_grad()
    def _sync(self, optimizer: torch.optim.Optimizer, last: bool = False) -> None:
        """Average the groups into one model; ``last``: no sync follows in this run."""
        start = time.perf_counter()
        self.syncs += 1
        self.note_state_change()
        low = [fp for fp in self.records if fp.mode == "lowrank"]
        if self.cfg.optimizer_state == "map":
            self._frozen = {fp.name: (fp.B if self._trained_role() == "A" else fp.A).detach().clone() for fp in low}
        with torch.profiler.record_function("abtrain::ab::sync"), self.comm.ledger.in_phase("sync"):
            buffers = [b for b in self.module.buffers() if b.is_floating_point()]
            full = full_rank_tensors(self.module, self.records)
            if self.cfg.optimizer_state == "reset":
                lowrank.reset_state(optimizer, full + [fp.weight for fp in low])
            # Parameters trained during the AB phase on every worker (full-rank ones)
            # carry group-specific optimizer moments: average them too, so that the
            # rebound that follows is exact data parallelism with one model everywhere.
            rest = full + buffers + (optimizer_moments(optimizer, full) if self.cfg.sync_moments else [])
            # tangent: Ā and B̄ were trained against different splits of one SVD; W adds their changes to it
            bases = ({fp.name: self._basis(fp) for fp in low if fp.name in self._bases}
                     if self.cfg.sync == "only-learned" else {})
            changes = average_models(self.comm, self.topo.world, self.cfg.sync, low, rest, buffers, self.wire_dtype,
                                     in_a=self.topo.rank in self.a_ranks, n_a=len(self.a_ranks),
                                     one_group=self.train_group is self.topo.world and not self.cfg.independent,
                                     as_change=self._send_as_change(low, bases), compressor=self._compressor,
                                     flush=self.cfg.sync_flush and (last or not self._sched().ab_after(self.t)))
            self.dense.reset()  # a new full-rank phase: error memories of the last one are stale
            factors = self._compressor.take_factors() if self._compressor is not None else {}
            core = TANGENT_CORES[self.cfg.tangent_core]
            for fp in low:
                if fp.mode != "lowrank":
                    continue
                if fp.name in factors and fp.name in bases:  # svd="update": W from its parts, kept for the SVD
                    self._parts[fp.name] = lowrank.tangent_parts(bases[fp.name], *factors[fp.name], core)
                    lowrank.recompose(fp, parts=self._parts[fp.name])
                else:
                    lowrank.recompose(fp, bases.get(fp.name), changes.get(fp.name), core=core)
            self._bases = {}
            lowrank.set_trainable(self.records, "full")
        self.sync_seconds += time.perf_counter() - start

    def _send_as_change(self, low: list[lowrank.FactorizedParam],
                        bases: dict[str, lowrank.SVD]) -> dict[str, lowrank.SVD]:
        """The tangent layers that send their change of W, with the SVD each started from: with
        sync_payload="smaller" those whose change (m·n numbers) is smaller than their factors (r·(m + n));
        with "lowrank" also every layer the compressor takes (q·(m + n) < m·n), whatever its rank, so that
        what its memory holds is sent at a later sync."""
        if self.cfg.sync_payload == "factors":
            return {}
        compressor = self._compressor
        return {fp.name: bases[fp.name] for fp in low
                if fp.name in bases and (fp.m * fp.n < fp.rank * (fp.m + fp.n)
                                         or (compressor is not None and compressor.rank_for(fp.m, fp.n) is not None))}

    @torch.no_grad()
    def export(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The plain state_dict (:meth:`Method.export`), the same bits on every worker where they agree.

        Right after a decomposition the tangent split holds W as (U·σ)·Vᵀ on A-workers and U·(σ·Vᵀ) on
        B-workers, equal up to rounding; every worker then exports (U·σ)·Vᵀ from the singular vectors they all
        hold bit for bit, so a loop that ends in consensus() ends with one model."""
        state = super().export(model)
        if self._bases and self.t in (self._switch_step, self._agreed_at) and model in (None, self.module):
            for fp in self.records:
                if fp.mode == "lowrank" and fp.name in self._bases and fp.name in state:
                    u, sigma, vh = self._basis(fp)
                    state[fp.name] = ((u * sigma) @ vh).reshape(fp.shape).to(state[fp.name].dtype)
        return state

    def in_consensus(self) -> bool:
        # Workers differ only while groups train apart: inside an AB phase after its first step.
        if self.phase != "ab" or self.t in (self._switch_step, self._agreed_at):
            return True
        return self.train_group is self.topo.world and not self.cfg.independent

    @torch.no_grad()
    def agree(self) -> None:
        """Inside an AB phase: a sync now, then every layer factorised again at the rank it had.

        The sync (the configured ``sync`` mode) leaves W = Ā·B̄ on every worker.
        Training W inside the groups for the rest of the phase would be wrong, so
        the layers that were low rank are split again at their current ranks and
        the phase goes on: A-groups train A, B-groups train B, from one model.
        Ā·B̄ has rank <= r, so that split is exact (with ``sync="full"``, and
        with ``split="tangent"``, whose merge has rank <= 2r, W is cut back to r,
        as at a scheduled truncation). With ``split="tangent"`` the A- and
        B-groups hold U·σ | Vᵀ and U | σ·Vᵀ of that one W, so their A·B agree up
        to the rounding of the two products, not bit for bit. The schedule
        does not move: the next sync still falls at the next multiple of K, no
        LR ramp starts, ranks are not re-chosen. Factor moments are kept as at
        every re-decomposition (``optimizer_state``).
        """
        optimizer = self._optimizer
        if optimizer is None:
            raise ValueError("consensus() inside an AB phase needs the optimizer: call method.attach(opt) first")
        ranks = {fp.name: fp.rank for fp in self.records if fp.mode == "lowrank"}
        self._sync(optimizer)
        low = [fp for fp in self.records if fp.name in ranks]
        start = time.perf_counter()
        with torch.profiler.record_function("abtrain::ab::decompose"):
            self._factorise(low, [ranks[fp.name] for fp in low], [self._svd(fp) for fp in low], optimizer, None)
        self.svd_seconds += time.perf_counter() - start
        self._agreed_at = self.t

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """End inside an AB phase with a last sync, so that every worker holds the same full-rank model."""
        if not self.in_consensus():
            self._sync(optimizer, last=True)
            self._parts = {}  # no decomposition follows
            self._switch_step = self.t
        elif self._bases and self.phase == "ab":
            self._settle_tangent()

    @torch.no_grad()
    def _settle_tangent(self) -> None:
        """split="tangent", ending right after a decomposition: the groups hold U·σ | Vᵀ and U | σ·Vᵀ, whose
        products differ in the last bits; every worker leaves with W = (U·σ)·Vᵀ of the one SVD they share
        (the tangent merge of a phase in which neither group has changed W yet)."""
        for fp in self.records:
            if fp.name in self._bases and fp.mode == "lowrank":
                lowrank.recompose(fp, self._basis(fp), fp.weight.new_zeros(fp.shape))
        self._bases = {}
        lowrank.set_trainable(self.records, "full")

    def extra_results(self) -> dict[str, Any]:
        sched = self._sched()
        return {
            "compression_ratio": self.ratio,
            **({"model_params": self.ranks[-1]["model_params"]} if self.ranks else {}),
            "ranks": self.ranks,
            "phases": sched.ranges(self.t),
            "schedule": {"warmup_steps": sched.warmup, "cycle_steps": sched.cycle, "rebound_steps": sched.rebound,
                         "lr_rebound_steps": sched.lr_rebound, "final_rebound_steps": sched.final_rebound},
            "kept_output_layers": self.kept,
            "svd_seconds": self.svd_seconds,
            "svd_counts": dict(self.svd_counts),
            "sync_seconds": self.sync_seconds,
            "syncs": self.syncs,
            "role": self.role,
        }

    def state_dict(self) -> dict[str, Any]:
        """Schedule position, ranks and timers. Factors, W and the layers' modes live in the model's state_dict."""
        return {"t": self.t, "switch_step": self._switch_step, "ranks": self.ranks, "role": self.role,
                "kept": self.kept, "output_searched": self.output_searched, "svd_seconds": self.svd_seconds, "sync_seconds": self.sync_seconds, "syncs": self.syncs,
                "svd_counts": dict(self.svd_counts), "ratio": self.ratio, "dense": self.dense.state_dict(), "frozen": dict(self._frozen),
                "vectors": dict(self._bases),
                "sync_compressor": self._compressor.state_dict() if self._compressor is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after the model's state_dict was loaded (it brings the factors and each layer's mode)."""
        if state.get("role", self.role) != self.role:
            raise ValueError(f"checkpoint was written by a worker of role {state['role']}, this worker trains "
                             f"{self.role}: the group layout differs (--group-size, number of workers)")
        self.t = state["t"]
        self._switch_step = state["switch_step"]
        self.ranks = state["ranks"]
        self.kept = list(state["kept"])
        if state["output_searched"]:
            self._stop_output_search()  # the output layer was looked for before the checkpoint
        self.svd_seconds = state["svd_seconds"]
        self.sync_seconds = state["sync_seconds"]
        self.syncs = int(state.get("syncs", 0))
        self.svd_counts = dict(state.get("svd_counts", {"full": 0, "updated": 0}))
        self.ratio = state["ratio"]
        self.dense.load_state_dict(state["dense"])
        self._frozen = dict(state.get("frozen", {}))
        self._bases = {name: tuple(b) for name, b in state.get("vectors", {}).items()}
        if state.get("bases"):  # an earlier layout: the whole SVD of each layer
            a_role = self._trained_role() == "A"
            self._bases = {name: (u if a_role else vh, s) for name, (u, s, vh) in state["bases"].items()}
        if self._compressor is not None and state.get("sync_compressor") is not None:
            if "errors" not in state["sync_compressor"]:
                raise ValueError("checkpoint holds the low-rank sync's memories in an earlier layout; "
                                 "resume it with the abtrain that wrote it or start the run again")
            self._compressor.load_state_dict(state["sync_compressor"])
        # requires_grad is not part of a state_dict: derive it from the restored modes and this worker's role.
        for fp in self.records:
            lowrank.set_mode([fp], fp.mode)
        lowrank.set_trainable(self.records, self._trained_role())
        self._watch_gradients()


register(MethodSpec("ab", ABTraining, "AB-training", "low-rank factors trained by independent groups, periodic sync "
                    "and full-rank rebound (docs/ab-training.md); the schedule scales with the run unless given "
                    "in steps", options=ABConfig, order=20, bench=8,
                    short_run_args=("--ab-warmup-steps", "2", "--ab-cycle-steps", "3", "--ab-rebound-steps", "1",
                                    "--ab-lr-rebound-steps", "0"),
                    check_topology=check_topology, check_run=check_run, group_layout=group_layout))
