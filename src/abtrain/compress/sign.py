"""Sign compression: each element as one bit (its sign), with one scale ``mean |x|`` per segment (the value
minimising ``||x - s sign(x)||``); signs packed 8 to a byte. 1-bit SGD's and 1-bit Adam's compressor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .codec import Codec
from .wire import as_floats

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


def segment_ids(starts: Sequence[int], numel: int, slices: int) -> tuple[torch.Tensor, int]:
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


class SignCodec(Codec):
    """``s * sign(x)`` for a buffer of ``length`` elements cut into segments, one float32 scale ``s = mean |x|``
    per segment: ``length / 8`` bytes of signs, then ``4 * scales`` bytes of scales.

    Segments begin at ``starts`` (and at 0). ``scales`` (at least the number of
    segments) fixes the message's size: scales past the last segment are 0.
    Where a buffer is cut into slices (:meth:`for_slices`) every slice boundary
    begins a segment too, and every slice carries as many scales as the slice
    with the most segments, so that all slices' messages have one size.
    """

    name = "sign"
    align = 8

    def __init__(self, length: int, starts: Sequence[int] = (), scales: int | None = None,
                 device: torch.device | None = None) -> None:
        if length < 8 or length % 8:
            raise ValueError(f"sign compression packs 8 signs to a byte: length must be a positive multiple of 8, "
                             f"got {length}")
        self.length = length
        self.starts = sorted({0} | {s for s in starts if 0 <= s < length})
        self.scales = len(self.starts) if scales is None else scales
        if self.scales < len(self.starts):
            raise ValueError(f"{len(self.starts)} segments need at least as many scales, got {self.scales}")
        self.device = device
        # Built at the first encode or decode: a buffer only ever cut in slices never holds its own.
        self._ids: torch.Tensor | None = None  # each element's segment
        self._counts: torch.Tensor | None = None  # each segment's elements (float32)
        self._slices: dict[tuple[int, int], list[Codec]] = {}

    def _segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ids is None or self._counts is None:
            bounds = torch.tensor(self.starts, dtype=torch.int64)
            ids = torch.searchsorted(bounds, torch.arange(self.length, dtype=torch.int64), right=True) - 1
            self._ids = ids.to(self.device)
            self._counts = torch.bincount(ids, minlength=self.scales).to(device=self.device, dtype=torch.float32)
        return self._ids, self._counts

    def message_bytes(self, numel: int) -> int:
        if numel != self.length:
            raise ValueError(f"this sign codec encodes {self.length} elements, not {numel}")
        return self.length // 8 + 4 * self.scales

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        ids, counts = self._segments()
        scales = torch.zeros(self.scales, dtype=torch.float32, device=x.device).index_add_(0, ids, x.abs())
        return torch.cat([pack_signs(x), scales.div_(counts.clamp(min=1)).view(torch.uint8)])

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        signs = self.length // 8
        return unpack_signs(message[:signs]).mul_(as_floats(message[signs:])[self._segments()[0]])

    def for_slices(self, length: int, count: int) -> list[Codec]:
        """One codec per slice: its segments those of this buffer inside it, cut at its start."""
        if length * count != self.length:
            raise ValueError(f"{count} slices of {length} elements do not make this codec's {self.length}")
        if (length, count) not in self._slices:
            _, most = segment_ids(self.starts, self.length, count)
            self._slices[length, count] = [
                SignCodec(length, [s - j * length for s in self.starts], scales=most, device=self.device)
                for j in range(count)]
        return self._slices[length, count]
