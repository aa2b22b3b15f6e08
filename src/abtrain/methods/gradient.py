"""Methods that exchange a compressed message of every step's gradient (EF21, 1-bit, DeMo)."""

from __future__ import annotations

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from .base import Method


class GradientMethod(Method):
    """Workers exchange a compressed message of each step's gradient; the optimizer sees the decompressed average.

    The exchange runs at the end of backward (as DDP's average) or at the
    latest in the optimizer's pre-step hook, once per step; gradient clipping
    calls :meth:`reduce_gradients` first and clips the averaged gradient. A
    method whose exchange yields a step direction rather than an average
    (DeMo) sets ``averages_gradients`` False: then only the step exchanges,
    and clipping sees this worker's own gradient. The gradients of the
    trainable parameters are handled as one flat float32 buffer (in
    ``model.parameters()`` order). The first ``warmup_steps`` steps average
    the full-precision gradients with one all-reduce (phase ``warmup``), the
    compressed steps are phase ``train``. Every worker decompresses the same
    received bytes with the same arithmetic, so every worker hands its
    optimizer the same gradient and the models stay identical.
    """

    averages_gradients = True

    def __init__(self, comm: Communicator, topo: Topology, warmup_steps: int) -> None:
        super().__init__(comm, topo)
        self.warmup_steps = warmup_steps
        self.t = 0  # optimizer steps taken
        self.params: list[nn.Parameter] = []
        self.numels: list[int] = []

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
        """Compress ``flat`` (this worker's gradient), exchange, return what the optimizer applies: the decompressed
        average (DeMo: a step direction), the same on every worker."""
        raise NotImplementedError

    def reduce_gradients(self) -> None:
        """Replace this step's gradients by the (compressed) average over all workers (idempotent per step);
        a method that does not average gradients (``averages_gradients`` False: DeMo) waits for the step."""
        if self.averages_gradients:
            self._replace_gradients()

    def _replace_gradients(self) -> None:
        """The exchange of this step's gradients, their replacement by what it returns (once per step)."""
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
        self._replace_gradients()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.t += 1
