"""torch.compile and a prepared module: the module inside a compiled wrapper, and a first training forward run
eagerly."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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
