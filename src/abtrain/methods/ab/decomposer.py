"""AB-training's decompositions: W's SVD, the ranks every worker agrees on, the factors and their state.

:class:`Decomposer` splits each factorisable W into A·B at a rank every worker agrees on (the rank rule's
choice, all-reduced with MAX), lowered to ``--ab-rank-cap``'s bound, with σ where the split puts it and the
trained factor's optimizer state carried over (``optimizer_state``). It reads and writes the
:class:`~.state.PhaseState` it is handed (the layers, what the phase keeps of its SVD, the record of ranks).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import torch
from torch import nn

from ...comm.communicator import Communicator
from ...comm.group import Group
from ..memory import moments_per_element
from . import lowrank
from .compressor import SyncCompressor
from .config import ABConfig
from .state import PhaseState

LOSS_JUMP = 1.5  # a truncation that lifts the training loss by this factor is reported
LOSS_WINDOW = 10  # steps of training loss compared before and after a truncation


class Decomposer:
    """W split into A·B at an agreed rank per layer, for the phase that follows.

    ``world``: the workers that agree on the ranks (all of them); ``compressor``: the low-rank sync's, whose
    error memory and warm-start Qs count against the ``state`` rank cap; ``say``: rank 0's line printer.
    """

    def __init__(self, cfg: ABConfig, comm: Communicator, world: Group, device: torch.device, state: PhaseState,
                 compressor: SyncCompressor | None, say: Callable[[str], None]) -> None:
        self.cfg, self.comm, self.world, self.device, self.state = cfg, comm, world, device, state
        self.compressor = compressor
        self.say = say
        self._said_lines: list[str] = []  # the per-layer decisions rank 0 printed last
        self._said_same = False  # rank 0 said that a decomposition left every layer as before, and none changed since
        self._capped_said: set[str] = set()  # layers whose rank cap rank 0 has explained
        self.losses = LossWatch()  # the training loss around the cuts

    def decompose(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, truncate: bool,
                  dense_follows: bool, records: list[lowrank.FactorizedParam] | None = None) -> None:
        """Every layer not kept full rank split at its agreed rank (``truncate``: the rank rule's; else full rank).

        ``dense_follows``: full-rank steps follow the next sync (a rebound), which read W's optimizer state.
        ``records``: only these layers (one fragment's, ``--ab-sync-fragments``); None: every layer.
        A cut that lowers some layer's rank starts :attr:`losses`' watch.
        """
        st = self.state
        start = time.perf_counter()
        records = [fp for fp in (st.records if records is None else records) if fp.name not in st.kept]
        with torch.profiler.record_function("abtrain::ab::decompose"), self.comm.ledger.in_phase("sync"):
            svds = [self.svd(fp) for fp in records]
            if truncate:
                floor = [min(self.cfg.min_rank, int(s.S.numel())) for s in svds]
                ranks = torch.tensor([max(f, self.cfg.rule.choose(s.S)) for f, s in zip(floor, svds)],
                                     dtype=torch.int64, device=self.device)
                # Every worker must use the same rank per layer.
                self.comm.all_reduce(ranks, self.world, op="max")
                chosen: list[int | None] = [int(r) for r in ranks.tolist()]
            else:
                chosen = [None] * len(records)
            capped = self._cap_ranks(records, chosen, optimizer)
            if self.cfg.optimizer_state == "reset":
                lowrank.reset_state(optimizer, [t for fp in records for t in (fp.A, fp.B)])
            self.factorise(records, chosen, svds, optimizer, dense_follows=dense_follows)
            self._say_capped(records, capped)
        st.svd_seconds += time.perf_counter() - start
        st.ratio = ratio = lowrank.compression_ratio(module, st.records)
        st.ranks.append({"step": st.t, "layers": {fp.name: (fp.rank if fp.mode == "lowrank" else None)
                                                  for fp in st.records},
                         "compression_ratio": ratio,
                         "model_params": lowrank.ab_param_count(module, st.records)})
        fell = len(st.ranks) > 1 and any((r or 0) < (st.ranks[-2]["layers"].get(name) or 0)
                                         for name, r in st.ranks[-1]["layers"].items())
        if truncate and fell:  # a loss that rises after a cut that dropped nothing is not the cut's
            self.losses.cut(st.t)
        self._report(ratio)

    def resplit(self, optimizer: torch.optim.Optimizer, ranks: dict[str, int], *, dense_follows: bool) -> None:
        """The layers of ``ranks`` split again at those ranks (the rank rule is not asked): consensus() inside a phase."""
        low = [fp for fp in self.state.records if fp.name in ranks]
        start = time.perf_counter()
        with torch.profiler.record_function("abtrain::ab::decompose"):
            self.factorise(low, [ranks[fp.name] for fp in low], [self.svd(fp) for fp in low], optimizer,
                           dense_follows=dense_follows)
        self.state.svd_seconds += time.perf_counter() - start

    def factorise(self, records: list[lowrank.FactorizedParam], ranks: list[int | None], svds: list[lowrank.SVD],
                  optimizer: torch.optim.Optimizer, *, dense_follows: bool) -> None:
        """Split each layer at its agreed rank, this worker's factor trainable, the tangent bases kept."""
        st = self.state
        lowrank.decompose_all(records, ranks, svds, split=self._split(), sigma_in=self._sigma_in(),
                              optimizer=optimizer, moments_against=self._take_frozen(records),
                              # the tangent split's frozen factor is U or Vᵀ, its own pseudo-inverse; only svd="update"
                              # (which needs that split) skips the pinv, so that full-SVD runs keep their rounding
                              frozen_orthonormal=self.cfg.svd == "update")
        lowrank.set_trainable(st.records, st.role)
        self._keep_bases(records, svds)
        if not dense_follows:
            # No full-rank step follows: W's optimizer state (from the warm-up) would never be read again.
            # A layer that later trains W again starts its moments afresh.
            lowrank.reset_state(optimizer, [fp.weight for fp in records if fp.mode == "lowrank"])

    def svd(self, fp: lowrank.FactorizedParam) -> lowrank.SVD:
        """W's SVD: updated from the parts the sync left (svd="update") where they hold and check out, else full.

        An updated SVD holds r+q singular vectors, enough for every cut that can follow: a rank rule finds no more
        than r+q nonzero singular values, agree() keeps r, and the untruncated first decomposition has no parts."""
        parts = self.state.parts.pop(fp.name, None)
        if parts is not None:
            usv = lowrank.svd_update(fp, parts)
            if usv is not None:
                self.state.svd_counts["updated"] += 1
                return usv
        self.state.svd_counts["full"] += 1
        return lowrank.svd(fp)

    def _take_frozen(self, records: list[lowrank.FactorizedParam]) -> dict[str, tuple[str, torch.Tensor]]:
        """For optimizer_state="map": the factor each of ``records`` trained and the frozen one it was trained
        against, handed to the decomposition that follows the sync and forgotten here."""
        frozen = self.state.frozen
        return {fp.name: (self.state.role, frozen.pop(fp.name)) for fp in records if fp.name in frozen}

    def _sigma_in(self) -> str:
        """split="sigma": the factor that holds the singular values, the same on every worker.

        The sync multiplies one group's A by another group's B, so every group must
        split W the same way: σ in A (the factor the A-groups train), or in B with
        only-b, where B is the factor every worker trains. split="tangent" does the
        opposite on purpose: σ in the factor this worker trains, the sync merging
        the two splits through the kept SVD (:meth:`_keep_bases`).
        """
        if self.cfg.split == "tangent":
            return self.state.role
        return "B" if self.cfg.sync == "only-b" else "A"

    def _split(self) -> str:
        """The split handed to the decomposition: tangent is sigma with σ in the factor this worker trains."""
        return "sigma" if self.cfg.split == "tangent" else self.cfg.split

    def _keep_bases(self, records: list[lowrank.FactorizedParam], svds: list[lowrank.SVD]) -> None:
        """split="tangent": what the next sync's merge needs of the SVD (U, σ, Vᵀ) each low-rank layer started from.

        The frozen factor already is Vᵀ (A-workers) or U (B-workers), so only the other singular vectors and σ
        are kept: a copy of one factor, not of the whole SVD (:meth:`PhaseState.basis` puts the three together
        at the sync). Every worker then holds the same U, σ and Vᵀ bit for bit and in the same (contiguous) layout
        as the factors, so every merge gives the same W: an operand's layout picks the BLAS kernel, and so its
        rounding."""
        if self.cfg.split == "tangent":
            a_role = self.state.role == "A"
            self.state.bases.update({fp.name: ((s.U[:, :fp.rank] if a_role else s.Vh[:fp.rank])
                                               .clone(memory_format=torch.contiguous_format), s.S[:fp.rank].clone())
                                     for fp, s in zip(records, svds) if fp.mode == "lowrank"})

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
        else:  # the warm-start Qs the layer keeps too: the sync compressor's (n×q: it compresses the factorised
            # matrix's change) and the full-rank phases' PowerSGD's (prod(S[1:])×q: it compresses W's gradient)
            qs = [(self.cfg.sync_rank * fp.n, self.compressor is not None),
                  (self.cfg.powersgd_rank * (fp.m * fp.n // fp.shape[0]), self.cfg.dense_comm == "powersgd")]
            # the sync's error memory, as a share of W's numbers
            memory = self.compressor.memory_share(fp.A.dtype) if self.compressor is not None else 0.0
            cap = lowrank.state_rank(fp.m, fp.n, moments, memory=memory, extra=sum(q for q, used in qs if used))
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

    def _report(self, ratio: float) -> None:
        """The per-layer lines when they change (the first decomposition, a new rank); else one line, once, until
        something changes again (a sync every few steps would otherwise print a line each time)."""
        st = self.state
        head = f"AB-training: decomposition at step {st.t} (compression {lowrank.format_ratio(ratio)})"
        lines = lowrank.decision_lines(st.records) + [f"{name}: full rank: {why}" for name, why in st.excluded]
        if st.others:
            lines.append(f"{st.others} parameter{'s' if st.others > 1 else ''} of fewer than 2 dims (biases, "
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


class LossWatch:
    """The training loss around the cuts: a truncation after which the mean loss of :data:`LOSS_WINDOW` steps
    rises above :data:`LOSS_JUMP` times the mean of the steps before it is worth a warning."""

    def __init__(self) -> None:
        self._losses: collections.deque[float] = collections.deque(maxlen=LOSS_WINDOW)
        self._cut: tuple[int, float] | None = None  # (step, loss level) of the last truncation, while watched

    def cut(self, step: int) -> None:
        """A truncation at ``step`` lowered some rank: its level is the mean of the losses seen before it."""
        if self._losses:
            self._cut = (step, sum(self._losses) / len(self._losses))
            self._losses.clear()

    def observe(self, value: float, t: int) -> tuple[int, float, float] | None:
        """The loss of the step before ``t``; once the window after a cut is full, (its step, the level before,
        the mean after) where the loss rose past the jump, else None."""
        self._losses.append(value)
        if self._cut is None or t - self._cut[0] < LOSS_WINDOW:
            return None
        step, level = self._cut
        after = sum(self._losses) / len(self._losses)
        self._cut = None
        return (step, level, after) if after > LOSS_JUMP * level else None
