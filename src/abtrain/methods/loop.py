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

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .._version import __version__

log = logging.getLogger(__name__)

#: the key under which the attached optimizer's ``state_dict()`` carries the method's state
STATE_KEY = "abtrain"
#: the layout of that state (the unnumbered one before counts as 1); an abtrain loads its own layout only, and
#: names the abtrain that wrote any other
STATE_VERSION = 3


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


class LoopContract:
    """The part of :class:`~abtrain.methods.base.Method` that keeps DDP's contract in a user's loop: the average
    at the end of backward, ``no_sync()``, the first training forward (eager, no DDP around it) and the method's
    state in the optimizer's state_dict. Its attributes are set by ``Method.__init__``."""

    name: str
    averages_gradients: bool
    comm: Any
    topo: Any
    module: nn.Module | None
    ddp: DistributedDataParallel | None
    steps: int
    _attached: tuple[torch.optim.Optimizer, list[Any]] | None
    _reduced: bool
    _no_sync: int
    _backward: BackwardWatch
    _first_forward: EagerFirstForward
    _forward_hook: Any
    _loaded_state: dict[str, Any] | None
    _awaiting_state: bool

    def reduce_gradients(self) -> None:
        """Average this step's gradients (the method's own; a no-op by default)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def _hook_module(self, model: nn.Module) -> None:
        """What the prepared module does for the method: its first training forward runs eagerly and checks that no
        DistributedDataParallel calls it; a state loaded into it while attached expects the method's state too."""
        if self._forward_hook is None:
            self._first_forward.start()
            self._forward_hook = model.register_forward_pre_hook(self._first_training_forward)
            # torch marks the hooks it is given with an attribute, which a bound method cannot take: wrap them
            model.register_load_state_dict_post_hook(functools.partial(LoopContract._model_loaded, self))

    def _first_training_forward(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self._forward_hook.remove()
        caller = ddp_calling(module)
        if caller is not None and caller is not self.ddp:
            self._first_forward.stop()
            raise RuntimeError(DDP_AROUND)
        handle: list[Any] = []

        def finished(*_: Any) -> None:  # the first forward has run eagerly: compile from the next call on
            handle[0].remove()
            self._first_forward.stop()

        handle.append(module.register_forward_hook(finished, always_call=True))

    def _model_loaded(self, module: nn.Module, incompatible: Any) -> None:
        if self._attached is not None:
            self._awaiting_state = True  # a resume: the optimizer's state_dict should bring the method's (_pre_step)

    def _save_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        state[STATE_KEY] = {"version": STATE_VERSION, "abtrain": __version__, "method": self.name,
                            "state": self.state_dict(), "steps": self.steps, "ledger": self.comm.ledger.state_dict()}

    def _take_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)  # the caller's dict stays as it was
        self._loaded_state = state.pop(STATE_KEY, None)
        return state

    def _restore_state(self, optimizer: torch.optim.Optimizer) -> None:
        saved, self._loaded_state = self._loaded_state, None
        if saved is None:
            return
        if saved.get("version") != STATE_VERSION:
            raise ValueError(f"the optimizer's state_dict carries abtrain's method state in layout "
                             f"{saved.get('version')!r}, this abtrain ({__version__}) reads layout {STATE_VERSION}: "
                             f"load it with the abtrain that wrote it ({saved.get('abtrain') or 'an earlier one'})")
        if saved["method"] != self.name:
            raise ValueError(f"the checkpoint was saved by method {saved['method']!r}, this run uses "
                             f"{self.name!r}: resume with the method that wrote it")
        self.load_state_dict(saved["state"])
        self.steps = saved["steps"]
        self.comm.ledger.load_state_dict(saved["ledger"])
        self._awaiting_state = False
        self._resumed()

    def _resumed(self) -> None:
        """Runs after the method's state was restored from a checkpoint (the method may re-arm its hooks)."""

    def _watch_backward(self) -> None:
        """Follow the trainable parameters (a decomposition may have made new ones) for the end of backward."""
        if self.averages_gradients and self.module is not None and self._attached is not None:
            self._backward.watch([p for p in self.module.parameters() if p.requires_grad])

    def _grad_accumulated(self) -> None:
        self._reduced = False

    def _backward_done(self) -> None:
        """The end of a backward pass: average now, as DDP does, unless inside no_sync()."""
        if self._attached is not None and not self._no_sync:
            self.reduce_gradients()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's ``no_sync()``: backward passes inside the block accumulate ``.grad`` locally and send nothing;
        the first backward after it (or the optimizer step) averages the accumulated gradient."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1


@torch.no_grad()
def plain_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every parametrized weight (``torch.nn.utils.parametrize``) replaced by the
    weight its forward uses.

    ``features.3.parametrizations.weight.original`` and the parametrization's own entries (factors
    ``...weight.0.A``, ``...0.B``, a mode in ``..._extra_state``) become one ``features.3.weight`` holding
    what the forward pass reads (W, or the product of the factors): the keys and shapes of the model before
    the parametrizations, so the result loads into a freshly built instance of the user's model class.
    """
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if ".parametrizations." not in f".{key}":
            out[key] = value
            continue
        owner, _, rest = f".{key}".rpartition(".parametrizations.")
        pname, _, leaf = rest.partition(".")
        if leaf != "original":
            continue  # factors and modes: folded into the weight below
        module = model.get_submodule(owner.lstrip("."))
        out[f"{owner.lstrip('.')}.{pname}".lstrip(".")] = getattr(module, pname).detach().clone()
    return out
