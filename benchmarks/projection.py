"""Which method reaches DDP's metric first at real model sizes and on real networks: a projection.

    .venv/bin/python benchmarks/projection.py [--peers docs/results/peers-full-fashion-cnn/ab_configs.json ...]
        [--cost docs/results/cost-cpu/cost.json ...] [--workers 8,16,32,64,128,256] [--out DIR]

A model, not a measurement: it combines three things that were measured with an α-β network model
and one assumption per model (the GPU's dense compute per step).

Each bench workload stands for a model of the same kind at real size: ``fashion-cnn`` for
ResNet-50 (25.6 M parameters), ``fashion-wide`` for ViT-B/16 (86 M), ``shakespeare-gpt`` for
GPT-2 small (124 M). For each method, the time to reach a target metric is

    T_m = f_m · (C · c_m + comm_m(p, network))     (per step of the run, times its steps)

- ``f_m`` (measured, ``--peers``): the fraction of the bench run's steps after which the method's
  evaluation first reaches the target, the mean over the seeds; a method that misses it on any
  seed does not reach it. Targets: DDP's final metric of the same seed, and the same less
  ``--tolerance`` (points of accuracy, or per cent of perplexity). That the fraction carries over
  from the bench model to the real one is the projection's main assumption.
- ``c_m`` (measured, ``--cost``): the method's step at the real model's layer shapes relative to
  ``none``'s, from ``benchmarks/cost.py`` (its amortised step: decompositions, syncs' arithmetic,
  factor products, DCTs), with its events spread over a run as long as the bench's (the same
  number of syncs per step as the bytes below). DDP's is 1 by definition: its communication is in
  ``comm_m``. A method the cost file lacks is taken as 1 and marked.
- ``C`` (assumed, ``--compute-ms``): the dense model's forward, backward and step on one GPU. The
  defaults are 6·N·tokens FLOPs for the transformers (GPT-2: 8 sequences of 1,024 tokens per GPU;
  ViT-B/16: 64 images of 197 tokens) and 3 × 8.2 GFLOPs per 224×224 image for ResNet-50 (64
  images), at 100 TFLOP/s sustained.
- ``comm_m`` (modelled from measured bytes): every collective of the bench run's ledger, its
  payload scaled by (real parameters / bench parameters), so each method keeps the bytes per
  parameter it sent, timed by :func:`abtrain.sidebyside.alphabeta.comm_seconds_per_step`: ``group``
  collectives inside a node of ``--node-size`` GPUs (``--intra-bw``), ``global`` ones between
  nodes over each network, on ``p`` workers; no overlap of compute and communication.

Prints, per model and network, the method that reaches the target first and its speed-up over
DDP at each worker count, and writes the whole grid (every method's T_m / T_ddp) to DIR/projection.json
and DIR/projection.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from abtrain.sidebyside.alphabeta import NetworkModel, comm_seconds_per_step  # noqa: E402

#: bench workload -> (cost.py's model, the real model's name, its parameters, dense GFLOPs per step per GPU)
MODELS = {
    "fashion-cnn": ("resnet50", "ResNet-50", 25.6e6, 3 * 8.2 * 64),
    "fashion-wide": ("vit", "ViT-B/16", 86e6, 6 * 86e6 * 197 * 64 / 1e9),
    "shakespeare-gpt": ("gpt2", "GPT-2 small", 124e6, 6 * 124e6 * 8 * 1024 / 1e9),
}
SUSTAINED_TFLOPS = 100.0
#: between nodes: name, bytes/s per node link, latency per message (s)
NETWORKS = (("10 Gb/s Ethernet", 10e9 / 8, 10e-6), ("25 Gb/s Ethernet", 25e9 / 8, 10e-6),
            ("100 Gb/s Ethernet", 100e9 / 8, 5e-6), ("200 Gb/s InfiniBand", 200e9 / 8, 2e-6))


def workload_of(report: dict[str, Any]) -> str:
    for name in MODELS:
        if name in report["command"]:
            return name
    raise SystemExit(f"projection: {report['command']!r} names none of the workloads {', '.join(MODELS)}")


def reach_fraction(history: list[list[float]], steps: int, target: float, perplexity: bool) -> float | None:
    """The fraction of the run's steps at the first evaluation as good as ``target``, or None."""
    for step, value in history:
        if value is not None and (value <= target if perplexity else value >= target):
            return step / steps
    return None


