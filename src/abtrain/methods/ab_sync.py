"""AB-training's sync: every worker leaves it with one model (W = Ā·B̄), in one of four modes."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from .. import lowrank
from ..comm import Communicator, Group


def full_rank_tensors(module: nn.Module, records: list[lowrank.FactorizedParam]) -> list[torch.Tensor]:
    """Parameters not represented by factors this phase (full-mode W, biases, norms, kept layers)."""
    factor_ids = {id(t) for fp in records for t in (fp.A, fp.B)}
    low_ids = {id(fp.weight) for fp in records if fp.mode == "lowrank"}
    return [p for p in module.parameters() if id(p) not in factor_ids and id(p) not in low_ids]


@torch.no_grad()
def average_models(comm: Communicator, world: Group, mode: str, low: list[lowrank.FactorizedParam],
                   rest: list[torch.Tensor], buffers: list[torch.Tensor], wire: torch.dtype | None, *,
                   in_a: bool, n_a: int, one_group: bool,
                   as_change: dict[str, lowrank.SVD] | None = None,
                   compressor: ChangeCompressor | None = None) -> dict[str, torch.Tensor]:
    """Average the factors of the ``low`` layers and ``rest`` over ``world`` as the sync ``mode`` says.

    ``in_a``: this worker trained A; ``n_a``: workers that trained A; ``one_group``:
    only-b trained B over one group of every worker, so only the buffers drifted apart.
    ``as_change`` (only-learned with the tangent split): the layers whose change of W is
    sent instead of their factors, each with the SVD (U, σ, Vᵀ) its phase started from.
    Returns those layers' summed changes of W (m×n), the same on every worker.
    ``compressor``: the layers it takes send their change as a rank-q approximation with error
    feedback (:class:`ChangeCompressor`) instead of in full.
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
                     compressor: ChangeCompressor | None = None) -> dict[str, torch.Tensor]:
    """only-learned: mean of A over the A-groups, mean of B over the B-groups, the rest over everyone.

    One summed all-reduce (the bytes of with-stale): each worker contributes its
    trained factor divided by the number of workers that trained it, zeros for
    its frozen factor, and the rest divided by the world size. A layer in
    ``as_change`` contributes instead the change its trained factor made to W
    ((A − Uσ)·Vᵀ from an A-worker, U·(B − σVᵀ) from a B-worker, over the
    workers that trained it): one m×n tensor in place of two factors. The sum is
    the change the tangent merge adds to UσVᵀ; its factors are set to U·σ and
    Vᵀ on every worker (the next decomposition replaces them). The layers the
    ``compressor`` takes send that change in its own two all-reduces instead.
    """
    n_b = world.size - n_a
    contrib = []
    compressed: dict[str, torch.Tensor] = {}
    for fp in low:
        if fp.name in as_change:
            u, s, vh = as_change[fp.name]
            change = (fp.A - u * s) @ vh / n_a if in_a else u @ (fp.B - s[:, None] * vh) / n_b
            if compressor is not None and compressor.takes(fp.m, fp.n):
                compressed[fp.name] = change
            else:
                contrib.append(change)
            continue
        contrib.append(fp.A / n_a if in_a else torch.zeros_like(fp.A))
        contrib.append(fp.B / n_b if not in_a else torch.zeros_like(fp.B))
    contrib += [t / world.size for t in rest]
    comm.all_reduce_tensors(contrib, world, average=False, wire_dtype=wire)
    changes = compressor.reduce(comm, world, compressed, wire) if compressed else {}
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


class ChangeCompressor:
    """The tangent sync's change of W sent as a rank-q approximation with error feedback.

    One step of PowerSGD's power iteration (Vogels et al. 2019) on the sum of the
    workers' changes M = Σ M_w, each M_w this worker's share of the change plus
    what earlier syncs did not send (its memory): P = Σ M_w·Q over all workers,
    P̂ its orthonormal basis, Q' = Σ M_wᵀ·P̂, and every worker adds P̂·Q'ᵀ, the
    same everywhere, to W. Each worker keeps M_w − P̂·P̂ᵀ·M_w in its memory and
    adds it to its next change, so what one sync leaves out a later one sends.
    Q starts from a seeded random matrix, the same on every worker, and is
    warm-started from the last sync's Q'. A layer is taken only where
    q·(m + n) < m·n; the memory is in W's coordinates, so it survives changes
    of rank; what is still in it after the run's last sync is not sent.
    """

    def __init__(self, rank: int, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"the sync's rank must be >= 1, got {rank}")
        self.rank = rank
        self.seed = seed
        self.memory: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}

    def takes(self, m: int, n: int) -> bool:
        """Whether an m×n layer's change is sent compressed: its P and Q hold fewer numbers than the change."""
        q = min(self.rank, m, n)
        return q * (m + n) < m * n

    @torch.no_grad()
    def reduce(self, comm: Communicator, world: Group, changes: dict[str, torch.Tensor],
               wire: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Sum ``changes`` (name: this worker's m×n share) over ``world``, each as its rank-q approximation."""
        names = sorted(changes)
        full = [changes[name] + self.memory[name] if name in self.memory else changes[name] for name in names]
        qs = [self._start(name, m) for name, m in zip(names, full)]
        ps = [m @ q for m, q in zip(full, qs)]
        comm.all_reduce_tensors(ps, world, average=False, wire_dtype=wire)
        ps = [torch.linalg.qr(p).Q for p in ps]
        qs = [m.T @ p for m, p in zip(full, ps)]
        comm.all_reduce_tensors(qs, world, average=False, wire_dtype=wire)
        out = {}
        for name, m, p, q in zip(names, full, ps, qs):
            out[name] = p @ q.T
            self.memory[name] = m - p @ (p.T @ m)
            self.q[name] = q.clone()
        return out

    def _start(self, name: str, m: torch.Tensor) -> torch.Tensor:
        if name not in self.q:
            # a seed from the layer's name, so every worker draws the same Q without a collective
            g = torch.Generator().manual_seed(self.seed + zlib.crc32(name.encode()))
            self.q[name] = torch.randn(m.shape[1], min(self.rank, *m.shape), generator=g).to(m.device, m.dtype)
        return self.q[name]

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"memory": dict(self.memory), "q": dict(self.q)}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.memory = dict(state.get("memory", {}))
        self.q = dict(state.get("q", {}))
