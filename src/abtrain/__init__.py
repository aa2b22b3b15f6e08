"""abtrain: communication-efficient distributed training (AB-training) on PyTorch, every byte counted."""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__

# The public names load their modules (and torch) on first use: the ``abtrain`` command installs its signal
# handlers before torch is imported, and the fork server ties itself to the launcher's life before it imports torch.
_EXPORTS = {"setup": "api", "Communicator": "comm.communicator", "Ledger": "comm.ledger", "METHODS": "methods",
            "ABConfig": "methods", "ABTraining": "methods", "Method": "methods", "build_method": "methods",
            "Topology": "comm.topology"}

__all__ = ["ABConfig", "ABTraining", "Communicator", "Ledger", "METHODS", "Method", "Topology", "build_method",
           "setup", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'abtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
