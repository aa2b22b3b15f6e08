"""An outer step at AB-training's syncs: the averaged change since the workers last agreed, through Nesterov SGD.

With ``--ab-outer-lr`` η and ``--ab-outer-momentum`` μ, a sync that averages the groups into W_new from the
W_start every worker held when the phase began (the SVD the tangent split started from; a full-rank tensor's
value at that decomposition) applies, as DiLoCo's outer optimizer does to its pseudo-gradient (Douillard et al.
2023; torch's SGD with ``nesterov=True`` on the gradient −Δ):

    Δ = W_new − W_start,   u ← μ·u + Δ,   W = W_start + η·(Δ + μ·u)

η = 1, μ = 0 is the plain average (W = W_new); that default builds no :class:`OuterStep`. Every worker computes
the same W from the same W_start and the same averaged W_new, so the workers still leave the sync with one model.
The momentum u of every factorised layer (m×n) and full-rank parameter, and each full-rank parameter's W_start,
are training state every worker holds: a model's worth of numbers, twice for the full-rank part. A layer's W is
then no longer the phase's SVD plus the sync's rank-q change, so its SVD after the sync is a full one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class OuterStep:
    """Nesterov momentum on the sync's averaged change, per tensor by name (see the module docstring)."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr, self.momentum = lr, momentum
        self.momenta: dict[str, Tensor] = {}  # u, by name
        self.starts: dict[str, Tensor] = {}  # each full-rank parameter's value when the workers last agreed

    def remember(self, named: list[tuple[str, Tensor]]) -> None:
        """The full-rank parameters every worker holds now (a decomposition, the end of a sync): the next sync's
        W_start for them."""
        self.starts = {name: t.detach().clone() for name, t in named}

    @torch.no_grad()
    def apply(self, name: str, start: Tensor, averaged: Tensor) -> None:
        """``averaged`` (W_new, in place) becomes W_start + η·(Δ + μ·u), u updated; ``start`` is W_start."""
        change = averaged - start
        u = self.momenta.get(name)
        u = change.clone() if u is None else u.mul_(self.momentum).add_(change)
        self.momenta[name] = u
        averaged.copy_(start + self.lr * (change + self.momentum * u))

    @torch.no_grad()
    def apply_full_rank(self, named: list[tuple[str, Tensor]]) -> None:
        """The outer step on every full-rank parameter that has a W_start (all but right after preparing)."""
        for name, t in named:
            if name in self.starts:
                self.apply(name, self.starts[name], t)

    def state_dict(self) -> dict[str, Any]:
        return {"momenta": dict(self.momenta), "starts": dict(self.starts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momenta, self.starts = dict(state["momenta"]), dict(state["starts"])
