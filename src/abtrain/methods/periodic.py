"""Methods whose workers train apart and meet every ``h`` optimizer steps (local SGD, DiLoCo, hierarchical local SGD)."""

from __future__ import annotations

import torch

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from .base import Method


class PeriodicMethod(Method):
    """Workers train apart and are brought to one model every ``h`` optimizer steps by one
    :meth:`synchronize` (local SGD, DiLoCo, hierarchical local SGD).

    The step ending with a synchronization is labelled ``sync_phase`` in the
    ledger, the others ``local_phase``. Leaving :meth:`attach` synchronizes once
    more if steps were taken since the last time, so every worker ends with one model.
    """

    local_phase = "local"
    sync_phase = "average"

    def __init__(self, comm: Communicator, topo: Topology, h: int) -> None:
        super().__init__(comm, topo)
        self.h = h
        self.t = 0  # optimizer steps taken
        self.syncs = 0
        self._last_sync = 0  # step of the last synchronization (step 0: prepare's broadcast)

    @property
    def phase(self) -> str:
        return self.sync_phase if (self.t + 1) % self.h == 0 else self.local_phase

    def synchronize(self) -> None:
        """Bring the workers to one model (one collective); the subclass's whole method."""
        raise NotImplementedError

    def _synchronize(self) -> None:
        self.synchronize()
        self.note_state_change()
        self.syncs += 1
        self._last_sync = self.t

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.t += 1
        if self.t % self.h == 0:
            self._synchronize()

    def in_consensus(self) -> bool:
        return self._last_sync == self.t

    def agree(self) -> None:
        """An extra synchronization now; the next ones stay at multiples of ``h``."""
        self._synchronize()

    def sync_buffers(self) -> None:
        """Nothing to do right after a synchronization: it averaged the buffers too."""
        if not self.in_consensus():
            super().sync_buffers()

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.in_consensus():
            self._synchronize()
