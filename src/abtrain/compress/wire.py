"""What travels: the dtypes a flag may choose for the wire, and float32 values read back out of a byte message."""

from __future__ import annotations

import torch

WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # a flag's value -> the dtype sent (None: as computed)


def as_floats(raw: torch.Tensor) -> torch.Tensor:
    """The bytes ``raw`` (uint8) as the float32 values they hold."""
    # A copy first: viewing bytes as float32 needs a 4-byte-aligned start, which a slice of a message may lack.
    return raw.clone().view(torch.float32)
