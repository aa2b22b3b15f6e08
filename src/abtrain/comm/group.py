"""A named group of workers as the communicator and the ledger see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Where a group's traffic goes: across groups of workers (``global``; between nodes in the intended
#: deployment) or inside one (``group``).
SCOPES = ("global", "group")


@dataclass(frozen=True)
class Group:
    """A named process group as the ledger sees it.

    ``scope`` is ``global`` when the group spans more than one group of
    workers (traffic that crosses nodes in the intended deployment) and
    ``group`` when it stays inside one.
    """

    name: str
    size: int
    scope: str
    pg: Any = None  # torch ProcessGroup, None when size == 1 or not distributed
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
