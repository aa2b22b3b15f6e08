"""The interface every communication method implements."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..topology import Topology


class Method:
    """A communication scheme around the user's model and optimizer.

    Use::

        method = build_method("ddp", comm, topo)
        model = method.prepare(model)          # wraps or rewrites the model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with method.attach(opt):               # hooks the optimizer, removes them on exit
            for x, y in data:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()

    ``phase`` is the label the ledger puts on the traffic of the current step.
    """

    name = "base"

    def __init__(self, comm: Communicator, topo: Topology) -> None:
        self.comm = comm
        self.topo = topo
        self.module: nn.Module | None = None  # the user's (unwrapped) model

    @property
    def phase(self) -> str:
        return "train"

    def prepare(self, model: nn.Module) -> nn.Module:
        """Make every worker start from rank 0's parameters and buffers; return the module to call."""
        self.module = model
        with self.comm.ledger.in_phase("setup"):
            self.comm.broadcast_tensors(list(model.parameters()) + list(model.buffers()), self.topo.world, src=0)
        return model

    @contextlib.contextmanager
    def attach(self, optimizer: torch.optim.Optimizer) -> Iterator["Method"]:
        """Hook the method into ``optimizer`` for the duration of the block; finalize on a normal exit."""
        handles = [optimizer.register_step_pre_hook(lambda *_: self.before_step(optimizer)),
                   optimizer.register_step_post_hook(lambda *_: self.after_step(optimizer))]
        try:
            self.comm.ledger.phase = self.phase
            yield self
            self.finalize(optimizer)  # like accelerate's LocalSGD: leave every worker with one model
        finally:
            for h in handles:
                h.remove()

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

    def plan(self, total_steps: int) -> None:
        """Tell the method the step budget (methods whose schedule depends on it use this)."""

    def in_consensus(self) -> bool:
        """True when every worker holds the same model (evaluation waits for this)."""
        return True

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the workers to one model at the end of training (e.g. a last average)."""

    def reduce_gradients(self) -> None:
        """Average this step's gradients now (before clipping); the step hook then skips it."""

    def close(self) -> None:
        """Leave the torch.distributed world (destroys the process groups)."""
        self.topo.close()

    def extra_results(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PeriodicMethod(Method):
    """Workers train apart and meet every ``h`` optimizer steps in one :meth:`meet` (local SGD, DiLoCo).

    The step ending with a meeting is labelled ``meet_phase`` in the ledger, the
    others ``apart_phase``. Leaving :meth:`attach` meets once more if steps were
    taken since the last meeting, so every worker ends with one model.
    """

    apart_phase = "local"
    meet_phase = "average"

    def __init__(self, comm: Communicator, topo: Topology, h: int) -> None:
        super().__init__(comm, topo)
        self.h = h
        self.t = 0  # optimizer steps taken
        self.meetings = 0
        self._last_meeting = 0  # step of the last meeting (step 0: prepare's broadcast)

    @property
    def phase(self) -> str:
        return self.meet_phase if (self.t + 1) % self.h == 0 else self.apart_phase

    def meet(self) -> None:
        """Bring the workers to one model (one collective); the subclass's whole method."""
        raise NotImplementedError

    def _meet(self) -> None:
        self.meet()
        self.meetings += 1
        self._last_meeting = self.t

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.t += 1
        if self.t % self.h == 0:
            self._meet()
        self.comm.ledger.phase = self.phase

    def in_consensus(self) -> bool:
        return self._last_meeting == self.t

    def sync_buffers(self) -> None:
        """Nothing to do at a meeting point: the meeting averaged the buffers too."""
        if not self.in_consensus():
            super().sync_buffers()

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.in_consensus():
            self._meet()


def optimizer_moments(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The optimizer's per-element state of ``params`` (SGD momentum, Adam's two moments), not scalars like ``step``."""
    out = []
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape:
                out.append(value)
    return out


class GradientMethod(Method):
    """Workers exchange a compressed message of each step's gradient; the optimizer sees the decompressed average.

    The exchange runs in the optimizer's pre-step hook through
    :meth:`reduce_gradients`, idempotent per step, so that gradient clipping
    can call it first and clip the averaged gradient. The gradients of the
    trainable parameters are handled as one flat float32 buffer (in
    ``model.parameters()`` order). The first ``warmup_steps`` steps average
    the full-precision gradients with one all-reduce (phase ``warmup``), the
    compressed steps are phase ``train``. Every worker decompresses the same
    received bytes with the same arithmetic, so every worker hands its
    optimizer the same gradient and the models stay identical.
    """

    def __init__(self, comm: Communicator, topo: Topology, warmup_steps: int) -> None:
        super().__init__(comm, topo)
        self.warmup_steps = warmup_steps
        self.t = 0  # optimizer steps taken
        self.params: list[nn.Parameter] = []
        self.numels: list[int] = []
        self._reduced = False

    @property
    def phase(self) -> str:
        return "warmup" if self.t < self.warmup_steps else "train"

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numels = [p.numel() for p in self.params]
        self.build(sum(self.numels))
        return model

    def build(self, numel: int) -> None:
        """Allocate the method's state for a flat gradient of ``numel`` elements."""

    def warmup(self, own: torch.Tensor, average: torch.Tensor) -> None:
        """A full-precision step: this worker's flat gradient and the average over all workers."""

    def exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """Compress ``flat`` (this worker's gradient), exchange, return the decompressed average (same on every worker)."""
        raise NotImplementedError

    def reduce_gradients(self) -> None:
        """Replace this step's gradients by the (compressed) average over all workers (idempotent per step)."""
        if self._reduced:
            return
        self._reduced = True
        assert self.module is not None, "prepare() first"
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in self.params])
        phase = self.phase
        with torch.profiler.record_function(f"abtrain::{self.name}::{phase}"), self.comm.ledger.in_phase(phase):
            if self.t < self.warmup_steps:
                average = self.comm.all_reduce(flat.clone(), self.topo.world, average=True)
                self.warmup(flat, average)
            else:
                average = self.exchange(flat)
        # Copied, never aliased: clipping scales p.grad in place and must not touch the method's state.
        with torch.no_grad():
            for p, chunk in zip(self.params, average.split(self.numels)):
                if p.grad is None:
                    p.grad = chunk.view_as(p).to(p.dtype).clone()
                else:
                    p.grad.copy_(chunk.view_as(p))

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.comm.ledger.phase = self.phase
        self.reduce_gradients()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._reduced = False
        self.t += 1
        self.comm.ledger.phase = self.phase
