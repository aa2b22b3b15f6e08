"""Top-k sparsification: the entries of each tensor of a flat buffer largest in magnitude, as values and indices
(EF21's compressor)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .codec import SparseCodec
from .wire import as_floats


def topk_count(numel: int, fraction: float) -> int:
    """Elements the compressor keeps of a tensor of ``numel`` elements (at least one)."""
    return max(1, min(numel, math.ceil(fraction * numel)))


def topk_compress(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of flat ``x`` largest in magnitude: (values, int64 indices)."""
    indices = torch.topk(x.abs(), k, sorted=False).indices
    return x[indices], indices


class TopKCodec(SparseCodec):
    """Of a flat buffer made of tensors of ``numels`` elements, the ``k = ceil(fraction * numel)`` entries of each
    tensor largest in magnitude. The message: ``K`` float32 values, then their ``K`` int32 indices into the
    buffer (``K`` the sum of the ``k``): ``8K`` bytes."""

    name = "topk"

    def __init__(self, numels: Sequence[int], fraction: float) -> None:
        self.coefficients = sum(numels)
        if self.coefficients >= 2 ** 31:
            raise ValueError(f"top-k sends int32 indices: a buffer of {self.coefficients:,} elements is too large")
        self.numels = list(numels)
        self.ks = [topk_count(n, fraction) for n in self.numels]
        self.k = sum(self.ks)

    def message_bytes(self, numel: int) -> int:
        return 8 * self.k

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        values, indices, offset = [], [], 0
        for n, k in zip(self.numels, self.ks):
            v, i = topk_compress(x[offset:offset + n], k)
            values.append(v)
            indices.append(i + offset)
            offset += n
        return torch.cat([torch.cat(values).view(torch.uint8), torch.cat(indices).to(torch.int32).view(torch.uint8)])

    def entries(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return as_floats(message[:4 * self.k]), message[4 * self.k:].clone().view(torch.int32).long()
