"""Local SGD: every worker takes H optimizer steps alone, then parameters are averaged.

As torchft's and accelerate's ``LocalSGD``: a context manager around the
user's optimizer whose post-step hook averages the model every ``h`` steps
(one flat-buffer all-reduce of the parameters and floating-point buffers)
and, on exit, once more if the last steps were not averaged yet. Gradients
are never exchanged; optimizer states stay per worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..comm import Communicator
from ..topology import Topology
from .base import Method
from ..validate import check_types


@dataclass
class LocalSGDConfig:
    """Options of local SGD; the CLI exposes each as ``--localsgd-<name>``."""

    h: int = field(default=8, metadata={"help": "local optimizer steps between two averages of the model (H; 1 is DDP for plain SGD)"})

    def __post_init__(self) -> None:
        check_types(self, "--localsgd-")
        if isinstance(self.h, bool) or not isinstance(self.h, int) or self.h < 1:
            raise ValueError(f"--localsgd-h must be a positive integer, got {self.h!r}")


class LocalSGD(Method):
    """Average parameters and float buffers over all workers every ``h`` optimizer steps."""

    name = "localsgd"

    def __init__(self, comm: Communicator, topo: Topology, config: LocalSGDConfig | None = None,
                 **options: Any) -> None:
        super().__init__(comm, topo)
        self.cfg = config if config is not None else LocalSGDConfig(**options)
        self.t = 0  # optimizer steps taken
        self.averages = 0
        self._last_average = 0  # step of the last average (step 0: prepare's broadcast)

    @property
    def phase(self) -> str:
        """``average`` for a step that ends with an average, ``local`` otherwise."""
        return "average" if (self.t + 1) % self.cfg.h == 0 else "local"

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.t += 1
        if self.t % self.cfg.h == 0:
            self.average()
        self.comm.ledger.phase = self.phase

    @torch.no_grad()
    def average(self) -> None:
        """Average every parameter and floating-point buffer over all workers (one collective per dtype)."""
        assert self.module is not None, "prepare() first"
        tensors = [p.data for p in self.module.parameters()]
        tensors += [b for b in self.module.buffers() if b.is_floating_point()]
        with torch.profiler.record_function("abtrain::localsgd::average"), self.comm.ledger.in_phase("average"):
            self.comm.all_reduce_tensors(tensors, self.topo.world, average=True)
        self.averages += 1
        self._last_average = self.t

    def in_consensus(self) -> bool:
        return self.t % self.cfg.h == 0 or self._last_average == self.t

    def sync_buffers(self) -> None:
        """Nothing to do at a consensus point: buffers were averaged with the parameters."""
        if not self.in_consensus():
            super().sync_buffers()

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """Average the steps taken since the last average, so that every worker ends with one model."""
        if not self.in_consensus():
            self.average()

    def extra_results(self) -> dict[str, Any]:
        return {"localsgd": {**asdict(self.cfg), "averages": self.averages}}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "averages": self.averages, "last_average": self._last_average}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = state["t"]
        self.averages = state["averages"]
        self._last_average = state["last_average"]
