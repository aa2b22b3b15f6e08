"""Unsigned integers of a few bits each, packed into one contiguous bit stream (:class:`IndexCodec`).

A top-k entry's position inside its chunk of ``E`` elements needs ``ceil(log2 E)`` bits (12 in a 64 × 64
chunk), a 2-bit code two: neither fills a byte. :func:`pack_bits` writes each value's ``width`` bits, most
significant first, value after value with no padding between them, and pads the stream's end to a whole
byte; :func:`unpack_bits` reads them back given the same widths. ``ceil(sum(widths) / 8)`` bytes in all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["IndexCodec", "index_width", "pack_bits", "packed_bytes", "unpack_bits"]

_BYTE = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32)


def index_width(elements: int) -> int:
    """Bits that address one of ``elements`` positions: ``ceil(log2 elements)`` (0 for a single one)."""
    if elements < 1:
        raise ValueError(f"a chunk holds at least one element, got {elements}")
    return (elements - 1).bit_length()


def packed_bytes(total_bits: int) -> int:
    """Bytes of a stream of ``total_bits`` bits."""
    return math.ceil(total_bits / 8)


def _positions(widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value and bit slot ``j`` (``j < max width``): the shift that brings bit ``j`` (most significant first)
    down to bit 0, and whether the value has that bit."""
    most = int(widths.max()) if widths.numel() else 0
    j = torch.arange(most, dtype=torch.int64, device=widths.device)
    present = j.unsqueeze(0) < widths.unsqueeze(1)
    shift = (widths.unsqueeze(1) - 1 - j.unsqueeze(0)).clamp_(min=0)
    return shift, present


def pack_bits(values: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 ``values``, value ``i`` in ``widths[i]`` bits: a uint8 stream of
    ``packed_bytes(widths.sum())`` bytes."""
    if values.numel() and (bool((values < 0).any()) or bool((values >> widths).any())):
        raise ValueError("pack_bits: a value does not fit its width")
    shift, present = _positions(widths)
    bits = ((values.unsqueeze(1) >> shift) & 1)[present].to(torch.int32)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)])
    return (bits.view(-1, 8) * _BYTE.to(bits.device)).sum(1).to(torch.uint8)


def unpack_bits(stream: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The int64 values :func:`pack_bits` wrote into the uint8 ``stream`` with these ``widths``."""
    bits = ((stream.to(torch.int32).unsqueeze(1) & _BYTE.to(stream.device)) > 0).reshape(-1).to(torch.int64)
    shift, present = _positions(widths)
    slots = torch.zeros(shift.shape, dtype=torch.int64, device=stream.device)
    slots[present] = bits[:int(present.sum())]
    return (slots << shift).masked_fill_(~present, 0).sum(1)


class IndexCodec:
    """Positions inside chunks in fixed-width fields: ``counts[g]`` positions of ``widths[g]`` bits for each
    group ``g`` (a tensor's entries, whose chunks all hold as many elements). The codec shape of
    :class:`~abtrain.compress.codec.Codec` -- ``encode``, ``decode``, ``message_bytes`` -- for int64 positions
    instead of float32 values: ``ceil(sum_g counts[g] * widths[g] / 8)`` bytes."""

    name = "index"

    def __init__(self, counts: Sequence[int], widths: Sequence[int], device: torch.device | None = None) -> None:
        if len(counts) != len(widths):
            raise ValueError(f"IndexCodec: {len(counts)} counts for {len(widths)} widths")
        self.count = sum(counts)
        self.bits = sum(c * w for c, w in zip(counts, widths))
        self.widths = torch.repeat_interleave(torch.tensor(list(widths), dtype=torch.int64),
                                              torch.tensor(list(counts), dtype=torch.int64)).to(device)

    def message_bytes(self, count: int) -> int:
        if count != self.count:
            raise ValueError(f"IndexCodec holds {self.count} positions, got {count}")
        return packed_bytes(self.bits)

    def encode(self, positions: torch.Tensor) -> torch.Tensor:
        return pack_bits(positions.reshape(-1).to(torch.int64), self.widths)

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        return unpack_bits(message, self.widths)
