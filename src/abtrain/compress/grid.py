"""The chunk grid of DeMo's and SparseLoCo's codecs: a tensor as a matrix cut into equal chunks.

A tensor is seen as a matrix (rows: its first dimension, columns: the rest; a vector or scalar as one
row); each dimension is cut into chunks of its largest divisor not above a target length
(:func:`chunk_length`), so a ``rows x cols`` matrix holds ``(rows / c1) * (cols / c2)`` chunks of
``c1 * c2`` entries each.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ChunkGrid", "chunk_length"]


def chunk_length(n: int, target: int) -> int:
    """The largest divisor of ``n`` not above ``target`` (``n`` itself when ``n <= target``)."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


class ChunkGrid:
    """A tensor of ``shape`` as a ``rows x cols`` matrix cut into ``c1 x c2`` chunks (``target`` per side at most)."""

    def __init__(self, shape: torch.Size, target: int) -> None:
        self.shape = shape
        self.numel = math.prod(shape)
        self.rows = shape[0] if len(shape) >= 2 else 1
        self.cols = self.numel // self.rows
        self.c1, self.c2 = chunk_length(self.rows, target), chunk_length(self.cols, target)

    @property
    def chunks(self) -> int:
        return (self.rows // self.c1) * (self.cols // self.c2)

    @property
    def elements(self) -> int:
        """Entries of one chunk."""
        return self.c1 * self.c2

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (any shape of ``numel`` entries) as ``(rows / c1, c1, cols / c2, c2)``: chunk ``(y, x)`` is
        ``blocks[y, :, x, :]``."""
        return x.reshape(self.rows // self.c1, self.c1, self.cols // self.c2, self.c2)
