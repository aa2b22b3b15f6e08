"""The communication ledger: every collective counted by op, process group, scope, dtype and phase.

The :class:`~abtrain.comm.communicator.Communicator` hands the :class:`Ledger` every call it
runs; the ledger records op, process group (name, size, scope), dtype, numel,
payload bytes, modelled wire bytes, training phase and time.

Wire-byte model (bytes *sent per worker*, for a group of ``p`` workers and a
payload of ``b`` bytes = the tensor handed to the collective by one worker):

=================  =====================  =======================================
op                 wire bytes per worker  why
=================  =====================  =======================================
all_reduce         2(p-1)/p * b           ring: reduce-scatter then all-gather
reduce_scatter     (p-1)/p * b            ring: b is the full input tensor
all_gather         (p-1) * b              ring: b is one worker's contribution
broadcast          (p-1)/p * b            pipelined ring: the p-1 receivers' b,
                                          spread over p senders
gather             b                      to one root: b is what this worker
                                          sends it (the root hands in nothing:
                                          its own part stays)
all_to_all         (p-1)/p * b            b is the full input tensor, split in p
                                          equal chunks: chunk j goes to member j,
                                          the worker's own chunk stays
=================  =====================  =======================================

With ``p == 1`` nothing leaves the worker: wire bytes are 0 (the collective is
skipped altogether, see "single-process is the same code").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .device_timing import EventTimes
from .group import SCOPES, Group

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "gather", "all_to_all")


def wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Modelled bytes one worker sends for ``op`` (see the module table)."""
    p = group_size
    if p <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (p - 1) / p * payload_bytes
    if op == "gather":
        return float(payload_bytes)
    if op in ("reduce_scatter", "broadcast", "all_to_all"):
        return (p - 1) / p * payload_bytes
    if op == "all_gather":
        return float((p - 1) * payload_bytes)
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")


@dataclass
class LedgerRow:
    calls: int = 0
    numel: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    seconds: float = 0.0


#: A ledger row's key: (op, group name, group size, scope, dtype, phase).
RowKey = tuple[str, str, int, str, str, str]


