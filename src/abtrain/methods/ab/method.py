"""AB-training: independent groups train low-rank factors A or B, periodic sync, full-rank rebound.

A context manager around the user's optimizer. The schedule is counted in
optimizer steps ``t`` and, by default, scales with the run (the fractions of
:class:`ABConfig`; absolute steps are options):

* ``t < T_w``: full-rank DP over all workers (phase ``warmup``).
* ``t == T_w``: every factorisable weight is split by SVD into A·B (full rank
  the first time), phase ``ab`` starts: A-groups train A, B-groups train B,
  gradients averaged inside the group only.
* at every multiple of ``sync_every`` after ``T_w``: sync (phase ``sync``:
  factors and full-rank parameters averaged over all workers, W = Ā·B̄), then
  F steps of full-rank DP (phase ``rebound``), then a truncated decomposition
  and AB steps until the next multiple of ``sync_every``. With F = 0 the sync
  and the truncated decomposition follow each other at once.
* with ``sync_fragments`` F > 1 (and F = 0): fragment f of the layers syncs
  and is decomposed again at the steps with ``t mod sync_every = f * sync_every
  // F``, the others training on apart (:mod:`.fragments`).

:class:`ABTraining` holds the hooks the optimizer and the loop call, and its parts, each an object of its own
that it calls: the :class:`~.schedule.Schedule` (when), the :class:`~.decomposer.Decomposer` (W split into
A·B), the :class:`~.syncer.Syncer` (the groups averaged into one W), the gradient averaging of each phase
(:mod:`.dense`, :mod:`.buckets`) and the :class:`~.prepare.OutputLayer`; what they share is the
:class:`~.state.PhaseState` each is handed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...comm.communicator import Communicator
from ...comm.topology import Topology
from ..base import Method
from ..registry import MethodSpec, register
from . import checkpoint, lowrank, results
from .buckets import OverlappedAverage
from .compressor import build_sync_compressor
from .config import ABConfig, check_topology, group_layout
from .decomposer import LOSS_WINDOW, Decomposer
from .fragments import AgreedModel, Part, SyncFragments
from .dense import build_dense_reducer
from .prepare import OutputLayer, factorise_layers, sync_batchnorm
from .schedule import Schedule, check_run
from .state import PhaseState
from .syncer import Syncer

log = logging.getLogger(__name__)


class ABTraining(Method):
    """AB-training around the user's optimizer. See the module docstring for the schedule and the parts.

    Built as ``ABTraining(comm, topo, config)`` or with the options (:class:`ABConfig`'s fields) as keywords.
    """

    name = "ab"
    averages_gradients = True

    def __init__(self, comm: Communicator, topo: Topology, config: ABConfig | None = None, **options: Any) -> None:
        super().__init__(comm, topo)
        self.cfg = cfg = config if config is not None else ABConfig(**options)
        self.verbose = not cfg.quiet
        check_topology(cfg, topo.world_size, topo.group_size, cli=config is not None)
        only_b = cfg.sync == "only-b"
        # only-b over "world": one group of all workers, low-rank DP on B every step. The ledger's
        # scopes still follow the physical groups (topo.world crosses them); only the reduction widens.
        self.train_group = topo.world if only_b and cfg.only_b_groups == "world" else topo.group
        # the first half of the groups (at least one) train A, the others B; with only-b every worker trains B
        self.state = PhaseState(role="B" if only_b else ("A" if topo.group_index < max(1, topo.num_groups // 2)
                                                         else "B"))
        self.dense = build_dense_reducer(cfg.dense_comm, comm, rank=cfg.powersgd_rank, powersgd_codec=cfg.powersgd_codec,
                                         scale_block=cfg.scale_block)  # full-rank phases
        self.overlap = OverlappedAverage(comm)  # AB steps: in-group averaging started during backward
        self.compressor = build_sync_compressor(cfg, comm)  # the low-rank sync payload, when it is chosen
        self.syncer = Syncer(cfg, comm, topo, self.state, self.train_group, self.compressor)
        self.decomposer = Decomposer(cfg, comm, topo.world, topo.device, self.state, self.compressor, self.say)
        self.output = OutputLayer(self.state, self.say)
        self._schedule: Schedule | None = None
        self._saved_lrs: list[float] = []
        self._optimizer: torch.optim.Optimizer | None = None  # the attached one (consensus() syncs its moments)
        self.fragments: SyncFragments | None = None  # --ab-sync-fragments > 1: the fragments (found in prepare())
        if not cfg.needs_budget:
            self.set_total_steps(None)

    # -- the phase state, as users read it ------------------------------------------
    @property
    def records(self) -> list[lowrank.FactorizedParam]:
        """The factorisable layers (:func:`lowrank.prepare_model`), in the model's order."""
        return self.state.records

    @property
    def ranks(self) -> list[dict[str, Any]]:
        """Every decomposition so far: its step, each layer's rank (None: full), the compression, the parameters."""
        return self.state.ranks

    @property
    def role(self) -> str:
        """The factor this worker trains in an AB phase: "A" or "B"."""
        return self.state.role

    @property
    def t(self) -> int:
        """Optimizer steps taken."""
        return self.state.t

    # -- the schedule ----------------------------------------------------------
    def set_total_steps(self, total_steps: int | None) -> None:
        """Fix the schedule for a run of ``total_steps`` optimizer steps (None: absolute options only)."""
        self._schedule = sched = Schedule.from_config(self.cfg, total_steps)
        n, g = self.topo.num_groups, self.topo.group_size
        self.say(f"AB-training schedule: {sched.describe()} ({n} group{'s' * (n != 1)} of {g} "
                 f"worker{'s' * (g != 1)})")
        if self.topo.rank == 0 and total_steps is not None:
            if sched.warmup >= total_steps:
                log.warning("AB-training: the warm-up (%d steps) fills the whole run of %d steps: no AB phase",
                            sched.warmup, total_steps)
            elif sched.syncs() < 3:
                log.warning("AB-training: %s (fewer than 3 syncs: little of the method runs)", sched.describe())

    @property
    def schedule(self) -> Schedule:
        """The schedule in steps; a ValueError that says what to do while the run's length is needed and unknown."""
        if self._schedule is None:
            self._schedule = Schedule.from_config(self.cfg, None)  # raises with what to do
        return self._schedule

    def phase_at(self, t: int) -> str:
        """Phase of optimizer step ``t`` (0-based)."""
        return self.schedule.phase_at(t)

    @property
    def phase(self) -> str:
        return self.phase_at(self.state.t)

    def _ends_local_phase(self) -> bool:
        """dense_comm="local": the step just taken (``t - 1``) was a full-rank step each worker took alone."""
        t = self.state.t
        return self.cfg.dense_comm == "local" and t > 0 and self.phase_at(t - 1) != "ab"

    def _apart_locally(self) -> bool:
        """dense_comm="local", inside a warm-up or rebound after its first step: each worker's steps were its own,
        and no average (:meth:`Syncer.average_local`) has brought the workers together since."""
        return self._ends_local_phase() and self.phase != "ab" and self.state.agreed_at != self.state.t

    # -- preparation -------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        model = self.unwrap(model)  # torch.compile's or DDP's wrapper: its module is factorised
        if self.cfg.sync_fragments > 1:  # on the model as built: a fragment holds whole layers
            self.fragments = SyncFragments(model, self.cfg.sync_fragments)
            self.say(f"AB-training: {self.cfg.sync_fragments} sync fragments of "
                     f"{', '.join(f'{n / 1e3:.1f}k' for n in self.fragments.sizes)} parameters")
        factorise_layers(model, self.cfg, self.state)
        if self.cfg.sync_batchnorm:
            model = sync_batchnorm(model, self.comm, self.topo, self.say)
        lowrank.set_trainable(self.state.records, "full")
        if self.cfg.keep_output:
            self.output.watch(model)
        return super().prepare(model)

    # -- the parts, as the hooks call them ------------------------------------
    def _decompose(self, optimizer: torch.optim.Optimizer, truncate: bool, part: Part | None = None) -> None:
        if self._ends_local_phase():
            self._average_local(optimizer)  # the workers stepped alone since the last sync: one W first
        assert self.module is not None, "prepare() first"
        self.decomposer.decompose(self.module, optimizer, truncate=truncate, dense_follows=self.schedule.rebound > 0,
                                  records=part.records if part is not None else None)
        self.syncer.agreed(self.module, part)
        self._after_decomposition()

    def _after_decomposition(self) -> None:
        self.dense.reset()  # the full-rank phase's error memories: the next one starts afresh after a sync anyway
        self.note_state_change()

    def _sync(self, optimizer: torch.optim.Optimizer, part: Part | None = None) -> None:
        assert self.module is not None, "prepare() first"
        self.syncer.sync(self.module, optimizer, part)
        self.dense.reset()  # a new full-rank phase: error memories of the last one are stale
        self.note_state_change()

    def _average_local(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.module is not None, "prepare() first"
        self.syncer.average_local(self.module, optimizer)
        self.note_state_change()

    # -- the hooks ----------------------------------------------------------
    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """A warm-up of 0 steps: decompose before the first forward."""
        checkpoint.check_loaded_model(self)  # a model state_dict of low-rank layers loaded before, without ours
        self._optimizer = optimizer
        if self.state.t == 0 and self.phase_at(0) == "ab" and not self.state.ranks:
            self._decompose(optimizer, truncate=False)
            self.state.switch_step = 0
        self._watch_gradients()

    def reduce_gradients(self) -> None:
        """Average this step's gradients over the workers the phase requires (idempotent per step)."""
        if self._reduced:
            return
        self._reduced = True
        if self.phase == "ab":
            self.overlap.finish()  # idle in groups of one worker
        else:
            assert self.module is not None, "prepare() first"
            self.dense.reduce([(n, p.grad) for n, p in self.module.named_parameters() if p.grad is not None],
                              self.topo.world)

    def _watch_gradients(self) -> None:
        """Arm the in-group averaging for the coming step when it is an AB step (its trained tensors may be new)."""
        in_group = self.phase == "ab" and self.train_group.size > 1
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
        R, switch = self.schedule.lr_rebound, self.state.switch_step
        if R == 0 or switch is None:
            return 1.0
        return min(1.0, (self.state.t - switch + 1) / R)

    def observe_loss(self, value: float) -> None:
        """Watch the training loss around truncations; rank 0 reports a cut that lifts it well above its level."""
        rose = self.decomposer.losses.observe(value, self.state.t)
        if rose is not None and self.topo.rank == 0:
            step, level, after = rose
            log.warning("AB-training: the training loss rose from %.4f to %.4f over the %d steps after the truncation "
                        "at step %d (compression %s); a smaller --ab-tau or a larger --ab-min-rank cuts less",
                        level, after, LOSS_WINDOW, step, lowrank.format_ratio(self.state.ratio or 1.0))

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        st = self.state
        for g, lr in zip(optimizer.param_groups, self._saved_lrs):
            g["lr"] = lr  # the user's schedule continues from its own value
        st.t += 1
        self.output.keep_full()
        sync, decompose = self.schedule.events(st.t)
        decompose = decompose and self.schedule.decomposes_at(st.t)
        if sync:
            self._sync(optimizer)
        if decompose:
            self._decompose(optimizer, truncate=bool(st.ranks))  # the first decomposition keeps full rank
        for f in self.schedule.fragments_due(st.t):  # a streaming sync: one fragment, the others go on apart
            assert self.fragments is not None and self.module is not None
            part = self.fragments.part(f, self.module, st.records)
            self._sync(optimizer, part)
            self._decompose(optimizer, truncate=True, part=part)
        st.parts = {}  # W changes at the next step
        if sync or decompose or self.phase_at(st.t) != self.phase_at(st.t - 1):
            st.switch_step = st.t
        self._watch_gradients()

    # -- one model on every worker: evaluation, export, the end ------------------
    @torch.no_grad()
    def export(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The plain state_dict (:meth:`Method.export`), the same bits on every worker where they agree.

        Right after a decomposition the tangent split holds W as (U·σ)·Vᵀ on A-workers and U·(σ·Vᵀ) on
        B-workers, equal up to rounding; every worker then exports (U·σ)·Vᵀ from the singular vectors they all
        hold bit for bit, so a loop that ends in consensus() ends with one model."""
        state, st = super().export(model), self.state
        if st.bases and st.t in (st.switch_step, st.agreed_at) and model in (None, self.module):
            for fp in st.records:
                if fp.mode == "lowrank" and fp.name in st.bases and fp.name in state:
                    u, sigma, vh = st.basis(fp)
                    state[fp.name] = fp.param.weight_of((u * sigma) @ vh).to(state[fp.name].dtype)
        return state

    def in_consensus(self) -> bool:
        # Workers differ while groups train apart (inside an AB phase after its first step) and after full-rank
        # steps each worker took alone (dense_comm="local").
        if self._apart_locally():
            return False
        if self.phase != "ab" or self.state.t in (self.state.switch_step, self.state.agreed_at):
            return True
        return self.train_group is self.topo.world

    def ready_for_evaluation(self) -> bool:
        # streaming syncs: the workers never all agree between the fragments' syncs; they evaluate the model they
        # agree on as of each fragment's last sync (:meth:`evaluation`)
        return self.fragments is not None or self.in_consensus()

    def evaluation(self) -> contextlib.AbstractContextManager[Any]:
        if self.fragments is None or self.in_consensus() or self.module is None:
            return super().evaluation()
        return AgreedModel(self.module, self.state)

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
        does not move: the next sync still falls at the next multiple of
        ``sync_every``, no LR ramp starts, ranks are not re-chosen. Factor
        moments are kept as at every re-decomposition (``optimizer_state``).
        """
        optimizer = self._optimizer
        if optimizer is None:
            raise ValueError("consensus() inside an AB phase needs the optimizer: call method.attach(opt) first")
        if self._apart_locally():  # a full-rank phase of local steps: the model averaged, nothing cut
            self._average_local(optimizer)
            return
        ranks = {fp.name: fp.rank for fp in self.state.low()}
        self._sync(optimizer)
        self.decomposer.resplit(optimizer, ranks, dense_follows=self.schedule.rebound > 0)
        assert self.module is not None
        self.syncer.agreed(self.module)
        self._after_decomposition()
        self.state.agreed_at = self.state.t

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """End inside an AB phase with a last sync, so that every worker holds the same full-rank model."""
        if self._apart_locally():  # a run that ends in a full-rank phase of local steps
            self._average_local(optimizer)
        elif not self.in_consensus():
            self._sync(optimizer)
            self.state.parts = {}  # no decomposition follows
            self.state.switch_step = self.state.t
        elif self.state.bases and self.phase == "ab":
            self.syncer.settle_tangent()

    # -- results and checkpoints -------------------------------------------
    def dense_size(self) -> tuple[int, int]:
        """The dense model the factorised layers stand for: each W at its full size, A and B left out."""
        if self.module is None or not self.state.records:
            return super().dense_size()
        records = self.state.records
        return lowrank.full_param_count(self.module, records), lowrank.full_tensor_count(self.module, records)

    def held_state(self) -> dict[str, Any]:
        """The parts' tensors under the names results.json has reported them by: the gradient reducers, the frozen
        factors and kept singular vectors of the phase state, the sync compressor's memories."""
        own = {k: v for k, v in super().held_state().items()
               if k not in ("state", "dense", "overlap", "compressor", "syncer", "decomposer", "output")}
        return {**own, "dense": self.dense, "overlap": self.overlap, "_frozen": self.state.frozen,
                "_bases": self.state.bases, "_compressor": self.compressor, "_parts": self.state.parts,
                "_outer": self.syncer.outer, "_agreed": self.state.agreed}

    extra_results = results.extra_results  # what results.json reports of the schedule and the phases

    # -- checkpoints: this worker's state, or another worker's adopted (:mod:`.checkpoint`) -----------------------
    own_state = checkpoint.OWN_STATE
    state_dict = checkpoint.state_dict
    load_state_dict = checkpoint.load
    adopt_state = checkpoint.adopt
    given_up = checkpoint.given_up
    dcp_split = checkpoint.dcp_split
    check_loaded_model = checkpoint.check_loaded_model
    _model_loaded = checkpoint.model_loaded


register(MethodSpec("ab", ABTraining, "AB-training", "low-rank factors trained by independent groups, periodic sync "
                    "and full-rank rebound (docs/ab-training.md); the schedule scales with the run unless given "
                    "in steps", options=ABConfig, order=20, bench=8,
                    short_run_args=("--ab-warmup-steps", "2", "--ab-sync-every", "3", "--ab-rebound-steps", "1",
                                    "--ab-lr-rebound-steps", "0"),
                    check_topology=check_topology, check_run=check_run, group_layout=group_layout))
