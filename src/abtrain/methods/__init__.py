"""Communication methods behind one interface, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from ..comm import Communicator
from ..topology import Topology
from .base import Method
from .ab import ABConfig, ABTraining
from .bf16 import BF16DDPMethod
from .ddp import DDPMethod
from .diloco import DiLoCo, DiLoCoConfig
from .ef21 import EF21, EF21Config
from .hlocalsgd import HLocalSGD, HLocalSGDConfig
from .localsgd import LocalSGD, LocalSGDConfig
from .none import NoCommunication
from .onebit import OneBit, OneBitConfig
from .powersgd import PowerSGD, PowerSGDConfig

METHODS: dict[str, Callable[..., Method]] = {
    "ddp": DDPMethod,
    "ab": ABTraining,
    "ddp-bf16": BF16DDPMethod,
    "powersgd": PowerSGD,
    "localsgd": LocalSGD,
    "diloco": DiLoCo,
    "ef21": EF21,
    "onebit": OneBit,
    "hlocalsgd": HLocalSGD,
    "none": NoCommunication,
}


def build_method(name: str, comm: Communicator, topo: Topology, **options) -> Method:
    """Build the method registered under ``name`` with its options."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name](comm, topo, **options)


__all__ = ["ABConfig", "ABTraining", "BF16DDPMethod", "DDPMethod", "DiLoCo", "DiLoCoConfig", "EF21", "EF21Config",
           "HLocalSGD", "HLocalSGDConfig", "LocalSGD", "LocalSGDConfig", "METHODS", "Method", "NoCommunication",
           "OneBit", "OneBitConfig", "PowerSGD", "PowerSGDConfig", "build_method"]
