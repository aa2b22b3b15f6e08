"""A named group of workers as the communicator and the ledger see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Where a group's traffic goes: across groups of workers (``global``; between nodes in the intended
#: deployment) or inside one (``group``).
SCOPES = ("global", "group")


@dataclass(frozen=True, init=False)
class Group:
    """A named process group as the ledger sees it.

    ``scope`` is ``global`` when the group spans more than one group of
    workers (traffic that crosses nodes in the intended deployment) and
    ``group`` when it stays inside one. ``pg`` is the torch ProcessGroup (None
    when ``size == 1``, not distributed, or after :meth:`release`); it takes no
    part in comparing groups.
    """

    name: str
    size: int
    scope: str
    ranks: tuple[int, ...] = ()
    _pg: Any = field(default=None, compare=False, repr=False)

    def __init__(self, name: str, size: int, scope: str, pg: Any = None, ranks: tuple[int, ...] = ()) -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        for key, value in (("name", name), ("size", size), ("scope", scope), ("ranks", tuple(ranks)), ("_pg", pg)):
            object.__setattr__(self, key, value)

    @property
    def pg(self) -> Any:
        return self._pg

    def release(self) -> None:
        """Drop the reference to the process group, for every holder of this Group at once.

        Whatever still holds the Group (a method, its bucket reducers) then no longer keeps the
        process group alive: destroyed, it is freed now, not at the interpreter's shutdown
        (``Topology.close``).
        """
        object.__setattr__(self, "_pg", None)
