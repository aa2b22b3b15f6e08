"""Run directory output: results.json, metrics.csv, TensorBoard, the summary table; files written atomically\n(status.json is :mod:`abtrain.run.rundir`'s)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import resource
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from .._version import __version__
from ..methods.memory import dense_training_state_bytes, peak_state_total
from ..methods.summary import ddp_equivalent, human_bytes, method_lines
from .safefile import atomic_write

log = logging.getLogger(__name__)

HISTORY_COLUMNS = ("step", "epoch", "test_accuracy", "test_loss", "test_perplexity", "train_loss",
                   "wire_bytes", "global_wire_bytes", "wall_seconds", "eval_seconds", "lr", "phase")


def write_metrics_csv(path: str, history: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=HISTORY_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in history:
        writer.writerow({k: row.get(k, "") for k in HISTORY_COLUMNS})
    atomic_write(path, buf.getvalue())


def peak_rss_bytes() -> int:
    """Largest resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def count_multiply_adds(counts: dict[str, int], phase: str) -> contextlib.AbstractContextManager[Any]:
    """A context that counts the multiply-adds of its block (torch's FlopCounterMode: matrix products and
    convolutions, half its FLOPs) into ``counts[phase]`` the first time ``phase`` is met, and an empty one
    afterwards. What has no formula there (an SVD, elementwise work) is not counted."""
    if phase in counts:
        return contextlib.nullcontext()
    return _counted(counts, phase)


@contextlib.contextmanager
def _counted(counts: dict[str, int], phase: str) -> Iterator[None]:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        yield
    counts[phase] = int(counter.get_total_flops()) // 2


def gather_memory(comm: Any, group: Any, device: Any, peak_rss: int, peak_state: dict[str, dict[str, int]],
                  multiply_adds: dict[str, int] | None = None) -> dict[str, Any]:
    """Every worker's peak RSS, training state and multiply-adds per step, gathered over ``group`` (two
    all-gathers, in the ledger: each worker's peak RSS and the length of its record, then the records).

    Returns ``peak_rss_bytes`` and ``training_state_bytes`` (the most any worker held), ``training_state_by_worker``
    (each worker's most after a step of each phase, by part, in rank order), ``training_state_by_phase`` (for
    each phase, the parts of the worker that held the most in it) and ``multiply_adds_by_worker`` (each worker's
    multiply-adds of one step's forward and backward, by phase): AB-training's groups train different factors,
    so one worker's figures do not stand for the others'."""
    encoded = list(json.dumps({"state": peak_state, "multiply_adds": multiply_adds or {}}).encode())
    heads = comm.all_gather(torch.tensor([peak_rss, len(encoded)], dtype=torch.float64, device=device), group)
    width = int(max(h[1].item() for h in heads))
    body = torch.zeros(width, dtype=torch.uint8)
    body[:len(encoded)] = torch.tensor(encoded, dtype=torch.uint8)
    bodies = comm.all_gather(body.to(device), group)
    records = [json.loads(bytes(b[:int(h[1].item())].cpu().tolist()).decode()) for h, b in zip(heads, bodies)]
    workers = [record["state"] for record in records]
    by_phase: dict[str, dict[str, int]] = {}
    for worker in workers:
        for phase, parts in worker.items():
            if sum(parts.values()) > sum(by_phase.get(phase, {}).values()):
                by_phase[phase] = parts
    return {"peak_rss_bytes": int(max(h[0].item() for h in heads)),
            "training_state_bytes": max(peak_state_total(worker) for worker in workers),
            "training_state_by_worker": workers, "training_state_by_phase": by_phase,
            "multiply_adds_by_worker": [record["multiply_adds"] for record in records]}


