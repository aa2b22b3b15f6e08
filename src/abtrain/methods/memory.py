"""Training state: the bytes a worker holds to train, counted the same way for every method.

``training_state_bytes`` adds up the storages of the model's parameters, their
gradients, the optimizer's state and every tensor the method object holds
(error memories, stale copies, outer parameters, warm-start factors), each
storage counted once however many tensors view it. Activations, the data and
communication buffers are not part of it (DDP's gradient buckets are not
counted either). :func:`dense_training_state_bytes` is the same figure for the
dense model trained with DDP: parameters, gradients and the optimizer's
state (per element, and per tensor such as AdamW's step count), nothing else.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

#: Attributes of a method that are not its own state: the model and optimizer (counted on their own),
#: the communicator and topology (process groups and the ledger's records, no training state).
_NOT_STATE = (nn.Module, torch.optim.Optimizer, type, types.FunctionType, types.MethodType, types.ModuleType,
              types.BuiltinFunctionType)
_SKIP_NAMES = frozenset({"comm", "topo", "module", "_attached", "_optimizer", "ledger"})
_MAX_DEPTH = 6


def peak_state_total(peak_state: dict[str, dict[str, int]]) -> int:
    """The most bytes a worker held after a step of any phase, from its parts by phase (0 for none)."""
    return max((sum(parts.values()) for parts in peak_state.values()), default=0)


def _tensors(obj: Any, out: list[torch.Tensor], seen: set[int], depth: int) -> None:
    """Every tensor reachable from ``obj`` through containers and plain objects' attributes."""
    if depth > _MAX_DEPTH or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, _NOT_STATE):
        return
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _tensors(value, out, seen, depth + 1)
    elif hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            if name not in _SKIP_NAMES:
                _tensors(value, out, seen, depth + 1)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def training_state_parts(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                         method: Any = None) -> dict[str, int]:
    """:func:`training_state_bytes` by part: ``parameters``, ``gradients``, ``optimizer``, and ``method.NAME``
    for each part of the method that holds tensors (``method.held_state()``, by name: :meth:`Method.held_state
    <abtrain.methods.base.Method.held_state>`); a storage shared by two parts counts in the first."""
    parts: dict[str, list[torch.Tensor]] = {
        "parameters": list(model.parameters()),
        "gradients": [p.grad for p in model.parameters() if p.grad is not None],
        "optimizer": [],
    }
    if optimizer is not None:
        _tensors(list(optimizer.state.values()), parts["optimizer"], set(), 0)
    if method is not None:
        seen = {id(model), id(optimizer), id(method)}
        for name, value in method.held_state().items():
            if name not in _SKIP_NAMES:
                found: list[torch.Tensor] = []
                _tensors(value, found, seen, 1)
                if found:
                    parts[f"method.{name}"] = found
    out: dict[str, int] = {}
    counted: set[tuple[str, int]] = set()
    for name, tensors in parts.items():
        fresh = []
        for t in tensors:
            key = (str(t.device), t.untyped_storage().data_ptr())
            if t.numel() and key not in counted:
                counted.add(key)
                fresh.append(t)
        out[name] = storage_bytes(fresh)
    return out


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, method: Any = None) -> int:
    """Parameters + gradients + optimizer state + the method's own tensors, each storage once."""
    return sum(training_state_parts(model, optimizer, method).values())


def moments_per_element(optimizer: torch.optim.Optimizer) -> int:
    """How many per-element state tensors the optimizer keeps for a parameter (SGD momentum 1, Adam 2, plain SGD 0),
    read from its state (the most any parameter has), or before its first step from its settings."""
    if not optimizer.state:
        group = optimizer.param_groups[0]
        if "betas" in group:  # the Adam family: two moments, a third with amsgrad
            return 3 if group.get("amsgrad") else 2
        return 1 if group.get("momentum", 0) else 0
    most = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            count = sum(1 for v in state.values()
                        if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape and p.numel() > 1)
            most = max(most, count)
    return most


def scalar_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state a parameter tensor holds besides its per-element tensors (AdamW's step count, a
    4-byte tensor; none for SGD), the most any parameter of more than one element has."""
    most = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.numel() > 1:
                state = optimizer.state.get(p, {}).values()
                most = max(most, sum(v.numel() * v.element_size() for v in state
                                     if torch.is_tensor(v) and v.shape != p.shape))
    return most


def dense_training_state_bytes(params: int, moments: int, element_bytes: int = 4, tensors: int = 0,
                               scalar_bytes: int = 0) -> int:
    """DDP's training state for a dense model of ``params`` parameters in ``tensors`` tensors: the parameters,
    their gradients and ``moments`` per-element optimizer tensors, ``element_bytes`` each, and ``scalar_bytes``
    of the optimizer's per-tensor state (:func:`scalar_state_bytes`) for each tensor (no communication buffers)."""
    return params * element_bytes * (2 + moments) + tensors * scalar_bytes


def optimizer_moments(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The optimizer's per-element state of ``params`` (SGD momentum, Adam's two moments), not scalars like ``step``."""
    out = []
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape:
                out.append(value)
    return out
