"""Hierarchical local SGD: data parallelism inside each group every step, one average over all workers every H steps.

Lin et al., "Don't Use Large Mini-Batches, Use Local SGD" (ICLR 2020),
hierarchical local SGD: the groups (``--group-size``, one node in the
intended deployment) train apart, each as ordinary data parallelism: the
gradients are averaged inside the group (one flat all-reduce per step, phase
``local``, scope ``group``). Every ``sync_every`` optimizer steps, and once more at the
end if steps were taken since, one flat all-reduce over all workers (phase
``average``, scope ``global``) averages

* every parameter,
* every floating-point buffer (BatchNorm running statistics),
* the optimizer's per-element state of every parameter (SGD momentum, AdamW's
  first and second moments; scalars like AdamW's ``step`` are the same
  everywhere already),

so that every worker leaves a meeting with one model and one optimizer state.
It is AB-training's grouping and sync without the low-rank factors: the
control that tells whether the factors earn their keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..validate import Options, opt
from .memory import optimizer_moments
from .periodic import PeriodicMethod
from .resume import Writer
from .registry import MethodSpec, register


@dataclass
class HLocalSGDConfig(Options):
    """Options of hierarchical local SGD; the CLI exposes each as ``--hlocalsgd-<name>``."""

    section = "hlocalsgd"
    sync_every: int = opt(8, "optimizer steps between two averages over all workers (H); gradients are averaged inside the group every step")

    def check(self) -> None:
        self.require("sync_every", self.sync_every >= 1, "a positive integer")


class HLocalSGD(PeriodicMethod):
    """Group-wise DP every step (phase ``local``); parameters, buffers and moments averaged every ``sync_every`` steps (``average``)."""

    name = "hlocalsgd"
    averages_gradients = True
    optimizer_apart = None  # averaged at every meeting, and the same inside a group between them

    def __init__(self, comm: Communicator, topo: Topology, config: HLocalSGDConfig | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else HLocalSGDConfig(**options)
        super().__init__(comm, topo, self.cfg.sync_every)
        self._optimizer: torch.optim.Optimizer | None = None

    def reduce_gradients(self) -> None:
        """Average this step's gradients inside the group (idempotent per step)."""
        if self._reduced:
            return
        self._reduced = True
        assert self.module is not None, "prepare() first"
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        with torch.profiler.record_function("abtrain::hlocalsgd::local"), self.comm.ledger.in_phase("local"):
            self.comm.all_reduce_tensors(grads, self.topo.group, average=True)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self.reduce_gradients()

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        super().finalize(optimizer)

    def apart_since(self, steps: int, since: int, writer: Writer) -> str:
        return (f"every other group's {steps} steps since step {since} (they go on from group {writer.group}'s model "
                f"and optimizer state)")

    def synchronize(self) -> None:
        """Average parameters, float buffers and optimizer moments over all workers (one collective per dtype)."""
        assert self.module is not None, "prepare() first"
        moments = optimizer_moments(self._optimizer, list(self.module.parameters())) if self._optimizer is not None else []
        self.average_model(moments)


register(MethodSpec("hlocalsgd", HLocalSGD, "hierarchical local SGD",
                    "gradients averaged inside each group every step; parameters, float buffers and optimizer "
                    "moments averaged over all workers every H steps", options=HLocalSGDConfig, order=90, bench=7))
