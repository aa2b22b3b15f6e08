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
import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import lowrank
from ..comm import Communicator, Group
from ..reducers import DENSE_REDUCERS, build_reducer
from ..topology import Topology
from ..validate import Options, opt
from .base import Method, optimizer_moments
from .registry import MethodSpec, register

log = logging.getLogger(__name__)

SYNC_MODES = ("with-stale", "only-learned", "full", "only-b")
ONLY_B_GROUPS = ("group", "world")
SPLITS = ("sqrt", "sigma")
SYNC_DTYPES = ("fp32", "bf16")
STATE_POLICIES = ("keep", "reset")
INITS = ("default", "ortho-sigma")
DEFAULT_TAU = 0.15  # the reference experiments' relative cut-off
LOSS_JUMP = 1.5  # a truncation that lifts the training loss by this factor is reported
LOSS_WINDOW = 10  # steps of training loss compared before and after a truncation


@dataclass
class ABConfig(Options):
    """Options of AB-training; the CLI exposes each as ``--ab-<name>``."""

    section = "ab"
    warmup_fraction: float = opt(0.25, "share of the run's steps trained full-rank before the first decomposition (T_w); --ab-warmup-steps overrides it")
    cycle_fraction: float = opt(0.06, "sync period K as a share of the run's steps (0.06: about 12 syncs after a 25 %% warm-up); --ab-cycle-steps overrides it")
    rebound_fraction: float = opt(0.1, "full-rank DP steps after each sync (F) as a share of K; --ab-rebound-steps overrides it")
    lr_rebound_fraction: float = opt(0.3, "learning-rate ramp after each phase switch (R) as a share of K (0 disables); --ab-lr-rebound-steps overrides it")
    warmup_steps: int | None = opt(None, "full-rank DP steps before the first decomposition (T_w), instead of the fraction; 0 decomposes before the first step")
    cycle_steps: int | None = opt(None, "steps per cycle K, instead of the fraction: a sync at every multiple of K after warm-up")
    rebound_steps: int | None = opt(None, "full-rank DP steps after each sync (F < K), instead of the fraction; 0 re-decomposes right after the sync")
    lr_rebound_steps: int | None = opt(None, "steps over which the learning rate ramps back from the floor at each phase switch (R), instead of the fraction; 0 disables")
    tau: float | None = opt(None, "relative rank cut-off: keep singular values > tau * sigma_1 (the rule used, with 0.15, when no other rank rule is given)")
    rank: int | None = opt(None, "fixed rank for every factorised layer")
    rank_fraction: float | None = opt(None, "rank as a fraction of each layer's full rank, in (0, 1]")
    energy: float | None = opt(None, "smallest rank keeping this fraction of the squared singular values, in (0, 1]")
    min_rank: int = opt(8, "rank floor: no layer is cut below this rank; a matrix whose factors at this rank would not be smaller than W stays full rank")
    min_compression: float | None = opt(None, "opt-in gate: keep a layer full rank at a truncation when its factors would hold more than m*n/rho numbers (rho); off by default, so ranks fall cycle after cycle")
    truncate_first: bool = opt(False, "truncate already at the first decomposition (by default it keeps full rank)")
    sync: str = opt("with-stale", "sync mode", choices=SYNC_MODES)
    only_b_groups: str = opt("group", "only-b: train B with DP inside each group and average it at sync (group), or over one group of all workers every step (world)", choices=ONLY_B_GROUPS)
    independent: bool = opt(False, "no communication inside a group during AB phases: each worker trains alone until sync")
    final_rebound_steps: int = opt(0, "end the run with this many full-rank DP steps (after a last sync), inside the step budget")
    lr_floor: float = opt(1e-5, "learning rate right after a phase switch")
    split: str = opt("sqrt", "sqrt: A = U sqrt(S), B = sqrt(S) V^T; sigma: all singular values in the trained factor", choices=SPLITS)
    optimizer_state: str = opt("keep", "keep (resized) or reset the optimizer state of factors at each decomposition", choices=STATE_POLICIES)
    init: str = opt("default", "ortho-sigma: every factorisable weight keeps its initial singular vectors with all singular values 1", choices=INITS)
    full_rank: str = opt(",".join(lowrank.DEFAULT_FULL_RANK_PATTERNS), "comma-separated parameter-name patterns kept full rank (fnmatch)")
    dense_comm: str = opt("fp32", "how warm-up and rebound average full-rank gradients over all workers: fp32 (as in the paper), bf16, or powersgd (rank --ab-powersgd-rank, error feedback)", choices=DENSE_REDUCERS)
    powersgd_rank: int = opt(4, "rank of PowerSGD's P and Q for --ab-dense-comm powersgd")
    sync_dtype: str = opt("fp32", "dtype of the sync payload on the wire (factors, full-rank parameters, moments, buffers); every worker still ends the sync with the same model", choices=SYNC_DTYPES)
    keep_output: bool = opt(True, "keep the layer that produces the model's output full rank (found from the autograd graph of the first training step, whatever its name)")
    quiet: bool = opt(False, "do not print the schedule and the per-layer decisions (rank 0 prints them by default)")

    def check(self) -> None:
        for name in ("warmup_steps", "rebound_steps", "lr_rebound_steps", "final_rebound_steps"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--ab-{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        if self.cycle_steps is not None and self.cycle_steps < 1:
            raise ValueError(f"--ab-cycle-steps must be a positive integer, got {self.cycle_steps!r}")
        for name in ("warmup_fraction", "cycle_fraction", "rebound_fraction", "lr_rebound_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0 or (name == "cycle_fraction" and value == 0.0):
                raise ValueError(f"--ab-{name.replace('_', '-')} must be in {'(0' if name == 'cycle_fraction' else '[0'}, 1), "
                                 f"got {value!r}")
        if self.cycle_steps is not None and self.rebound_steps is not None and self.rebound_steps >= self.cycle_steps:
            raise ValueError(f"--ab-rebound-steps (F={self.rebound_steps}) must be smaller than --ab-cycle-steps "
                             f"(K={self.cycle_steps}): each cycle is F rebound steps then K-F AB steps")
        if self.min_rank < 1:
            raise ValueError(f"--ab-min-rank must be >= 1, got {self.min_rank}")
        if self.powersgd_rank < 1:
            raise ValueError(f"--ab-powersgd-rank must be >= 1, got {self.powersgd_rank}")
        rules = [n for n in ("tau", "rank", "rank_fraction", "energy") if getattr(self, n) is not None]
        if len(rules) > 1:
            raise ValueError(f"choose one rank rule, got {', '.join('--ab-' + r.replace('_', '-') for r in rules)}")
        if not rules:
            self.tau = DEFAULT_TAU
        self.rank_rule()  # validates the values
        if self.min_compression is not None and self.min_compression <= 0:
            raise ValueError(f"--ab-min-compression must be > 0, got {self.min_compression}")
        if not self.lr_floor >= 0:
            raise ValueError(f"--ab-lr-floor must be >= 0, got {self.lr_floor}")

    @property
    def needs_budget(self) -> bool:
        """True when the schedule is given as fractions of the run, which must then be told its length."""
        return self.warmup_steps is None or self.cycle_steps is None

    def rank_rule(self) -> lowrank.RankRule:
        try:
            return lowrank.RankRule(tau=self.tau, rank=self.rank, fraction=self.rank_fraction, energy=self.energy)
        except ValueError as exc:
            raise ValueError(f"AB-training rank rule: {exc}") from None

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.full_rank.split(",") if p.strip())


def check_topology(cfg: ABConfig, world_size: int, group_size: int, cli: bool = True) -> None:
    """The group layout AB-training needs; raises before any training starts.

    ``cli`` words the fix as flags (``--group-size 2``), else as keyword arguments (``group_size=2``).
    """
    def opt(name: str, value: Any) -> str:
        return f"--{name.replace('_', '-')} {value}" if cli else f"{name}={value!r}"

    if world_size % group_size:
        raise ValueError(f"{world_size} workers cannot be split into groups of {group_size}: "
                         f"choose a {'--group-size' if cli else 'group_size='} that divides the number of workers")
    if cfg.sync != "only-b" and world_size == 1:
        start = "--workers 2 (or more)" if cli else "torchrun --nproc-per-node 2 (or more)"
        raise ValueError(f"AB-training trains A and B in different groups of workers, so it needs at least 2; "
                         f"this is a world of one process: start it with {start}, or use "
                         f"{opt('ab_sync' if cli else 'sync', 'only-b')}")
    if cfg.sync != "only-b" and world_size // group_size < 2:
        raise ValueError(f"AB-training needs at least 2 groups of workers, got {world_size // group_size} "
                         f"({world_size} workers in groups of {group_size}): pass e.g. "
                         f"{opt('group_size', max(1, world_size // 2))}, or {opt('ab_sync' if cli else 'sync', 'only-b')}")


def default_group_size(world_size: int, local_world_size: int, cfg: ABConfig) -> int:
    """The group size AB-training uses when none was chosen: one group per node, or 2 groups on one node.

    On one node (all workers in one group) the world is split into the smallest
    number of groups above one that divides it: 2 groups for an even world.
    """
    g = local_world_size if world_size % max(1, local_world_size) == 0 else world_size
    if cfg.sync == "only-b" or world_size < 2 or world_size // g >= 2:
        return g
    groups = next(k for k in range(2, world_size + 1) if world_size % k == 0)
    return world_size // groups


@dataclass(frozen=True)
class Schedule:
    """AB-training's schedule in optimizer steps: T_w, K, F, R and the run's length when known."""

    warmup: int
    cycle: int
    rebound: int
    lr_rebound: int
    total: int | None = None
    final_rebound: int = 0

    @classmethod
    def from_config(cls, cfg: ABConfig, total: int | None) -> "Schedule":
        """Steps from the config: absolute options where given, else the fractions of ``total``."""
        if cfg.needs_budget and total is None:
            raise ValueError("AB-training's schedule is set as fractions of the run: give it the run's length "
                             "(abtrain.setup(..., total_steps=N) or method.set_total_steps(N)), or set warmup_steps and "
                             "cycle_steps (--ab-warmup-steps, --ab-cycle-steps)")
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_fraction * total)
        cycle = cfg.cycle_steps if cfg.cycle_steps is not None else max(2, round(cfg.cycle_fraction * total))
        if cfg.rebound_steps is not None:
            rebound = cfg.rebound_steps
        else:
            rebound = min(cycle - 1, max(1, round(cfg.rebound_fraction * cycle))) if cfg.rebound_fraction else 0
        if rebound >= cycle:
            raise ValueError(f"--ab-rebound-steps (F={rebound}) must be smaller than the cycle (K={cycle})")
        if cfg.lr_rebound_steps is not None:
            lr_rebound = cfg.lr_rebound_steps
        else:
            lr_rebound = max(rebound + 1, round(cfg.lr_rebound_fraction * cycle)) if cfg.lr_rebound_fraction else 0
        return cls(warmup, cycle, rebound, lr_rebound, total, cfg.final_rebound_steps)

    def phase_at(self, t: int) -> str:
        """Phase of optimizer step ``t`` (0-based)."""
        if t < self.warmup:
            return "warmup"
        if self.total is not None and self.final_rebound and t >= self.total - self.final_rebound:
            return "rebound"
        last_sync = (t // self.cycle) * self.cycle  # syncs fall at multiples of K after warm-up
        if last_sync <= self.warmup or t - last_sync >= self.rebound:
            return "ab"
        return "rebound"

    def events(self, t: int) -> tuple[bool, bool]:
        """(sync, decompose) due between step ``t - 1`` and step ``t``."""
        before, after = self.phase_at(t - 1), self.phase_at(t)
        sync = before == "ab" and (after != "ab" or (t % self.cycle == 0 and t > self.warmup))
        return sync, after == "ab" and (before != "ab" or sync)

    def syncs(self) -> int:
        """Syncs in the whole run (needs ``total``)."""
        assert self.total is not None
        return sum(self.events(t)[0] for t in range(max(1, self.warmup + 1), self.total))

    def describe(self) -> str:
        text = f"warm-up {self.warmup} steps, sync every {self.cycle}, rebound {self.rebound}, LR ramp {self.lr_rebound}"
        if self.total is not None:
            text += f": {self.syncs()} syncs in {self.total} steps"
        return text


class ABTraining(Method):
    """AB-training around the user's optimizer. See the module docstring for the schedule."""

    name = "ab"

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
        self.dense = build_reducer(self.cfg.dense_comm, comm, rank=self.cfg.powersgd_rank)
        self.wire_dtype = torch.bfloat16 if self.cfg.sync_dtype == "bf16" else None
        num_a_groups = max(1, topo.num_groups // 2)
        self.role = "B" if only_b else ("A" if topo.group_index < num_a_groups else "B")
        self.a_ranks = list(range(num_a_groups * topo.group_size))
        self.records: list[lowrank.FactorizedParam] = []
        self.kept: list[str] = []  # layers kept full rank because they produce the model's output
        self.t = 0  # optimizer steps taken
        self.schedule: Schedule | None = None
        self._switch_step: int | None = None  # step of the last phase switch, for the LR rebound
        self._reduced = False
        self._saved_lrs: list[float] = []
        self._output_hook: Any = None
        self.output_searched = False  # the first training forward looked for the output layer
        self._losses: collections.deque[float] = collections.deque(maxlen=LOSS_WINDOW)
        self._cut: tuple[int, float] | None = None  # (step, loss level) of the last truncation, while watched
        self._said_lines: list[str] = []  # the per-layer decisions rank 0 printed last
        self._agreed_at: int | None = None  # step at which consensus() last brought the workers together
        self._optimizer: torch.optim.Optimizer | None = None  # the attached one (consensus() syncs its moments)
        self.ranks: list[dict[str, Any]] = []
        self.svd_seconds = 0.0
        self.sync_seconds = 0.0
        self.ratio: float | None = None
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
        if isinstance(model, DistributedDataParallel):
            # DDP would all-reduce every gradient over the world and fight the groups; its own hooks stay
            # idle when its forward is not called, so training the inner module is safe.
            self.say("AB-training: the model was wrapped in DistributedDataParallel; training its .module "
                     "(AB-training averages gradients itself: drop the DDP wrapper, use the model prepare() returns)")
            model = model.module
        self.records = lowrank.prepare_model(model, full_rank_patterns=self.cfg.patterns, min_rank=self.cfg.min_rank)
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
        if torch.is_tensor(output):
            first = output
        elif isinstance(output, (tuple, list, dict)):
            values = output.values() if isinstance(output, dict) else output
            first = next((v for v in values if torch.is_tensor(v)), None)
        else:
            first = None
        found = lowrank.output_weights(first, self.records) if first is not None else []
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

    def reduce_gradients(self) -> None:
        """Average this step's gradients over the workers the phase requires (idempotent per step)."""
        if self._reduced:
            return
        self._reduced = True
        named = [(n, p.grad) for n, p in self.module.named_parameters() if p.grad is not None]
        if self.phase == "ab":
            if not self.cfg.independent:
                self.comm.all_reduce_tensors([g for _, g in named], self.train_group, average=True)
        else:
            self.dense.reduce(named, self.topo.world)

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
        self._reduced = False
        self.t += 1
        if any(fp.mode == "lowrank" for fp in self._kept_records()):
            self._keep_output_full()
        sync, decompose = self._sched().events(self.t)
        if sync:
            self._sync(optimizer)
        if decompose:
            self._decompose(optimizer, truncate=self.cfg.truncate_first or bool(self.ranks))
        if sync or decompose or self.phase_at(self.t) != self.phase_at(self.t - 1):
            self._switch_step = self.t

    @torch.no_grad()
    def _keep_output_full(self) -> None:
        """Warm-up 0 found the output layer after decomposing it: W = A·B (exact at full rank), trained full."""
        for fp in self._kept_records():
            if fp.mode == "lowrank":
                lowrank.recompose(fp)
                fp.param.note = "produces the model's output"
        lowrank.set_trainable(self.records, self._trained_role())

    def _trained_role(self) -> str:
        return "B" if self.cfg.sync == "only-b" else self.role

    # -- decomposition and sync -----------------------------------------
    def _decompose(self, optimizer: torch.optim.Optimizer, truncate: bool) -> None:
        start = time.perf_counter()
        records = [fp for fp in self.records if fp.name not in self.kept]
        with torch.profiler.record_function("abtrain::ab::decompose"), self.comm.ledger.in_phase("sync"):
            svds = [lowrank.svd(fp) for fp in records]
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
            if self.cfg.optimizer_state == "reset":
                lowrank.reset_state(optimizer, [t for fp in records for t in (fp.A, fp.B)])
            trained = self._trained_role() if self.cfg.split == "sigma" else None
            lowrank.decompose_all(records, chosen, svds, min_compression=min_compression,
                                  split=self.cfg.split, trained=trained, optimizer=optimizer)
            lowrank.set_trainable(self.records, self._trained_role())
        self.svd_seconds += time.perf_counter() - start
        self.ratio = lowrank.compression_ratio(self.module, self.records)
        self.ranks.append({"step": self.t, "layers": {fp.name: (fp.rank if fp.mode == "lowrank" else None)
                                                      for fp in self.records},
                           "compression_ratio": self.ratio})
        if truncate and self._losses:
            self._cut = (self.t, sum(self._losses) / len(self._losses))
            self._losses.clear()
        # The per-layer lines when they change (the first decomposition, a new rank); else one line.
        head = f"AB-training: decomposition at step {self.t} (compression {lowrank.format_ratio(self.ratio)})"
        lines = lowrank.decision_lines(self.records)
        if lines == self._said_lines:
            self.say(head + ", every layer as before")
        else:
            self.say(head)
            for line in lines:
                self.say("  " + line)
            self._said_lines = lines

    def _full_rank_tensors(self) -> list[torch.Tensor]:
        """Parameters not represented by factors this phase (full-mode W, biases, norms, kept layers)."""
        factor_ids = {id(t) for fp in self.records for t in (fp.A, fp.B)}
        low_ids = {id(fp.weight) for fp in self.records if fp.mode == "lowrank"}
        return [p for p in self.module.parameters() if id(p) not in factor_ids and id(p) not in low_ids]

    @torch.no_grad()
    def _sync(self, optimizer: torch.optim.Optimizer) -> None:
        start = time.perf_counter()
        low = [fp for fp in self.records if fp.mode == "lowrank"]
        world = self.topo.world
        with torch.profiler.record_function("abtrain::ab::sync"), self.comm.ledger.in_phase("sync"):
            buffers = [b for b in self.module.buffers() if b.is_floating_point()]
            full = self._full_rank_tensors()
            if self.cfg.optimizer_state == "reset":
                lowrank.reset_state(optimizer, full + [fp.weight for fp in low])
            # Parameters trained during the AB phase on every worker (full-rank ones)
            # carry group-specific optimizer moments: average them too, so that the
            # rebound that follows is exact data parallelism with one model everywhere.
            rest = full + buffers + optimizer_moments(optimizer, full)
            mode, wire = self.cfg.sync, self.wire_dtype
            if mode == "with-stale":
                self.comm.all_reduce_tensors([t for fp in low for t in (fp.A, fp.B)] + rest, world, wire_dtype=wire)
            elif mode == "only-learned":
                self._average_learned(low, rest, world)
            elif mode == "full":
                for fp in low:
                    lowrank.recompose(fp)
                self.comm.all_reduce_tensors([fp.weight for fp in low] + rest, world, wire_dtype=wire)
            elif self.train_group is world and not self.cfg.independent:
                # only-b over one group of everyone: nothing drifts apart but BatchNorm statistics
                self.comm.all_reduce_tensors(buffers, world, wire_dtype=wire)
            else:  # only-b in groups: A is the same frozen factor everywhere; B and the rest are averaged
                self.comm.all_reduce_tensors([fp.B for fp in low] + rest, world, wire_dtype=wire)
            self.dense.reset()  # a new full-rank phase: error memories of the last one are stale
            for fp in low:
                if fp.mode == "lowrank":
                    lowrank.recompose(fp)
            lowrank.set_trainable(self.records, "full")
        self.sync_seconds += time.perf_counter() - start

    def _average_learned(self, low: list[lowrank.FactorizedParam], rest: list[torch.Tensor], world: Group) -> None:
        """only-learned: mean of A over the A-groups, mean of B over the B-groups, the rest over everyone.

        One summed all-reduce (the bytes of with-stale): each worker contributes its
        trained factor divided by the number of workers that trained it, zeros for
        its frozen factor, and the rest divided by the world size.
        """
        n_a = len(self.a_ranks)
        n_b = self.topo.world_size - n_a
        in_a = self.topo.rank in self.a_ranks
        contrib = []
        for fp in low:
            contrib.append(fp.A / n_a if in_a else torch.zeros_like(fp.A))
            contrib.append(fp.B / n_b if not in_a else torch.zeros_like(fp.B))
        contrib += [t / self.topo.world_size for t in rest]
        self.comm.all_reduce_tensors(contrib, world, average=False, wire_dtype=self.wire_dtype)
        for fp, a, b in zip(low, contrib[0::2], contrib[1::2]):
            fp.A.copy_(a)
            fp.B.copy_(b)
        for t, mean in zip(rest, contrib[2 * len(low):]):
            t.copy_(mean)

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
        Ā·B̄ has rank <= r, so that split is exact (with ``sync="full"`` the
        averaged W is cut back to r, as at a scheduled truncation). The schedule
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
            trained = self._trained_role() if self.cfg.split == "sigma" else None
            lowrank.decompose_all(low, [ranks[fp.name] for fp in low], [lowrank.svd(fp) for fp in low],
                                  min_compression=None, split=self.cfg.split, trained=trained, optimizer=optimizer)
            lowrank.set_trainable(self.records, self._trained_role())
        self.svd_seconds += time.perf_counter() - start
        self._agreed_at = self.t

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """End inside an AB phase with a last sync, so that every worker holds the same full-rank model."""
        if not self.in_consensus():
            self._sync(optimizer)
            self._switch_step = self.t

    def extra_results(self) -> dict[str, Any]:
        sched = self._sched()
        return {
            "compression_ratio": self.ratio,
            "ranks": self.ranks,
            "phases": self.phase_ranges(),
            "schedule": {"warmup_steps": sched.warmup, "cycle_steps": sched.cycle, "rebound_steps": sched.rebound,
                         "lr_rebound_steps": sched.lr_rebound, "final_rebound_steps": sched.final_rebound},
            "kept_output_layers": self.kept,
            "svd_seconds": self.svd_seconds,
            "sync_seconds": self.sync_seconds,
            "role": self.role,
        }

    def phase_ranges(self) -> list[dict[str, Any]]:
        """Step ranges [start, end) of each phase of the run so far."""
        out: list[dict[str, Any]] = []
        for t in range(self.t):
            p = self.phase_at(t)
            if out and out[-1]["phase"] == p:
                out[-1]["end"] = t + 1
            else:
                out.append({"phase": p, "start": t, "end": t + 1})
        return out

    def state_dict(self) -> dict[str, Any]:
        """Schedule position, ranks and timers. Factors, W and the layers' modes live in the model's state_dict."""
        return {"t": self.t, "switch_step": self._switch_step, "ranks": self.ranks, "role": self.role,
                "kept": self.kept, "output_searched": self.output_searched, "svd_seconds": self.svd_seconds, "sync_seconds": self.sync_seconds,
                "ratio": self.ratio, "dense": self.dense.state_dict()}

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
        self.ratio = state["ratio"]
        self.dense.load_state_dict(state["dense"])
        # requires_grad is not part of a state_dict: derive it from the restored modes and this worker's role.
        for fp in self.records:
            lowrank.set_mode([fp], fp.mode)
        lowrank.set_trainable(self.records, self._trained_role())


# -- the registry's view of AB-training -------------------------------------
def _group_layout(cfg: ABConfig, world_size: int, local_world_size: int) -> tuple[int, str | None]:
    g = default_group_size(world_size, local_world_size, cfg)
    per_node = local_world_size if world_size % max(1, local_world_size) == 0 else world_size
    if g == per_node or cfg.quiet:
        return g, None
    return g, (f"AB-training: one node of {world_size} workers: {world_size // g} groups of {g} "
               f"(--group-size to choose)")


def _check_run(cfg: ABConfig, model: nn.Module, total_steps: int) -> None:
    Schedule.from_config(cfg, total_steps)  # a rebound as long as the cycle fails here, not in the workers
    lowrank.prepare_model(copy.deepcopy(model), full_rank_patterns=cfg.patterns, min_rank=cfg.min_rank)


register(MethodSpec("ab", ABTraining, "AB-training", "low-rank factors trained by independent groups, periodic sync "
                    "and full-rank rebound (docs/ab-training.md); the schedule scales with the run unless given "
                    "in steps", options=ABConfig, order=20, bench=8,
                    short_run_args=("--ab-warmup-steps", "2", "--ab-cycle-steps", "3", "--ab-rebound-steps", "1",
                                    "--ab-lr-rebound-steps", "0"),
                    check_topology=check_topology, check_run=_check_run, group_layout=_group_layout))
