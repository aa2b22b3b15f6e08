"""The interface every communication method implements."""

from __future__ import annotations

import contextlib
import functools
import logging
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.communicator import Communicator
from ..comm.digest import same_everywhere
from ..comm.topology import Topology
from .compiled import EagerFirstForward, compiled_inner
from .loop import BackwardWatch, LoopContract, plain_state_dict
from .memory import (dense_training_state_bytes, moments_per_element, peak_state_total, scalar_state_bytes,
                     training_state_parts)
from .resume import dcp_call
from .summary import ddp_equivalent, method_lines

log = logging.getLogger(__name__)


class Method(LoopContract):
    """A communication scheme around the user's model and optimizer.

    Use::

        method = build_method("ddp", comm, topo)
        model = method.prepare(model)          # wraps or rewrites the model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        method.attach(opt)                     # hooks the optimizer (or: with method.attach(opt): ...)
        for x, y in data:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
        with method.consensus():               # every worker holds the same model here
            evaluate(model)
        method.detach()                        # the final step (a last average or sync), hooks removed

    ``phase`` is the label the ledger puts on the traffic of the current step
    (the ledger reads it from the attached method).
    """

    name = "base"
    #: the method averages the gradients itself (:meth:`reduce_gradients`): it does so at the end of every
    #: backward pass outside :meth:`no_sync`, so ``.grad`` holds the averaged gradient when ``backward()`` returns
    averages_gradients = False

    def __init__(self, comm: Communicator, topo: Topology) -> None:
        self.comm = comm
        self.topo = topo
        self.module: nn.Module | None = None  # the user's (unwrapped) model
        self._attached: tuple[torch.optim.Optimizer, list[Any]] | None = None  # the optimizer and its hooks
        self.last_lrs: list[float] = []  # learning rates applied in the last step
        self.verbose = True  # rank 0 prints what the method decides (see say())
        #: by phase (the ledger's label of the step), the most bytes of training state this worker held after a
        #: step of that phase, by part (:mod:`abtrain.methods.memory`)
        self.peak_state: dict[str, dict[str, int]] = {}
        self._measure_steps = 0  # steps still to measure since the state last changed shape (see note_state_change)
        self._measured_phase: str | None = None
        self.steps = 0  # optimizer steps taken while attached
        # the gradients in .grad are averaged; a gradient accumulated since, or the end of a step, clears it
        self._reduced = False
        self._no_sync = 0  # depth of no_sync() blocks
        self._backward = BackwardWatch(self._grad_accumulated, self._backward_done)
        self._first_forward = EagerFirstForward()
        self._forward_hook: Any = None
        self._loaded_state: dict[str, Any] | None = None
        self._awaiting_state = False  # the model was loaded while attached, the method's state not (yet)
        self._last_optimizer: torch.optim.Optimizer | None = None  # the one attached last (results() after detach)
        self.compiled: nn.Module | None = None  # torch.compile's wrapper the model came in, if any
        #: the DistributedDataParallel the method itself wraps the model in ("ddp", "powersgd"): the one
        #: allowed to call the prepared module (a method that builds its own sets it in prepare())
        self.ddp: DistributedDataParallel | None = None

    @property
    def phase(self) -> str:
        return "train"

    def prepare(self, model: nn.Module) -> nn.Module:
        """Make every worker start from rank 0's parameters and buffers (broadcast only where a 32-byte digest
        says they differ: :func:`~abtrain.comm.digest.same_everywhere`); return the module to call.
        ``torch.compile(model)`` is accepted: its module is prepared and the compiled wrapper returned."""
        model = self.unwrap(model)
        self.module = model
        tensors = list(model.parameters()) + list(model.buffers())
        with self.comm.ledger.in_phase("setup"):
            if not same_everywhere(self.comm, self.topo.world, tensors):
                log.info("abtrain: the workers built different models: every worker starts from rank 0's")
                self.comm.broadcast_tensors(tensors, self.topo.world, src=0)
        self._hook_module(model)
        return self.compiled if self.compiled is not None else model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside a ``torch.compile`` wrapper (kept in :attr:`compiled`, returned by prepare)
        or a DistributedDataParallel (dropped: its all-reduces would bypass the ledger and the method)."""
        if isinstance(model, DistributedDataParallel):
            # DDP's hooks stay idle when its forward is not called, so training the inner module is safe.
            self.say(f"{self.name}: the model was wrapped in DistributedDataParallel; training its .module (abtrain "
                     f"averages gradients itself: drop the DDP wrapper, use the model prepare() returns)")
            model = model.module
        inner = compiled_inner(model)
        if inner is not None:
            self.compiled = model
            return inner
        return model

    def attach(self, optimizer: torch.optim.Optimizer) -> "Attachment":
        """Hook the method into ``optimizer`` until :meth:`detach`; also usable as ``with method.attach(opt):``.

        A plain call keeps the loop as it is (no re-indenting); :meth:`detach`
        (or leaving the ``with`` block without an exception) runs the method's
        final step, which leaves every worker with one model.
        """
        if self._attached is not None:
            raise ValueError("the method is already attached to an optimizer: call method.detach() first")
        handles = [optimizer.register_step_pre_hook(lambda *_: self._pre_step(optimizer)),
                   optimizer.register_step_post_hook(lambda *_: self._post_step(optimizer)),
                   # the method's state travels in the optimizer's state_dict: model + optimizer is a checkpoint
                   optimizer.register_state_dict_post_hook(functools.partial(Method._save_state, self)),
                   optimizer.register_load_state_dict_pre_hook(functools.partial(Method._take_state, self)),
                   optimizer.register_load_state_dict_post_hook(functools.partial(Method._restore_state, self))]
        self._attached = (optimizer, handles)
        self._last_optimizer = optimizer
        try:
            self.start(optimizer)
        except BaseException:
            self._unhook()
            raise
        self.comm.ledger.follow(self)  # the ledger labels unlabelled traffic with self.phase from here on
        self._watch_backward()
        return Attachment(self)

    def detach(self, finalize: bool = True) -> None:
        """Finalize (e.g. a last sync, so every worker holds one model) and remove the optimizer hooks.

        Collective: every worker calls it. Does nothing when the method is not attached.
        ``finalize=False`` only removes the hooks: the run stops here to be continued
        (the workers may still differ), or leaves on an error.
        """
        if self._attached is None:
            return
        try:
            if finalize:
                self.finalize(self._attached[0])
        finally:
            self._unhook()

    def _unhook(self) -> None:
        """Remove the optimizer hooks without finalizing (an exception left the loop)."""
        if self._attached is not None:
            for h in self._attached[1]:
                h.remove()
            self._attached = None
        self._backward.close()

    @property
    def attached(self) -> bool:
        return self._attached is not None

    def _pre_step(self, optimizer: torch.optim.Optimizer) -> None:
        if dcp_call():  # torch.distributed.checkpoint's step with zero gradients, to create the optimizer's state
            return
        self._check_resume()
        self.before_step(optimizer)
        # What the optimizer uses in this step, after any change the method made (AB's LR ramp).
        self.last_lrs = [g["lr"] for g in optimizer.param_groups]

    def note_state_change(self) -> None:
        """What the worker holds may change shape now (a sync, a decomposition): measure it after this step and
        the next (whose backward creates the gradients of the new shapes)."""
        self._measure_steps = 2

    def _post_step(self, optimizer: torch.optim.Optimizer) -> None:
        if dcp_call():
            return
        phase = self.phase
        self.after_step(optimizer)
        self._reduced = False
        self.steps += 1
        self._gathered = None  # gather_state()'s parts are of the step before
        self.comm.ledger.end_step(self.steps)
        self._watch_backward()
        if phase != self._measured_phase:  # the first steps of the run and of every phase
            self._measured_phase = phase
            self.note_state_change()
        # Between those events the tensors keep their shapes, so the walk (about a millisecond for a hundred
        # parameters) stays off the other steps. Measured after the method's own step: a sync or decomposition has
        # changed what the worker holds by then, and this step's gradients are still there (zero_grad frees them).
        if self._measure_steps and self.module is not None:
            self._measure_steps -= 1
            parts = training_state_parts(self.module, optimizer, self)
            if sum(parts.values()) > sum(self.peak_state.get(phase, {}).values()):
                self.peak_state[phase] = parts

    @property
    def peak_state_bytes(self) -> int:
        """The most bytes of training state this worker held after any step so far."""
        return peak_state_total(self.peak_state)

    @property
    def last_lr(self) -> float | None:
        """The learning rate of the first parameter group actually applied in the last optimizer step.

        Methods may change ``param_group["lr"]`` during the step only (AB-training's
        ramp after each phase switch) and restore the scheduled value afterwards,
        so an LR logger reading the optimizer sees the schedule; this is what was used.
        ``last_lrs`` holds every group's. None before the first step.
        """
        return self.last_lrs[0] if self.last_lrs else None

    def lr_scale(self) -> float:
        """Factor the method applies to the scheduled learning rate in the next step (1.0: none)."""
        return 1.0

    def consensus(self) -> contextlib.AbstractContextManager["Method"]:
        """Bring every worker to the same model now (parameters and floating-point buffers).

        ``with method.consensus(): evaluate(model)`` or a plain call. Collective:
        every worker calls it at the same step. Where the workers already agree it
        sends nothing (DDP-like methods average only BatchNorm statistics, which
        DDP leaves per worker). Training continues afterwards as the method's own
        schedule says (see each method's :meth:`agree`).
        """
        if not self.in_consensus():
            with torch.profiler.record_function(f"abtrain::{self.name}::consensus"), \
                    self.comm.ledger.in_phase("consensus"):
                self.agree()
        with self.comm.ledger.in_phase("consensus"):
            self.sync_buffers()
        return contextlib.nullcontext(self)

    def agree(self) -> None:
        """Make the workers' models equal between two steps (called by :meth:`consensus` when they differ)."""
        raise NotImplementedError(f"method {self.name!r} cannot bring its workers to one model")

    def evaluation(self) -> contextlib.AbstractContextManager[Any]:
        """A block in which the module holds the model to evaluate (default: the worker's own, unchanged).

        Local, it sends nothing. Streaming DiLoCo's workers never all hold one
        model between two outer steps; it lends the module its global
        parameters, the same on every worker, for the block's duration.
        """
        return contextlib.nullcontext(self)

    def ready_for_evaluation(self) -> bool:
        """The trainer evaluates when this is True (default: when the workers agree)."""
        return self.in_consensus()

    def say(self, text: str) -> None:
        """One line on rank 0's stdout (not with ``verbose=False``, then only as a log record)."""
        if self.topo.rank != 0:
            return
        if self.verbose:
            print(f"abtrain: {text}", flush=True)
        else:
            log.info("%s", text)

    def export(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The model's weights as a plain state_dict that loads into the user's original model class.

        Factorised weights are exported as the weight the forward pass uses
        (W, or A·B reshaped); no parametrization keys, no ``module.`` prefix of a
        DDP wrapper. Local: it sends nothing, so rank 0 alone may call it; call it
        where the workers agree (after :meth:`detach` or inside :meth:`consensus`)
        to export the model every worker holds.
        """
        target = model if model is not None else self.module
        if target is None:
            raise ValueError("nothing to export: call method.prepare(model) first, or pass the model")
        if isinstance(target, DistributedDataParallel):
            target = target.module
        return plain_state_dict(target)

    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """Runs when :meth:`attach` begins, before the first step of the block."""

    def observe_loss(self, value: float) -> None:
        """This worker's training loss of the step just taken (methods may watch it; the trainer reports it)."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Runs after backward, before the optimizer updates the parameters."""

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Runs after the optimizer update."""

    def sync_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm running statistics) over all workers.

        Running statistics never feed back into training-mode forwards and are
        linear in the batch statistics, so averaging them before evaluation
        gives the same numbers as averaging after every step, for one
        collective per evaluation instead of one per step.
        """
        assert self.module is not None, "prepare() first"
        bufs = [b for b in self.module.buffers() if b.is_floating_point()]
        self.comm.all_reduce_tensors(bufs, self.topo.world, average=True)

    def set_total_steps(self, total_steps: int) -> None:
        """Tell the method the step budget (methods whose schedule depends on it use this)."""

    def in_consensus(self) -> bool:
        """True when every worker holds the same model (evaluation waits for this)."""
        return True

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the workers to one model at the end of training (e.g. a last average)."""

    def reduce_gradients(self) -> None:
        """Average this step's gradients now (before clipping); the step hook then skips it."""

    def close(self) -> None:
        """Remove the optimizer hooks and release the process groups abtrain created.

        A process group the user initialised before :func:`abtrain.setup` is left alone.
        Does not finalize: call :meth:`detach` first to end with one model everywhere.
        """
        if self._attached is not None and not self.in_consensus() and self.topo.rank == 0:
            log.warning("method closed while attached and the workers' models differ: call method.detach() "
                        "before close() to end with one model on every worker")
        self._unhook()
        self._first_forward.stop()
        self.topo.close()

    def extra_results(self) -> dict[str, Any]:
        return {}

    def held_state(self) -> dict[str, Any]:
        """What the method holds besides the model and the optimizer, by the name its training state is reported
        under (``method.NAME`` in results.json's ``training_state_by_phase``): its attributes."""
        return vars(self)

    def dense_size(self) -> tuple[int, int]:
        """The dense model's parameters and the tensors that hold them (DDP's per-tensor optimizer state), which
        results() sets DDP's figures from: the prepared module's trainable ones, unless the method reshapes it."""
        trained = [p for p in self.module.parameters() if p.requires_grad] if self.module is not None else []
        return sum(p.numel() for p in trained), len(trained)

    def results(self) -> dict[str, Any]:
        """This worker's run so far, as results.json has it: the dense model's parameters, the model as it
        trains, the most training state held against DDP's, the ledger's bytes and DDP's for the same steps."""
        params, tensors = self.dense_size()
        ddp = ddp_equivalent(params, self.topo.world_size, self.topo.group_size, self.steps)
        optimizer = self._attached[0] if self._attached is not None else self._last_optimizer
        if optimizer is not None:
            ddp["training_state_bytes"] = dense_training_state_bytes(
                params, moments_per_element(optimizer), tensors=tensors, scalar_bytes=scalar_state_bytes(optimizer))
        return {"method": self.name, "world_size": self.topo.world_size, "group_size": self.topo.group_size,
                "steps": self.steps, "params": params, "model_params": params, "compression_ratio": None,
                "training_state_bytes": self.peak_state_bytes or None, "training_state_by_phase": self.peak_state,
                "comm": self.comm.ledger.summary(), "ddp_equivalent": ddp, **self.extra_results()}

    def summary(self) -> str:
        """The lines of ``abtrain train``'s summary that one's own loop can have: model size, training state,
        bytes by scope and phase, and DDP's bytes for the same steps (call it while attached, on rank 0)."""
        results = self.results()
        head = (f"abtrain {self.name} | {results['world_size']} workers in groups of {results['group_size']} | "
                f"{results['steps']} steps")
        return "\n".join([head, *method_lines(results)])

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Attachment:
    """What :meth:`Method.attach` returns: the method stays attached; as a ``with`` block it detaches on exit.

    Leaving the block normally runs :meth:`Method.detach` (the final step);
    leaving it by an exception only removes the hooks (a collective could hang
    when other workers did not fail).
    """

    def __init__(self, method: Method) -> None:
        self.method = method

    def __enter__(self) -> Method:
        return self.method

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.method.detach()
        else:
            self.method._unhook()

