"""AB-training (docs/ab-training.md): independent groups train low-rank factors A or B, periodic sync.

Importing the package registers the method under "ab" (:mod:`.method`). :class:`ABTraining` is made of parts,
each an object it holds and calls, sharing one :class:`~.state.PhaseState`: ``schedule`` (:class:`Schedule`),
``decomposer`` (W's SVD, agreed ranks, rank caps, factors and their optimizer state), ``syncer`` (the four
sync modes, the tangent merge; ``compressor``: the low-rank change's PowerSGD), ``dense`` (``--ab-dense-comm``)
and ``buckets`` (in-group gradient averaging), ``prepare`` (the factorised layers, SyncBatchNorm, the output
layer). ``config`` holds :class:`ABConfig` and the presets; ``lowrank`` the single-process factorisation.
"""

from __future__ import annotations

from .config import PAPER, ABConfig, check_topology, default_group_size
from .method import ABTraining
from .schedule import Schedule

__all__ = ["PAPER", "ABConfig", "ABTraining", "Schedule", "check_topology", "default_group_size"]
