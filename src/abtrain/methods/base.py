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
            self.start(optimizer)
            self.comm.ledger.phase = self.phase
            yield self
            self.finalize(optimizer)  # like accelerate's LocalSGD: leave every worker with one model
        finally:
            for h in handles:
                h.remove()

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
