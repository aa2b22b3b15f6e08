"""DiLoCo: H inner steps of the user's optimizer, then an outer Nesterov step on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models" (2023), Algorithm 1, in the shape of torchft's ``DiLoCo``
(``torchft/local_sgd.py``): the user's optimizer is the inner optimizer
(the paper uses AdamW: ``--optimizer adamw``); every ``h`` steps each worker
forms the pseudo-gradient ``global - local``, one flat all-reduce averages it
over all workers, and an outer SGD with Nesterov momentum, owned by this
method, updates a copy of the global parameters, which every worker then
loads. Floating-point buffers are averaged in the same collective. Inner
optimizer states stay per worker.

With ``h = 1``, ``outer_lr = 1``, ``outer_momentum = 0`` and plain SGD as the
inner optimizer this is DDP: global - mean(global - (global - lr g_i)) = global - lr mean(g_i).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..validate import Options, opt
from .periodic import PeriodicMethod
from .registry import MethodSpec, register


@dataclass
class DiLoCoConfig(Options):
    """Options of DiLoCo; the CLI exposes each as ``--diloco-<name>``."""

    section = "diloco"
    h: int = opt(20, "inner optimizer steps between two outer steps (H)")
    outer_lr: float = opt(0.7, "learning rate of the outer SGD on the averaged pseudo-gradient")
    outer_momentum: float = opt(0.9, "Nesterov momentum of the outer SGD (0: plain SGD)")

    def check(self) -> None:
        self.require("h", self.h >= 1, "a positive integer")
        self.require("outer_lr", self.outer_lr > 0, "> 0")
        self.require("outer_momentum", 0 <= self.outer_momentum < 1, "in [0, 1)")


class DiLoCo(PeriodicMethod):
    """The user's optimizer for ``h`` inner steps, then an averaged outer step (phases ``inner`` / ``outer``)."""

    name = "diloco"
    local_phase, sync_phase = "inner", "outer"

    def __init__(self, comm: Communicator, topo: Topology, config: DiLoCoConfig | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else DiLoCoConfig(**options)
        super().__init__(comm, topo, self.cfg.h)
        self.global_params: list[torch.Tensor] = []
        self.outer_optimizer: torch.optim.Optimizer | None = None

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        # The outer optimizer's parameters: the global model, identical on every worker after the broadcast.
        self.global_params = [p.detach().clone() for p in model.parameters()]
        m = self.cfg.outer_momentum
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=self.cfg.outer_lr, momentum=m, nesterov=m > 0)
        return model

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the pseudo-gradients (and float buffers) over all workers, step the outer optimizer, load the result."""
        assert self.module is not None and self.outer_optimizer is not None, "prepare() first"
        params = list(self.module.parameters())
        pseudo = [g - p.detach() for g, p in zip(self.global_params, params)]
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        with torch.profiler.record_function("abtrain::diloco::outer"), self.comm.ledger.in_phase("outer"):
            self.comm.all_reduce_tensors(pseudo + buffers, self.topo.world, average=True)
        for g, d in zip(self.global_params, pseudo):
            g.grad = d
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for p, g in zip(params, self.global_params):
            p.copy_(g)

    def extra_results(self) -> dict[str, Any]:
        return {"diloco": {**asdict(self.cfg), "outer_steps": self.syncs}}

    def state_dict(self) -> dict[str, Any]:
        assert self.outer_optimizer is not None, "prepare() first"
        return {"t": self.t, "outer_steps": self.syncs, "last_outer": self._last_sync,
                "global_params": [g.clone() for g in self.global_params],
                "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.outer_optimizer is not None, "prepare() first"
        self.t = state["t"]
        self.syncs = state["outer_steps"]
        self._last_sync = state["last_outer"]
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global_params"]):
                g.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])


register(MethodSpec("diloco", DiLoCo, "DiLoCo", "H inner steps of the chosen optimizer (AdamW recommended), then an "
                    "outer Nesterov step on the averaged pseudo-gradient", options=DiLoCoConfig, order=60, bench=4,
                    short_run_args=("--diloco-h", "2")))