def fractions(rows: list[dict[str, Any]], perplexity: bool, tolerance: float) -> dict[str, dict[str, Any]]:
    """Per method: f for the strict target (DDP's final metric) and the loose one, mean over seeds."""
    ddp = next((r for r in rows if r["config"] == "ddp"), None)
    if ddp is None or "runs" not in ddp:
        raise SystemExit("projection: the report has no ddp row with its runs (rerun benchmarks/ab_configs.py)")
    finals = {run["seed"]: run["history"][-1][1] for run in ddp["runs"]}
    out = {}
    for r in rows:
        entry: dict[str, Any] = {}
        for kind in ("strict", "loose"):
            per_seed = []
            for run in r["runs"]:
                final = finals.get(run["seed"])
                if final is None:
                    continue
                target = (final * (1 + tolerance / 100) if perplexity else final - tolerance / 100) \
                    if kind == "loose" else final
                per_seed.append(reach_fraction(run["history"], run["steps"], target, perplexity))
            entry[kind] = (None if not per_seed or any(f is None for f in per_seed)
                           else statistics.mean(per_seed))
        out[r["config"]] = entry
    return out


def amortised_over(row: dict[str, Any], run_steps: int) -> float:
    """cost.py's amortised step of a method with its events (syncs, decompositions) spread over a run of
    ``run_steps`` instead of cost.py's ``--run-steps``: their count is fixed by the schedule's fractions, not
    by the run's length."""
    events = row.get("amortised_event_seconds") or 0.0
    measured_over = row.get("default_schedule", {}).get("run_steps") or run_steps
    return row["amortised_step_seconds"] - events + events * measured_over / run_steps


def compute_factors(costs: list[dict[str, Any]], model: str, methods: list[str],
                    run_steps: int) -> dict[str, tuple[float, bool]]:
    """Per method: (its amortised step over a run of ``run_steps`` / none's at the model's shapes, measured?),
    from the first cost file that has both (each method against the ``none`` of its own run)."""
    out = {}
    for m in methods:
        out[m] = (1.0, m == "ddp")
        for cost in costs if m != "ddp" else []:
            rows = {r["variant"]: r for r in cost["rows"] if r["model"] == model}
            none = rows.get("none", {}).get("amortised_step_seconds")
            if none and rows.get(m, {}).get("amortised_step_seconds"):
                out[m] = (amortised_over(rows[m], run_steps) / none, True)
                break
    return out


def as_results(run: dict[str, Any]) -> dict[str, Any]:
    """A stored run in the shape comm_seconds_per_step reads."""
    return {"steps": run["steps"], "world_size": run["world_size"], "comm": {"rows": run["comm_rows"]}}


def project(report: dict[str, Any], costs: list[dict[str, Any]], workers: list[int], args: argparse.Namespace) -> dict:
    workload = workload_of(report)
    cost_model, real_name, params, gflops = MODELS[workload]
    perplexity = report["metric"] == "test_perplexity"
    rows = [r for r in report["rows"] if r.get("runs")]
    methods = [r["config"] for r in rows]
    f = fractions(rows, perplexity, args.tolerance)
    # the events of the bench's run length, as its bytes per step are
    c = compute_factors(costs, cost_model, methods, rows[0]["runs"][0]["steps"])
    compute = (args.compute_ms.get(workload) / 1e3 if workload in args.compute_ms
               else gflops / (SUSTAINED_TFLOPS * 1e3))
    grid = []
    for net_name, bw, latency in NETWORKS:
        net = NetworkModel(intra_bw=args.intra_bw, inter_bw=bw, intra_latency=1e-6, inter_latency=latency,
                           node_size=args.node_size)
        for p in workers:
            step = {}
            for r in rows:
                comm = statistics.mean(comm_seconds_per_step(as_results(run), p, net, params / run["params"])
                                       for run in r["runs"])
                step[r["config"]] = {"compute": compute * c[r["config"]][0], "comm": comm}
            cell: dict[str, Any] = {"network": net_name, "workers": p, "step_seconds": step}
            for kind in ("strict", "loose"):
                base = f["ddp"][kind] * sum(step["ddp"].values())
                cell[kind] = {m: (None if f[m][kind] is None else f[m][kind] * sum(step[m].values()) / base)
                              for m in methods}
            grid.append(cell)
    return {"workload": workload, "model": real_name, "parameters": params, "compute_seconds": compute,
            "compute_factors": {m: {"factor": v, "measured": ok} for m, (v, ok) in c.items()},
            "fractions": f, "grid": grid, "source": report["command"]}


