"""AB-training's decompositions: W's SVD, the ranks every worker agrees on, the factors and their state."""

from __future__ import annotations

import time

import torch

from . import lowrank
from ..memory import moments_per_element
from .core import ABCore


class ABDecomposition(ABCore):
    """The decomposition part of :class:`~.method.ABTraining`: W split into A·B at an agreed rank per layer."""

    def _decompose(self, optimizer: torch.optim.Optimizer, truncate: bool) -> None:
        if self.ends_local_phase():
            self._average_local(optimizer)  # the workers stepped alone since the last sync: one W first
        start = time.perf_counter()
        records = [fp for fp in self.records if fp.name not in self.kept]
        with torch.profiler.record_function("abtrain::ab::decompose"), self.comm.ledger.in_phase("sync"):
            svds = [self._svd(fp) for fp in records]
            if truncate:
                floor = [min(self.cfg.min_rank, int(s.S.numel())) for s in svds]
                ranks = torch.tensor([max(f, self.cfg.rule.choose(s.S)) for f, s in zip(floor, svds)],
                                     dtype=torch.int64, device=self.topo.device)
                # Every worker must use the same rank per layer.
                self.comm.all_reduce(ranks, self.topo.world, op="max")
                chosen: list[int | None] = [int(r) for r in ranks.tolist()]
            else:
                chosen = [None] * len(records)
            capped = self._cap_ranks(records, chosen, optimizer)
            if self.cfg.optimizer_state == "reset":
                lowrank.reset_state(optimizer, [t for fp in records for t in (fp.A, fp.B)])
            self._factorise(records, chosen, svds, optimizer)
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
                   optimizer: torch.optim.Optimizer) -> None:
        """Split each layer at its agreed rank, this worker's factor trainable, the tangent bases kept."""
        lowrank.decompose_all(records, ranks, svds, split=self._split(),
                              sigma_in=self._sigma_in(), optimizer=optimizer, moments_against=self._take_frozen(),
                              # the tangent split's frozen factor is U or Vᵀ, its own pseudo-inverse; only svd="update"
                              # (which needs that split) skips the pinv, so that full-SVD runs keep their rounding
                              frozen_orthonormal=self.cfg.svd == "update")
        lowrank.set_trainable(self.records, self._trained_role())
        self._keep_bases(records, svds)
        self.note_state_change()
        sched = self._sched()
        if sched.rebound == 0:
            # No full-rank step follows: W's optimizer state (from the warm-up) would never be read again.
            # A layer that later trains W again starts its moments afresh.
            lowrank.reset_state(optimizer, [fp.weight for fp in records if fp.mode == "lowrank"])
        self.dense.reset()  # the full-rank phase's error memories: the next one starts afresh after a sync anyway

    def _take_frozen(self) -> dict[str, tuple[str, torch.Tensor]]:
        """For optimizer_state="map": the factor each layer trained and the frozen one it was trained against,
        handed to the decomposition that follows the sync and forgotten here."""
        role = self._trained_role()
        against = {name: (role, frozen) for name, frozen in self._frozen.items()}
        self._frozen = {}
        return against

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
        sync). Every worker then holds the same U, σ and Vᵀ bit for bit and in the same (contiguous) layout as the
        factors, so every merge gives the same W: an operand's layout picks the BLAS kernel, and so its rounding."""
        if self.cfg.split == "tangent":
            a_role = self._trained_role() == "A"
            self._bases = {fp.name: ((s.U[:, :fp.rank] if a_role else s.Vh[:fp.rank])
                                     .clone(memory_format=torch.contiguous_format), s.S[:fp.rank].clone())
                           for fp, s in zip(records, svds) if fp.mode == "lowrank"}

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
            memory = 0.0  # the sync's error memory, as a share of W's numbers
            if self._compressor is not None:
                memory = (self._compressor.error_dtype or fp.A.dtype).itemsize / fp.A.dtype.itemsize
            cap = lowrank.state_rank(fp.m, fp.n, moments, memory=memory,
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
