"""SparseLoCo's 2-bit values: each tensor's selected entries in 4 bins sized by their standard deviation,
decoded as the mean of each bin (:class:`TwoBitCodec`).

The statistical quantiser of the authors' code (``quantization_bins = 4``, ``quantization_range = 6``), per
segment of ``n`` values ``v`` (the top-k entries of one tensor)::

    mu = mean(v),  c = v - mu
    sigma = ||c|| / sqrt(n - 1)                 the sample standard deviation (0 for n = 1)
    s = 6 * sigma / 4                           a range of 6 sigma over 4 bins (s = 1 where that is 0)
    q = clamp(round(c / s) + 2, 0, 3)           2 bits; round half to even
    lookup[b] = mean of the c with q = b        (0 for an empty bin)
    decoded = lookup[q] + mu

What travels per segment: its ``n`` codes at 2 bits (all segments' codes in one stream) and 5 float32
(``mu`` and the 4 bin means): ``ceil(2 * sum(n) / 8) + 20 * segments`` bytes. The bins are not symmetric
(code 2 is the centre bin ``|c| < 0.75 sigma``, 3 every ``c >= 0.75 sigma``, 1 and 0 the negative side split
at ``-2.25 sigma``): the authors' offset of ``bins // 2``, kept as they run it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .bits import pack_bits, packed_bytes, unpack_bits
from .codec import Codec
from .wire import as_floats

__all__ = ["TwoBitCodec"]

BINS = 4
RANGE_SIGMAS = 6.0
#: Float32 numbers sent per segment: the shift and the mean of each bin.
SCALARS = 1 + BINS


class TwoBitCodec(Codec):
    """2-bit codes with a shift and 4 bin means per segment (see the module docstring); ``segments`` are the
    lengths of the consecutive segments of the flat buffer."""

    name = "2bit"

    def __init__(self, segments: Sequence[int], device: torch.device | None = None) -> None:
        self.segments = list(segments)
        if any(n < 1 for n in self.segments):
            raise ValueError(f"TwoBitCodec: every segment holds at least one value, got {self.segments}")
        self.numel = sum(self.segments)
        self.widths = torch.full((self.numel,), 2, dtype=torch.int64, device=device)

    def message_bytes(self, numel: int) -> int:
        if numel != self.numel:
            raise ValueError(f"TwoBitCodec holds {self.numel} values in {len(self.segments)} segments, got {numel}")
        return packed_bytes(2 * numel) + 4 * SCALARS * len(self.segments)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.message_bytes(x.numel())
        codes, scalars = [], []
        for v in x.float().split(self.segments):
            q, table = quantize(v)
            codes.append(q)
            scalars.append(table)
        stream = pack_bits(torch.cat(codes), self.widths)
        return torch.cat([stream, torch.cat(scalars).view(torch.uint8)])

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        at = packed_bytes(2 * self.numel)
        codes = unpack_bits(message[:at], self.widths)
        scalars = as_floats(message[at:]).view(-1, SCALARS)
        return torch.cat([table[1:][q] + table[0] for q, table in zip(codes.split(self.segments), scalars)])


def quantize(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 codes in 0..3, float32 [mu, lookup 0..3]) of one segment of float32 values."""
    n = v.numel()
    mu = v.mean()
    c = v - mu
    sigma = c.norm() / math.sqrt(n - 1) if n > 1 else torch.zeros((), dtype=v.dtype, device=v.device)
    s = RANGE_SIGMAS * sigma / BINS
    if not (bool(torch.isfinite(s)) and float(s) != 0.0):
        s = torch.ones((), dtype=v.dtype, device=v.device)
    q = (c / s + BINS // 2).round_().clamp_(0, BINS - 1).to(torch.int64)
    sums = torch.zeros(BINS, dtype=torch.float32, device=v.device).scatter_add_(0, q, c)
    counts = torch.zeros(BINS, dtype=torch.float32, device=v.device).scatter_add_(0, q, torch.ones_like(c))
    lookup = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
    return q, torch.cat([mu.view(1), lookup])
