"""AB-training's consensus: one model on every worker inside an AB phase (evaluation, export, the end)."""

from __future__ import annotations

import time

import torch
from torch import nn

from . import lowrank
from .decomposition import ABDecomposition
from .sync import ABSync


class ABConsensus(ABSync, ABDecomposition):
    """The consensus part of :class:`~.method.ABTraining`: where the workers agree, and a sync where they do not."""

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
        # Workers differ while groups train apart (inside an AB phase after its first step) and after full-rank
        # steps each worker took alone (dense_comm="local").
        if self.apart_locally():
            return False
        if self.phase != "ab" or self.t in (self._switch_step, self._agreed_at):
            return True
        return self.train_group is self.topo.world

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
        does not move: the next sync still falls at the next multiple of
        ``cycle_steps``, no LR ramp starts, ranks are not re-chosen. Factor
        moments are kept as at every re-decomposition (``optimizer_state``).
        """
        optimizer = self._optimizer
        if optimizer is None:
            raise ValueError("consensus() inside an AB phase needs the optimizer: call method.attach(opt) first")
        if self.apart_locally():  # a full-rank phase of local steps: the model averaged, nothing cut
            self._average_local(optimizer)
            return
        ranks = {fp.name: fp.rank for fp in self.records if fp.mode == "lowrank"}
        self._sync(optimizer)
        low = [fp for fp in self.records if fp.name in ranks]
        start = time.perf_counter()
        with torch.profiler.record_function("abtrain::ab::decompose"):
            self._factorise(low, [ranks[fp.name] for fp in low], [self._svd(fp) for fp in low], optimizer)
        self.svd_seconds += time.perf_counter() - start
        self._agreed_at = self.t

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """End inside an AB phase with a last sync, so that every worker holds the same full-rank model."""
        if self.apart_locally():  # a run that ends in a full-rank phase of local steps
            self._average_local(optimizer)
        elif not self.in_consensus():
            self._sync(optimizer)
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
