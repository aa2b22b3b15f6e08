"""The one place where collectives run and where bytes are counted.

Every method (DDP through its communication hook, AB-training, the baselines)
sends its traffic through a :class:`Communicator`; its :class:`~abtrain.comm.ledger.Ledger`
records each call (op, process group, scope, dtype, numel, payload and modelled
wire bytes, phase, time). The wire-byte model is in :mod:`abtrain.comm.ledger`.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .group import Group
from .ledger import Ledger, LedgerRow

__all__ = ["CollectiveError", "Communicator"]


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, or stopped answering for longer than the process-group timeout."""


def _collective_error(op: str, group: Group, phase: str, seconds: float, exc: BaseException) -> CollectiveError:
    # The backend's message can span many lines (a C++ stack); its first line says what happened.
    cause = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return CollectiveError(
        f"collective {op} on group {group.name} (phase {phase}) failed after {seconds:.1f} s: peer stopped "
        f"answering? ({cause[:300]}); if a step legitimately takes that long, raise --timeout")


class Communicator:
    """Runs collectives over named groups and records each one in the ledger.

    With a group of size 1 (or no process group at all) every call returns
    the input unchanged and nothing is recorded: single-process code is the
    same code with communication skipped.
    """

    def __init__(self, ledger: Ledger | None = None, device: torch.device | None = None) -> None:
        self.ledger = ledger if ledger is not None else Ledger()
        self.device = device or torch.device("cpu")

    @contextlib.contextmanager
    def _guarded(self, op: str, group: Group) -> Iterator[float]:
        """Turn a backend failure (timeout, dead peer) into one line naming the collective, group and phase."""
        start = time.perf_counter()
        try:
            yield start
        except CollectiveError:
            raise
        except RuntimeError as exc:  # DistBackendError is a RuntimeError
            raise _collective_error(op, group, self.ledger.phase, time.perf_counter() - start, exc) from exc

    @contextlib.contextmanager
    def _timed(self, op: str, group: Group, tensor: torch.Tensor) -> Iterator[None]:
        # On a GPU: CUDA events around the collective, read at the next summary (no synchronize here).
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if tensor.is_cuda else None
        with self._guarded(op, group) as start:
            if events:
                events[0].record()
            yield
            if events:
                events[1].record()
        self.ledger.record(op, group, tensor, 0.0 if events else time.perf_counter() - start, events)

    def rank_in(self, group: Group) -> int:
        """This worker's position in ``group`` (0 .. size-1): which slice of a split buffer is its own."""
        if group.size <= 1 or group.pg is None:
            return 0
        return dist.get_rank(group.pg)

    def barrier(self, group: Group) -> None:
        """Wait until every member of ``group`` arrives. Not a data transfer: nothing is recorded in the ledger."""
        if group.size <= 1:
            return
        with self._guarded("barrier", group):
            dist.barrier(group=group.pg)

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = "sum", average: bool = False) -> torch.Tensor:
        """In-place all-reduce (``op``: sum, max, min); ``average`` divides a sum by the group size."""
        if group.size <= 1:
            return tensor
        with self._timed("all_reduce", group, tensor):
            dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.pg)
        if average:
            tensor.div_(group.size)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, group: Group, average: bool = True) -> torch.futures.Future:
        """Asynchronous sum all-reduce returning a Future of the (averaged) tensor.

        This is the seam for DDP communication hooks: DDP keeps its own
        bucketing and overlap; the ledger records each bucket. Time is
        recorded when the future completes (issue to completion).
        """
        if group.size <= 1:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(tensor)
            return fut
        if average:
            tensor.div_(group.size)
        phase = self.ledger.phase
        start = time.perf_counter()
        self.ledger.record("all_reduce", group, tensor, 0.0)
        with self._guarded("all_reduce", group):
            work = dist.all_reduce(tensor, group=group.pg, async_op=True)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                value = fut.value()[0]
            except RuntimeError as exc:
                raise _collective_error("all_reduce", group, phase, time.perf_counter() - start, exc) from exc
            self.ledger.add_seconds("all_reduce", group, tensor.dtype, phase, time.perf_counter() - start)
            return value

        return work.get_future().then(done)

    def broadcast(self, tensor: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
        """In-place broadcast from global rank ``src`` (which must belong to ``group``)."""
        if group.size <= 1:
            return tensor
        with self._timed("broadcast", group, tensor):
            dist.broadcast(tensor, src=src, group=group.pg)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Group) -> list[torch.Tensor]:
        """Gather one tensor from every member; returns them in group-rank order."""
        if group.size <= 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(group.size)]
        with self._timed("all_gather", group, tensor):
            dist.all_gather(out, tensor, group=group.pg)
        return out

    def gather(self, tensor: torch.Tensor, group: Group, sizes: Sequence[int], dst: int = 0
               ) -> list[torch.Tensor] | None:
        """Every member's 1-D ``tensor`` (member i's of ``sizes[i]`` elements, one dtype) to global rank ``dst``
        (which must belong to ``group``): the list in group-rank order on ``dst``, None elsewhere. Each other member
        sends its tensor to ``dst`` only, at its own size (an all-to-all with uneven splits); ``dst``'s own stays
        where it is, and ``dst`` sends nothing."""
        if group.size <= 1:
            return [tensor]
        root = group.ranks.index(dst) if group.ranks else dst
        me = self.rank_in(group)
        none = [0] * group.size
        if me == root:
            sent = tensor[:0]
            out = torch.empty(sum(sizes) - sizes[root], dtype=tensor.dtype, device=tensor.device)
            splits = [0 if i == root else n for i, n in enumerate(sizes)]
            with self._timed("gather", group, sent):
                dist.all_to_all_single(out, sent, output_split_sizes=splits, input_split_sizes=none, group=group.pg)
            parts = list(out.split(splits))
            parts[root] = tensor
            return parts
        splits = [tensor.numel() if i == root else 0 for i in range(group.size)]
        with self._timed("gather", group, tensor):
            dist.all_to_all_single(tensor[:0], tensor, output_split_sizes=none, input_split_sizes=splits,
                                   group=group.pg)
        return None

    def all_to_all(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        """Send the j-th of ``group.size`` equal chunks of ``tensor`` to member j; return what each member sent
        this worker, in group-rank order, as one tensor of the same shape."""
        if group.size <= 1:
            return tensor
        if tensor.numel() % group.size:
            raise ValueError(f"all_to_all needs numel divisible by {group.size}, got {tensor.numel()}")
        out = torch.empty_like(tensor)
        with self._timed("all_to_all", group, tensor):
            dist.all_to_all_single(out, tensor, group=group.pg)
        return out

    # -- flat-buffer helpers: one collective per dtype ---------------------
    def all_reduce_tensors(self, tensors: Sequence[torch.Tensor], group: Group, average: bool = True,
                           wire_dtype: torch.dtype | None = None) -> None:
        """Average (or sum) several tensors in place through one flat buffer per dtype.

        ``wire_dtype`` (e.g. bfloat16) casts the buffer for the collective and back;
        an average then divides before the sum, as torch's bf16 hook does, so the
        narrow type cannot overflow. Every worker receives the same result.
        """
        if wire_dtype is None:
            self._packed(tensors, group, lambda flat: self.all_reduce(flat, group, average=average))
            return

        def narrow(flat: torch.Tensor) -> torch.Tensor:
            sent = flat.to(wire_dtype)
            if average:
                sent.div_(group.size)
            return self.all_reduce(sent, group).to(flat.dtype)

        self._packed(tensors, group, lambda flat: flat.copy_(narrow(flat)))

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], group: Group, src: int = 0) -> None:
        """Broadcast several tensors in place through one flat buffer per dtype."""
        self._packed(tensors, group, lambda flat: self.broadcast(flat, group, src=src))

    @staticmethod
    @torch.no_grad()
    def _packed(tensors: Sequence[torch.Tensor], group: Group, collective) -> None:
        if group.size <= 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same_dtype])
            collective(flat)
            offset = 0
            for t in same_dtype:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def mean_summary(self, group: Group) -> dict[str, Any]:
        """The ledger summary averaged over ``group``'s workers, with each worker's totals.

        Workers of different groups can send different amounts (AB-training's
        A- and B-groups train factors of different sizes), so results report
        the mean per worker; the peak bytes of one step are the most any worker sent. Two small collectives (a key check and the sums)
        and one all-gather of the totals do it; they are recorded in the ledger
        after the snapshot they average, so the figures exclude their own few
        hundred bytes. Workers whose ledgers hold different keys (never in
        abtrain's methods) fall back to this worker's own summary.
        """
        ledger = self.ledger
        ledger.device_times.resolve()
        keys = sorted(ledger.rows)
        stats = torch.tensor([[ledger.rows[k].payload_bytes, ledger.rows[k].wire_bytes, ledger.rows[k].calls,
                               ledger.rows[k].seconds, ledger.rows[k].numel] for k in keys],
                             dtype=torch.float64, device=self.device).reshape(-1, 5)
        own = torch.tensor([stats[:, 0].sum(), stats[:, 1].sum(),
                            sum(ledger.rows[k].wire_bytes for k in keys if k[3] == "global"),
                            ledger.summary()["peak_global_step_bytes"], ledger.summary()["end_global_bytes"]],
                           dtype=torch.float64, device=self.device)
        per_worker = [t.tolist() for t in self.all_gather(own, group)]
        digest = int.from_bytes(hashlib.sha256(repr(keys).encode()).digest()[:7], "big")
        check = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        self.all_reduce(check, group, op="max")
        mean = Ledger()
        if check.tolist() == [digest, -digest]:
            self.all_reduce(stats, group, average=True)
            for k, (payload, wire, calls, seconds, numel) in zip(keys, stats.tolist()):
                mean.rows[k] = LedgerRow(calls=_exact(calls), numel=_exact(numel), payload_bytes=_exact(payload),
                                    wire_bytes=wire, seconds=seconds)
            averaged = True
        else:
            mean.rows = dict(ledger.rows)
            averaged = False
        out = mean.summary()
        out["averaged_over_workers"] = averaged
        # the most any worker sent in one training step, and at the run's end
        out["peak_global_step_bytes"] = max(peak for *_, peak, _ in per_worker)
        out["end_global_bytes"] = max(end for *_, end in per_worker)
        out["per_worker"] = [{"rank": r, "payload_bytes": _exact(p), "wire_bytes": w, "global_wire_bytes": g,
                              "peak_global_step_bytes": peak, "end_global_bytes": end}
                             for r, (p, w, g, peak, end) in zip(group.ranks or range(group.size), per_worker)]
        return out


def _exact(x: float) -> int | float:
    """An integral mean as an int (equal workers), a fractional one as it is."""
    return int(x) if float(x).is_integer() else x
