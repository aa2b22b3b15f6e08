"""The library entry point for a user's own training loop."""

from __future__ import annotations

from typing import Any

from .comm import Communicator, Ledger
from .methods import Method, build_method
from .topology import Topology


def setup(method: str = "ab", *, total_steps: int | None = None, group_size: int | None = None,
          backend: str = "auto", device: str = "auto", timeout_s: float = 300.0, **options: Any) -> Method:
    """Join the torch.distributed world of this process (torchrun's variables) and build ``method``.

    ``total_steps``: the run's length in optimizer steps; AB-training's schedule
    is a fraction of it (or call ``method.plan(total_steps)`` later).
    ``options`` are the method's own (for ``ab``: the fields of
    :class:`abtrain.methods.ABConfig`, e.g. ``warmup_fraction=0.2, rank_fraction=0.25``).
    The returned method has ``.topo`` (rank, world, device), ``.comm.ledger`` (every byte
    sent) and ``.close()``. A single process without torchrun runs with communication skipped.
    """
    topo = Topology.from_env(backend=backend, device=device, group_size=group_size, timeout_s=timeout_s)
    built = build_method(method, Communicator(Ledger(), topo.device), topo, **options)
    if total_steps is not None:
        built.plan(total_steps)
    return built
