"""Collective times on a GPU without stalling the host: CUDA event pairs, read when a summary needs them.

A device-wide ``torch.cuda.synchronize`` after every collective would make the
host wait for all queued work and serialise what overlaps; the time it gives
also includes that work. Events recorded on the current stream just before
and after a collective measure the collective on the device; :class:`EventTimes`
keeps the pairs and reads them lazily (``elapsed_time`` after waiting for the
end event only), or early for pairs already finished when many are pending.
"""

from __future__ import annotations

from typing import Any, Protocol


class _Timed(Protocol):
    seconds: float


class EventTimes:
    """Pending (ledger row, start event, end event) triples; :meth:`resolve` adds their times to the rows."""

    #: pending pairs above which the finished ones are read without waiting
    LIMIT = 1024

    def __init__(self) -> None:
        self.pending: list[tuple[_Timed, Any, Any]] = []

    def add(self, row: _Timed, start: Any, end: Any) -> None:
        self.pending.append((row, start, end))
        if len(self.pending) >= self.LIMIT:
            self.resolve(wait=False)

    def resolve(self, wait: bool = True) -> None:
        """Add each pair's time to its row (``wait=False``: only pairs whose end event has completed)."""
        left = []
        for row, start, end in self.pending:
            if wait:
                end.synchronize()  # this event only, not the whole device
            elif not end.query():
                left.append((row, start, end))
                continue
            row.seconds += start.elapsed_time(end) / 1000.0  # milliseconds
        self.pending = left
