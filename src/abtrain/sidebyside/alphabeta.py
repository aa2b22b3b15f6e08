"""Time per epoch beyond one machine, from counted bytes and measured compute, under an α-β model.

This is a model, not a measurement. A collective over ``p`` workers of a
payload ``n`` (the bytes one worker hands to it) costs

    T = s(p) · α + w(n, p) / β

with ``w`` the wire bytes per worker of :func:`abtrain.comm.ledger.wire_bytes` and
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

from ..comm.ledger import wire_bytes

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


def group_size_of(op: str, payload_bytes: float, wire: float) -> int:
    """The group size a ledger row was counted for, recovered from its wire/payload ratio (for rows
    without ``group_size``; see :func:`row_group_size`)."""
    if payload_bytes <= 0 or wire <= 0:
        return 1
    r = wire / payload_bytes
    if op == "all_reduce":  # r = 2(p-1)/p
        return max(2, round(2 / (2 - r))) if r < 2 else 1 << 30
    if op in ("reduce_scatter", "broadcast", "gather", "all_to_all"):  # r = (p-1)/p
        return max(2, round(1 / (1 - r))) if r < 1 else 1 << 30
    if op == "all_gather":  # r = p-1
        return round(r) + 1
    raise ValueError(f"unknown collective {op!r}")


def row_group_size(row: dict[str, Any], world: int) -> int:
    """The size of the group a ledger row was counted for: the row's ``group_size``; rows of results
    written before the ledger recorded it, from their wire/payload ratio."""
    if "group_size" in row:
        return int(row["group_size"])
    return min(world, group_size_of(row["op"], row["payload_bytes"], row["wire_bytes"]))


def comm_seconds_per_step(results: dict[str, Any], workers: int, model: NetworkModel, scale: float = 1.0) -> float:
    """Modelled communication time per step of a run's collectives, rescaled to ``workers`` workers.

    The one-off ``setup`` broadcast is left out; evaluation traffic is spread over the steps.
    ``scale`` multiplies every payload (a model ``scale`` times the measured one's size).
    """
    steps = max(1, int(results["steps"]))
    world = int(results["world_size"])
    total = 0.0
    for row in results["comm"]["rows"]:
        if row["phase"] == "setup" or row["calls"] == 0:
            continue
        payload = scale * row["payload_bytes"] / row["calls"]
        p_run = row_group_size(row, world)
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


def compute_per_step(runs: dict[str, dict[str, Any]], none: dict[str, Any] | None = None) -> dict[str, float]:
    """Each run's compute per step: its wall time less the time in collectives, so that a method's own work
    (AB-training's decompositions, PowerSGD's products) counts against it. ``none`` (a run that sends
    nothing, so its wall time per step is the model's compute alone) is a floor: time inside a collective on
    an oversubscribed CPU includes work the run would do anyway."""
    floor = none["wall_seconds"] / max(1, none["steps"]) if none is not None else 0.0
    return {m: max(floor, max(0.0, r["wall_seconds"] - r["comm"]["seconds"]) / max(1, r["steps"]))
            for m, r in runs.items()}


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


#: Model sizes where communication is felt (parameters), and links between nodes (bytes/s).
SCALED_MODELS = (("ResNet-50", 25.6e6), ("ViT-B/16", 86e6), ("GPT-2 small", 124e6))
SCALED_NETWORKS = (("10 Gb/s Ethernet", 10e9 / 8), ("25 Gb/s Ethernet", 25e9 / 8), ("200 Gb/s InfiniBand", 200e9 / 8))
SCALED_WORKERS = 32


def project_scaled(runs: dict[str, dict[str, Any]], model: NetworkModel, workers: int = SCALED_WORKERS,
                   models: tuple[tuple[str, float], ...] = SCALED_MODELS,
                   networks: tuple[tuple[str, float], ...] = SCALED_NETWORKS) -> dict[str, Any]:
    """Communication seconds per step of each method for larger models on slower links between nodes.

    Every payload is scaled by (target parameters / measured parameters): each method keeps the bytes per
    parameter it sent here. The links between nodes get each network's bandwidth; everything else is ``model``.
    """
    rows = []
    for model_name, params in models:
        for net_name, bw in networks:
            net = NetworkModel(intra_bw=model.intra_bw, inter_bw=bw, intra_latency=model.intra_latency,
                               inter_latency=model.inter_latency, node_size=model.node_size)
            rows.append({"model": model_name, "parameters": params, "network": net_name, "inter_bw": bw,
                         "comm_seconds_per_step": {name: comm_seconds_per_step(r, workers, net, params / r["params"])
                                                   for name, r in runs.items()}})
    return {"workers": workers, "node_size": model.node_size, "rows": rows}


def render_scaled(scaled: dict[str, Any]) -> list[str]:
    """report.md's table of :func:`project_scaled`."""
    methods = list(scaled["rows"][0]["comm_seconds_per_step"]) if scaled["rows"] else []
    lines = ["", f"### Larger models on slower links ({scaled['workers']} workers in nodes of {scaled['node_size']}; "
                 "a model, not a measurement)", "",
             "Communication per step when every method keeps the bytes per parameter it sent in this run, scaled to "
             "the model's size, with the named network between nodes (a ring over contiguous ranks crosses each "
             "node's link once, so the node's link is the ring's bandwidth). Which assumptions carry over: "
             "docs/bench.md.", "",
             "| model | network | " + " | ".join(methods) + " |", "|---|---|" + "---:|" * len(methods)]
    for row in scaled["rows"]:
        secs = row["comm_seconds_per_step"]
        ddp = secs.get("ddp")
        cells = [f"{secs[m] * 1e3:.3g} ms" + (f" ({ddp / secs[m]:.1f}×)" if ddp and secs[m] > 0 and m != "ddp" else "")
                 for m in methods]
        lines.append(f"| {row['model']} ({row['parameters'] / 1e6:g} M) | {row['network']} | " + " | ".join(cells) + " |")
    lines += ["", "(×: DDP's time divided by the method's.)"]
    return lines
