"""What AB-training reports in results.json beside every method's figures: the schedule, its phases, the ranks of
every decomposition and the time spent in SVDs and syncs."""

from __future__ import annotations

from typing import Any


def extra_results(m: Any) -> dict[str, Any]:
    """``m``: the :class:`~.method.ABTraining` whose schedule and phase state are reported."""
    sched, st = m.schedule, m.state
    return {
        "compression_ratio": st.ratio,
        **({"model_params": st.ranks[-1]["model_params"]} if st.ranks else {}),
        "ranks": st.ranks,
        "phases": sched.ranges(st.t),
        "schedule": {"warmup_steps": sched.warmup, "sync_every": sched.sync_every, "rebound_steps": sched.rebound,
                     "lr_rebound_steps": sched.lr_rebound, "sync_fragments": sched.fragments},
        "kept_output_layers": st.kept,
        "svd_seconds": st.svd_seconds,
        "svd_counts": dict(st.svd_counts),
        "sync_seconds": st.sync_seconds,
        "syncs": st.syncs,
        "role": st.role,
    }
