"""No communication during training: every worker trains alone (the compute floor)."""

from __future__ import annotations

from typing import Any

from .base import Method


class NoCommunication(Method):
    """Workers start from rank 0's weights (the ``setup`` broadcast) and never talk again while training.

    The workers' models drift apart. :meth:`in_consensus` still answers
    True so that evaluations happen on schedule: each worker evaluates its
    *own* model on its part of the test set, and the summed metrics are the
    accuracy of that ensemble of per-worker evaluations, not of one averaged
    model. Buffers stay per worker for the same reason.
    """

    name = "none"

    @property
    def phase(self) -> str:
        return "local"

    def sync_buffers(self) -> None:
        """Nothing: each worker's running statistics belong to its own model."""

    def in_consensus(self) -> bool:
        # Not literally true (see the class docstring); evaluation must not wait for a consensus that never comes.
        return True

    def extra_results(self) -> dict[str, Any]:
        return {"evaluation": "per-worker models, metrics summed over the workers' test shards"}
