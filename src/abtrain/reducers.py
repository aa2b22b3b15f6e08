"""Gradient reducers: how a list of gradients is averaged over a group of workers.

One seam (``reduce(named_grads, group)``) with three implementations, each
sending its traffic through the :class:`~abtrain.comm.Communicator` so the
ledger counts exactly what travels:

* :class:`AllReduce` -- one flat fp32 all-reduce (ordinary data parallelism).
* :class:`BF16AllReduce` -- the same buffer sent as bfloat16 (half the bytes).
* :class:`PowerSGDReducer` -- rank-r PowerSGD with error feedback and warm start
  (Vogels et al., NeurIPS 2019, Algorithm 1): each gradient matrix M (plus its
  error memory) is sent as P = M·Q and Q = Mᵀ·P̂ (r·(m+n) numbers instead of m·n);
  tensors that would not shrink (1-D, small) go uncompressed in P's buffer.

Every worker ends a ``reduce`` with the same gradients. Reducers hold state
(error memories, warm-start Qs) keyed by parameter name, so it checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .comm import Communicator, Group

NamedGrads = Sequence[tuple[str, torch.Tensor]]


class Reducer:
    """Average ``grads`` (name, tensor) in place over ``group``."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def reduce(self, grads: NamedGrads, group: Group) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget memories that belong to the gradients of an earlier phase."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class AllReduce(Reducer):
    """Plain averaging: one flat all-reduce per dtype."""

    def reduce(self, grads: NamedGrads, group: Group) -> None:
        self.comm.all_reduce_tensors([g for _, g in grads], group, average=True)


class BF16AllReduce(Reducer):
    """Averaging with the buffer sent as bfloat16 (divided by the group size before the sum)."""

    def reduce(self, grads: NamedGrads, group: Group) -> None:
        self.comm.all_reduce_tensors([g for _, g in grads], group, average=True, wire_dtype=torch.bfloat16)


def _orthonormal_columns(m: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``m`` (n x r), in place; the same on every worker for the same input."""
    for i in range(m.shape[1]):
        col = m[:, i]
        col.div_(col.norm() + eps)
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1:]
            rest.sub_(col[:, None] * (col @ rest)[None, :])
    return m


class PowerSGDReducer(Reducer):
    """Rank-``rank`` PowerSGD with error feedback; a matrix is compressed when r(m+n) < m·n / 2."""

    def __init__(self, comm: Communicator, rank: int = 4, seed: int = 0) -> None:
        super().__init__(comm)
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank = rank
        self.seed = seed
        self.errors: dict[str, torch.Tensor] = {}
        self.qs: dict[str, torch.Tensor] = {}

    def compressible(self, grad: torch.Tensor) -> bool:
        if grad.ndim < 2:
            return False
        m, n = grad.shape[0], grad[0].numel()
        r = min(self.rank, m, n)
        return 2 * r * (m + n) < m * n

    def _q(self, name: str, n: int, r: int, device: torch.device) -> torch.Tensor:
        q = self.qs.get(name)
        if q is None or q.shape != (n, r):
            # The same seed on every worker gives the same Q (only its first use is random).
            gen = torch.Generator().manual_seed(self.seed + sum(map(ord, name)) * 7919 + n)
            q = torch.randn(n, r, generator=gen).to(device)
            self.qs[name] = q
        return q

    @torch.no_grad()
    def reduce(self, grads: NamedGrads, group: Group) -> None:
        if group.size <= 1:
            return
        low = [(name, g) for name, g in grads if self.compressible(g)]
        plain = [g for name, g in grads if not self.compressible(g)]
        mats, ps, qs = [], [], []
        for name, g in low:
            m = g.reshape(g.shape[0], -1)
            err = self.errors.get(name)
            if err is not None:
                m.add_(err)  # the gradient the last compressions did not deliver
            q = self._q(name, m.shape[1], min(self.rank, *m.shape), g.device)
            _orthonormal_columns(q)
            mats.append(m)
            ps.append(m @ q)
            qs.append(q)
        # Step 1: the Ps (summed) and the uncompressed tensors (averaged) in one collective.
        flat = torch.cat([p.reshape(-1) for p in ps] + [t.reshape(-1) / group.size for t in plain])
        self.comm.all_reduce(flat, group)
        offset = 0
        for p in ps:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        for t in plain:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        if not mats:
            return
        # Step 2: Q = M^T P over an orthonormal P, averaged; the approximation is P Q^T.
        for p, q, m in zip(ps, qs, mats):
            _orthonormal_columns(p)
            torch.matmul(m.T, p, out=q)
        self.comm.all_reduce_tensors(qs, group, average=True)
        for (name, _), m, p, q in zip(low, mats, ps, qs):
            approx = p @ q.T
            self.errors[name] = m - approx  # what this worker's gradient lost in the compression
            m.copy_(approx)

    def reset(self) -> None:
        self.errors.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"errors": dict(self.errors), "qs": dict(self.qs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.errors = dict(state["errors"])
        self.qs = dict(state["qs"])


DENSE_REDUCERS = ("fp32", "bf16", "powersgd")


def build_reducer(kind: str, comm: Communicator, rank: int = 4, seed: int = 0) -> Reducer:
    """The reducer called ``kind`` (one of :data:`DENSE_REDUCERS`)."""
    if kind == "fp32":
        return AllReduce(comm)
    if kind == "bf16":
        return BF16AllReduce(comm)
    if kind == "powersgd":
        return PowerSGDReducer(comm, rank=rank, seed=seed)
    raise ValueError(f"unknown gradient reducer {kind!r}; choose one of: {', '.join(DENSE_REDUCERS)}")
