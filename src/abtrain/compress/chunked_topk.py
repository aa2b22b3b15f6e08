"""Top-k per chunk, without a transform: SparseLoCo's sparsifier (:class:`ChunkedTopKCodec`).

Each tensor is seen as a matrix (rows: its first dimension, columns: the rest; a vector or scalar as one
row) and each dimension is cut into chunks of its largest divisor not above ``chunk``, as DeMo's chunks
(:class:`~abtrain.compress.grid.ChunkGrid`), with no DCT. Of a chunk of ``E`` elements the
``k = min(E, max(1, round(E * topk / chunk**2)))`` entries largest in magnitude travel: ``topk`` of a full
``chunk x chunk`` block and the same share of a smaller one (the authors' rule for chunks of vectors and of
dimensions that ``chunk`` does not divide).

The message of ``K`` entries (tensor by tensor, chunk by chunk): each entry's position inside its chunk in
``ceil(log2 E)`` bits (:class:`~abtrain.compress.bits.IndexCodec`: 12 bits in a 64 x 64 chunk; the chunk is
implied by the entry's place in the message), then the ``K`` values in the value codec's format
(:class:`~abtrain.compress.twobit.TwoBitCodec`, one segment per tensor, or float32).
``message_bytes = ceil(sum_t K_t * ceil(log2 E_t) / 8) + values.message_bytes(K)``; fixed for a model, so
every worker's message has the same size. :meth:`entries` gives each entry's index into the flat buffer
itself (no transform: :meth:`synthesize` is the identity).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .bits import IndexCodec, index_width
from .codec import Codec, Float32Codec, SparseCodec
from .grid import ChunkGrid
from .twobit import TwoBitCodec

__all__ = ["VALUE_FORMATS", "ChunkedTopKCodec", "Chunks", "chunk_topk"]

#: How the values of the selected entries travel.
VALUE_FORMATS = ("2bit", "fp32")


class Chunks(ChunkGrid):
    """A tensor of ``shape`` as a matrix cut into ``c1 x c2`` chunks: ``split`` gives (chunks, elements)."""

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """The flat tensor ``x`` as (chunks, elements): chunk ``(y, x)`` of the grid at row ``y * cols/c2 + x``."""
        return self.blocks(x).permute(0, 2, 1, 3).reshape(self.chunks, self.elements)

    def flat_index(self, local: torch.Tensor) -> torch.Tensor:
        """Indices into the flat tensor of the (chunks, k) positions ``local`` inside each chunk."""
        grid = self.cols // self.c2
        chunk = torch.arange(self.chunks, dtype=torch.int64, device=local.device).unsqueeze(1)
        row = (chunk // grid) * self.c1 + local // self.c2
        col = (chunk % grid) * self.c2 + local % self.c2
        return row * self.cols + col


def chunk_topk(elements: int, chunk: int, topk: int) -> int:
    """Entries kept of a chunk of ``elements``: ``topk`` of a full ``chunk**2`` block, the same share of others."""
    return min(elements, max(1, round(elements * topk / chunk ** 2)))


class ChunkedTopKCodec(SparseCodec):
    """Of a flat buffer made of tensors of ``shapes``, per chunk the entries largest in magnitude (see the
    module docstring); ``values`` is ``"2bit"`` or ``"fp32"``."""

    name = "chunked-topk"

    def __init__(self, shapes: Sequence[torch.Size], chunk: int, topk: int, values: str = "2bit",
                 device: torch.device | None = None) -> None:
        if values not in VALUE_FORMATS:
            raise ValueError(f"unknown value format {values!r}; choose one of: {', '.join(VALUE_FORMATS)}")
        self.layout = [Chunks(torch.Size(shape), chunk) for shape in shapes]
        self.ks = [chunk_topk(c.elements, chunk, topk) for c in self.layout]
        self.numels = [c.numel for c in self.layout]
        self.coefficients = sum(self.numels)
        counts = [c.chunks * k for c, k in zip(self.layout, self.ks)]
        self.k = sum(counts)
        self.indices = IndexCodec(counts, [index_width(c.elements) for c in self.layout], device=device)
        self.values: Codec = TwoBitCodec(counts, device=device) if values == "2bit" else Float32Codec()

    @property
    def index_bytes(self) -> int:
        return self.indices.message_bytes(self.k)

    def message_bytes(self, numel: int) -> int:
        if numel != self.coefficients:
            raise ValueError(f"{self.name}: the codec holds {self.coefficients} elements, got {numel}")
        return self.index_bytes + self.values.message_bytes(self.k)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 values, int64 positions inside their chunk) of every tensor's kept entries, in message order."""
        values, local = [], []
        for c, k, piece in zip(self.layout, self.ks, x.float().split(self.numels)):
            chunks = c.split(piece)
            index = torch.topk(chunks.abs(), k, dim=-1, sorted=False).indices
            values.append(chunks.gather(-1, index).reshape(-1))
            local.append(index.reshape(-1))
        return torch.cat(values), torch.cat(local)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.message_bytes(x.numel())
        values, local = self.select(x)
        return torch.cat([self.indices.encode(local), self.values.encode(values)])

    def entries(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.indices.decode(message[:self.index_bytes])
        values = self.values.decode(message[self.index_bytes:])
        flat, at, offset = [], 0, 0
        for c, k in zip(self.layout, self.ks):
            n = c.chunks * k
            flat.append(c.flat_index(local[at:at + n].view(c.chunks, k)).reshape(-1) + offset)
            at += n
            offset += c.numel
        return values, torch.cat(flat)
