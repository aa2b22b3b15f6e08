"""PNG plots of a bench report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from typing import Any

PHASE_ORDER = ("setup", "warmup", "train", "ab", "sync", "rebound", "local", "average", "inner", "outer", "eval")


def ordered_phases(names: set[str]) -> list[str]:
    """Phases in the order a run goes through them; unknown labels last, alphabetically."""
    return sorted(names, key=lambda p: (PHASE_ORDER.index(p) if p in PHASE_ORDER else len(PHASE_ORDER), p))

SCOPES = (("global", "between groups (global)"), ("group", "inside groups"))


def _paired_bars(ax: Any, runs: list[dict[str, Any]], series: list[tuple[str, list[float]]], fmt: str) -> None:
    """Two bars per method side by side, each labelled with its value (a value of 0 or less draws no bar)."""
    width = 0.4
    for i, (label, values) in enumerate(series):
        xs = [k + (i - 0.5) * width for k in range(len(runs))]
        bars = ax.bar(xs, [v if v > 0 else float("nan") for v in values], width, label=label)
        for bar, v in zip(bars, values):
            if v > 0:
                ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                            fontsize=6)
    ax.set_xticks(range(len(runs)), [r["method"] for r in runs])


def _save(plt: Any, fig: Any, out: str, name: str) -> str:
    """Write ``fig`` as ``out/name`` and free it; returns ``name``."""
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=120)
    plt.close(fig)
    return name


def write_plots(report: dict[str, Any], out: str) -> list[str]:
    """Metric vs cumulative global bytes (log axis), metric vs wall time, bytes per scope (log axis) and bytes per
    phase with the two scopes apart; returns the file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["methods"] if r["status"] == "complete"]
    ppl = report["workload"]["metric"] == "perplexity"
    key, label = ("test_perplexity", "test perplexity") if ppl else ("test_accuracy", "test accuracy")
    title = f"{report['workload']['name']}{' (quick)' if report['workload']['quick'] else ''}"
    if report.get("net"):
        title += f", --net {report['net']['spec']}"
    written = []

    for name, x_key, x_label, scale, log in (
            ("accuracy_vs_global_bytes.png", "global_wire_bytes", "cumulative global wire bytes per worker (MB, log)",
             1e-6, True),
            ("accuracy_vs_wall.png", "wall_seconds", "wall time (s)", 1.0, False)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in runs:
            # A log axis cannot show zero: evaluations before the first global byte are left out.
            points = [(h[x_key] * scale, h[key]) for h in r["history"]
                      if h.get(key) is not None and (not log or (h.get(x_key) or 0) > 0)]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3,
                    label=r["method"] + (" ★" if r["pareto"] else ""))
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both" if log else "major")
        if runs:
            ax.legend(fontsize=8)
        written.append(_save(plt, fig, out, name))

    # Global and in-group bytes side by side per method, on a log axis: methods differ by orders of magnitude,
    # and a byte inside a node costs far less than one between nodes.
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _paired_bars(ax, runs, [(label, [r["global_wire_bytes" if scope == "global" else "group_wire_bytes"] / 1e6
                                     for r in runs]) for scope, label in SCOPES], "{:.3g}")
    ax.set_yscale("log")
    positive = [r[k] / 1e6 for r in runs for k in ("global_wire_bytes", "group_wire_bytes") if r[k] > 0]
    if positive:  # bars start at the axis: leave a decade below the smallest so that it is not a sliver
        ax.set_ylim(bottom=min(positive) / 10)
    ax.set_ylabel("wire bytes per worker (MB, log)")
    ax.set_title(f"{title}: bytes between and inside groups", fontsize=9)
    ax.legend(fontsize=8)
    written.append(_save(plt, fig, out, "bytes_by_scope.png"))

    # Per phase, one panel per scope (stacked bars need a linear axis; each panel has its own scale).
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    phases = ordered_phases({p for r in runs for p in r["by_phase"]})
    colors = {p: f"C{i % 10}" for i, p in enumerate(phases)}
    for ax, (scope, scope_label) in zip(axes, SCOPES):
        bottoms = [0.0] * len(runs)
        ax.bar([r["method"] for r in runs], bottoms)  # every method on the axis, also one that sent nothing here
        for phase in phases:
            heights = [(r.get("by_scope_phase") or {}).get(scope, {}).get(phase, 0.0) / 1e6 for r in runs]
            if any(heights):
                ax.bar([r["method"] for r in runs], heights, bottom=bottoms, label=phase, color=colors[phase])
                bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_ylabel("wire bytes per worker (MB)")
        ax.set_title(scope_label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        if any(bottoms):
            ax.legend(fontsize=7)
    fig.suptitle(f"{title}: bytes per phase", fontsize=9)
    written.append(_save(plt, fig, out, "bytes_by_phase.png"))

    # What each method holds against the dense model: its model's parameters and its training state, both as a
    # share of DDP's (below 1: smaller than DDP's).
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _paired_bars(ax, runs, [
        ("model parameters / dense", [1 / r["compression_ratio"] if r.get("compression_ratio") else 1.0 for r in runs]),
        ("training state / DDP's", [r.get("state_vs_ddp") or 0.0 for r in runs])], "{:.2f}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel("share of the dense model / of DDP")
    ax.set_title(f"{title}: model size and training state", fontsize=9)
    ax.legend(fontsize=8)
    written.append(_save(plt, fig, out, "model_and_state.png"))
    report["plots"] = written
    return written
