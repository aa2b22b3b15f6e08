"""DiLoCo: H inner steps of the user's optimizer, then an outer Nesterov step on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models" (2023), Algorithm 1, in the shape of torchft's ``DiLoCo``
(``torchft/local_sgd.py``): the user's optimizer is the inner optimizer
(the paper uses AdamW: ``--optimizer adamw``); every ``sync_every`` steps each worker
forms the pseudo-gradient ``global - local``, one flat all-reduce averages it
over all workers, and an outer SGD with Nesterov momentum, owned by this
method, updates a copy of the global parameters, which every worker then
loads. Floating-point buffers are averaged in the same collective. Inner
optimizer states stay per worker.

With ``sync_every = 1``, ``outer_lr = 1``, ``outer_momentum = 0`` and plain SGD as the
inner optimizer this is DDP: global - mean(global - (global - lr g_i)) = global - lr mean(g_i).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..validate import Options, opt
from .periodic import PeriodicMethod
from .registry import MethodSpec, register
from .resume import Writer


@dataclass
class DiLoCoConfig(Options):
    """Options of DiLoCo; the CLI exposes each as ``--diloco-<name>``."""

    section = "diloco"
    sync_every: int = opt(20, "inner optimizer steps between two outer steps (H)")
    outer_lr: float = opt(0.7, "learning rate of the outer SGD on the averaged pseudo-gradient")
    outer_momentum: float = opt(0.9, "Nesterov momentum of the outer SGD (0: plain SGD)")

    def check(self) -> None:
        self.require("sync_every", self.sync_every >= 1, "a positive integer")
        self.require("outer_lr", self.outer_lr > 0, "> 0")
        self.require("outer_momentum", 0 <= self.outer_momentum < 1, "in [0, 1)")


class OuterStep:
    """The global copy of some parameters and the outer SGD (Nesterov momentum) that steps it on an averaged
    pseudo-gradient: DiLoCo's outer loop, held by DiLoCo for the whole model and by Streaming DiLoCo once per
    fragment (torchft's ``_StreamingDiLoCoFragment``). The same on every worker when built after the broadcast."""

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float) -> None:
        self.params = [p.detach().clone() for p in params]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def pseudo_gradients(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``global - local`` of each parameter."""
        return [g - p.detach() for g, p in zip(self.params, local)]

    @torch.no_grad()
    def step(self, averaged: Sequence[torch.Tensor]) -> None:
        """One outer step on the averaged pseudo-gradients (one per parameter, any shape of its numel)."""
        for g, d in zip(self.params, averaged):
            g.grad = d.view_as(g).to(g.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def merge(self, local: Sequence[torch.Tensor], alpha: float = 0.0) -> None:
        """``local = alpha * local + (1 - alpha) * global`` (alpha 0: take the global copy)."""
        for p, g in zip(local, self.params):
            if alpha == 0.0:
                p.copy_(g)
            else:
                p.mul_(alpha).add_(g, alpha=1.0 - alpha)

    def state_dict(self) -> dict[str, Any]:
        return {"global_params": [g.clone() for g in self.params], "outer_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for g, saved in zip(self.params, state["global_params"]):
                g.copy_(saved)
        self.optimizer.load_state_dict(state["outer_optimizer"])


class DiLoCo(PeriodicMethod):
    """The user's optimizer for ``sync_every`` inner steps, then an averaged outer step (phases ``inner`` / ``outer``)."""

    name = "diloco"
    local_phase, sync_phase = "inner", "outer"
    optimizer_apart = "inner optimizer state"
    config_class: type[Options] = DiLoCoConfig

    def __init__(self, comm: Communicator, topo: Topology, config: Options | None = None, **options: Any) -> None:
        self.cfg: Any = config if config is not None else self.config_class(**options)
        super().__init__(comm, topo, self.first_sync_every())
        self.outer: OuterStep | None = None

    def first_sync_every(self) -> int:
        """H before the run's length is known."""
        return self.cfg.sync_every

    def outer_momentum(self) -> float:
        return self.cfg.outer_momentum

    def prepare(self, model: nn.Module) -> nn.Module:
        """The global copy and the outer optimizer, built after the model is confirmed the same everywhere."""
        model = super().prepare(model)
        self.outer = OuterStep(list(model.parameters()), self.cfg.outer_lr, self.outer_momentum())
        return model

    @property
    def global_params(self) -> list[torch.Tensor]:
        return self.outer.params if self.outer is not None else []

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the pseudo-gradients (and float buffers) over all workers, step the outer optimizer, load the result."""
        assert self.module is not None and self.outer is not None, "prepare() first"
        params = list(self.module.parameters())
        pseudo = self.outer.pseudo_gradients(params)
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        with torch.profiler.record_function("abtrain::diloco::outer"), self.comm.ledger.in_phase("outer"):
            self.comm.all_reduce_tensors(pseudo + buffers, self.topo.world, average=True)
        self.outer.step(pseudo)
        self.outer.merge(params)

    def state_dict(self) -> dict[str, Any]:
        assert self.outer is not None, "prepare() first"
        return {**super().state_dict(), **self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.outer is not None, "prepare() first"
        super().load_state_dict(state)
        self.outer.load_state_dict(state)

    def adopt_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> None:
        """Another worker's state: the global model and the outer optimizer's, and the inner steps since the last
        outer step given up: the local model starts again from the global one."""
        assert self.module is not None and self.outer is not None, "prepare() first"
        self.load_state_dict(state)
        self.outer.merge(list(self.module.parameters()))

    def apart_since(self, steps: int, since: int, writer: Writer) -> str:
        return (f"every other worker's {steps} inner steps since the outer step at step {since} (they go on from the "
                f"global model)")


register(MethodSpec("diloco", DiLoCo, "DiLoCo", "H inner steps of the chosen optimizer (AdamW recommended), then an "
                    "outer Nesterov step on the averaged pseudo-gradient", options=DiLoCoConfig, order=60, bench=4,
                    short_run_args=("--diloco-sync-every", "2")))
