"""A codec: the format in which a flat float32 buffer travels, and its size in bytes.

The seam every method that sends compressed values uses (torchft's quantised
all-reduce, epfml/powersgd's reducers): the format is one object, the
collective that moves it another (:mod:`abtrain.compress.allreduce` for the
dense formats here and :class:`~abtrain.compress.sign.SignCodec`; an
all-gather of every worker's message for the sparse ones, :class:`SparseCodec`).

* ``encode(x)``: flat float32 ``x`` -> a uint8 message of ``message_bytes(x.numel())`` bytes.
* ``decode(message)``: the float32 values the message holds.
* ``summable``: the collective may sum the payload itself, sent as ``wire_dtype`` through one
  all_reduce (a cast: float32, bfloat16); quantised codes (a block's scale, 3-bit exponents) cannot be summed.
* ``align``: a slice the compressed all-reduce encodes holds a multiple of this many elements (the block).
* ``for_slices(length, count)``: the codec of each of ``count`` consecutive slices of ``length`` elements;
  the same object for all unless where a slice lies changes its format (the sign codec's segments).

Formats here (bytes for ``n`` elements, ``b`` elements to a block):

==========  ==================  ==========================================================
name        message bytes       values
==========  ==================  ==========================================================
fp32        ``4n``              as they are (summable)
bf16        ``2n``              rounded to bfloat16 (summable)
int8        ``n + 4n/b``        ``q * s``, ``s = max|x| / 127`` per block, ``q = round(x / s)``
e3m0        ``n/2 + 4n/b``      ``0`` or ``±s * 2**(e - 7)``, ``s = max|x|`` per block, ``e`` in 1..7
==========  ==================  ==========================================================
"""

from __future__ import annotations

import torch

from .wire import as_floats

__all__ = ["BF16Codec", "CODECS", "Codec", "E3M0Codec", "Float32Codec", "Int8Codec", "SparseCodec", "build_codec"]

_TINY = torch.finfo(torch.float32).tiny


class Codec:
    """The format of a flat float32 buffer on the wire (see the module docstring)."""

    name = ""
    align = 1
    summable = False
    #: summable codecs: the dtype the all_reduce sums in
    wire_dtype: torch.dtype | None = None

    def message_bytes(self, numel: int) -> int:
        """Bytes of the message of ``numel`` elements."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Flat float32 ``x`` as a uint8 message of :meth:`message_bytes` bytes."""
        raise NotImplementedError

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        """The float32 values ``message`` holds (flat)."""
        raise NotImplementedError

    def for_slices(self, length: int, count: int) -> list[Codec]:
        """The codec of each of ``count`` consecutive slices of ``length`` elements (this one for all)."""
        return [self] * count


class _CastCodec(Codec):
    """The values cast to :attr:`wire_dtype`, their bytes as they are; the all_reduce sums them in that dtype."""

    summable = True
    wire_dtype: torch.dtype

    def message_bytes(self, numel: int) -> int:
        return self.wire_dtype.itemsize * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.wire_dtype, copy=True).reshape(-1).view(torch.uint8)

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        # A copy first: viewing bytes as a wider type needs an aligned start, which a slice of a message may lack.
        return message.clone().view(self.wire_dtype).to(torch.float32)


class Float32Codec(_CastCodec):
    """The values as they are: 4 bytes each."""

    name = "fp32"
    wire_dtype = torch.float32


class BF16Codec(_CastCodec):
    """The values rounded to bfloat16 (to nearest, ties to even): 2 bytes each."""

    name = "bf16"
    wire_dtype = torch.bfloat16


class _BlockCodec(Codec):
    """Codes with one float32 scale per block of ``block`` elements: the message is [codes | scales]."""

    code_bytes_per_block = 0

    def __init__(self, block: int = 256) -> None:
        if block < 1:
            raise ValueError(f"a codec's block must be >= 1 element, got {block}")
        self.block = self.align = block

    def message_bytes(self, numel: int) -> int:
        blocks = self._blocks(numel)
        return blocks * (self.code_bytes_per_block + 4)

    def _blocks(self, numel: int) -> int:
        if numel % self.block:
            raise ValueError(f"{self.name}: {numel} elements are not a whole number of blocks of {self.block}; "
                             f"pad to a multiple of {self.block}")
        return numel // self.block

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._blocks(x.numel())
        codes, scales = self.encode_blocks(x.reshape(-1, self.block))
        return torch.cat([codes.reshape(-1), scales.view(torch.uint8)])

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        blocks = message.numel() // (self.code_bytes_per_block + 4)
        at = blocks * self.code_bytes_per_block
        return self.decode_blocks(message[:at], as_floats(message[at:])).view(-1)

    def encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 codes, float32 scales) of float32 ``blocks`` (one block a row)."""
        raise NotImplementedError

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The values (one block a row) of :meth:`encode_blocks`' codes and scales."""
        raise NotImplementedError


