"""The low-rank sync payload (``--ab-sync-payload lowrank``): PowerSGD on each layer's summed change of W.

:class:`SyncCompressor` is :class:`~abtrain.compress.powersgd.PowerSGDReducer` (Vogels et al. 2019) with what
the sync needs beyond a gradient reducer: the P and Q of the last call, from which ``--ab-svd update`` builds
W's SVD (W is the SVD its phase started from plus the rank-q change P·Qᵀ), and error memories held in a dtype
of their own (``--ab-sync-memory-dtype``).
"""

from __future__ import annotations

import torch

from ...comm.communicator import Communicator
from ...comm.group import Group
from ...compress.codec import Codec, build_codec
from ...compress.powersgd import PowerSGDReducer
from ...compress.reducer import NamedGrads
from ...compress.wire import WIRE_DTYPES
from .config import ABConfig


class SyncCompressor(PowerSGDReducer):
    """Rank-``rank`` PowerSGD on the sync's changes of W, every matrix whose P and Q are smaller than it.

    ``keep_factors``: :meth:`take_factors` returns each compressed change's P (m×q) and Q (n×q).
    ``codec`` (int8, E3M0; ``--ab-sync-codec``): the P, Q and the changes too small to compress travel in
    that format, what it loses kept in the error memories with the rest.
    ``error_dtype`` (bfloat16) keeps the error memories (an m×n tensor per layer) in that type: half their
    memory; what the rounding loses is lost for good.
    """

    def __init__(self, comm: Communicator, rank: int, *, wire_dtype: torch.dtype | None,
                 error_dtype: torch.dtype | None, keep_factors: bool, codec: Codec | None = None) -> None:
        super().__init__(comm, rank=rank, min_compression_rate=1.0, orthogonalization_epsilon=1e-8,
                         wire_dtype=wire_dtype, codec=codec)
        self.error_dtype = error_dtype
        self.keep_factors = keep_factors
        self._factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def reduce(self, grads: NamedGrads, group: Group) -> None:
        self._factors = {}  # a call that compresses nothing leaves none behind
        super().reduce(grads, group)

    def _compressed(self, names: list[str], ps: list[torch.Tensor], qs: list[torch.Tensor]) -> None:
        if self.keep_factors:
            self._factors = {name: (p[0], q[0]) for name, p, q in zip(names, ps, qs)}

    def _remember(self, name: str, lost: torch.Tensor) -> None:
        self.errors[name] = lost if self.error_dtype is None else lost.to(self.error_dtype)

    def take_factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """With ``keep_factors``: P (m×q) and Q (n×q) of each tensor the last call compressed (that tensor,
        viewed m×n, now holds P·Qᵀ), by name; emptied, so that a later call's factors never pass for older ones."""
        factors, self._factors = self._factors, {}
        return factors

    def memory_share(self, dtype: torch.dtype) -> float:
        """The error memory of a layer held in ``dtype``, as a share of W's numbers (1: as wide, 0.5: half)."""
        return (self.error_dtype or dtype).itemsize / dtype.itemsize


def build_sync_compressor(cfg: ABConfig, comm: Communicator) -> SyncCompressor | None:
    """The compressor of ``--ab-sync-payload lowrank`` (None for another payload): rank ``--ab-sync-rank``, P and Q
    in ``--ab-sync-codec``'s format, memories in ``--ab-sync-memory-dtype``, factors kept for ``--ab-svd update``."""
    if cfg.sync_payload != "lowrank":
        return None
    codec = build_codec(cfg.sync_codec, cfg.scale_block)
    return SyncCompressor(comm, cfg.sync_rank, wire_dtype=codec.wire_dtype, codec=None if codec.summable else codec,
                          error_dtype=WIRE_DTYPES[cfg.sync_memory_dtype], keep_factors=cfg.svd == "update")
