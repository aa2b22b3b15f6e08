"""AB-training's schedule in optimizer steps: warm-up, periods of rebound and AB steps, syncs."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..fragments import fragments_of
from . import lowrank
from .config import ABConfig


@dataclass(frozen=True)
class Schedule:
    """AB-training's schedule in optimizer steps and the run's length when known.

    ``warmup`` (T_w) full-rank steps, then a sync at every multiple of ``sync_every`` after them, each
    followed by ``rebound`` (F) full-rank steps; ``lr_rebound`` (R): the learning-rate ramp after each
    phase switch. ``floored_from``: the period the fraction gave where the floor (``min_sync_every``)
    raised it, else None. ``fragments`` (F > 1, no rebound): the model synced fragment by fragment, fragment
    ``f`` at the steps ``t`` with ``t mod sync_every = f * sync_every // F`` (:meth:`fragments_due`).
    """

    warmup: int
    sync_every: int
    rebound: int
    lr_rebound: int
    total: int | None = None
    floored_from: int | None = None
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.fragments > 1 and (self.rebound or self.lr_rebound):
            raise ValueError("--ab-sync-fragments keeps every fragment in its AB phase between its syncs: it has no "
                             "rebound and no learning-rate ramp (set --ab-rebound-steps 0 --ab-lr-rebound-steps 0)")
        if self.fragments > self.sync_every:
            raise ValueError(f"--ab-sync-fragments {self.fragments}: at most one fragment syncs per step, and the "
                             f"period is {self.sync_every} steps; choose at most {self.sync_every}")
        if self.rebound >= self.sync_every:
            raise ValueError(f"--ab-rebound-steps (F={self.rebound}) must be smaller than the period "
                             f"({self.sync_every} steps): each period is F rebound steps, then AB steps")

    @classmethod
    def from_config(cls, cfg: ABConfig, total: int | None) -> "Schedule":
        """Steps from the config: absolute options where given, else the fractions of ``total``."""
        if cfg.needs_budget and total is None:
            raise ValueError("AB-training's schedule is set as fractions of the run: give it the run's length "
                             "(abtrain.setup(..., total_steps=N) or method.set_total_steps(N)), or set warmup_steps and "
                             "sync_every (--ab-warmup-steps, --ab-sync-every)")
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_fraction * total)
        floored_from = None
        if cfg.sync_every is not None:
            sync_every = cfg.sync_every
        else:
            sync_every = max(2, round(cfg.sync_fraction * total))
            if sync_every < cfg.min_sync_every:
                floored_from, sync_every = sync_every, cfg.min_sync_every
        if cfg.rebound_steps is not None:
            rebound = cfg.rebound_steps
        else:
            rebound = (min(sync_every - 1, max(1, round(cfg.rebound_fraction * sync_every)))
                       if cfg.rebound_fraction else 0)
        if cfg.lr_rebound_steps is not None:
            lr_rebound = cfg.lr_rebound_steps
        else:
            lr_rebound = (max(rebound + 1, round(cfg.lr_rebound_fraction * sync_every))
                          if cfg.lr_rebound_fraction else 0)
        return cls(warmup, sync_every, rebound, lr_rebound, total, floored_from, cfg.sync_fragments)

    def phase_at(self, t: int) -> str:
        """Phase of optimizer step ``t`` (0-based).

        Past the run's length a full-rank last phase goes on (a warm-up that fills the
        run never decomposes); an AB phase goes on with its periods.
        """
        if self.total is not None and t >= self.total > 0:
            last = self._phase(self.total - 1)
            if last != "ab":
                return last
        return self._phase(t)

    def _phase(self, t: int) -> str:
        if t < self.warmup:
            return "warmup"
        last_sync = (t // self.sync_every) * self.sync_every  # syncs fall at its multiples after warm-up
        if last_sync <= self.warmup or t - last_sync >= self.rebound:
            return "ab"
        return "rebound"

    def events(self, t: int) -> tuple[bool, bool]:
        """(sync, decompose) due between step ``t - 1`` and step ``t``."""
        before, after = self.phase_at(t - 1), self.phase_at(t)
        sync = (before == "ab" and (after != "ab" or (t % self.sync_every == 0 and t > self.warmup))
                and self.fragments == 1)
        return sync, after == "ab" and (before != "ab" or sync)

    def fragments_due(self, t: int) -> list[int]:
        """The fragments synced (and decomposed again) between step ``t - 1`` and step ``t``; none with one fragment,
        in the warm-up, or after the run's last step (where the last sync takes the whole model)."""
        if self.fragments == 1 or t <= self.warmup or (self.total is not None and t >= self.total):
            return []
        return [f for f in range(self.fragments) if t % self.sync_every == f * self.sync_every // self.fragments]

    def syncs(self) -> int:
        """Syncs in the whole run (needs ``total``): the scheduled ones, the one after the last step included,
        and the last sync that ends a run inside an AB phase (every worker leaves with one model)."""
        assert self.total is not None
        scheduled = sum(self.events(t)[0] + len(self.fragments_due(t))
                        for t in range(max(1, self.warmup + 1), self.total + 1))
        ends_apart = self.total > 0 and self.phase_at(self.total - 1) == "ab" and not self.events(self.total)[0]
        return scheduled + (1 if ends_apart and self.total > self.warmup else 0)

    def decomposes_at(self, t: int) -> bool:
        """Whether a decomposition follows step ``t``: not after the run's last step, where nothing would train
        the factors and the cut would only drop what the last sync merged."""
        return self.events(t)[1] and (self.total is None or t < self.total)

    def ranges(self, steps: int) -> list[dict[str, Any]]:
        """Step ranges [start, end) of each phase over the first ``steps`` steps."""
        out: list[dict[str, Any]] = []
        for t in range(steps):
            p = self.phase_at(t)
            if out and out[-1]["phase"] == p:
                out[-1]["end"] = t + 1
            else:
                out.append({"phase": p, "start": t, "end": t + 1})
        return out

    def describe(self) -> str:
        every = f"sync every {self.sync_every}"
        if self.fragments > 1:
            every += f" in {self.fragments} fragments (staggered: one every {self.sync_every / self.fragments:g} steps)"
        if self.floored_from is not None:
            every += (f" (the floor, --ab-min-sync-every: --ab-sync-fraction gives every {self.floored_from} in a run "
                      "this short)")
        text = f"warm-up {self.warmup} steps, {every}, rebound {self.rebound}, LR ramp {self.lr_rebound}"
        if self.total is not None:
            text += f": {self.syncs()} syncs in {self.total} steps"
        return text


def check_run(cfg: ABConfig, model: nn.Module, total_steps: int) -> None:
    """Refuse a schedule or model AB-training cannot run, before any worker starts."""
    Schedule.from_config(cfg, total_steps)  # the schedule's own rule (F < the period) fails here, not in the workers
    if cfg.sync_fragments > 1:
        fragments_of(model, cfg.sync_fragments, option="--ab-sync-fragments")
    lowrank.prepare_model(copy.deepcopy(model), full_rank_patterns=cfg.patterns, min_rank=cfg.min_rank)
