"""Top-k sparsification: the entries of a tensor largest in magnitude, as values and indices (EF21's compressor)."""

from __future__ import annotations

import math

import torch


def topk_count(numel: int, fraction: float) -> int:
    """Elements the compressor keeps of a tensor of ``numel`` elements (at least one)."""
    return max(1, min(numel, math.ceil(fraction * numel)))


def topk_compress(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of flat ``x`` largest in magnitude: (values, int64 indices)."""
    indices = torch.topk(x.abs(), k, sorted=False).indices
    return x[indices], indices