def render(p: dict[str, Any], workers: list[int], tolerance: float, perplexity: bool) -> list[str]:
    tol = f"{tolerance:g} % of perplexity" if perplexity else f"{tolerance:g} points"
    lines = [f"## {p['model']} ({p['parameters'] / 1e6:g} M parameters), from `{p['workload']}`", "",
             f"Dense compute per step C = {p['compute_seconds'] * 1e3:.0f} ms (assumed). Compute factor c "
             "(measured at the layer shapes): " + ", ".join(
                 f"{m} {v['factor']:.3f}" + ("" if v["measured"] else " (not measured, taken as 1)")
                 for m, v in p["compute_factors"].items()) + ".", "",
             "Fraction of the run to the target f (DDP's final metric / less " + tol + "): " + ", ".join(
                 f"{m} {_f(v['strict'])} / {_f(v['loose'])}" for m, v in p["fractions"].items()) + ".", ""]
    for kind, name in (("strict", "DDP's final metric"), ("loose", f"DDP's final metric less {tol}")):
        lines += [f"First to {name} (its time / DDP's; – when no method but DDP reaches it):", "",
                  "| network | " + " | ".join(f"{w} workers" for w in workers) + " |",
                  "|---|" + "---:|" * len(workers)]
        for net in dict.fromkeys(c["network"] for c in p["grid"]):
            cells = []
            for cell in (c for c in p["grid"] if c["network"] == net):
                ratios = {m: r for m, r in cell[kind].items() if r is not None}
                best = min(ratios, key=ratios.get)
                cells.append(f"{best} {ratios[best]:.2f}" if best != "ddp" else "ddp")
            lines.append(f"| {net} | " + " | ".join(cells) + " |")
        lines.append("")
    at = 64 if 64 in workers else workers[-1]
    methods = list(p["fractions"])
    lines += [f"Every method at {at} workers, to DDP's final metric less {tol} (its time / DDP's; – never "
              "reached), and its step (compute + communication, ms):", "",
              "| network | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for cell in (c for c in p["grid"] if c["workers"] == at):
        lines.append(f"| {cell['network']} | " + " | ".join(
            f"{_f(cell['loose'][m])} ({1e3 * cell['step_seconds'][m]['compute']:.0f} + "
            f"{1e3 * cell['step_seconds'][m]['comm']:.0f})" for m in methods) + " |")
    lines.append("")
    return lines


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", action="append",
                    help="an ab_configs.json with the methods' runs (repeatable; default: "
                         "docs/results/peers-full-*/ab_configs.json)")
    ap.add_argument("--cost", action="append",
                    help="benchmarks/cost.py's JSON: the compute factors (repeatable; a method is taken from the "
                         "first file that has it; default: docs/results/cost-cpu/cost*.json)")
    ap.add_argument("--workers", default="8,16,32,64,128,256", help="comma-separated worker counts")
    ap.add_argument("--node-size", type=int, default=8, help="GPUs per node (group collectives stay inside one)")
    ap.add_argument("--intra-bw", type=float, default=150e9, help="bytes/s per GPU inside a node (default NVLink)")
    ap.add_argument("--tolerance", type=float, default=0.5,
                    help="the loose target: DDP's final accuracy less this many points (perplexity: per cent more)")
    ap.add_argument("--compute-ms", action="append", default=[], metavar="WORKLOAD=MS",
                    help="the dense model's step on one GPU, instead of the FLOP estimate (repeatable)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "projection"))
    args = ap.parse_args()
    try:
        args.compute_ms = {k: float(v) for k, v in (x.split("=", 1) for x in args.compute_ms)}
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error("--compute-ms takes WORKLOAD=MS and --workers comma-separated integers")
    if any(w < 2 for w in workers) or args.node_size < 1:
        ap.error("--workers must be 2 or more and --node-size positive")
    paths = args.peers or sorted(glob.glob(os.path.join(ROOT, "docs", "results", "peers-full-*", "ab_configs.json")))
    if not paths:
        ap.error("no ab_configs.json found; give --peers")
    cost_paths = args.cost or sorted(glob.glob(os.path.join(ROOT, "docs", "results", "cost-cpu", "cost*.json")))
    costs = []
    for path in cost_paths:
        with open(path) as fh:
            costs.append(json.load(fh))
    command = " ".join(shlex.quote(a) for a in ["benchmarks/projection.py", *sys.argv[1:]])
    results, lines = [], [
        "# Which method reaches DDP's metric first, projected to real sizes (a model, not a measurement)", "",
        f"`{command}`: "
        f"nodes of {args.node_size} GPUs joined inside by {args.intra_bw / 1e9:g} GB/s; compute factors from "
        + ", ".join(f"`{os.path.relpath(p, ROOT)}` ({c.get('device')}, {c.get('date')})" for p, c in zip(cost_paths, costs))
        + "; the assumptions in the script's docstring and docs/cost.md.", ""]
    for path in paths:
        with open(path) as fh:
            report = json.load(fh)
        p = project(report, costs, workers, args)
        p["peers"] = os.path.relpath(path, ROOT)
        results.append(p)
        lines += render(p, workers, args.tolerance, report["metric"] == "test_perplexity")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "projection.json"), "w") as fh:
        json.dump({"command": command, "workers": workers, "node_size": args.node_size,
                   "intra_bw": args.intra_bw, "tolerance": args.tolerance, "models": results}, fh, indent=1)
    with open(os.path.join(args.out, "projection.md"), "w") as fh:
        fh.write(text + "\n")
    print(f"wrote {os.path.join(args.out, 'projection.json')} and projection.md")


if __name__ == "__main__":
    main()
