"""AB-training's sync: every worker leaves it with one model (W = Ā·B̄), in one of four modes.

:class:`Syncer` averages the groups' factors (or their changes of W) and every full-rank tensor over all
workers, merges them into W, and with ``dense_comm="local"`` averages the model once at the end of a
full-rank phase of local steps. It reads and writes the :class:`~.state.PhaseState` it is handed (what the
phase kept of its SVD, the frozen factors for the optimizer state's map, the parts of W for an updated SVD).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ...comm.communicator import Communicator
from ...comm.group import Group
from ...comm.topology import Topology
from ...compress.wire import WIRE_DTYPES
from ..memory import optimizer_moments
from . import lowrank
from .compressor import SyncCompressor
from .config import TANGENT_CORES, ABConfig
from .fragments import Part, part_of
from .outer import OuterStep
from .state import PhaseState


class Syncer:
    """The groups averaged into one full-rank model.

    ``train_group``: the workers that average their gradients in an AB phase (the whole world with
    ``only_b_groups="world"``, whose sync then averages only the buffers); ``compressor``: the low-rank sync
    payload's, None unless ``sync_payload="lowrank"``.
    """

    def __init__(self, cfg: ABConfig, comm: Communicator, topo: Topology, state: PhaseState, train_group: Group,
                 compressor: SyncCompressor | None) -> None:
        self.cfg, self.comm, self.topo, self.state = cfg, comm, topo, state
        self.train_group = train_group
        self.compressor = compressor
        self.outer = OuterStep(cfg.outer_lr, cfg.outer_momentum) if cfg.outer_step else None
        # the full-rank tensors travel as values: in float32 with the fp32 codec, else in bfloat16 (a quantised
        # codec carries the factorised layers' changes, whose rounding the sync's error memories keep)
        self.wire_dtype = None if cfg.sync_codec == "fp32" else WIRE_DTYPES["bf16"]
        # the first half of the groups (at least one) train A: their workers come first in rank order
        self.a_workers = max(1, topo.num_groups // 2) * topo.group_size

    @torch.no_grad()
    def sync(self, module: nn.Module, optimizer: torch.optim.Optimizer, part: Part | None = None) -> None:
        """Average the groups into one model: every layer (of the part) leaves it in full mode, W the same on every
        worker.

        ``part``: one fragment's layers and tensors (``--ab-sync-fragments``); None: the whole model."""
        st, cfg = self.state, self.cfg
        start = time.perf_counter()
        st.syncs += 1
        part = part if part is not None else part_of(module, st.records)
        low = part.low
        if cfg.optimizer_state == "map":
            st.frozen.update({fp.name: (fp.B if st.role == "A" else fp.A).detach().clone() for fp in low})
        with torch.profiler.record_function("abtrain::ab::sync"), self.comm.ledger.in_phase("sync"):
            buffers = [b for _, b in part.buffers]
            full = [p for _, p in part.params]
            if cfg.optimizer_state == "reset":
                lowrank.reset_state(optimizer, full + [fp.weight for fp in low])
            # Parameters trained during the AB phase on every worker (full-rank ones)
            # carry group-specific optimizer moments: average them too, so that the
            # rebound that follows is exact data parallelism with one model everywhere.
            rest = full + buffers + (optimizer_moments(optimizer, full) if cfg.sync_moments else [])
            # tangent: Ā and B̄ were trained against different splits of one SVD; W adds their changes to it
            bases = ({fp.name: st.basis(fp) for fp in low if fp.name in st.bases}
                     if cfg.sync == "only-learned" else {})
            changes = average_models(self.comm, self.topo.world, cfg.sync, low, rest, buffers, self.wire_dtype,
                                     in_a=self.topo.rank < self.a_workers, n_a=self.a_workers,
                                     one_group=self.train_group is self.topo.world,
                                     as_change=self._send_as_change(low, bases), compressor=self.compressor,
                                     rank0=cfg.only_b_sync == "rank0")
            factors = self.compressor.take_factors() if self.compressor is not None else {}
            core = TANGENT_CORES[cfg.tangent_core]
            for fp in low:
                if fp.mode != "lowrank":
                    continue
                if fp.name in factors and fp.name in bases:  # svd="update": W from its parts, kept for the SVD
                    st.parts[fp.name] = lowrank.tangent_parts(bases[fp.name], *factors[fp.name], core)
                    lowrank.recompose(fp, parts=st.parts[fp.name])
                else:
                    lowrank.recompose(fp, bases.get(fp.name), changes.get(fp.name), core=core)
            if self.outer is not None:
                self._outer_step(low, part.params, bases)
            for fp in low:
                st.bases.pop(fp.name, None)
            lowrank.set_trainable(part.records, "full")
        st.sync_seconds += time.perf_counter() - start

    def _outer_step(self, low: list[lowrank.FactorizedParam], named: list[tuple[str, torch.Tensor]],
                    bases: dict[str, lowrank.SVD]) -> None:
        """--ab-outer-lr/--ab-outer-momentum: each merged W and full-rank parameter through the outer step, from
        what the workers held when the phase began (:mod:`.outer`)."""
        assert self.outer is not None
        for fp in low:
            if fp.name in bases:
                u, s, vh = bases[fp.name]
                self.outer.apply(fp.name, ((u * s) @ vh).reshape(fp.shape).to(fp.weight.dtype), fp.weight)
                self.state.parts.pop(fp.name, None)  # W is no longer the phase's SVD plus the sync's change
        self.outer.apply_full_rank(named)
        self.outer.remember(named)

    def agreed(self, module: nn.Module, part: Part | None = None) -> None:
        """A decomposition (of ``part``; None: the whole model): every worker holds the same full-rank parameters,
        the outer step's next W_start; with ``--ab-sync-fragments`` copied with the buffers into
        :attr:`~.state.PhaseState.agreed`, the model an evaluation between syncs is lent (:mod:`.fragments`)."""
        if self.outer is None and self.cfg.sync_fragments == 1:
            return
        part = part if part is not None else part_of(module, self.state.records)
        if self.outer is not None:  # never with fragments (ABConfig refuses both): part is the whole model
            self.outer.remember(part.params)
        if self.cfg.sync_fragments > 1:
            for name, t in part.params + part.buffers:
                self.state.agreed[name] = t.detach().clone()

    @torch.no_grad()
    def average_local(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """dense_comm="local": the full-rank steps since the last sync were each worker's own. One all-reduce over
        every worker averages the model (parameters and floating-point buffers, in the sync's wire dtype), one
        inside each group the optimizer's moments, so that the decomposition that follows starts from one W and
        the workers of a group, which average their gradients from then on, step alike."""
        with torch.profiler.record_function("abtrain::ab::average_local"), self.comm.ledger.in_phase("sync"):
            params = [p for _, p in part_of(module, self.state.records).params]  # a full-rank phase trains no factor
            buffers = [b for b in module.buffers() if b.is_floating_point()]
            self.comm.all_reduce_tensors(params + buffers, self.topo.world, wire_dtype=self.wire_dtype)
            moments = optimizer_moments(optimizer, params)
            if moments and self.train_group.size > 1:
                self.comm.all_reduce_tensors(moments, self.train_group, wire_dtype=self.wire_dtype)
        self.state.agreed_at = self.state.t

    @torch.no_grad()
    def settle_tangent(self) -> None:
        """split="tangent", ending right after a decomposition: the groups hold U·σ | Vᵀ and U | σ·Vᵀ, whose
        products differ in the last bits; every worker leaves with W = (U·σ)·Vᵀ of the one SVD they share
        (the tangent merge of a phase in which neither group has changed W yet)."""
        st = self.state
        for fp in st.records:
            if fp.name in st.bases and fp.mode == "lowrank":
                lowrank.recompose(fp, st.basis(fp), fp.weight.new_zeros(fp.m, fp.n))
        st.bases = {}
        lowrank.set_trainable(st.records, "full")

    def _send_as_change(self, low: list[lowrank.FactorizedParam],
                        bases: dict[str, lowrank.SVD]) -> dict[str, lowrank.SVD]:
        """The tangent layers that send their change of W, with the SVD each started from: with
        sync_payload="smaller" those whose change (m·n numbers) is smaller than their factors (r·(m + n));
        with "lowrank" also every layer the compressor takes (q·(m + n) < m·n), whatever its rank, so that
        what its memory holds is sent at a later sync."""
        if self.cfg.sync_payload == "factors":
            return {}
        compressor = self.compressor
        return {fp.name: bases[fp.name] for fp in low
                if fp.name in bases and (fp.m * fp.n < fp.rank * (fp.m + fp.n) or self.cfg.quantised_sync
                                         or (compressor is not None and compressor.rank_for(fp.m, fp.n) is not None))}


@torch.no_grad()
def average_models(comm: Communicator, world: Group, mode: str, low: list[lowrank.FactorizedParam],
                   rest: list[torch.Tensor], buffers: list[torch.Tensor], wire: torch.dtype | None, *,
                   in_a: bool, n_a: int, one_group: bool,
                   as_change: dict[str, lowrank.SVD] | None = None,
                   compressor: SyncCompressor | None = None, rank0: bool = False) -> dict[str, torch.Tensor]:
    """Average the factors of the ``low`` layers and ``rest`` over ``world`` as the sync ``mode`` says.

    ``in_a``: this worker trained A; ``n_a``: workers that trained A; ``one_group``:
    only-b trained B over one group of every worker, so only the buffers drifted apart.
    ``as_change`` (only-learned with the tangent split): the layers whose change of W is
    sent instead of their factors, each with the SVD (U, σ, Vᵀ) its phase started from.
    Returns those layers' summed changes of W (m×n), the same on every worker.
    ``compressor``: the layers it compresses send their change as a rank-q PowerSGD
    approximation with error feedback instead of in full (see :func:`_average_learned`).
    ``rank0`` (only-b): ``rest`` and the buffers take rank 0's copy, broadcast, instead of their average.
    """
    if mode == "with-stale":
        comm.all_reduce_tensors([t for fp in low for t in (fp.A, fp.B)] + rest, world, wire_dtype=wire)
    elif mode == "only-learned":
        return _average_learned(comm, world, low, rest, wire, in_a=in_a, n_a=n_a, as_change=as_change or {},
                                compressor=compressor)
    elif mode == "full":
        for fp in low:
            lowrank.recompose(fp)
        comm.all_reduce_tensors([fp.weight for fp in low] + rest, world, wire_dtype=wire)
    elif one_group:
        # only-b over one group of everyone: nothing drifts apart but BatchNorm statistics
        if rank0:
            comm.broadcast_tensors(buffers, world)
        else:
            comm.all_reduce_tensors(buffers, world, wire_dtype=wire)
    elif rank0:  # only-b in groups, as the authors' code: B averaged, all else from rank 0 (their DDP rebuild)
        comm.all_reduce_tensors([fp.B for fp in low], world, wire_dtype=wire)
        comm.broadcast_tensors(rest, world)
    else:  # only-b in groups: A is the same frozen factor everywhere; B and the rest are averaged
        comm.all_reduce_tensors([fp.B for fp in low] + rest, world, wire_dtype=wire)
    return {}


def _average_learned(comm: Communicator, world: Group, low: list[lowrank.FactorizedParam],
                     rest: list[torch.Tensor], wire: torch.dtype | None, *, in_a: bool, n_a: int,
                     as_change: dict[str, lowrank.SVD],
                     compressor: SyncCompressor | None = None) -> dict[str, torch.Tensor]:
    """only-learned: mean of A over the A-groups, mean of B over the B-groups, the rest over everyone.

    One summed all-reduce (the bytes of with-stale): each worker contributes its
    trained factor divided by the number of workers that trained it, zeros for
    its frozen factor, and the rest divided by the world size. A layer in
    ``as_change`` contributes instead the change its trained factor made to W
    ((A − Uσ)·Vᵀ from an A-worker, U·(B − σVᵀ) from a B-worker, over the
    workers that trained it): one m×n tensor in place of two factors. The sum is
    the change the tangent merge adds to UσVᵀ; its factors are set to U·σ and
    Vᵀ on every worker (the next decomposition replaces them).

    The layers the ``compressor`` compresses send that change in its two
    all-reduces instead: one step of PowerSGD's power iteration (Vogels et al.
    2019) on the sum of the workers' shares, each share plus what earlier syncs
    did not deliver (the worker's error memory, in W's coordinates, so it
    survives changes of rank). Every worker adds the same rank-q result to W;
    what one sync leaves out, a later one sends. The reducer averages, so each
    share goes in multiplied by the world size and the average is the sum. With a
    quantising codec (``compressor.codec``: int8, E3M0) every layer in ``as_change``
    goes to the compressor, the changes too small to compress averaged in that
    format beside the Ps, their rounding kept by the same error memories.
    """
    n_b = world.size - n_a
    contrib = []
    compressed: dict[str, torch.Tensor] = {}
    for fp in low:
        if fp.name in as_change:
            u, s, vh = as_change[fp.name]
            change = (fp.A - u * s) @ vh / n_a if in_a else u @ (fp.B - s[:, None] * vh) / n_b
            if compressor is not None and (compressor.codec is not None or compressor.rank_for(fp.m, fp.n) is not None):
                compressed[fp.name] = change.mul_(world.size)
            else:
                contrib.append(change)
            continue
        contrib.append(fp.A / n_a if in_a else torch.zeros_like(fp.A))
        contrib.append(fp.B / n_b if not in_a else torch.zeros_like(fp.B))
    contrib += [t / world.size for t in rest]
    comm.all_reduce_tensors(contrib, world, average=False, wire_dtype=wire)
    if compressed:
        assert compressor is not None
        compressor.reduce(list(compressed.items()), world)  # in place: each share becomes the summed change
    changes = dict(compressed)
    received = iter(contrib)
    for fp in low:
        if fp.name in as_change:
            u, s, vh = as_change[fp.name]
            if fp.name not in compressed:
                changes[fp.name] = next(received)
            fp.A.copy_(u * s)
            fp.B.copy_(vh)
            continue
        fp.A.copy_(next(received))
        fp.B.copy_(next(received))
    for t, mean in zip(rest, received):
        t.copy_(mean)
    return changes
