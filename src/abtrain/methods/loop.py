"""What a user's training loop relies on, as under DDP: the gradient is averaged when ``backward()`` returns,
``no_sync()`` accumulates without a collective, ``torch.compile`` in either order, a checkpoint of the
model and the optimizer (whose ``state_dict()`` carries the method's while attached), and no
DistributedDataParallel sending bytes the ledger cannot see.

:class:`BackwardWatch` follows the trainable parameters of the prepared module with
``Tensor.register_post_accumulate_grad_hook``: the first gradient accumulated in a backward pass
queues one callback on the autograd engine, which runs when that backward pass has finished
(``torch.autograd.Variable._execution_engine.queue_callback``, the call DDP's and FSDP's Python
reducers use). The method averages the gradients there, so clipping, scaling or logging ``.grad``
between ``backward()`` and ``step()`` sees the gradient the optimizer will apply.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

#: the key under which the attached optimizer's ``state_dict()`` carries the method's state
STATE_KEY = "abtrain"


class BackwardWatch:
    """Call ``done()`` once at the end of every backward pass that accumulated a gradient into a watched parameter."""

    def __init__(self, accumulated: Callable[[], None], done: Callable[[], None]) -> None:
        self._accumulated = accumulated
        self._done = done
        self._handles: list[Any] = []
        self._ids: list[int] = []
        self._queued = False

    def watch(self, params: list[torch.Tensor]) -> None:
        """Follow these parameters from the next backward on (nothing changes when they are already followed)."""
        ids = [id(p) for p in params]
        if ids == self._ids:
            return
        self.close()
        self._ids = ids
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _hook(self, param: torch.Tensor) -> None:
        self._accumulated()
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finished)

    def _finished(self) -> None:
        self._queued = False
        self._done()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._ids = []


def compiled_inner(model: nn.Module) -> nn.Module | None:
    """The module inside ``torch.compile(module)``'s wrapper, None when ``model`` is not one."""
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    wrapper = getattr(optimized, "OptimizedModule", None)
    if wrapper is not None and isinstance(model, wrapper):
        return model._orig_mod  # type: ignore[return-value]
    return None


class EagerFirstForward:
    """Run the first training forward of a prepared module eagerly, compiled or not, then compile as the user asked.

    What the method learns at that forward (which layer produces the model's output, read from the autograd
    graph; whether a DistributedDataParallel is calling the module) needs the eager graph and call stack:
    a compiled forward shows one fused node. torch.compile's stance ``force_eager`` holds from
    :meth:`start` (at ``prepare()``, before any compiled call: a stance cannot change inside one) to the end
    of the first forward in training mode with gradients on; the stance found at :meth:`start` is then
    restored, and ``torch.compile`` compiles from the next call on, in whichever order the user applied it.
    """

    def __init__(self) -> None:
        self._prior: Any = None
        self._active = False

    def start(self) -> None:
        eval_frame = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
        if self._active or eval_frame is None or not hasattr(eval_frame, "_stance"):
            return
        self._prior = eval_frame._stance
        if self._prior.stance != "default":
            return  # the user chose a stance; keep it (a forced-eager one already runs eagerly)
        torch.compiler.set_stance("force_eager")
        self._active = True

    def stop(self) -> None:
        if self._active:
            self._active = False
            torch._dynamo.eval_frame._set_stance(self._prior)


def ddp_calling(module: nn.Module, depth: int = 40) -> DistributedDataParallel | None:
    """The DistributedDataParallel whose forward is calling ``module`` now, found on the call stack (None if none).

    Its all-reduces would bypass the ledger, so a prepared model refuses to run inside one."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, DistributedDataParallel) and owner.module is not None:
            inner = compiled_inner(owner.module) or owner.module
            if inner is module or any(m is module for m in inner.modules()):
                return owner
        frame = frame.f_back
    return None


DDP_AROUND = ("the model prepare() returned is wrapped in DistributedDataParallel, whose all-reduces the ledger "
              "cannot count (and which fight the method's own averaging): drop the DDP wrapper and call the model "
              "prepare() returned; method.no_sync() replaces DDP's no_sync()")
