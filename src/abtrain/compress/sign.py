"""Sign compression: each element as one bit (its sign), with one scale ``mean |x|`` per segment (the value
minimising ``||x - s sign(x)||``); signs packed 8 to a byte. 1-bit SGD's and 1-bit Adam's compressor.
"""

from __future__ import annotations

import torch

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of flat ``x`` (numel a multiple of 8), 1 for ``x >= 0``, 8 to a uint8, first element in the high bit."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    return ((x >= 0).view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """The ±1.0 float32 signs of :func:`pack_signs`' bytes."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) & weights).ne(0).view(-1)
    return bits.to(torch.float32).mul_(2).sub_(1)


def segment_ids(starts: list[int], numel: int, slices: int) -> tuple[torch.Tensor, int]:
    """Per element of a buffer of ``numel`` (divisible by ``slices``) its segment's id, ``slice * M + local``.

    ``starts`` are the first elements of the segments; the slice boundaries are
    added. Returns the ids and ``M``, the most segments any slice holds.
    """
    length = numel // slices
    bounds = sorted(set(starts) | {j * length for j in range(slices)})
    bounds_t = torch.tensor(bounds, dtype=torch.int64)
    element = torch.arange(numel, dtype=torch.int64)
    which = torch.searchsorted(bounds_t, element, right=True) - 1  # index of the segment in ``bounds``
    slice_of = element // length
    first = torch.searchsorted(bounds_t, torch.arange(slices, dtype=torch.int64) * length)
    local = which - first[slice_of]
    m = int(torch.bincount(bounds_t // length, minlength=slices).max())
    return slice_of * m + local, m


def sign_compress(x: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as (packed signs, one float32 scale ``mean |x|`` per segment); ``counts`` are the segments' sizes."""
    scales = torch.zeros(counts.numel(), dtype=torch.float32, device=x.device).index_add_(0, ids, x.abs())
    return pack_signs(x), scales.div_(counts.clamp(min=1))


def sign_decompress(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The ``s * sign`` values that :func:`sign_compress` sent."""
    return unpack_signs(packed).mul_(scales[ids])
