"""PNG plots of a bench report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from typing import Any

PHASE_ORDER = ("setup", "warmup", "train", "ab", "sync", "rebound", "local", "average", "inner", "outer", "eval")


def ordered_phases(names: set[str]) -> list[str]:
    """Phases in the order a run goes through them; unknown labels last, alphabetically."""
    return sorted(names, key=lambda p: (PHASE_ORDER.index(p) if p in PHASE_ORDER else len(PHASE_ORDER), p))


def write_plots(report: dict[str, Any], out: str) -> list[str]:
    """Metric vs cumulative global bytes, metric vs wall time, and bytes per phase; returns the file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["methods"] if r["status"] == "complete"]
    ppl = report["workload"]["metric"] == "perplexity"
    key, label = ("test_perplexity", "test perplexity") if ppl else ("test_accuracy", "test accuracy")
    title = f"{report['workload']['name']}{' (quick)' if report['workload']['quick'] else ''}"
    written = []

    for name, x_key, x_label, scale in (
            ("accuracy_vs_global_bytes.png", "global_wire_bytes", "cumulative global wire bytes per worker (MB)", 1e-6),
            ("accuracy_vs_wall.png", "wall_seconds", "wall time (s)", 1.0)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in runs:
            xs = [h[x_key] * scale for h in r["history"] if h.get(key) is not None]
            ys = [h[key] for h in r["history"] if h.get(key) is not None]
            ax.plot(xs, ys, marker="o", markersize=3, label=r["method"] + (" ★" if r["pareto"] else ""))
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if runs:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=120)
        plt.close(fig)
        written.append(name)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    phases = ordered_phases({p for r in runs for p in r["by_phase"]})
    bottoms = [0.0] * len(runs)
    for phase in phases:
        heights = [r["by_phase"].get(phase, 0.0) / 1e6 for r in runs]
        ax.bar([r["method"] for r in runs], heights, bottom=bottoms, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("wire bytes per worker (MB)")
    ax.set_title(f"{title}: bytes per phase")
    if phases:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bytes_by_phase.png"), dpi=120)
    plt.close(fig)
    written.append("bytes_by_phase.png")
    report["plots"] = written
    return written
