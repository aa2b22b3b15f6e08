"""AB-training (docs/ab-training.md): independent groups train low-rank factors A or B, periodic sync.

Importing the package registers the method under "ab" (:mod:`.method`). Its files:
``method`` (:class:`ABTraining` and its hooks), ``core`` (the state its parts
share), ``decomposition``, ``sync``, ``consensus``, ``schedule``, ``config``
(:class:`ABConfig` and the presets) and ``buckets`` (in-group gradient averaging).
"""

from __future__ import annotations

from .config import EARLIER_DEFAULTS, PAPER, ABConfig, check_topology, default_group_size
from .method import ABTraining
from .schedule import Schedule

__all__ = ["EARLIER_DEFAULTS", "PAPER", "ABConfig", "ABTraining", "Schedule", "check_topology",
           "default_group_size"]
