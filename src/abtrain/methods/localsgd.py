"""Local SGD: every worker takes H optimizer steps alone, then parameters are averaged.

As torchft's and accelerate's ``LocalSGD``: a context manager around the
user's optimizer whose post-step hook averages the model every ``h`` steps
(one flat-buffer all-reduce of the parameters and floating-point buffers)
and, on exit, once more if the last steps were not averaged yet. Gradients
are never exchanged; optimizer states stay per worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..validate import Options, opt
from .periodic import PeriodicMethod
from .registry import MethodSpec, register


@dataclass
class LocalSGDConfig(Options):
    """Options of local SGD; the CLI exposes each as ``--localsgd-<name>``."""

    section = "localsgd"
    h: int = opt(8, "local optimizer steps between two averages of the model (H; 1 is DDP for plain SGD)")

    def check(self) -> None:
        self.require("h", self.h >= 1, "a positive integer")


class LocalSGD(PeriodicMethod):
    """Average parameters and float buffers over all workers every ``h`` optimizer steps."""

    name = "localsgd"
    local_phase, sync_phase = "local", "average"

    def __init__(self, comm: Communicator, topo: Topology, config: LocalSGDConfig | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else LocalSGDConfig(**options)
        super().__init__(comm, topo, self.cfg.h)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average every parameter and floating-point buffer over all workers (one collective per dtype)."""
        assert self.module is not None, "prepare() first"
        tensors = [p.data for p in self.module.parameters()]
        tensors += [b for b in self.module.buffers() if b.is_floating_point()]
        with torch.profiler.record_function("abtrain::localsgd::average"), self.comm.ledger.in_phase("average"):
            self.comm.all_reduce_tensors(tensors, self.topo.world, average=True)

    def extra_results(self) -> dict[str, Any]:
        return {"localsgd": {**asdict(self.cfg), "averages": self.syncs}}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "averages": self.syncs, "last_average": self._last_sync}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = state["t"]
        self.syncs = state["averages"]
        self._last_sync = state["last_average"]


register(MethodSpec("localsgd", LocalSGD, "local SGD", "workers train alone, the model is averaged every H steps",
                    options=LocalSGDConfig, order=50, bench=3, short_run_args=("--localsgd-h", "2")))
