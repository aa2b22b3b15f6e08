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
from . import resume
from .compiled import EagerFirstForward, compiled_inner
from .resume import HELD, STATE_KEY, Writer, dcp_call

log = logging.getLogger(__name__)

#: the layout of that state (the unnumbered one before counts as 1; 3 names the worker that wrote it); an abtrain
#: loads its own layout only, and names the abtrain that wrote any other
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


HELD_ALONE = ("the model's state_dict was saved by torch.distributed.checkpoint with some tensors in the optimizer's "
              "state (those of each worker's own, and AB-training's factors): load {\"model\": model, \"optim\": opt} "
              "together, after method.attach(opt)")
DDP_AROUND = ("the model prepare() returned is wrapped in DistributedDataParallel, whose all-reduces the ledger "
              "cannot count (and which fight the method's own averaging): drop the DDP wrapper and call the model "
              "prepare() returned; method.no_sync() replaces DDP's no_sync()")


class LoopContract:
    """The part of :class:`~abtrain.methods.base.Method` that keeps DDP's contract in a user's loop: the average
    at the end of backward, ``no_sync()``, the first training forward (eager, no DDP around it) and the method's
    state in the optimizer's state_dict, from which any worker resumes (:mod:`.resume`). Its attributes are set
    by ``Method.__init__``."""

    #: dotted paths of the entries of :meth:`state_dict` that are this worker's own (its error memories...), the
    #: others being the same on every worker
    own_state: tuple[str, ...] = ()
    _plain_state = False  # the module's state_dict as it is, whoever asks (the method reads it itself)
    _dcp_every_worker = False  # a torch.distributed.checkpoint being loaded holds every worker's own part
    _just_restored = False  # the method's state was restored since the last step (a model loaded now goes with it)
    _held_loaded = False  # a model state_dict whose placeholders wait for the optimizer's state (DCP's form)
    _resume_check: Any = None  # the forward pre-hook that checks, at the next training forward, what was loaded
    _gathered: dict[str, bytes] | None = None  # rank 0: every worker's own part, gathered at this step
    #: the checkpoints that resume every worker exactly, as rank 0's line names them when a worker adopts another's
    #: state (a framework that checkpoints for the user names its own way)
    exact_resume = resume.EXACT

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
    say: Callable[[str], None]

    def reduce_gradients(self) -> None:
        """Average this step's gradients (the method's own; a no-op by default)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def _hook_module(self, model: nn.Module) -> None:
        """What the prepared module does for the method: its first training forward runs eagerly and checks that no
        DistributedDataParallel calls it; a state loaded into it while attached expects the method's state too;
        under torch.distributed.checkpoint its state_dict leaves some tensors to the optimizer's (:mod:`.resume`)."""
        if self._forward_hook is None:
            self._first_forward.start()
            self._forward_hook = model.register_forward_pre_hook(self._first_training_forward)
            # torch marks the hooks it is given with an attribute, which a bound method cannot take: wrap them
            model.register_load_state_dict_post_hook(functools.partial(self._model_loaded))
            model.register_state_dict_post_hook(functools.partial(LoopContract._model_state_dict, self))
            model.register_load_state_dict_pre_hook(functools.partial(LoopContract._model_loading, self))

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
        # a resume: the optimizer's state_dict should bring the method's (_pre_step), unless it came just before
        # (torch's set_state_dict loads the optimizer first)
        if self._attached is not None and not self._just_restored:
            self._awaiting_state = True
            self._arm_resume_check()

    # -- the method's state in the optimizer's state_dict (:mod:`.resume`) ------------------------------------------
    def dcp_split(self) -> tuple[set[str], set[str]]:
        """(own, held): keys of the module's state_dict whose tensors, and the optimizer's state of them, are this
        worker's own now, and keys whose tensors change shape. Under torch.distributed.checkpoint both travel in
        the optimizer's state (own: one copy per worker; held: once). Default: the floating-point buffers are
        own (BatchNorm statistics stay per worker under DDP-like steps)."""
        assert self.module is not None, "prepare() first"
        return resume.float_buffer_names(self.module), set()

    def gather_state(self) -> None:
        """Collective, called by every worker at the same step just before rank 0 saves: each worker's own part of
        the state (what per-rank files and torch.distributed.checkpoint keep per worker: AB-training's factors,
        their optimizer state and error memories, DiLoCo's local model...) goes to rank 0, whose optimizer
        state_dict of this step then carries every worker's, so that rank 0's file resumes each worker exactly.
        Rank 0 receives each distinct tensor of the parts once (the workers of a group hold the same factors and
        optimizer state: one of them sends them), after the workers exchanged their tensors' digests; counted in
        the ledger under the phase ``checkpoint`` (:func:`~.resume.gather_parts`). Rank 0 keeps them until the
        next step; its file holds each distinct tensor once. Where the workers hold one state it is not needed
        (rank 0's file is exact without it) and costs only the digests and the parts' small entries."""
        if self._attached is None:
            raise ValueError("gather_state() needs the optimizer attached: call method.attach(optimizer) first")
        optimizer = self._attached[0]
        self._gathered = None
        own = resume.own_part(self, optimizer)
        with self.comm.ledger.in_phase("checkpoint"):
            self._gathered = resume.gather_parts(self.comm, self.topo.world, own, self.comm.device)
        # rank 0 holds them until the step's end (Method._post_step); the others None

    def adopt_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> None:
        """Load a state another worker wrote (rank 0's checkpoint, loaded by every worker), after the model's and
        the optimizer's: taken as it is by default, which is right where every worker holds the same state; a
        method with state of each worker's own takes what the workers share and rebuilds the rest."""
        self.load_state_dict(state)

    def given_up(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
        """What a worker that adopts ``state`` loses against its own state, as phrases of rank 0's line (none: it
        resumes exactly). ``optimizer`` holds the writer's optimizer state."""
        return []

    def check_loaded_model(self) -> None:
        """A state_dict was loaded into the prepared model while attached and no method state followed it: raise
        a ValueError where training on would be wrong (by default it goes on, and rank 0 says so)."""

    def _plain_module_state(self) -> dict[str, Any]:
        """The module's state_dict, whatever form torch.distributed.checkpoint would get."""
        assert self.module is not None, "prepare() first"
        self._plain_state = True
        try:
            return self.module.state_dict()
        finally:
            self._plain_state = False

    def _model_state_dict(self, module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        """Under torch.distributed.checkpoint: :data:`~.resume.HELD` in place of the tensors the optimizer's state
        carries (saving: this worker's own and those that change shape; loading: those that change shape, so that
        a tensor of the model of the checkpoint's shape receives what was saved as a tensor)."""
        kind = None if self._plain_state or self._attached is None else dcp_call()
        if kind is None:  # detached, the optimizer's state_dict carries nothing of the method's: the tensors stay
            return
        own, held = self.dcp_split()
        for name in (own | held) if kind == "save" else held:
            if prefix + name in state:
                state[prefix + name] = HELD

    def _model_loading(self, module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """Loading: a placeholder keeps what the module holds (the optimizer's state brings the saved value)."""
        held = [k for k, v in state.items() if k.startswith(prefix) and isinstance(v, str) and v == HELD]
        if held:
            if self._attached is None:
                raise ValueError(HELD_ALONE)
            self._held_loaded = not self._just_restored
            if self._held_loaded:
                self._arm_resume_check()
            current = self._plain_module_state()
            for key in held:
                state[key] = current[key[len(prefix):]]

    def _save_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        kind = dcp_call()
        if kind == "load":  # a template for torch.distributed.checkpoint.load: the keys to read, nothing to save
            resume.dcp_template(self, state)
            return
        section = {"version": STATE_VERSION, "abtrain": __version__, "method": self.name,
                   "writer": Writer.of(self.topo).to_dict(), "state": self.state_dict(), "steps": self.steps,
                   "ledger": self.comm.ledger.state_dict()}
        if kind is None and self._gathered is not None:  # gather_state() at this step: every worker's own part
            resume.to_dcp(self, optimizer, state, section, workers=self._gathered)
        elif kind is None:
            state[STATE_KEY] = section
        else:
            resume.to_dcp(self, optimizer, state, section)

    def _take_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)  # the caller's dict stays as it was
        self._loaded_state = state.pop(STATE_KEY, None)
        if resume.in_dcp_form(state):  # torch.distributed.checkpoint's form, or rank 0's after gather_state()
            state, self._loaded_state = resume.from_dcp(self, state)
        return state

    def _restore_state(self, optimizer: torch.optim.Optimizer) -> None:
        saved, self._loaded_state = self._loaded_state, None
        if saved is not None:
            self.restore(saved, optimizer)

    def restore(self, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Resume from the method's part of an optimizer's state_dict (``state_dict()["abtrain"]``), after the
        model's state_dict and the optimizer's own were loaded: this worker's own state exactly, another worker's
        by :meth:`adopt_state`; rank 0 says in one line what a worker adopting this state gives up."""
        if saved.get("version") != STATE_VERSION:
            raise ValueError(f"the optimizer's state_dict carries abtrain's method state in layout "
                             f"{saved.get('version')!r}, this abtrain ({__version__}) reads layout {STATE_VERSION}: "
                             f"load it with the abtrain that wrote it ({saved.get('abtrain') or 'an earlier one'})")
        if saved["method"] != self.name:
            raise ValueError(f"the checkpoint was saved by method {saved['method']!r}, this run uses "
                             f"{self.name!r}: resume with the method that wrote it")
        writer = Writer.from_dict(saved["writer"])
        phrases = self.given_up(saved["state"], optimizer, writer) if self.topo.rank == 0 else []
        if writer.is_worker(self.topo):
            self.load_state_dict(saved["state"])
        else:
            self.adopt_state(saved["state"], optimizer, writer)
        self.steps = saved["steps"]
        self.comm.ledger.load_state_dict(saved["ledger"])
        self._awaiting_state = self._held_loaded = False
        self._just_restored = True
        self._resumed()
        if phrases and not (self._dcp_every_worker and writer.same_layout(self.topo)):  # a worker adopts another's
            self.say(resume.resume_line(self.name, self.steps, writer, phrases, writer.same_layout(self.topo),
                                        self.exact_resume))
        self._dcp_every_worker = False

    def _arm_resume_check(self) -> None:
        """Check at the next training forward (before the step's first collective, so that no worker that refuses
        leaves the others waiting) what was loaded into the model, unless the method's state follows first."""
        if self._resume_check is None and self.module is not None:
            self._resume_check = self.module.register_forward_pre_hook(self._forward_check)

    def _forward_check(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._resume_check.remove()
            self._resume_check = None
            self._check_resume()

    def _check_resume(self) -> None:
        """The first training forward or step after a state_dict was loaded into the model while attached, with no
        method state after it: a ValueError where going on would be wrong, else a warning on rank 0."""
        self._just_restored = False
        if self._held_loaded:
            self._held_loaded = self._awaiting_state = False
            raise ValueError(HELD_ALONE)
        if self._awaiting_state:
            self._awaiting_state = False
            self.check_loaded_model()
            if self.topo.rank == 0:
                log.warning("abtrain: a state_dict was loaded into the prepared model after attach(), but no %s "
                            "state came with it: the method goes on from its step %d, not the checkpoint's. Load "
                            "the optimizer's state_dict (saved while attached: it carries the method's) after "
                            "attach(); starting weights load before attach()", self.name, self.steps)

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
