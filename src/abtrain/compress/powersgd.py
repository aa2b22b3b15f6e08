"""PowerSGD: rank-r compression of gradient matrices with error feedback and warm start.

Vogels et al., NeurIPS 2019, Algorithm 1, in the form of torch's
``powerSGD_hook``: each gradient matrix M (plus its error memory) is sent as
P = M·Q and Q = Mᵀ·P̂ (r·(m+n) numbers instead of m·n); tensors that would
not shrink (1-D, small) are averaged uncompressed. ``wire_dtype=bfloat16``
sends all three buffers in half the bytes; error feedback keeps the rounding.
A :class:`~abtrain.compress.reducer.Reducer`: the same seam as the uncompressed averages.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..comm.communicator import Communicator
from ..comm.group import Group
from .allreduce import compressed_all_reduce
from .codec import Codec
from .reducer import NamedGrads, Reducer, unpack


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise the columns of each matrix of a batch (b × n × r) in place.

    QR for r > 2 in full precision (faster), Gram-Schmidt otherwise; ``epsilon``
    (Gram-Schmidt only) keeps an all-zero column from dividing by zero. The
    choice and the arithmetic are those of torch's PowerSGD hook, so both give
    the same bits.
    """
    rank = matrices.shape[2]
    if rank > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        r = torch.empty(matrices.shape[0], rank, rank, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r))
        return
    for i in range(rank):
        col = matrices[:, :, i:i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= norm + epsilon if epsilon else norm
        if i + 1 < rank:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGDReducer(Reducer):
    """Rank-``rank`` PowerSGD; a gradient viewed as the m×n matrix is compressed when (m+n)·r·rate < m·n.

    Per call: add each gradient's error memory; P = M·Q summed and the
    uncompressed tensors averaged (one collective), the Ps orthonormalised;
    Q = Mᵀ·P averaged (one collective); M ≈ P·Qᵀ; the error
    memory keeps what this worker's (corrected) gradient lost. Random Qs come
    from ``seed`` through one NumPy stream, one draw per new set of tensors
    (the same on every worker); with ``warm_start`` each Q starts from the last one.

    ``wire_dtype`` (bfloat16) casts each buffer for its all-reduce
    and back; averages divide before the sum, as :class:`BF16AllReduce` does.
    The Ps are orthonormalised and M ≈ P·Qᵀ formed in the gradients' dtype from
    what arrived, so the rounding the narrow type costs is part of what the
    error memory keeps and is sent again later (with ``error_feedback``).

    ``codec`` (a quantising :class:`~abtrain.compress.codec.Codec`: int8, E3M0) sends the three buffers in
    that format through :func:`~abtrain.compress.allreduce.compressed_all_reduce` instead (its all_to_all and
    all_gather; ``wire_dtype`` is then not used): the Ps are summed as the mean of what arrived times the
    group's size, the Qs and the uncompressed tensors averaged. Every worker decodes the same bytes, so every
    worker forms the same P·Qᵀ, and what the codes lose is again in the error memories.
    """

    def __init__(self, comm: Communicator, rank: int = 4, *, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 seed: int = 0, wire_dtype: torch.dtype | None = None, codec: Codec | None = None) -> None:
        super().__init__(comm)
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        if codec is not None and codec.summable:
            raise ValueError(f"codec {codec.name} is summed by the all_reduce itself: give it as wire_dtype")
        self.rank = rank
        self.codec = codec
        self.wire_dtype = wire_dtype
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(seed)
        self.errors: dict[str, torch.Tensor] = {}
        self.qs: dict[str, torch.Tensor] = {}  # each tensor's last Q (warm start)
        self.numel_before = 0  # elements handed to the compressed reductions
        self.numel_after = 0  # elements they sent: uncompressed tensors, every P and Q

    def _rank_of(self, grad: torch.Tensor) -> int | None:
        """r for ``grad`` viewed m×n, or None when compression would not pay."""
        if grad.ndim == 0 or grad.numel() == 0:
            return None
        return self.rank_for(grad.shape[0], grad.numel() // grad.shape[0])

    def rank_for(self, m: int, n: int) -> int | None:
        """r for an m×n matrix, or None when its P and Q would not be ``min_compression_rate`` times smaller."""
        r = min(m, n, self.rank)
        return r if (m + n) * r * self.min_compression_rate < m * n else None

    def compressible(self, grad: torch.Tensor) -> bool:
        return self._rank_of(grad) is not None

    @property
    def compression_rate(self) -> float:
        return self.numel_before / self.numel_after if self.numel_after else 0

    @torch.no_grad()
    def reduce(self, grads: NamedGrads, group: Group) -> None:
        if group.size <= 1 or not grads:
            return
        if self.error_feedback:
            for name, g in grads:
                if name in self.errors:
                    g.add_(self.errors[name])  # the gradient earlier compressions did not deliver
            sent = [g.clone() for _, g in grads]
        plain, low = [], []
        for name, g in grads:
            r = self._rank_of(g)
            self.numel_before += g.numel()
            if r is None:
                plain.append(g)
                self.numel_after += g.numel()
            else:
                low.append((name, g.view(1, g.shape[0], -1), r))
                self.numel_after += (g.shape[0] + g.numel() // g.shape[0]) * r
        # Matrices of one shape next to each other (torch's order: it decides which random numbers each Q gets).
        by_shape: dict[torch.Size, list[tuple[str, torch.Tensor, int]]] = {}
        for item in low:
            by_shape.setdefault(item[1].shape, []).append(item)
        low = [item for same in by_shape.values() for item in same]
        dtype, device = grads[0][1].dtype, grads[0][1].device
        # The uncompressed tensors travel in the Ps' collective (one round of messages instead of two):
        # ``first`` is [every P | the uncompressed tensors of the Ps' dtype].
        rides = [bool(low) and g.dtype == dtype for g in plain]
        riders = [g for g, r in zip(plain, rides) if r]
        p_numel = sum(m.shape[1] * r for _, m, r in low)
        first = torch.empty(p_numel + sum(g.numel() for g in riders), dtype=dtype, device=device)
        p_flat = first[:p_numel]
        q_flat = torch.empty(sum(m.shape[2] * r for _, m, r in low), dtype=dtype, device=device)
        ps, qs, p_at, q_at = [], [], 0, 0
        for _, m, r in low:
            ps.append(p_flat[p_at:p_at + m.shape[1] * r].view(1, m.shape[1], r))
            qs.append(q_flat[q_at:q_at + m.shape[2] * r].view(1, m.shape[2], r))
            p_at += m.shape[1] * r
            q_at += m.shape[2] * r
        # Warm start where every tensor of the call has its Q of the last call: by name, so that a call whose
        # bucket holds the same tensors in another order (DDP's first step after a resume, before it orders its
        # buckets again) starts from them too; the first call of a bucket draws them, as torch's hook does.
        if self.warm_start and all(self.qs.get(name) is not None and self.qs[name].shape == q.shape
                                   for (name, _, _), q in zip(low, qs)):
            for (name, _, _), q in zip(low, qs):
                q.copy_(self.qs[name])
                orthogonalize(q, self.epsilon)
        else:
            # A generator of its own (the global RNG stays untouched), seeded as torch's hook seeds the global one.
            gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=gen, dtype=dtype))
                orthogonalize(q, self.epsilon)
        for (_, m, _), q, p in zip(low, qs, ps):
            torch.bmm(m, q, out=p)
        alone = [g for g, r in zip(plain, rides) if not r]
        if alone and self.codec is not None:
            flat = torch.cat([g.reshape(-1).float() for g in alone])
            unpack(compressed_all_reduce(self.comm, group, flat, self.codec), alone)
        elif alone:
            self.comm.all_reduce_tensors(alone, group, average=True, wire_dtype=self.wire_dtype)
        if low:
            self._reduce_first(first, p_numel, riders, group)
            for p in ps:
                orthogonalize(p, self.epsilon)
            for (_, m, _), p, q in zip(low, ps, qs):
                torch.bmm(m.transpose(1, 2), p, out=q)
            self._all_reduce(q_flat, group, average=True)
            for (_, m, _), p, q in zip(low, ps, qs):
                torch.bmm(p, q.transpose(1, 2), out=m)
            self._compressed([name for name, _, _ in low], ps, qs)
            if self.warm_start:
                self.qs.update((name, q) for (name, _, _), q in zip(low, qs))
        if self.error_feedback:
            for (name, g), before in zip(grads, sent):
                self._remember(name, before.sub_(g))  # what this worker's gradient lost in the reduction

    def _compressed(self, names: list[str], ps: list[torch.Tensor], qs: list[torch.Tensor]) -> None:
        """After a call's second collective: P (1×m×r) and Q (1×n×r) of each tensor it compressed, which now
        holds P·Qᵀ (a subclass may keep them; they are overwritten by the next call)."""

    def _remember(self, name: str, lost: torch.Tensor) -> None:
        """Keep what tensor ``name`` lost in this call, to add it to the next one (a subclass may narrow it)."""
        self.errors[name] = lost

    def _reduce_first(self, first: torch.Tensor, p_numel: int, riders: list[torch.Tensor], group: Group) -> None:
        """Sum the Ps (orthonormalised next) and average the uncompressed ``riders`` in one collective.

        The averages divide as a collective of their own would: after the sum in
        full precision, before it on a narrow wire (against overflow).
        """
        offset = p_numel
        for g in riders:
            first[offset:offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        if self.codec is not None:
            first.copy_(compressed_all_reduce(self.comm, group, first.float(), self.codec))
            first[:p_numel].mul_(group.size)  # the Ps' sum: the mean of what arrived times the group's size
        elif self.wire_dtype is None:
            self.comm.all_reduce(first, group)
            first[p_numel:].div_(group.size)
        else:
            sent = first.to(self.wire_dtype)
            sent[p_numel:].div_(group.size)
            first.copy_(self.comm.all_reduce(sent, group))
        unpack(first[p_numel:], riders)

    def _all_reduce(self, flat: torch.Tensor, group: Group, average: bool) -> None:
        """Sum (or average) ``flat`` in place over ``group``, sent as :attr:`wire_dtype` when one is set, or in
        :attr:`codec`'s format."""
        if self.codec is not None:
            mean = compressed_all_reduce(self.comm, group, flat.float(), self.codec)
            flat.copy_(mean if average else mean.mul_(group.size))
        elif self.wire_dtype is None:
            self.comm.all_reduce(flat, group, average=average)
        else:
            self.comm.all_reduce_tensors([flat], group, average=average, wire_dtype=self.wire_dtype)

    def reset(self) -> None:
        self.errors.clear()

    def state_dict(self) -> dict[str, Any]:
        # NumPy's RandomState as plain values and a tensor, loadable with torch.load(weights_only=True).
        kind, keys, pos, has_gauss, cached = self.rng.get_state()
        return {"errors": dict(self.errors), "qs": dict(self.qs), "numel_before": self.numel_before,
                "numel_after": self.numel_after,
                "rng": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.errors = dict(state["errors"])
        self.qs = dict(state["qs"])
        self.numel_before, self.numel_after = state["numel_before"], state["numel_after"]
        rng = state["rng"]
        self.rng.set_state((rng["kind"], rng["keys"].numpy().astype("uint32"), rng["pos"], rng["has_gauss"],
                            rng["cached_gaussian"]))
