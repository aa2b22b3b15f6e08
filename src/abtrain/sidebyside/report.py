"""The bench report: one row per method, Pareto front, time to DDP's result, measured vs counted bytes,
the α-β projection; written as report.json and report.md."""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from .._version import __version__
from ..methods.summary import human_bytes
from ..run.safefile import atomic_write, write_json
from .config import BenchConfig
from .linkbytes import link_check
from .linkbytes import render as render_links
from .plots import ordered_phases, write_plots
from .alphabeta import compute_per_step, project, project_scaled, render_scaled
from .timing import METRIC_KEYS, against_ddp, better_or_equal, reach
from .timing import render as render_timing
from .workloads import Workload


@dataclass
class Outcome:
    """What one method's run left behind."""

    method: str
    command: list[str]
    run_dir: str
    status: str = "not run"  # complete / failed / interrupted / not run
    error: str | None = None
    returncode: int | None = None
    seconds: float = 0.0
    results: dict[str, Any] | None = None
    measured: dict[str, Any] | None = None  # --net: interface counters of each node during the run

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "status": self.status, "error": self.error, "returncode": self.returncode,
                "run_dir": self.run_dir, "command": " ".join(shlex.quote(c) for c in self.command),
                "seconds": self.seconds, "measured": self.measured}


def metric_of(results: dict[str, Any], metric: str) -> float | None:
    """The final value of the workload's metric (test accuracy, or test perplexity for a language model)."""
    return results["final"].get("test_perplexity" if metric == "perplexity" else "test_accuracy")


def first_reaching(history: list[dict[str, Any]], target: float, metric: str) -> dict[str, Any] | None:
    """The first evaluation row at least as good as ``target``; None when never reached."""
    key = METRIC_KEYS[metric]
    for row in history:
        value = row.get(key)
        if value is not None and better_or_equal(value, target, metric):
            return row
    return None


def time_to_reach(history: list[dict[str, Any]], target: float, metric: str) -> float | None:
    """Training seconds (wall less earlier evaluations, :mod:`.timing`) of the first evaluation at least as good
    as ``target``; None when never reached."""
    got = reach(history, target, metric)
    return None if got is None else float(got["seconds"])


