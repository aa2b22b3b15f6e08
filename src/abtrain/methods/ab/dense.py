"""How AB-training's full-rank phases (warm-up, rebounds) average their gradients: ``--ab-dense-comm``."""

from __future__ import annotations

from ...comm.communicator import Communicator
from ...compress.powersgd import PowerSGDReducer
from ...compress.reducer import AllReduce, BF16AllReduce, NoReduce, Reducer
from ...compress.wire import WIRE_DTYPES

DENSE_REDUCERS = ("fp32", "bf16", "powersgd", "local")


def build_dense_reducer(kind: str, comm: Communicator, rank: int = 4, seed: int = 0,
                        powersgd_dtype: str = "fp32") -> Reducer:
    """The reducer called ``kind`` (one of :data:`DENSE_REDUCERS`); ``powersgd_dtype``: its P and Q on the wire."""
    if kind == "fp32":
        return AllReduce(comm)
    if kind == "bf16":
        return BF16AllReduce(comm)
    if kind == "local":
        return NoReduce(comm)
    if kind == "powersgd":
        return PowerSGDReducer(comm, rank=rank, seed=seed, orthogonalization_epsilon=1e-8,
                               wire_dtype=WIRE_DTYPES[powersgd_dtype])
    raise ValueError(f"unknown gradient reducer {kind!r}; choose one of: {', '.join(DENSE_REDUCERS)}")
