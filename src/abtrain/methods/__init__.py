"""Communication methods behind one interface, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from ..comm import Communicator
from ..topology import Topology
from .base import Method
from .ab import ABConfig, ABTraining
from .ddp import DDPMethod

METHODS: dict[str, Callable[..., Method]] = {
    "ddp": DDPMethod,
    "ab": ABTraining,
}


def build_method(name: str, comm: Communicator, topo: Topology, **options) -> Method:
    """Build the method registered under ``name`` with its options."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name](comm, topo, **options)


__all__ = ["ABConfig", "ABTraining", "DDPMethod", "METHODS", "Method", "build_method"]
