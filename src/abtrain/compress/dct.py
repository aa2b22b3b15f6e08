"""The chunked 2-D DCT of DeMo and its top-k components per chunk.

A tensor is seen as a matrix (rows = its first dimension, columns the rest; a
vector as one row); each dimension is cut into chunks of its largest divisor
not above a target length, and every chunk gets an orthonormal 2-D DCT-II.
"""

from __future__ import annotations

import math

import torch


def chunk_length(n: int, target: int) -> int:
    """The largest divisor of ``n`` not above ``target`` (``n`` itself when ``n <= target``)."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``C`` (float64): ``C @ x`` transforms, ``C.T @ y`` inverts."""
    k = torch.arange(n, dtype=torch.float64).view(-1, 1)
    i = torch.arange(n, dtype=torch.float64).view(1, -1)
    c = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c


class ChunkedDCT:
    """The chunked 2-D DCT of one tensor: ``encode`` gives (chunks, chunk elements), ``decode`` inverts it."""

    def __init__(self, shape: torch.Size, target: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        rows = shape[0] if len(shape) >= 2 else 1
        cols = math.prod(shape) // rows
        self.shape, self.rows, self.cols = shape, rows, cols
        self.c1, self.c2 = chunk_length(rows, target), chunk_length(cols, target)
        self.left = dct_matrix(self.c1).to(dtype=dtype, device=device)
        self.right = dct_matrix(self.c2).to(dtype=dtype, device=device)

    @property
    def chunks(self) -> int:
        return (self.rows // self.c1) * (self.cols // self.c2)

    @property
    def elements(self) -> int:
        """Entries of one chunk."""
        return self.c1 * self.c2

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(self.rows // self.c1, self.c1, self.cols // self.c2, self.c2)
        coef = torch.einsum("yaxb,ia,jb->yxij", blocks, self.left.to(x.dtype), self.right.to(x.dtype))
        return coef.reshape(self.chunks, self.elements)

    def decode(self, coef: torch.Tensor) -> torch.Tensor:
        blocks = coef.reshape(self.rows // self.c1, self.cols // self.c2, self.c1, self.c2)
        x = torch.einsum("yxij,ia,jb->yaxb", blocks, self.left.to(coef.dtype), self.right.to(coef.dtype))
        return x.reshape(self.shape)


def extract(coef: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk (row) the ``k`` coefficients largest in magnitude: (values, indices), both (chunks, k)."""
    index = torch.topk(coef.abs(), k, dim=-1, sorted=False).indices
    return coef.gather(-1, index), index


def scatter_mean(values: list[torch.Tensor], indices: list[torch.Tensor], chunks: int, elements: int) -> torch.Tensor:
    """The workers' sparse components summed per (chunk, index), divided by how many workers sent each.

    As the authors' ``scatter_reduce(..., "mean", include_self=False)``: an
    entry one worker sent keeps its value, one all sent is their mean. Added
    worker by worker in rank order, so every worker gets the same bits.
    """
    total = torch.zeros(chunks, elements, dtype=values[0].dtype, device=values[0].device)
    count = torch.zeros_like(total)
    for v, i in zip(values, indices):
        total.scatter_add_(-1, i, v)
        count.scatter_add_(-1, i, torch.ones_like(v))
    return total.div_(count.clamp_(min=1))
