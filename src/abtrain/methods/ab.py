"""AB-training: independent groups train low-rank factors A or B, periodic sync, full-rank rebound.

The method of ``ALGORITHM.md``, as a context manager around the user's
optimizer. The schedule, counted in optimizer steps ``t``:

* ``t < warmup_steps``: full-rank DP over all workers (phase ``warmup``).
* ``t == warmup_steps``: every factorisable weight is split by SVD into
  A·B (full rank the first time), phase ``ab`` starts: A-groups train A,
  B-groups train B, gradients averaged inside the group only.
* every ``cycle_steps`` (K) steps after warm-up: sync (phase ``sync``,
  factors and full-rank parameters averaged over all workers, W = Ā·B̄),
  then ``rebound_steps`` (F) steps of full-rank DP (phase ``rebound``), then a
  truncated decomposition and K−F AB steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import lowrank
from ..comm import Communicator, Group
from ..topology import Topology
from .base import Method
from ..validate import check_types

log = logging.getLogger(__name__)

SYNC_MODES = ("with-stale", "only-learned", "full", "only-b")
SPLITS = ("sqrt", "sigma")
STATE_POLICIES = ("keep", "reset")
INITS = ("default", "ortho-sigma")
DEFAULT_TAU = 0.15  # the reference experiments' relative cut-off


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class ABConfig:
    """Options of AB-training; the CLI exposes each as ``--ab-<name>``."""

    warmup_steps: int = _opt(200, "full-rank DP steps before the first decomposition (T_w)")
    cycle_steps: int = _opt(150, "steps per cycle K: a sync every K steps after warm-up")
    rebound_steps: int = _opt(10, "full-rank DP steps after each sync (F, must be < K)")
    tau: float | None = _opt(None, "relative rank cut-off: keep singular values > tau * sigma_1 (the rule used, with 0.15, when no other rank rule is given)")
    rank: int | None = _opt(None, "fixed rank for every factorised layer")
    rank_fraction: float | None = _opt(None, "rank as a fraction of each layer's full rank, in (0, 1]")
    energy: float | None = _opt(None, "smallest rank keeping this fraction of the squared singular values, in (0, 1]")
    min_compression: float = _opt(2.0, "keep a layer full rank when its factors would hold more than m*n/rho numbers (rho)")
    truncate_first: bool = _opt(False, "truncate already at the first decomposition (the spec keeps full rank there)")
    sync: str = _opt("with-stale", "sync mode", choices=SYNC_MODES)
    independent: bool = _opt(False, "no communication inside a group during AB phases: each worker trains alone until sync")
    final_rebound_steps: int = _opt(0, "end the run with this many full-rank DP steps (after a last sync), inside the step budget (needs the budget: abtrain train passes it; in your own loop call method.plan(total_steps))")
    lr_rebound_steps: int = _opt(10, "steps over which the learning rate ramps back from the floor at each phase switch (R; 0 disables)")
    lr_floor: float = _opt(1e-5, "learning rate right after a phase switch")
    split: str = _opt("sqrt", "sqrt: A = U sqrt(S), B = sqrt(S) V^T; sigma: all singular values in the trained factor", choices=SPLITS)
    optimizer_state: str = _opt("keep", "keep (resized) or reset the optimizer state of factors at each decomposition", choices=STATE_POLICIES)
    init: str = _opt("default", "ortho-sigma: start every factorisable weight as U V^T (all singular values 1)", choices=INITS)
    full_rank: str = _opt(",".join(lowrank.DEFAULT_FULL_RANK_PATTERNS), "comma-separated parameter-name patterns kept full rank (fnmatch)")

    def __post_init__(self) -> None:
        check_types(self, "--ab-")
        for name in ("warmup_steps", "rebound_steps", "lr_rebound_steps", "final_rebound_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"--ab-{name.replace('_', '-')} must be an integer >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.cycle_steps, int) or self.cycle_steps < 1:
            raise ValueError(f"--ab-cycle-steps must be a positive integer, got {self.cycle_steps!r}")
        if self.rebound_steps >= self.cycle_steps:
            raise ValueError(f"--ab-rebound-steps (F={self.rebound_steps}) must be smaller than --ab-cycle-steps "
                             f"(K={self.cycle_steps}): each cycle is F rebound steps then K-F AB steps")
        rules = [n for n in ("tau", "rank", "rank_fraction", "energy") if getattr(self, n) is not None]
        if len(rules) > 1:
            raise ValueError(f"choose one rank rule, got {', '.join('--ab-' + r.replace('_', '-') for r in rules)}")
        if not rules:
            self.tau = DEFAULT_TAU
        self.rank_rule()  # validates the values
        if self.min_compression <= 0:
            raise ValueError(f"--ab-min-compression must be > 0, got {self.min_compression}")
        if not self.lr_floor >= 0:
            raise ValueError(f"--ab-lr-floor must be >= 0, got {self.lr_floor}")
        for name, choices in (("sync", SYNC_MODES), ("split", SPLITS), ("optimizer_state", STATE_POLICIES),
                              ("init", INITS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown --ab-{name.replace('_', '-')} {getattr(self, name)!r}; choose one of: {', '.join(choices)}")

    def rank_rule(self) -> lowrank.RankRule:
        try:
            return lowrank.RankRule(tau=self.tau, rank=self.rank, fraction=self.rank_fraction, energy=self.energy)
        except ValueError as exc:
            raise ValueError(f"AB-training rank rule: {exc}") from None

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.full_rank.split(",") if p.strip())


def check_topology(cfg: ABConfig, world_size: int, group_size: int) -> None:
    """The group layout AB-training needs; raises before any training starts."""
    if world_size % group_size:
        raise ValueError(f"{world_size} workers cannot be split into groups of {group_size}: "
                         f"choose a --group-size that divides the number of workers")
    if cfg.sync != "only-b" and world_size // group_size < 2:
        raise ValueError(f"AB-training needs at least 2 groups of workers, got {world_size // group_size} "
                         f"({world_size} workers in groups of {group_size}): pass e.g. --group-size {max(1, world_size // 2)}, "
                         f"or --ab-sync only-b")


class ABTraining(Method):
    """AB-training around the user's optimizer. See the module docstring for the schedule."""

    name = "ab"

    def __init__(self, comm: Communicator, topo: Topology, config: ABConfig | None = None, **options: Any) -> None:
        super().__init__(comm, topo)
        self.cfg = config if config is not None else ABConfig(**options)
        check_topology(self.cfg, topo.world_size, topo.group_size)
        # only-b: one group of all workers, DP on B every step. The ledger's scopes still
        # follow the physical groups (topo.world crosses them), only the reduction widens.
        self.train_group = topo.world if self.cfg.sync == "only-b" else topo.group
        self.rule = self.cfg.rank_rule()
        num_a_groups = max(1, topo.num_groups // 2)
        self.role = "B" if self.cfg.sync == "only-b" else ("A" if topo.group_index < num_a_groups else "B")
        self.a_ranks = list(range(num_a_groups * topo.group_size))
        self.records: list[lowrank.FactorizedParam] = []
        self.t = 0  # optimizer steps taken
        self.total_steps: int | None = None
        self._switch_step = 0  # step of the last phase switch, for the LR rebound
        self._reduced = False
        self._saved_lrs: list[float] = []
        self.ranks: list[dict[str, Any]] = []
        self.svd_seconds = 0.0
        self.sync_seconds = 0.0
        self.ratio: float | None = None

    # -- schedule --------------------------------------------------------
    def phase_at(self, t: int) -> str:
        """Phase of optimizer step ``t`` (0-based)."""
        c = self.cfg
        if t < c.warmup_steps:
            return "warmup"
        if self.total_steps is not None and c.final_rebound_steps and t >= self.total_steps - c.final_rebound_steps:
            return "rebound"
        u = t - c.warmup_steps
        if u < c.cycle_steps:
            return "ab"
        return "rebound" if (u - c.cycle_steps) % c.cycle_steps < c.rebound_steps else "ab"

    @property
    def phase(self) -> str:
        return self.phase_at(self.t)

    def plan(self, total_steps: int) -> None:
        self.total_steps = total_steps

    # -- preparation -------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        self.records = lowrank.prepare_model(model, full_rank_patterns=self.cfg.patterns,
                                             min_compression=self.cfg.min_compression)
        if self.cfg.init == "ortho-sigma":
            gen = torch.Generator().manual_seed(12345)  # same on every worker
            lowrank.ortho_sigma_init(self.records, gen)
        lowrank.set_trainable(self.records, "full")
        return super().prepare(model)

    # -- the hooks ----------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Average this step's gradients over the workers the phase requires (idempotent per step)."""
        if self._reduced:
            return
        self._reduced = True
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if self.phase == "ab":
            if not self.cfg.independent:
                self.comm.all_reduce_tensors(grads, self.train_group, average=True)
        else:
            self.comm.all_reduce_tensors(grads, self.topo.world, average=True)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.comm.ledger.phase = self.phase
        self.reduce_gradients()
        self._saved_lrs = [g["lr"] for g in optimizer.param_groups]
        scale = self.lr_scale()
        if scale < 1.0:
            for g in optimizer.param_groups:
                g["lr"] = self.cfg.lr_floor + (g["lr"] - self.cfg.lr_floor) * scale

    def lr_scale(self) -> float:
        """Linear ramp from the floor back to the scheduled LR over R steps after each phase switch."""
        R = self.cfg.lr_rebound_steps
        if R == 0 or self._switch_step == 0:
            return 1.0
        return min(1.0, (self.t - self._switch_step + 1) / R)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        for g, lr in zip(optimizer.param_groups, self._saved_lrs):
            g["lr"] = lr  # the user's schedule continues from its own value
        self._reduced = False
        before = self.phase
        self.t += 1
        after = self.phase
        if before == after:
            return
        if before == "ab":
            self._sync(optimizer)
        if after == "ab":
            # The first decomposition (right after warm-up) keeps full rank unless asked otherwise.
            first = self.t == self.cfg.warmup_steps
            self._decompose(optimizer, truncate=self.cfg.truncate_first or not first)
        self._switch_step = self.t
        self.comm.ledger.phase = after

    # -- decomposition and sync -----------------------------------------
    def _decompose(self, optimizer: torch.optim.Optimizer, truncate: bool) -> None:
        start = time.perf_counter()
        with torch.profiler.record_function("abtrain::ab::decompose"), self.comm.ledger.in_phase("sync"):
            svds = [lowrank.svd(fp) for fp in self.records]
            if truncate:
                ranks = torch.tensor([self.rule.choose(s.S) for s in svds], dtype=torch.int64, device=self.topo.device)
                # Every worker must use the same rank per layer.
                self.comm.all_reduce(ranks, self.topo.world, op="max")
                chosen: list[int | None] = [int(r) for r in ranks.tolist()]
                min_compression: float | None = self.cfg.min_compression
            else:
                chosen = [None] * len(self.records)
                min_compression = None
            if self.cfg.optimizer_state == "reset":
                lowrank.reset_state(optimizer, [t for fp in self.records for t in (fp.A, fp.B)])
            trained = self.role if self.cfg.split == "sigma" else None
            lowrank.decompose_all(self.records, chosen, svds, min_compression=min_compression,
                                  split=self.cfg.split, trained=trained, optimizer=optimizer)
            if self.cfg.sync == "only-b":
                lowrank.set_trainable(self.records, "B")
            else:
                lowrank.set_trainable(self.records, self.role)
        self.svd_seconds += time.perf_counter() - start
        self.ratio = lowrank.compression_ratio(self.module, self.records)
        self.ranks.append({"step": self.t, "layers": {fp.name: (fp.rank if fp.mode == "lowrank" else None)
                                                      for fp in self.records},
                           "compression_ratio": self.ratio})
        if self.topo.rank == 0:
            log.info("decomposition at step %d (compression %s)", self.t, lowrank.format_ratio(self.ratio))
            lowrank.log_decisions(self.records, log)

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
            rest = full + buffers + _moments(optimizer, full)
            mode = self.cfg.sync
            if mode == "with-stale":
                self.comm.all_reduce_tensors([t for fp in low for t in (fp.A, fp.B)] + rest, world)
            elif mode == "only-learned":
                self._average_learned(low, rest, world)
            elif mode == "full":
                for fp in low:
                    lowrank.recompose(fp)
                self.comm.all_reduce_tensors([fp.weight for fp in low] + rest, world)
            else:  # only-b: one group of everyone, nothing drifts apart but BatchNorm statistics
                self.comm.all_reduce_tensors(buffers, world)
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
        self.comm.all_reduce_tensors(contrib, world, average=False)
        for fp, a, b in zip(low, contrib[0::2], contrib[1::2]):
            fp.A.copy_(a)
            fp.B.copy_(b)
        for t, mean in zip(rest, contrib[2 * len(low):]):
            t.copy_(mean)

    def in_consensus(self) -> bool:
        # Workers differ only while groups train apart: inside an AB phase after its first step.
        return self.cfg.sync == "only-b" or self.phase != "ab" or self.t == self._switch_step

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """End inside an AB phase with a last sync, so that every worker holds the same full-rank model."""
        if not self.in_consensus():
            self._sync(optimizer)
            self._switch_step = self.t

    def extra_results(self) -> dict[str, Any]:
        return {
            "compression_ratio": self.ratio,
            "ranks": self.ranks,
            "phases": self.phase_ranges(),
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
                "svd_seconds": self.svd_seconds, "sync_seconds": self.sync_seconds, "ratio": self.ratio}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after the model's state_dict was loaded (it brings the factors and each layer's mode)."""
        if state.get("role", self.role) != self.role:
            raise ValueError(f"checkpoint was written by a worker of role {state['role']}, this worker trains "
                             f"{self.role}: the group layout differs (--group-size, number of workers)")
        self.t = state["t"]
        self._switch_step = state["switch_step"]
        self.ranks = state["ranks"]
        self.svd_seconds = state["svd_seconds"]
        self.sync_seconds = state["sync_seconds"]
        self.ratio = state["ratio"]
        # requires_grad is not part of a state_dict: derive it from the restored modes and this worker's role.
        for fp in self.records:
            lowrank.set_mode([fp], fp.mode)
        lowrank.set_trainable(self.records, "B" if self.cfg.sync == "only-b" else self.role)


def _moments(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The optimizer's per-element state of ``params`` (momentum, Adam moments), not scalars like ``step``."""
    out = []
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape:
                out.append(value)
    return out
