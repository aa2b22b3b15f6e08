"""Methods whose workers train apart and meet every ``sync_every`` optimizer steps (local SGD, hierarchical local
SGD, DiLoCo, Streaming DiLoCo, SparseLoCo)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from .base import Method
from .resume import Writer, has_state, optimizer_params


class PeriodicMethod(Method):
    """Workers train apart and meet every ``sync_every`` optimizer steps, where :meth:`synchronize` brings them to one
    model (:meth:`synchronize_fragments`, of the fragments that meet, where the model is cut in fragments).

    The model may be cut into ``fragments`` that meet at staggered steps
    (Streaming DiLoCo): fragment ``f`` meets at the steps ``t >= 1`` with
    ``t mod h = f * h // fragments``; with one fragment (the default) the whole
    model meets at the multiples of ``sync_every``. The step at which any fragment meets
    is labelled ``sync_phase`` in the ledger, the others ``local_phase``.
    :meth:`agree` (and leaving :meth:`attach`) brings every fragment that has
    trained since it last met to one model at once.

    ``cfg`` is the method's options (with ``sync_every`` and ``section``); its state and
    results name the count of meetings ``syncs`` and the step of the last one ``last_sync``.
    """

    local_phase = "local"
    sync_phase = "average"
    #: a synchronization averages the floating-point buffers too (consensus then need not)
    syncs_buffers = True
    #: what the optimizer's state is called in rank 0's resume line where it stays per worker (None: the
    #: meetings average it)
    optimizer_apart: str | None = "optimizer state"
    cfg: Any

    def __init__(self, comm: Communicator, topo: Topology, sync_every: int, fragments: int = 1) -> None:
        super().__init__(comm, topo)
        self.sync_every = sync_every
        # fragment f meets at t mod sync_every == offsets[f]
        self.offsets = [f * sync_every // fragments for f in range(fragments)]
        self.t = 0  # optimizer steps taken
        self.syncs = 0  # synchronizations (of one fragment or more)
        self.last_sync = [0] * fragments  # step of each fragment's last synchronization (0: prepare's broadcast)

    def due(self, step: int) -> list[int]:
        """The fragments that meet at optimizer step ``step``."""
        return [f for f, o in enumerate(self.offsets) if step >= 1 and step % self.sync_every == o]

    @property
    def phase(self) -> str:
        return self.sync_phase if self.due(self.t + 1) else self.local_phase

    def synchronize(self) -> None:
        """Bring the workers to one model (one collective); the subclass's whole method."""
        raise NotImplementedError

    def synchronize_fragments(self, fragments: list[int]) -> None:
        """Bring the workers to one model of ``fragments``; with the model whole (one fragment), :meth:`synchronize`."""
        self.synchronize()

    @torch.no_grad()
    def average_model(self, extra: Sequence[torch.Tensor] = ()) -> None:
        """Average every parameter, every floating-point buffer and ``extra`` over all workers, one collective
        per dtype (phase ``sync_phase``): local SGD's whole synchronization."""
        assert self.module is not None, "prepare() first"
        tensors = [p.data for p in self.module.parameters()]
        tensors += [b for b in self.module.buffers() if b.is_floating_point()]
        tensors += extra
        with torch.profiler.record_function(f"abtrain::{self.name}::{self.sync_phase}"), \
                self.comm.ledger.in_phase(self.sync_phase):
            self.comm.all_reduce_tensors(tensors, self.topo.world, average=True)

    def _synchronize(self, fragments: list[int]) -> None:
        self.synchronize_fragments(fragments)
        self.note_state_change()
        self.syncs += 1
        for f in fragments:
            self.last_sync[f] = self.t

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.t += 1
        due = self.due(self.t)
        if due:
            self._synchronize(due)

    def in_consensus(self) -> bool:
        return all(last == self.t for last in self.last_sync)

    def agree(self) -> None:
        """An extra synchronization now of the fragments that trained since they met; the schedule stays."""
        self._synchronize([f for f, last in enumerate(self.last_sync) if last != self.t])

    def sync_buffers(self) -> None:
        """Nothing to do right after a synchronization that averaged the buffers too."""
        if not (self.syncs_buffers and self.in_consensus()):
            super().sync_buffers()

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.in_consensus():
            self.agree()

    def extra_results(self) -> dict[str, Any]:
        return {self.cfg.section: {**asdict(self.cfg), "syncs": self.syncs}}

    def state_dict(self) -> dict[str, Any]:
        last: int | list[int] = self.last_sync[0] if len(self.last_sync) == 1 else list(self.last_sync)
        return {"t": self.t, "syncs": self.syncs, "last_sync": last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        last = state["last_sync"]
        self.t = state["t"]
        self.syncs = state["syncs"]
        self.last_sync = list(last) if isinstance(last, list) else [last]

    def dcp_split(self) -> tuple[set[str], set[str]]:
        """Every parameter and its optimizer state are this worker's own between meetings."""
        assert self.module is not None, "prepare() first"
        own, held = super().dcp_split()
        return own | {name for name, _ in self.module.named_parameters(remove_duplicate=False)}, held

    def given_up(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
        last = state["last_sync"]
        since = min(last) if isinstance(last, list) else last
        out = [self.apart_since(state["t"] - since, since, writer)] if state["t"] > since else []
        if self.optimizer_apart and has_state(optimizer, optimizer_params(optimizer)):
            out.append(f"every other worker's {self.optimizer_apart} (they take rank {writer.rank}'s)")
        return out

    def apart_since(self, steps: int, since: int, writer: Writer) -> str:
        """The phrase of rank 0's resume line for the ``steps`` the workers trained apart since step ``since``."""
        return f"every other worker's {steps} local steps since step {since} (they go on from rank {writer.rank}'s model)"
