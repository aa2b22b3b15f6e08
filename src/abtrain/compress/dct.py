"""The chunked 2-D DCT of DeMo and its top-k components per chunk (:class:`DCTTopKCodec`).

A tensor is seen as a matrix (rows = its first dimension, columns the rest; a
vector as one row); each dimension is cut into chunks of its largest divisor
not above a target length, and every chunk gets an orthonormal 2-D DCT-II.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .codec import SparseCodec
from .grid import ChunkGrid
from .wire import as_floats

#: Indices inside a chunk travel as int16: a chunk may hold at most this many entries.
MAX_CHUNK_ELEMENTS = 2 ** 15


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``C`` (float64): ``C @ x`` transforms, ``C.T @ y`` inverts."""
    k = torch.arange(n, dtype=torch.float64).view(-1, 1)
    i = torch.arange(n, dtype=torch.float64).view(1, -1)
    c = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c


class ChunkedDCT(ChunkGrid):
    """The chunked 2-D DCT of one tensor: ``encode`` gives (chunks, chunk elements), ``decode`` inverts it."""

    def __init__(self, shape: torch.Size, target: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__(shape, target)
        self.left = dct_matrix(self.c1).to(dtype=dtype, device=device)
        self.right = dct_matrix(self.c2).to(dtype=dtype, device=device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        coef = torch.einsum("yaxb,ia,jb->yxij", self.blocks(x), self.left.to(x.dtype), self.right.to(x.dtype))
        return coef.reshape(self.chunks, self.elements)

    def decode(self, coef: torch.Tensor) -> torch.Tensor:
        blocks = coef.reshape(self.rows // self.c1, self.cols // self.c2, self.c1, self.c2)
        x = torch.einsum("yxij,ia,jb->yaxb", blocks, self.left.to(coef.dtype), self.right.to(coef.dtype))
        return x.reshape(self.shape)


def extract(coef: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk (row) the ``k`` coefficients largest in magnitude: (values, indices), both (chunks, k)."""
    index = torch.topk(coef.abs(), k, dim=-1, sorted=False).indices
    return coef.gather(-1, index), index


def scatter_mean(values: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], size: int) -> torch.Tensor:
    """The workers' sparse entries (flat values and indices into ``size`` entries) summed per index, divided by
    how many workers sent each.

    As the authors' ``scatter_reduce(..., "mean", include_self=False)``: an
    entry one worker sent keeps its value, one all sent is their mean. Added
    worker by worker in rank order, so every worker gets the same bits.
    """
    total = torch.zeros(size, dtype=values[0].dtype, device=values[0].device)
    count = torch.zeros_like(total)
    for v, i in zip(values, indices):
        total.scatter_add_(0, i, v)
        count.scatter_add_(0, i, torch.ones_like(v))
    return total.div_(count.clamp_(min=1))


class DCTTopKCodec(SparseCodec):
    """DeMo's compressor: of a flat buffer made of tensors of ``shapes``, per tensor its chunked DCT and per
    chunk the ``k = min(topk, chunk elements)`` coefficients largest in magnitude.

    The message: the ``K`` float32 values (tensor by tensor, chunk by chunk),
    then ``K`` int16 indices inside their chunk (the chunk is implied by the
    position): ``6K`` bytes. :meth:`entries` gives indices into the
    concatenated coefficients of every tensor; :meth:`synthesize` is the
    inverse DCT. Each tensor's transform runs on a tensor of its own, as a
    buffer of that tensor alone would (a slice of the flat buffer is copied
    first), so the bits do not depend on where the tensor lies in the buffer.
    """

    name = "dct-topk"

    def __init__(self, shapes: Sequence[torch.Size], chunk: int, topk: int, device: torch.device | None = None) -> None:
        self.transforms = [ChunkedDCT(shape, chunk, device=device) for shape in shapes]
        if any(t.elements > MAX_CHUNK_ELEMENTS for t in self.transforms):
            raise ValueError(f"chunks of more than {MAX_CHUNK_ELEMENTS} entries: their indices do not fit int16; "
                             f"choose a smaller chunk")
        self.ks = [min(topk, t.elements) for t in self.transforms]
        self.numels = [math.prod(shape) for shape in shapes]
        self.coefficients = sum(t.chunks * t.elements for t in self.transforms)
        self.k = sum(t.chunks * k for t, k in zip(self.transforms, self.ks))

    def message_bytes(self, numel: int) -> int:
        return 6 * self.k

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        values, indices = [], []
        for t, k, piece in zip(self.transforms, self.ks, x.split(self.numels)):
            v, i = extract(t.encode(piece.view(t.shape).clone()), k)
            values.append(v.reshape(-1))
            indices.append(i.reshape(-1))
        # Bytes, because gloo gathers no int16: 4K bytes of float32 values, then 2K bytes of int16 indices.
        return torch.cat([torch.cat(values).view(torch.uint8), torch.cat(indices).to(torch.int16).view(torch.uint8)])

    def entries(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = message[4 * self.k:].clone().view(torch.int16).long()
        return as_floats(message[:4 * self.k]), self._chunk_starts(message.device) + local

    def _chunk_starts(self, device: torch.device) -> torch.Tensor:
        """Per entry of a message, the index in the coefficients of its chunk's first element (built per call,
        a few operations on ``K`` integers, rather than held beside the model)."""
        starts, offset = [], 0
        for t, k in zip(self.transforms, self.ks):
            rows = torch.arange(t.chunks, dtype=torch.int64, device=device) * t.elements + offset
            starts.append(rows.repeat_interleave(k))
            offset += t.chunks * t.elements
        return torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int64, device=device)

    def synthesize(self, coefficients: torch.Tensor) -> torch.Tensor:
        sizes = [t.chunks * t.elements for t in self.transforms]
        return torch.cat([t.decode(c.view(t.chunks, t.elements).clone()).reshape(-1)
                          for t, c in zip(self.transforms, coefficients.split(sizes))])