@dataclass
class Ledger:
    """Totals of every collective, keyed by (op, group, group size, scope, dtype, phase).

    Aggregated rather than one record per call so that a long run keeps a
    fixed-size ledger; ``calls`` keeps the count. The phase label is the
    innermost :meth:`in_phase` block's, else the phase of the method the
    ledger follows (:meth:`follow`; the attached method), else ``setup``.
    """

    rows: dict[RowKey, LedgerRow] = field(default_factory=dict)
    enabled: bool = True
    #: the most global wire bytes of any one optimizer step (see :meth:`end_step`), and that step (1-based)
    peak_global_step_bytes: float = 0.0
    peak_global_step: int = 0
    _step_global: float = field(default=0.0, repr=False)  # global wire bytes of the step in progress
    _labels: list[str] = field(default_factory=list, repr=False)
    _source: Any = field(default=None, repr=False)
    device_times: EventTimes = field(default_factory=EventTimes, repr=False, compare=False)  # CUDA collectives

    @property
    def phase(self) -> str:
        """The label the next collective gets."""
        if self._labels:
            return self._labels[-1]
        return self._source.phase if self._source is not None else "setup"

    def follow(self, source: Any) -> None:
        """Label traffic outside :meth:`in_phase` blocks with ``source.phase`` (a method's current phase)."""
        self._source = source

    def record(self, op: str, group: Group, tensor: torch.Tensor, seconds: float, events: Any = None
               ) -> tuple[int, float]:
        """Count one collective; ``events`` (start, end CUDA events) give its time later instead of ``seconds``."""
        payload = tensor.numel() * tensor.element_size()
        wire = wire_bytes(op, payload, group.size)
        if self.enabled:
            key = (op, group.name, group.size, group.scope, str(tensor.dtype).removeprefix("torch."), self.phase)
            row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = LedgerRow()
            row.calls += 1
            row.numel += tensor.numel()
            row.payload_bytes += payload
            row.wire_bytes += wire
            row.seconds += seconds
            if events is not None:
                self.device_times.add(row, *events)
            if group.scope == "global" and key[5] not in ("setup", "eval", "checkpoint"):
                self._step_global += wire
        return payload, wire

    def end_step(self, step: int) -> None:
        """Close optimizer step ``step`` (1-based): its global wire bytes (every collective between the end of the
        step before and the end of this one, a sync or decomposition after it included; the one-off setup,
        the evaluations and a checkpoint's gather not) count towards :attr:`peak_global_step_bytes`, the peak a
        slow link between nodes has to carry in one step."""
        if self._step_global > self.peak_global_step_bytes:
            self.peak_global_step_bytes, self.peak_global_step = self._step_global, step
        self._step_global = 0.0

    def add_seconds(self, op: str, group: Group, dtype: torch.dtype, phase: str, seconds: float) -> None:
        row = self.rows.get((op, group.name, group.size, group.scope, str(dtype).removeprefix("torch."), phase))
        if row is not None:
            row.seconds += seconds

    @contextlib.contextmanager
    def in_phase(self, label: str) -> Iterator[None]:
        """Label every collective issued inside the block with ``label``."""
        self._labels.append(label)
        try:
            yield
        finally:
            self._labels.pop()

    # -- summaries ---------------------------------------------------------
    def _sum(self, pred) -> dict[str, float]:
        out = {"payload_bytes": 0, "wire_bytes": 0.0, "calls": 0, "seconds": 0.0}
        for key, row in self.rows.items():
            if pred(key):
                out["payload_bytes"] += row.payload_bytes
                out["wire_bytes"] += row.wire_bytes
                out["calls"] += row.calls
                out["seconds"] += row.seconds
        return out

    @property
    def wire_total(self) -> float:
        return sum(r.wire_bytes for r in self.rows.values())

    @property
    def global_wire_total(self) -> float:
        return sum(r.wire_bytes for k, r in self.rows.items() if k[3] == "global")

    def summary(self) -> dict[str, Any]:
        """The ``comm`` section of results.json (per worker, summed over the run)."""
        self.device_times.resolve()
        total = self._sum(lambda k: True)
        phases = sorted({k[5] for k in self.rows})
        return {
            "payload_bytes": total["payload_bytes"],
            "wire_bytes": total["wire_bytes"],
            "calls": total["calls"],
            "seconds": total["seconds"],
            "peak_global_step_bytes": self.peak_global_step_bytes,
            # what the last end_step has not closed: the run's end (a last sync that brings apart workers together)
            "end_global_bytes": self._step_global,
            "by_scope": {s: self._sum(lambda k, s=s: k[3] == s) for s in SCOPES},
            "by_phase": {p: self._sum(lambda k, p=p: k[5] == p) for p in phases},
            "by_op": {o: self._sum(lambda k, o=o: k[0] == o) for o in sorted({k[0] for k in self.rows})},
            "rows": [
                {"op": k[0], "group": k[1], "group_size": k[2], "scope": k[3], "dtype": k[4], "phase": k[5],
                 "calls": r.calls, "numel": r.numel, "payload_bytes": r.payload_bytes,
                 "wire_bytes": r.wire_bytes, "seconds": r.seconds}
                for k, r in sorted(self.rows.items())
            ],
        }

    def state_dict(self) -> dict[str, Any]:
        self.device_times.resolve()
        return {"rows": [[list(k), vars(r).copy()] for k, r in self.rows.items()],
                "peak_global_step": [self.peak_global_step_bytes, self.peak_global_step, self._step_global]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows = {tuple(k): LedgerRow(**r) for k, r in state["rows"]}  # type: ignore[misc]
        self.peak_global_step_bytes, self.peak_global_step, self._step_global = state["peak_global_step"]
