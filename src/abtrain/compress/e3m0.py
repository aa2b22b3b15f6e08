"""4-bit E3M0 codes with one float32 scale per block (Streaming DiLoCo's outer gradients).

Each code is a sign bit and a 3-bit exponent ``e``: the value ``0`` for ``e = 0``,
else ``s * 2**(e - 7)`` with ``s`` the largest magnitude of its block; magnitudes
are rounded in log2. Two codes to a byte, the first in the high nibble.
"""

from __future__ import annotations

import torch

#: The magnitudes an E3M0 code holds, as multiples of the block's scale: 0, 2**-6, ..., 2**-1, 1.
E3M0_LEVELS = 8


def e3m0_encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` (numel a multiple of ``block``) as (uint8 codes two to a byte, the first in the high nibble;
    float32 scales, one per block)."""
    blocks = x.view(-1, block)
    scales = blocks.abs().amax(dim=1)
    ratio = blocks.abs() / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    # log2(0) = -inf clamps to code 0: magnitudes below s * 2**-6.5 travel as zero.
    exponent = torch.round(torch.log2(ratio)).add_(E3M0_LEVELS - 1).clamp_(0, E3M0_LEVELS - 1)
    codes = exponent.to(torch.uint8) | (blocks < 0).to(torch.uint8) << 3
    pairs = codes.view(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1], scales


def e3m0_decode(packed: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The float32 values of :func:`e3m0_encode`'s codes."""
    codes = torch.stack([packed >> 4, packed & 15], dim=1).view(-1, block)
    exponent = (codes & 7).to(torch.float32)
    magnitude = torch.where(exponent > 0, torch.exp2(exponent - (E3M0_LEVELS - 1)), 0.0) * scales.unsqueeze(1)
    return torch.where((codes & 8) > 0, -magnitude, magnitude).view(-1)
