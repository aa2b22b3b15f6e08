"""Counting and reporting: parameter counts, compression ratio, one line per layer, the output layer."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .layers import FactorizedParam

logger = logging.getLogger(__name__)


def output_weights(output: Any, records: Sequence[FactorizedParam]) -> list[FactorizedParam]:
    """The factorisable layers whose weights produce ``output``: the model's output layer(s).

    ``output`` is a tensor, or a tuple, list or dict whose first tensor is the output.

    A breadth-first walk from ``output.grad_fn`` stops at the first depth where
    the gradient reaches any weight (a parameter of ≥ 2 dims); the records among
    those weights are returned (W in full mode, A or B in low-rank mode). A model
    with two output layers gives both; one whose nearest weight is not a record
    (kept full rank by name, tied to an embedding) gives none. Works whatever
    the layer is called and whatever follows it (a division by a temperature, a
    reshape). Empty when ``output`` has no autograd graph.
    """
    if isinstance(output, (tuple, list, dict)):
        values = output.values() if isinstance(output, dict) else output
        output = next((v for v in values if torch.is_tensor(v)), None)
    if not torch.is_tensor(output):
        return []
    owner = {id(t): fp for fp in records for t in (fp.weight, fp.A, fp.B)}
    frontier = [output.grad_fn] if output.grad_fn is not None else []
    seen: set[int] = set()
    while frontier:
        weights: list[Tensor] = []
        following = []
        for node in frontier:
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)
            if variable is not None and variable.ndim >= 2:
                weights.append(variable)
            following.extend(next_node for next_node, _ in node.next_functions)
        if weights:
            found = [owner[id(w)] for w in weights if id(w) in owner]
            return list({id(fp): fp for fp in found}.values())
        frontier = following
    return []



def _factor_ids(records: Iterable[FactorizedParam]) -> set[int]:
    return {id(p) for fp in records for p in (fp.A, fp.B)}


def full_param_count(model: nn.Module, records: Sequence[FactorizedParam]) -> int:
    """Parameters of the full-rank model: every parameter, factors A and B excluded, each W at its full size
    (a layer in lowrank mode stores its W 0-size)."""
    skip = _factor_ids(records) | {id(fp.weight) for fp in records}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip) + sum(fp.m * fp.n for fp in records)


def full_tensor_count(model: nn.Module, records: Sequence[FactorizedParam]) -> int:
    """Parameter tensors of the full-rank model: every parameter but the factors A and B (each W is one)."""
    skip = _factor_ids(records)
    return sum(1 for p in model.parameters() if id(p) not in skip)


def ab_param_count(model: nn.Module, records: Sequence[FactorizedParam]) -> int:
    """Parameters during the AB phase: A and B of lowrank layers (not their W), plus everything else."""
    skip = _factor_ids(records) | {id(fp.weight) for fp in records if fp.mode == "lowrank"}
    kept = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return kept + sum(fp.A.numel() + fp.B.numel() for fp in records if fp.mode == "lowrank")


def compression_ratio(model: nn.Module, records: Sequence[FactorizedParam]) -> float:
    """full_param_count / ab_param_count, for the model's current modes."""
    return full_param_count(model, records) / ab_param_count(model, records)


def format_ratio(x: float) -> str:
    """Compression ratio as printed in reports: ``"12.3:1"``."""
    return f"{x:.1f}:1"


def describe(records: Iterable[FactorizedParam]) -> list[dict[str, Any]]:
    """One row per layer: name, shape, matrix (m, n), mode, rank, params_full, params_lowrank, note."""
    rows = []
    for fp in records:
        low = fp.mode == "lowrank"
        rows.append(
            {
                "name": fp.name,
                "shape": tuple(fp.shape),
                "matrix": (fp.m, fp.n),
                "mode": fp.mode,
                "rank": fp.rank if low else None,
                "params_full": fp.m * fp.n,
                "params_lowrank": fp.rank * (fp.m + fp.n) if low else None,
                "note": fp.param.note,
            }
        )
    return rows


def decision_lines(records: Iterable[FactorizedParam]) -> list[str]:
    """One line per layer: its rank and parameter counts, or why it is full rank."""
    lines = []
    for row in describe(records):
        m, n = row["matrix"]
        if row["mode"] == "lowrank":
            lines.append(f"{row['name']} {row['shape']} as {m}x{n}: rank {row['rank']}, "
                         f"{row['params_full']} -> {row['params_lowrank']} params")
        else:
            lines.append(f"{row['name']} {row['shape']} as {m}x{n}: full rank: {row['note']}")
    return lines


def log_decisions(records: Iterable[FactorizedParam], log: logging.Logger | None = None) -> None:
    """Log :func:`decision_lines` at INFO."""
    log = log or logger
    for line in decision_lines(records):
        log.info("%s", line)
