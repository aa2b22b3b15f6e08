"""Time to a metric from a run's evaluation history: when a method first reached DDP's final value, and what it
held when DDP's run ended.

Times are **training seconds**: a row's ``wall_seconds`` less the seconds of the evaluations before it (each row's
``eval_seconds``; a history written before runs recorded them counts its evaluations in). How often a run
evaluates is the bench's choice, not the method's cost, and a method that runs more steps in less time
evaluates more often; leaving the evaluations out makes the times comparable whatever the evaluation interval.
Nothing is interpolated: a time is that of an evaluation row, so a method that reaches a value between two
evaluations is credited with the later one, and the earlier one's time (``previous_seconds``) bounds it from
below.
"""

from __future__ import annotations

from typing import Any

METRIC_KEYS = {"accuracy": "test_accuracy", "perplexity": "test_perplexity"}


def better_or_equal(a: float, b: float, metric: str) -> bool:
    """``a`` is at least as good as ``b``: higher accuracy, lower perplexity."""
    return a <= b if metric == "perplexity" else a >= b


def training_seconds(history: list[dict[str, Any]]) -> list[float]:
    """Each row's wall seconds less the evaluations before it: the run's clock with its evaluations taken out."""
    out, spent = [], 0.0
    for row in history:
        out.append(float(row["wall_seconds"]) - spent)
        spent += float(row.get("eval_seconds") or 0.0)
    return out


def reach(history: list[dict[str, Any]], target: float, metric: str) -> dict[str, Any] | None:
    """The first evaluation at least as good as ``target``: its step and training seconds, and the training
    seconds of the evaluation before it (0 for the first); None when no evaluation reaches it."""
    key, times = METRIC_KEYS[metric], training_seconds(history)
    for i, row in enumerate(history):
        value = row.get(key)
        if value is not None and better_or_equal(value, target, metric):
            return {"step": row["step"] if "step" in row else None, "seconds": times[i],
                    "previous_seconds": times[i - 1] if i else 0.0, "value": value}
    return None


def at_time(history: list[dict[str, Any]], seconds: float, metric: str) -> dict[str, Any] | None:
    """The last evaluation at or before ``seconds`` of training: its value and step; None when the first
    evaluation came later."""
    key, found = METRIC_KEYS[metric], None
    for row, t in zip(history, training_seconds(history)):
        if t <= seconds and row.get(key) is not None:
            found = {"step": row.get("step"), "seconds": t, "value": row[key]}
    return found


def against_ddp(runs: dict[str, dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """For every run (method -> a dict with ``history``, ``steps``): the training seconds to DDP's final value
    and its ratio to DDP's time, and the value it held at DDP's time. DDP's time is the training seconds of its
    last evaluation, the one after its last step. None without a DDP run with a history."""
    ddp = runs.get("ddp")
    if ddp is None or not ddp.get("history"):
        return None
    key = METRIC_KEYS[metric]
    target = ddp["history"][-1][key]
    ddp_seconds = training_seconds(ddp["history"])[-1]
    rows = {}
    for method, run in runs.items():
        history = run.get("history") or []
        got, held = reach(history, target, metric), at_time(history, ddp_seconds, metric)
        rows[method] = {
            "steps": run.get("steps"),
            "to_ddp_seconds": None if got is None else got["seconds"],
            "to_ddp_previous_seconds": None if got is None else got["previous_seconds"],
            "to_ddp_step": None if got is None else got["step"],
            "to_ddp_ratio": None if got is None or ddp_seconds <= 0 else got["seconds"] / ddp_seconds,
            "at_ddp_time": None if held is None else held["value"],
            "at_ddp_time_step": None if held is None else held["step"],
            "eval_seconds": sum(float(h.get("eval_seconds") or 0.0) for h in history),
            "evaluations": len(history),
        }
    return {"target": target, "ddp_seconds": ddp_seconds, "methods": rows}


def render(section: dict[str, Any] | None, metric: str, steps_factor: float, where: str) -> list[str]:
    """report.md's section on time to DDP's final value (empty without DDP)."""
    if section is None:
        return []
    ppl = metric == "perplexity"
    show = (lambda v: f"{v:.3f}") if ppl else (lambda v: f"{100 * v:.2f} %")
    name = "perplexity" if ppl else "accuracy"
    longer = (f" Every method but DDP and `none` ran {steps_factor:g}× DDP's steps, its learning-rate schedule "
              "stretched over them." if steps_factor != 1 else "")
    lines = ["", f"## Time to DDP's {name} ({where})", "",
             f"DDP's final {name}: {show(section['target'])}, after {section['ddp_seconds']:.1f} s of training.{longer} "
             "Seconds are training seconds: wall time less the evaluations before (the last column says what they "
             f"took). \"to DDP's {name}\": the first evaluation at least as good (not interpolated; it was reached "
             f"after the previous evaluation, whose time is in brackets); \"at DDP's time\": the {name} of the last "
             "evaluation at or before DDP's time.", "",
             f"| method | steps | to DDP's {name} | ÷ DDP's time | at DDP's time | evaluations (their seconds) |",
             "|---|---:|---:|---:|---:|---:|"]
    for method, r in section["methods"].items():
        to = ("not reached" if r["to_ddp_seconds"] is None else
              f"{r['to_ddp_seconds']:.1f} s ({r['to_ddp_previous_seconds']:.1f} s)")
        ratio = "–" if r["to_ddp_ratio"] is None else f"{r['to_ddp_ratio']:.2f}"
        held = "–" if r["at_ddp_time"] is None else f"{show(r['at_ddp_time'])} (step {r['at_ddp_time_step']})"
        lines.append(f"| {method} | {r['steps'] if r['steps'] is not None else '–'} | {to} | {ratio} | {held} | "
                     f"{r['evaluations']} ({r['eval_seconds']:.1f} s) |")
    return lines
