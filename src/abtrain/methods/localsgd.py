"""Local SGD: every worker takes H optimizer steps alone, then parameters are averaged.

As torchft's and accelerate's ``LocalSGD``: a context manager around the
user's optimizer whose post-step hook averages the model every ``sync_every`` steps
(one flat-buffer all-reduce of the parameters and floating-point buffers)
and, on exit, once more if the last steps were not averaged yet. Gradients
are never exchanged; optimizer states stay per worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..validate import Options, opt
from .periodic import PeriodicMethod
from .registry import MethodSpec, register


@dataclass
class LocalSGDConfig(Options):
    """Options of local SGD; the CLI exposes each as ``--localsgd-<name>``."""

    section = "localsgd"
    sync_every: int = opt(8, "local optimizer steps between two averages of the model (H; 1 is DDP for plain SGD)")

    def check(self) -> None:
        self.require("sync_every", self.sync_every >= 1, "a positive integer")


class LocalSGD(PeriodicMethod):
    """Average parameters and float buffers over all workers every ``sync_every`` optimizer steps."""

    name = "localsgd"

    def __init__(self, comm: Communicator, topo: Topology, config: LocalSGDConfig | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else LocalSGDConfig(**options)
        super().__init__(comm, topo, self.cfg.sync_every)

    def synchronize(self) -> None:
        self.average_model()


register(MethodSpec("localsgd", LocalSGD, "local SGD", "workers train alone, the model is averaged every H steps",
                    options=LocalSGDConfig, order=50, bench=3, short_run_args=("--localsgd-sync-every", "2")))
