"""AB-training's sync: every worker leaves it with one model (W = Ā·B̄), in one of four modes."""

from __future__ import annotations

import time

import torch

from . import lowrank
from ...comm.communicator import Communicator
from ...comm.group import Group
from ...compress.powersgd import PowerSGDReducer
from ..base import optimizer_moments
from .config import TANGENT_CORES
from .core import ABCore, full_rank_tensors


class ABSync(ABCore):
    """The sync part of :class:`~.method.ABTraining`: the groups averaged into one full-rank model."""

    @torch.no_grad()
    def _sync(self, optimizer: torch.optim.Optimizer) -> None:
        """Average the groups into one model."""
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
                                     one_group=self.train_group is self.topo.world,
                                     as_change=self._send_as_change(low, bases), compressor=self._compressor)
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
def average_models(comm: Communicator, world: Group, mode: str, low: list[lowrank.FactorizedParam],
                   rest: list[torch.Tensor], buffers: list[torch.Tensor], wire: torch.dtype | None, *,
                   in_a: bool, n_a: int, one_group: bool,
                   as_change: dict[str, lowrank.SVD] | None = None,
                   compressor: PowerSGDReducer | None = None) -> dict[str, torch.Tensor]:
    """Average the factors of the ``low`` layers and ``rest`` over ``world`` as the sync ``mode`` says.

    ``in_a``: this worker trained A; ``n_a``: workers that trained A; ``one_group``:
    only-b trained B over one group of every worker, so only the buffers drifted apart.
    ``as_change`` (only-learned with the tangent split): the layers whose change of W is
    sent instead of their factors, each with the SVD (U, σ, Vᵀ) its phase started from.
    Returns those layers' summed changes of W (m×n), the same on every worker.
    ``compressor``: the layers it compresses send their change as a rank-q PowerSGD
    approximation with error feedback instead of in full (see :func:`_average_learned`).
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
        comm.all_reduce_tensors(buffers, world, wire_dtype=wire)
    else:  # only-b in groups: A is the same frozen factor everywhere; B and the rest are averaged
        comm.all_reduce_tensors([fp.B for fp in low] + rest, world, wire_dtype=wire)
    return {}


def _average_learned(comm: Communicator, world: Group, low: list[lowrank.FactorizedParam],
                     rest: list[torch.Tensor], wire: torch.dtype | None, *, in_a: bool, n_a: int,
                     as_change: dict[str, lowrank.SVD],
                     compressor: PowerSGDReducer | None = None) -> dict[str, torch.Tensor]:
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
    share goes in multiplied by the world size and the average is the sum.
    """
    n_b = world.size - n_a
    contrib = []
    compressed: dict[str, torch.Tensor] = {}
    for fp in low:
        if fp.name in as_change:
            u, s, vh = as_change[fp.name]
            change = (fp.A - u * s) @ vh / n_a if in_a else u @ (fp.B - s[:, None] * vh) / n_b
            if compressor is not None and compressor.rank_for(fp.m, fp.n) is not None:
                compressed[fp.name] = change.mul_(world.size)
            else:
                contrib.append(change)
            continue
        contrib.append(fp.A / n_a if in_a else torch.zeros_like(fp.A))
        contrib.append(fp.B / n_b if not in_a else torch.zeros_like(fp.B))
    contrib += [t / world.size for t in rest]
    comm.all_reduce_tensors(contrib, world, average=False, wire_dtype=wire)
    if compressed:
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