def pareto_front(points: dict[str, tuple[float, float]], metric: str) -> set[str]:
    """Methods no other method beats on both (final metric, global bytes) with one strictly better.

    ``points`` maps a method to (metric, global wire bytes); accuracy is better high, perplexity low.
    """
    front = set()
    for name, (m, b) in points.items():
        dominated = any(
            better_or_equal(m2, m, metric) and b2 <= b and (m2 != m or b2 != b)
            for other, (m2, b2) in points.items() if other != name)
        if not dominated:
            front.add(name)
    return front


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def _by_scope_phase(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Wire bytes per worker for each scope (``global``, ``group``) and phase."""
    out: dict[str, dict[str, float]] = {"global": {}, "group": {}}
    for row in rows:
        phases = out.setdefault(row["scope"], {})
        phases[row["phase"]] = phases.get(row["phase"], 0.0) + row["wire_bytes"]
    return out


def build_report(workload: Workload, cfg: BenchConfig, outcomes: list[Outcome], out: str,
                 interrupted: bool = False) -> dict[str, Any]:
    """Everything report.json holds; report.md and the plots are drawn from it."""
    metric = workload.metric
    done = {o.method: o.results for o in outcomes if o.status == "complete" and o.results}
    ddp, none = done.get("ddp"), done.get("none")
    target = metric_of(ddp, metric) if ddp else None
    points = {m: (metric_of(r, metric), r["comm"]["by_scope"]["global"]["wire_bytes"]) for m, r in done.items()
              if metric_of(r, metric) is not None}
    front = pareto_front(points, metric)
    rate = cfg.net_spec.rate_bytes_per_s if cfg.net_spec else None
    rows = []
    for o in outcomes:
        row: dict[str, Any] = o.to_dict()
        r = o.results
        if r is not None:
            comm = r["comm"]
            g, total = comm["by_scope"]["global"]["wire_bytes"], comm["wire_bytes"]
            reached = time_to_reach(r["history"], target, metric) if target is not None else None
            row.update({
                "metric": metric_of(r, metric),
                "test_accuracy": r["final"]["test_accuracy"],
                "test_perplexity": r["final"].get("test_perplexity"),
                "test_loss": r["final"]["test_loss"],
                "steps": r["steps"],
                "world_size": r["world_size"],
                "group_size": r.get("group_size"),
                "global_wire_bytes": g,
                "peak_global_step_bytes": comm.get("peak_global_step_bytes"),
                "group_wire_bytes": comm["by_scope"]["group"]["wire_bytes"],
                "wire_bytes": total,
                "payload_bytes": comm["payload_bytes"],
                "global_reduction_vs_ddp": _ratio(ddp["comm"]["by_scope"]["global"]["wire_bytes"], g) if ddp else None,
                "total_reduction_vs_ddp": _ratio(ddp["comm"]["wire_bytes"], total) if ddp else None,
                "compression_ratio": r.get("compression_ratio"),
                "model_params": r.get("model_params", r["params"]),
                "training_state_bytes": r.get("training_state_bytes"),
                "state_vs_ddp": (r["training_state_bytes"] / r["ddp_equivalent"]["training_state_bytes"]
                                 if r.get("training_state_bytes") and
                                 r.get("ddp_equivalent", {}).get("training_state_bytes") else None),
                "wall_seconds": r["wall_seconds"],
                "wall_vs_none": _ratio(r["wall_seconds"], none["wall_seconds"]) if none else None,
                "time_to_ddp_metric": reached,
                "peak_rss_bytes": r["peak_rss_bytes"],
                "by_phase": {p: v["wire_bytes"] for p, v in comm["by_phase"].items()},
                "by_scope_phase": _by_scope_phase(comm["rows"]),
                "pareto": o.method in front,
                "history": [{k: h.get(k) for k in ("step", "test_accuracy", "test_perplexity", "wire_bytes",
                                                   "global_wire_bytes", "wall_seconds", "eval_seconds")}
                            for h in r["history"]],
            })
            if o.measured is not None:
                check = link_check(r, o.measured)
                row["measured"] = {**o.measured, **check,
                                   "ideal_wire_seconds": check["expected_tx_bytes"] / rate if rate else None}
        rows.append(row)
    compute = compute_per_step(done, none)
    projection = project(done, cfg.network_model, compute) if done else None
    if projection is not None:
        projection["compute_source"] = ("each run: (wall - comm) / steps, at least the none run's wall / steps"
                                        if none else "each run: (wall - comm) / steps")
        projection["description"] = cfg.network_model.describe()
        projection["scaled"] = project_scaled(done, cfg.network_model)
    return {
        "workload": {"name": workload.name, "description": workload.description, "quick": cfg.quick,
                     "metric": metric, "steps": workload.steps, "train_args": workload.train_args,
                     "method_args": workload.method_args},
        "command": " ".join(shlex.quote(a) for a in sys.argv) if sys.argv and sys.argv[0] else None,
        "extra": cfg.extra,
        "user_method_args": cfg.method_args,
        "net": ({"spec": cfg.net, "description": cfg.net_spec.describe(), "rate_bytes_per_s": rate,
                 "delay_seconds": cfg.net_spec.delay_seconds,
                 "node_size": next((o.measured["node_size"] for o in outcomes if o.measured), None)}
                if cfg.net_spec else None),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "abtrain_version": __version__,
        "torch_version": torch.__version__,
        "interrupted": interrupted,
        "ddp_target": target,
        "steps_factor": cfg.steps_factor,
        "time_to_ddp": against_ddp({m: {"history": r["history"], "steps": r["steps"]} for m, r in done.items()},
                                   metric),
        "pareto_front": sorted(front),
        "methods": rows,
        "projection": projection,
        "plots": ["accuracy_vs_global_bytes.png", "accuracy_vs_wall.png", "bytes_by_scope.png", "bytes_by_phase.png",
                  "model_and_state.png"],
    }


def _fmt(value: float | None, spec: str, suffix: str = "", missing: str = "–") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec) + suffix


def _state(row: dict[str, Any]) -> str:
    """Training state and its multiple of DDP's, for a table cell."""
    if not row.get("training_state_bytes"):
        return "–"
    ratio = f" ({row['state_vs_ddp']:.2f}×)" if row.get("state_vs_ddp") else ""
    return human_bytes(row["training_state_bytes"]) + ratio


def _peak(row: dict[str, Any]) -> str:
    peak = row.get("peak_global_step_bytes")
    return "–" if peak is None else human_bytes(peak)


def _reduction(x: float | None) -> str:
    if x is None:
        return "–"
    return "∞" if math.isinf(x) else f"{x:.1f}×"


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: the tables a reader compares methods with."""
    w = report["workload"]
    ppl = w["metric"] == "perplexity"
    metric_name = "test perplexity" if ppl else "test accuracy"
    lines = [f"# abtrain bench: {w['name']}{' (quick)' if w['quick'] else ''}", "",
             f"{w['description']}. Every method runs with the same data order, seed, workers and groups, "
             f"{_budget(w['steps'], report.get('steps_factor', 1.0))}, each as its own `abtrain train` "
             "run. Bytes are per worker, as counted by the ledger (modelled wire bytes). `global` is traffic "
             "between groups of workers.", "",
             f"- shared flags: `{' '.join(shlex.quote(a) for a in w['train_args'])}`"]
    for m, args in w["method_args"].items():
        lines.append(f"- `{m}` adds: `{' '.join(args)}`")
    if report["extra"]:
        lines.append(f"- `--extra` for every run: `{report['extra']}`")
    for m, args in report["user_method_args"].items():
        lines.append(f"- `--method-args` for `{m}`: `{args}`")
    if report["net"]:
        g = report["net"].get("node_size") or 1
        where = "each worker in its own network namespace" if g == 1 else (
            f"each group of {g} workers in one network namespace (a node; unshaped loopback inside it)")
        lines.append(f"- network: {where}, {report['net']['description']} (`--net {report['net']['spec']}`)")
    if report.get("abtrain_version"):
        lines.append(f"- abtrain {report['abtrain_version']}, torch {report['torch_version']}")
    if report["interrupted"]:
        lines.append("- **interrupted**: methods after the interruption did not run")
    lines += ["", "## Results", "",
              f"| method | {metric_name} | global wire | peak global step | total wire | global vs DDP | total vs DDP | "
              f"compression | training state | wall | × none | time to DDP's {'perplexity' if ppl else 'accuracy'} | "
              "peak RSS | Pareto |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    failed = []
    for r in report["methods"]:
        if r["status"] != "complete":
            lines.append(f"| {r['method']} | **{r['status']}** |" + " |" * 12)
            failed.append(r)
            continue
        metric = _fmt(r["metric"], ".2f") if ppl else _fmt(r["metric"] * 100 if r["metric"] is not None else None,
                                                          ".2f", " %")
        reached = _fmt(r["time_to_ddp_metric"], ".1f", " s",
                       missing="not reached" if report["ddp_target"] is not None else "–")
        comp = _fmt(r["compression_ratio"], ".1f", ":1")
        lines.append(
            f"| {r['method']} | {metric} | {human_bytes(r['global_wire_bytes'])} | {_peak(r)} | "
            f"{human_bytes(r['wire_bytes'])} | "
            f"{_reduction(r['global_reduction_vs_ddp'])} | {_reduction(r['total_reduction_vs_ddp'])} | {comp} | "
            f"{_state(r)} | {r['wall_seconds']:.1f} s | {_fmt(r['wall_vs_none'], '.2f', '×')} | {reached} | "
            f"{human_bytes(r['peak_rss_bytes'])} | {'★' if r['pareto'] else ''} |")
    lines += ["",
              f"★ Pareto front of ({metric_name} {'↓' if ppl else '↑'}, global wire bytes ↓): "
              f"{', '.join(report['pareto_front']) or '–'}. "
              "\"peak global step\": the most global bytes a worker sent in any one optimizer step, what a slow "
              "link between nodes feels at once. \"vs DDP\": DDP's bytes divided by the method's (× less). \"training state\": the most a worker held "
              "after a step (parameters, gradients, optimizer and method state), as a multiple of DDP's for the same "
              "model. \"× none\": wall time relative to `none`, "
              "where every worker trains alone (the compute floor; it evaluates each worker's own model). "
              "\"time to DDP's …\": training seconds (wall less the evaluations before) at the first evaluation as "
              "good as DDP's final value."]
    for r in failed:
        lines += ["", f"**{r['method']} {r['status']}**: {r['error']}  ", f"run directory: `{r['run_dir']}`"]
    done = [r for r in report["methods"] if r["status"] == "complete"]
    where = f"through `--net {report['net']['spec']}`" if report["net"] else "on this machine"
    lines += render_timing(report.get("time_to_ddp"), w["metric"], report.get("steps_factor", 1.0), where)
    lines += _time_to_targets(done, report)
    lines += render_links([r for r in done if r.get("measured")])
    if done:
        phases = ordered_phases({p for r in done for p in r["by_phase"]})
        lines += ["", "## Wire bytes per phase (per worker)", "",
                  "Each cell: between groups (`global`) / inside groups (`group`); – where the phase sent nothing.",
                  "", "| method | " + " | ".join(phases) + " |", "|---|" + "---:|" * len(phases)]
        for r in done:
            split = r.get("by_scope_phase") or {"global": r["by_phase"], "group": {}}
            cells = []
            for p in phases:
                g, i = split.get("global", {}).get(p), split.get("group", {}).get(p)
                cells.append("–" if g is None and i is None else f"{human_bytes(g or 0)} / {human_bytes(i or 0)}")
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    proj = report["projection"]
    if proj:
        lines += ["", "## Projection beyond one machine (a model, not a measurement)", "",
                  f"Seconds per epoch (an epoch of this run's samples, same batch per worker) under an α-β network "
                  f"model: {proj['description']}. Compute per step: {proj['compute_source']}, as measured here. "
                  "Counted bytes per phase and scope rescaled to each worker count; `group` traffic inside a node, "
                  "`global` between nodes; no overlap of compute and communication. Formula: docs/bench.md. "
                  "Override with --intra-bw, --inter-bw, --intra-latency, --inter-latency, --node-size.", "",
                  "| method | " + " | ".join(f"{p} workers" for p in proj["workers"]) + " |",
                  "|---|" + "---:|" * len(proj["workers"])]
        for m, secs in proj["epoch_seconds"].items():
            lines.append(f"| {m} | " + " | ".join(f"{s:.3g} s" for s in secs) + " |")
        lines += ["", "Communication per step in the model:", "",
                  "| method | " + " | ".join(f"{p}" for p in proj["workers"]) + " |",
                  "|---|" + "---:|" * len(proj["workers"])]
        for m, secs in proj["comm_seconds_per_step"].items():
            lines.append(f"| {m} | " + " | ".join(f"{s * 1e3:.3g} ms" for s in secs) + " |")
        if proj.get("scaled"):
            lines += render_scaled(proj["scaled"])
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in report["plots"]] + [""]
    return "\n".join(lines)


def _time_to_targets(done: list[dict[str, Any]], report: dict[str, Any]) -> list[str]:
    """Wall seconds for each method to reach each method's final metric (on the shaped network with --net)."""
    ppl = report["workload"]["metric"] == "perplexity"
    targets = sorted({r["metric"] for r in done if r["metric"] is not None}, reverse=ppl)
    if len(targets) < 2:
        return []
    where = f"through `--net {report['net']['spec']}`" if report["net"] else "on this machine"
    name = "perplexity" if ppl else "accuracy"
    head = [_fmt(t, ".2f") if ppl else _fmt(t * 100, ".2f", " %") for t in targets]
    lines = ["", f"## Time to every method's {name} ({where})", "",
             f"Training seconds (wall less the evaluations before) until the first evaluation at least as good as "
             f"each target (the final {name} of some method), \"–\" when never reached.", "",
             "| method | " + " | ".join(head) + " |", "|---|" + "---:|" * len(targets)]
    for r in done:
        lines.append(f"| {r['method']} | " + " | ".join(
            _fmt(time_to_reach(r["history"], t, report["workload"]["metric"]), ".1f", " s") for t in targets) + " |")
    return lines


def _budget(steps: int, factor: float) -> str:
    """The step budget as report.md states it."""
    if factor == 1:
        return f"the same step budget ({steps} steps)"
    return (f"{steps} steps for DDP and `none` and {factor:g}× as many ({max(1, round(factor * steps))}) for the "
            "others, their learning-rate schedules stretched over them")


def write_report(report: dict[str, Any], out: str) -> None:
    """report.json, report.md and the PNG plots (plots are skipped with a note when matplotlib is missing)."""
    try:
        write_plots(report, out)
    except ImportError:
        report["plots"] = []
        print("abtrain bench: matplotlib is not installed, no plots (pip install 'abtrain[plots]')", flush=True)
    write_json(os.path.join(out, "report.json"), report)
    atomic_write(os.path.join(out, "report.md"), render_markdown(report))
