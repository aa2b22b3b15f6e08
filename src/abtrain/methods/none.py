"""No communication during training: every worker trains alone (the compute floor)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .base import Method
from .registry import MethodSpec, register
from .resume import Writer


class NoCommunication(Method):
    """Workers start from rank 0's weights (the ``setup`` broadcast) and never talk again while training.

    The workers' models drift apart from the first step on, and
    :meth:`in_consensus` says so. Evaluations still happen on schedule
    (:meth:`ready_for_evaluation`): each worker evaluates its *own* model on
    its part of the test set, and the summed metrics are the accuracy of that
    ensemble of per-worker evaluations, not of one averaged model. Buffers stay
    per worker for the same reason, and :meth:`consensus` sends nothing.
    """

    name = "none"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.t = 0  # optimizer steps taken
        self._said_apart = False

    @property
    def phase(self) -> str:
        return "local"

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.t += 1

    def sync_buffers(self) -> None:
        """Nothing: each worker's running statistics belong to its own model."""

    def in_consensus(self) -> bool:
        # Honest: one model only before the first step (prepare() broadcast rank 0's), or in a world of one.
        return self.t == 0 or self.topo.world_size == 1

    def ready_for_evaluation(self) -> bool:
        # Evaluation never waits: each worker evaluates its own model (see the class docstring).
        return True

    def consensus(self) -> contextlib.AbstractContextManager[Method]:
        """Sends nothing: the workers keep their own models (the point of this baseline)."""
        if not self.in_consensus() and not self._said_apart:
            self._said_apart = True
            self.say("method none: the workers keep their own models; each evaluates its own")
        return contextlib.nullcontext(self)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = int(state.get("t", 0))

    def dcp_split(self) -> tuple[set[str], set[str]]:
        """Every parameter and its optimizer state are this worker's own."""
        assert self.module is not None, "prepare() first"
        own, held = super().dcp_split()
        return own | {name for name, _ in self.module.named_parameters(remove_duplicate=False)}, held

    def given_up(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
        return [f"every other worker's own model and optimizer state (they go on from rank {writer.rank}'s)"
                ] if state.get("t") else []

    def extra_results(self) -> dict[str, Any]:
        return {"evaluation": "per-worker models, metrics summed over the workers' test shards"}


register(MethodSpec("none", NoCommunication, "no communication", "every worker trains alone after the initial "
                    "broadcast (the compute floor)", order=1000, bench=0))
