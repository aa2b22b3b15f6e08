"""The lines that sum up a run -- model size, training state, bytes by scope and phase -- beside DDP's bytes for
the same steps: the end-of-run table of ``abtrain train`` (:mod:`abtrain.run.results`) and ``method.summary()``
in one's own loop read the same results and print the same lines."""

from __future__ import annotations

from typing import Any

from ..comm.ledger import wire_bytes


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def ddp_equivalent(params: int, world_size: int, group_size: int, steps: int) -> dict[str, float]:
    """Wire bytes per worker DDP would have sent for the same steps: one fp32 all-reduce of every
    trainable parameter over all workers per step, ``steps · 2(p−1)/p · 4 · params`` (the figure the
    ledger records for ``--method ddp``'s train phase). It is ``global`` when the workers form more
    than one group, as DDP's all-reduce then crosses groups."""
    total = steps * wire_bytes("all_reduce", 4 * params, world_size)
    return {"wire_bytes": total, "global_wire_bytes": total if group_size < world_size else 0.0}


def _model_line(results: dict[str, Any]) -> str:
    """The low-rank model's size and the training state beside DDP's, where the run knows them."""
    text = ""
    ratio = results.get("compression_ratio")
    if ratio is not None:
        text += f" dense, {results['model_params']:,} low rank (compression {ratio:.2f}:1)"
    state = results.get("training_state_bytes")
    ddp_state = (results.get("ddp_equivalent") or {}).get("training_state_bytes")
    if state:
        text += f"\n  training state  {human_bytes(state)} per worker at most"
        if ddp_state and results["method"] != "ddp":
            text += f" ({state / ddp_state:.2f}x DDP's {human_bytes(ddp_state)})"
        phases = results.get("training_state_by_phase") or {}
        if len(phases) > 1:
            text += "; by phase " + ", ".join(f"{name} {human_bytes(sum(parts.values()))}"
                                              for name, parts in phases.items())
    macs = multiply_adds_by_phase(results)
    if macs:
        text += (f"\n  multiply-adds   {human_count(max(macs.values()))} per step at most (forward and backward, "
                 "one worker's batch)")
        if len(macs) > 1:
            text += "; by phase " + ", ".join(f"{name} {human_count(n)}" for name, n in macs.items())
    return text


def multiply_adds_by_phase(results: dict[str, Any]) -> dict[str, int]:
    """The most multiply-adds any worker counted for one step of each phase."""
    out: dict[str, int] = {}
    for worker in results.get("multiply_adds_by_worker") or []:
        for phase, n in worker.items():
            out[phase] = max(out.get(phase, 0), n)
    return out


def human_count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"


def _times_fewer(ddp: float, ours: float) -> str:
    if ddp <= 0:
        return "none, as DDP" if ours <= 0 else "DDP would send none"
    if ours <= 0:
        return "none sent"
    return f"{ddp / ours:.1f}x fewer" if ours <= ddp else f"{ours / ddp:.1f}x more"


def method_lines(results: dict[str, Any]) -> list[str]:
    """The summary's lines on the model, the training state and the bytes, against DDP for the same steps
    (the CLI's table and ``method.summary()`` in one's own loop)."""
    comm = results["comm"]
    lines = [
        f"  parameters      {results['params']:,}" + _model_line(results),
        f"  communication   wire {human_bytes(comm['wire_bytes'])} per worker "
        f"(global {human_bytes(comm['by_scope']['global']['wire_bytes'])}, "
        f"group {human_bytes(comm['by_scope']['group']['wire_bytes'])}); "
        f"payload {human_bytes(comm['payload_bytes'])}; {comm['calls']:,} collectives",
        "  by phase        " + " | ".join(f"{k} {human_bytes(v['wire_bytes'])}" for k, v in comm["by_phase"].items()),
    ]
    ddp = results.get("ddp_equivalent")
    steps = results.get("steps") or 0
    peak = f"  peak step       global {human_bytes(comm['peak_global_step_bytes'])} in one optimizer step"
    if ddp and steps and results["method"] != "ddp":
        peak += f" (DDP {human_bytes(ddp['global_wire_bytes'] / steps)} in every step)"
    if comm.get("end_global_bytes"):
        peak += f"; {human_bytes(comm['end_global_bytes'])} at the end (the last sync)"
    lines.append(peak)
    if ddp and results["method"] != "ddp":
        ours_global = comm["by_scope"]["global"]["wire_bytes"]
        lines += [
            f"  DDP, same steps global {human_bytes(ddp['global_wire_bytes'])}, total {human_bytes(ddp['wire_bytes'])} "
            f"per worker (an fp32 gradient all-reduce every step)",
            f"  versus DDP      global {_times_fewer(ddp['global_wire_bytes'], ours_global)}, "
            f"total {_times_fewer(ddp['wire_bytes'], comm['wire_bytes'])}",
        ]
    return lines
