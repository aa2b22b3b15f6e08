"""Communication methods behind one interface, chosen by name from the registry.

Every module of this package is imported here, and each registers its method
(:mod:`.registry`), so a new method is one new file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from . import registry
from .base import Method

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
registry.import_plugins()

from .ab import ABConfig, ABTraining  # noqa: E402  (re-exports for the public API)
from .bf16 import BF16DDPMethod  # noqa: E402
from .ddp import DDPMethod  # noqa: E402
from .demo import DeMo, DeMoConfig  # noqa: E402
from .diloco import DiLoCo, DiLoCoConfig  # noqa: E402
from .ef21 import EF21, EF21Config  # noqa: E402
from .hlocalsgd import HLocalSGD, HLocalSGDConfig  # noqa: E402
from .localsgd import LocalSGD, LocalSGDConfig  # noqa: E402
from .none import NoCommunication  # noqa: E402
from .onebit import OneBit, OneBitConfig  # noqa: E402
from .powersgd import PowerSGD, PowerSGDConfig  # noqa: E402
from .sparseloco import SparseLoCo, SparseLoCoConfig  # noqa: E402
from .streaming_diloco import StreamingDiLoCo, StreamingDiLoCoConfig  # noqa: E402


class _Methods(Mapping[str, Callable[..., Method]]):
    """``name -> method class`` of every registered method, in the registry's order (a live view)."""

    def __getitem__(self, name: str) -> Callable[..., Method]:
        if name not in self:
            raise KeyError(name)
        return registry.get(name).build

    def __iter__(self) -> Iterator[str]:
        return iter(registry.names())

    def __len__(self) -> int:
        return len(registry.names())

    def __contains__(self, name: object) -> bool:
        return name in registry.names()


METHODS: Mapping[str, Callable[..., Method]] = _Methods()


def build_method(name: str, comm: Communicator, topo: Topology, **options) -> Method:
    """Build the method registered under ``name`` with its options."""
    return registry.get(name).build(comm, topo, **options)


__all__ = ["ABConfig", "ABTraining", "BF16DDPMethod", "DDPMethod", "DeMo", "DeMoConfig", "DiLoCo", "DiLoCoConfig",
           "EF21", "EF21Config", "HLocalSGD", "HLocalSGDConfig", "LocalSGD", "LocalSGDConfig", "METHODS", "Method",
           "NoCommunication", "OneBit", "OneBitConfig", "PowerSGD", "PowerSGDConfig", "SparseLoCo",
           "SparseLoCoConfig", "StreamingDiLoCo", "StreamingDiLoCoConfig", "build_method", "registry"]