class Int8Codec(_BlockCodec):
    """int8 codes ``q = round(x / s)`` (to nearest, ties to even) with ``s = max|x| / 127`` per block: each value
    is off by at most ``s / 2``; a block of zeros has ``s = 0`` and decodes to zeros."""

    name = "int8"

    def __init__(self, block: int = 256) -> None:
        super().__init__(block)
        self.code_bytes_per_block = block

    def encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = blocks.abs().amax(dim=1) / 127
        q = torch.round(blocks / scales.clamp(min=_TINY).unsqueeze(1)).clamp_(-127, 127)
        return q.to(torch.int8).view(torch.uint8), scales

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.int8).view(-1, self.block).to(torch.float32) * scales.unsqueeze(1)


#: The magnitudes an E3M0 code holds, as multiples of the block's scale: 0, 2**-6, ..., 2**-1, 1.
E3M0_LEVELS = 8


class E3M0Codec(_BlockCodec):
    """4-bit E3M0 codes (Streaming DiLoCo's outer gradients): a sign bit and a 3-bit exponent ``e``, the value
    ``0`` for ``e = 0``, else ``s * 2**(e - 7)`` with ``s`` the largest magnitude of the block; magnitudes are
    rounded in log2, those below ``s * 2**-6.5`` travel as zero. Two codes to a byte, the first in the high
    nibble, so ``block`` is even. Encoding what it decoded gives the same codes (idempotent)."""

    name = "e3m0"

    def __init__(self, block: int = 256) -> None:
        if block % 2:
            raise ValueError(f"e3m0 packs two codes to a byte: its block must be even, got {block}")
        super().__init__(block)
        self.code_bytes_per_block = block // 2

    def encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = blocks.abs().amax(dim=1)
        ratio = blocks.abs() / scales.clamp(min=_TINY).unsqueeze(1)
        # log2(0) = -inf clamps to code 0.
        exponent = torch.round(torch.log2(ratio)).add_(E3M0_LEVELS - 1).clamp_(0, E3M0_LEVELS - 1)
        codes = exponent.to(torch.uint8) | (blocks < 0).to(torch.uint8) << 3
        pairs = codes.view(-1, 2)
        return (pairs[:, 0] << 4) | pairs[:, 1], scales

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        unpacked = torch.stack([codes >> 4, codes & 15], dim=1).view(-1, self.block)
        exponent = (unpacked & 7).to(torch.float32)
        magnitude = torch.where(exponent > 0, torch.exp2(exponent - (E3M0_LEVELS - 1)), 0.0) * scales.unsqueeze(1)
        return torch.where((unpacked & 8) > 0, -magnitude, magnitude)


class SparseCodec(Codec):
    """A codec whose message holds some entries of the buffer, or of a transform of it: values and indices.

    Top-k compressors (EF21's per-tensor top-k, :class:`~abtrain.compress.topk.TopKCodec`; DeMo's top-k of a
    chunked DCT, :class:`~abtrain.compress.dct.DCTTopKCodec`) are codecs like the dense ones -- ``encode``,
    ``decode``, ``message_bytes`` -- with one addition, :meth:`entries`: a sparse message is all-gathered,
    not averaged slice by slice (a mean of sparse messages is dense), and each method combines every worker's
    entries its own way (EF21 sums them, DeMo averages each index over the workers that sent it), so it reads
    them as (values, indices) rather than as a dense buffer. The indices address ``coefficients`` entries;
    :meth:`synthesize` maps such a dense buffer of coefficients back to values (the identity without a
    transform), so ``decode(m) = synthesize(entries of m scattered into zeros)``.
    """

    coefficients = 0

    def entries(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 values, int64 indices into the ``coefficients``) that ``message`` holds."""
        raise NotImplementedError

    def synthesize(self, coefficients: torch.Tensor) -> torch.Tensor:
        """Flat float32 values of a dense buffer of ``coefficients`` (the identity without a transform)."""
        return coefficients

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        values, indices = self.entries(message)
        dense = torch.zeros(self.coefficients, dtype=torch.float32, device=values.device)
        return self.synthesize(dense.scatter_(0, indices, values))


#: The codecs a flag may name; the block-scaled ones take ``block``.
CODECS = ("fp32", "bf16", "int8", "e3m0")


def build_codec(name: str, block: int = 256) -> Codec:
    """The codec called ``name`` (one of :data:`CODECS`), ``block`` elements to a scale where it has blocks."""
    if name == "fp32":
        return Float32Codec()
    if name == "bf16":
        return BF16Codec()
    if name == "int8":
        return Int8Codec(block)
    if name == "e3m0":
        return E3M0Codec(block)
    raise ValueError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}")