def check_writable(run_dir: str) -> None:
    """Create ``run_dir`` and prove a file can be written there; ValueError with the reason otherwise."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=run_dir)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ValueError(f"cannot write to run directory {run_dir}: {exc.strerror}; pass --out with a writable directory") from None
    if os.path.exists(os.path.join(run_dir, "results.json")):
        raise ValueError(f"run directory {run_dir} already holds a finished run (results.json); pass another --out")


class TensorBoard:
    """TensorBoard event files (``RUN_DIR/tensorboard``) when the ``tensorboard`` extra is installed; a no-op otherwise.

    Scalars per evaluation, against the step: the test metrics, ``train_loss``,
    ``lr`` (as applied), ``wire_bytes`` and ``global_wire_bytes`` (cumulative,
    per worker). Accuracy against communication: ``test_accuracy_vs_wire_kB`` and
    ``test_accuracy_vs_global_wire_kB``, whose x-axis (TensorBoard's integer
    step) is cumulative kilobytes, fine enough that the evaluations of a short
    run stay apart.
    """

    def __init__(self, run_dir: str) -> None:
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    def add(self, row: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key in ("test_accuracy", "test_loss", "test_perplexity", "train_loss", "lr",
                    "wire_bytes", "global_wire_bytes"):
            value = row.get(key)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, row["step"])
        accuracy = row.get("test_accuracy") or 0.0
        self.writer.add_scalar("test_accuracy_vs_wire_kB", accuracy, round(row["wire_bytes"] / 1e3))
        self.writer.add_scalar("test_accuracy_vs_global_wire_kB", accuracy, round(row["global_wire_bytes"] / 1e3))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def results_record(cfg: Any, topo: Any, history: list[dict[str, Any]], steps: int, steps_per_epoch: int,
                   params: int, wall: float, peak_rss: int, comm: dict[str, Any], method_results: dict[str, Any],
                   resumes: list[dict[str, Any]], memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """The content of results.json: the run's identity, final metrics, the ledger's summary, the history.

    ``memory``: ``training_state_bytes`` (the most any worker held after a step), ``moments_per_element``
    (the optimizer's per-element state tensors), ``scalar_state_bytes`` (its state per parameter tensor besides
    those) and ``param_tensors`` (the dense model's parameter tensors), which DDP's training state of the same
    model counts."""
    memory = memory or {}
    ddp = ddp_equivalent(params, topo.world_size, topo.group_size, steps)
    if "moments_per_element" in memory:
        ddp["training_state_bytes"] = dense_training_state_bytes(params, memory["moments_per_element"],
                                                                 tensors=memory.get("param_tensors", 0),
                                                                 scalar_bytes=memory.get("scalar_state_bytes", 0))

    last = history[-1]
    return {
        "status": "complete",
        "method": cfg.method,
        "model": cfg.model,
        "dataset": cfg.dataset,
        "world_size": topo.world_size,
        "group_size": topo.group_size,
        "backend": topo.backend,
        "device": topo.device.type,
        "steps": steps,
        "epochs": round(steps / steps_per_epoch, 4),
        "steps_per_epoch": steps_per_epoch,
        "params": params,
        "final": {k: last[k] for k in ("test_accuracy", "test_loss", "test_perplexity", "train_loss")},
        "wall_seconds": wall,
        "peak_rss_bytes": peak_rss,
        # the model as it trains: the low-rank model of AB-training's last phase, the dense one otherwise
        "model_params": params,
        "compression_ratio": None,
        "training_state_bytes": memory.get("training_state_bytes"),
        # by phase, the parts (parameters, gradients, optimizer, method.*) of the worker that held the most in it
        "training_state_by_phase": memory.get("training_state_by_phase"),
        "training_state_by_worker": memory.get("training_state_by_worker"),
        # each worker's multiply-adds of one step's forward and backward, by phase (counted at its first step)
        "multiply_adds_by_worker": memory.get("multiply_adds_by_worker"),
        "comm": comm,
        "ddp_equivalent": ddp,
        **method_results,
        "resumes": resumes,
        "history": history,
        "config": cfg.to_dict(),
        "abtrain_version": __version__,
        "torch_version": torch.__version__,
    }


def summary_table(results: dict[str, Any], run_dir: str) -> str:
    """The table rank 0 prints at the end of a run."""
    final = results["final"]
    lines = [
        f"abtrain {results['method']} | {results['model']} on {results['dataset']} | "
        f"{results['world_size']} workers | {results['steps']} steps",
        f"  test accuracy   {100 * final['test_accuracy']:.2f} %" + f"    test loss {final['test_loss']:.4f}"
        + (f"    perplexity {final['test_perplexity']:.2f}" if final.get("test_perplexity") else ""),
        f"  wall time       {results['wall_seconds']:.1f} s    peak RSS {human_bytes(results['peak_rss_bytes'])}",
        *method_lines(results),
        f"  results         {os.path.join(run_dir, 'results.json')}",
    ]
    return "\n".join(lines)


