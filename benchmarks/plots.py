"""The plot two benchmark scripts draw (ab_configs.py and results_page.py): each configuration's metric, the seeds'
spread as a bar, against its global wire bytes per worker on a log axis."""

from __future__ import annotations

from pathlib import Path


def front(points: list[tuple[str, float, float, float, str]], path: str | Path, *, ylabel: str, title: str) -> bool:
    """``points``: (label, global MB, mean, spread, marker) each; written to ``path``. False where matplotlib is not
    installed (the plots extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, x, y, spread, marker in points:
        ax.errorbar(x, y, yerr=spread / 2, fmt=marker, capsize=3, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("global wire bytes per worker (MB, log)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
