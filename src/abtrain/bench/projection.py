"""Time per epoch beyond one machine, from counted bytes and measured compute, under an α-β model.

This is a model, not a measurement. A collective over ``p`` workers of a
payload ``n`` (the bytes one worker hands to it) costs

    T = s(p) · α + w(n, p) / β

with ``w`` the wire bytes per worker of :func:`abtrain.comm.wire_bytes` and
``s`` the number of sequential ring steps (all-reduce: 2(p−1), so the ring
all-reduce costs 2(p−1) α + 2(p−1)/p · n / β; reduce-scatter, all-gather and
broadcast: p−1). ``group``-scope collectives run inside one node (α, β of the
intra-node links, p = node size); ``global``-scope collectives span the same
fraction of the world as in the measured run (α, β between nodes). Compute
and communication are assumed not to overlap. See docs/bench.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..comm import wire_bytes

DEFAULT_WORKERS = (8, 16, 32, 64, 128, 256)


@dataclass
class NetworkModel:
    """Bandwidths in bytes/s and latencies in seconds, per worker link."""

    intra_bw: float = 100e9
    inter_bw: float = 12.5e9
    intra_latency: float = 1e-6
    inter_latency: float = 5e-6
    node_size: int = 4

    def __post_init__(self) -> None:
        for name in ("intra_bw", "inter_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("intra_latency", "inter_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.node_size < 1:
            raise ValueError(f"--node-size must be positive, got {self.node_size}")

    def describe(self) -> str:
        return (f"nodes of {self.node_size} workers; inside a node {self.intra_bw / 1e9:g} GB/s and "
                f"{self.intra_latency * 1e6:g} µs, between nodes {self.inter_bw / 1e9:g} GB/s and "
                f"{self.inter_latency * 1e6:g} µs per worker link")


def ring_steps(op: str, p: int) -> int:
    """Sequential message steps of the ring (pipelined) algorithm behind each wire-byte formula."""
    if p <= 1:
        return 0
    return 2 * (p - 1) if op == "all_reduce" else p - 1


def collective_seconds(op: str, payload_bytes: float, p: int, bandwidth: float, latency: float) -> float:
    """α-β time of one collective: ring steps × α + wire bytes per worker / β."""
    return ring_steps(op, p) * latency + wire_bytes(op, payload_bytes, p) / bandwidth


def comm_seconds_per_step(results: dict[str, Any], workers: int, model: NetworkModel) -> float:
    """Modelled communication time per step of a run's collectives, rescaled to ``workers`` workers.

    The one-off ``setup`` broadcast is left out; evaluation traffic is spread over the steps.
    """
    steps = max(1, int(results["steps"]))
    world = int(results["world_size"])
    total = 0.0
    for row in results["comm"]["rows"]:
        if row["phase"] == "setup" or row["calls"] == 0:
            continue
        payload = row["payload_bytes"] / row["calls"]
        p_run = row["group_size"]  # the size of the group the ledger counted this row for
        if row["scope"] == "group":
            p, bw, lat = min(model.node_size, workers), model.intra_bw, model.intra_latency
        else:
            p, bw, lat = max(2, round(p_run * workers / world)), model.inter_bw, model.inter_latency
        total += row["calls"] / steps * collective_seconds(row["op"], payload, p, bw, lat)
    return total


def epoch_seconds(results: dict[str, Any], workers: int, model: NetworkModel, compute_per_step: float) -> float:
    """Modelled time of one epoch on ``workers`` workers: steps per epoch × (compute + communication).

    The batch per worker stays as measured, so an epoch of the measured run's samples takes
    ``steps_per_epoch · world_size / workers`` steps.
    """
    steps = results["steps_per_epoch"] * results["world_size"] / workers
    return steps * (compute_per_step + comm_seconds_per_step(results, workers, model))


def project(runs: dict[str, dict[str, Any]], model: NetworkModel, compute_per_step: dict[str, float],
            workers: tuple[int, ...] = DEFAULT_WORKERS) -> dict[str, Any]:
    """Epoch times of every method for each worker count (``{"workers": [...], "seconds": {method: [...]}}``)."""
    return {
        "workers": list(workers),
        "node_size": model.node_size,
        "model": {"intra_bw": model.intra_bw, "inter_bw": model.inter_bw, "intra_latency": model.intra_latency,
                  "inter_latency": model.inter_latency},
        "compute_seconds_per_step": compute_per_step,
        "epoch_seconds": {name: [epoch_seconds(r, p, model, compute_per_step[name]) for p in workers]
                          for name, r in runs.items()},
        "comm_seconds_per_step": {name: [comm_seconds_per_step(r, p, model) for p in workers]
                                  for name, r in runs.items()},
    }
