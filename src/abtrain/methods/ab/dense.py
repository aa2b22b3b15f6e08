"""How AB-training's full-rank phases (warm-up, rebounds) average their gradients: ``--ab-dense-comm``."""

from __future__ import annotations

from ...comm.communicator import Communicator
from ...compress.codec import build_codec
from ...compress.powersgd import PowerSGDReducer
from ...compress.reducer import AllReduce, BF16AllReduce, NoReduce, Reducer

DENSE_REDUCERS = ("fp32", "bf16", "powersgd", "local")


def build_dense_reducer(kind: str, comm: Communicator, rank: int = 4, seed: int = 0,
                        powersgd_codec: str = "fp32", scale_block: int = 256) -> Reducer:
    """The reducer called ``kind`` (one of :data:`DENSE_REDUCERS`); ``powersgd_codec``: the format of its P, Q
    and uncompressed tensors on the wire (:data:`~abtrain.compress.codec.CODECS`, ``scale_block`` elements to a
    scale where it has blocks)."""
    if kind == "fp32":
        return AllReduce(comm)
    if kind == "bf16":
        return BF16AllReduce(comm)
    if kind == "local":
        return NoReduce(comm)
    if kind == "powersgd":
        codec = build_codec(powersgd_codec, scale_block)
        return PowerSGDReducer(comm, rank=rank, seed=seed, orthogonalization_epsilon=1e-8,
                               wire_dtype=codec.wire_dtype if codec.summable else None,
                               codec=None if codec.summable else codec)
    raise ValueError(f"unknown gradient reducer {kind!r}; choose one of: {', '.join(DENSE_REDUCERS)}")
