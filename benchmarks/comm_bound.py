"""Time to accuracy where communication dominates: `abtrain bench --net` at a rate that makes DDP's run mostly link time.

    sudo .venv/bin/python benchmarks/comm_bound.py                       # fashion-cnn, 20 Mbit/s, seeds 0 and 1
    sudo .venv/bin/python benchmarks/comm_bound.py --steps-factor 1.5    # the methods that compress get 1.5x the steps
    sudo .venv/bin/python benchmarks/comm_bound.py --workload fashion-wide --link-share 0.83 --steps-factor 1.5
    sudo .venv/bin/python benchmarks/comm_bound.py --workload shakespeare-gpt --rate 14mbit   # its rate: about 9 h

Runs, for each seed, `abtrain bench --workload W --methods M --net rate=R --steps-factor F --extra "--seed S
--eval-every E" --out OUT/sS` (2 nodes of 2 workers on the bench workloads; a seed whose OUT/sS/report.json exists
is reused, so an interrupted sweep continues, and `--seeds 0` then `--seeds 0,1` runs seed 0 first). Under
`--steps-factor F` every method but DDP and `none` runs F times DDP's steps, its learning-rate schedule stretched
over them. E defaults to a twelfth of the workload's steps (twice the bench's density): the same step interval
for every method, so a method that runs more steps in less time evaluates more often in wall time.

The rate. DDP's link time is its global wire bytes per worker B over the node link's rate R (a node sends what
one of its workers counts, docs/bench.md), and its compute is about `none`'s wall T (the same steps, no
communication; both in training seconds, below), so DDP's link share is B/R / (B/R + T). `--link-share S` picks R for a share S: it first runs
`none` alone (OUT/rate/, seed of the first of --seeds), takes T from it and B from its results' `ddp_equivalent`
(what DDP's fp32 all-reduce sends for those steps), and sets R = B / (T · S / (1 − S)), rounded to a whole
Mbit/s. The stored sweeps (docs/results/comm-bound-steps15-*): fashion-cnn at 20 Mbit/s, B = 1801 MB, T = 103 s,
predicted share 87 % (measured 89 %); fashion-wide with --link-share 0.83, B = 11,252 MB, T = 86 s (the rate's
run), 214 Mbit/s (measured shares 83 % and 86 %).

Prints one table and writes OUT/comm_bound.json and OUT/table.md:

- DDP's link share: (DDP's time − none's) / DDP's time in training seconds (below), measured, and the
  prediction above;
- per method and seed: its steps, final metric, global wire bytes per worker, wall; the training seconds (wall
  less the evaluations before, abtrain.sidebyside.timing) at the first evaluation as good as DDP's final metric,
  not interpolated, with the previous evaluation's (the value was reached between the two), and its ratio to
  DDP's time (the training seconds of DDP's last evaluation); the metric of its last evaluation at or before
  DDP's time; the same time for the "common" level (the worst final metric of the methods other than none,
  which every one of them reaches); the node link's measured tx bytes against the ledger's global bytes;
- network namespaces of the bench (`abtb-*`) left afterwards by a bench process that no longer runs.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from abtrain.sidebyside.netns import stale_namespaces  # noqa: E402
from abtrain.sidebyside.timing import against_ddp, reach, training_seconds  # noqa: E402
from abtrain.sidebyside.workloads import get_workload  # noqa: E402

METHODS = "none,ddp,powersgd,diloco,streaming-diloco,demo,ab"


def bench(args, methods: str, rate: str, seed: int, out: str) -> dict:
    """`abtrain bench` of the methods into ``out`` (reused when its report.json exists); the report."""
    path = os.path.join(out, "report.json")
    if not os.path.exists(path):
        cmd = [sys.executable, "-m", "abtrain.cli", "bench", "--workload", args.workload, "--methods", methods,
               "--net", f"rate={rate}", f"--extra=--seed {seed} --eval-every {args.eval_every}", "--out", out]
        if args.steps_factor != 1:
            cmd += ["--steps-factor", f"{args.steps_factor:g}"]
        print("$ " + " ".join(cmd), flush=True)
        # The bench and its runs import this checkout's abtrain, whatever the environment has installed.
        src = os.path.join(ROOT, "src")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        done = subprocess.run(cmd, cwd=ROOT, env=env)
        if done.returncode not in (0, 1) or not os.path.exists(path):
            raise SystemExit(f"comm_bound: the bench of seed {seed} stopped (exit {done.returncode})")
    with open(path) as f:
        return json.load(f)


def derive_rate(args, seed: int) -> dict:
    """The node rate at which DDP's run is ``args.link_share`` link time, from a run of `none` (module docstring)."""
    report = bench(args, "none", "1gbit", seed, os.path.join(args.out, "rate"))
    none = next(m for m in report["methods"] if m["method"] == "none")
    if none["status"] != "complete":
        raise SystemExit(f"comm_bound: the none run that sets the rate did not complete: {none['error']}")
    with open(os.path.join(none["run_dir"], "results.json")) as f:
        results = json.load(f)
    share, wall = args.link_share, training_seconds(results["history"])[-1]  # none's compute, evaluations left out
    ddp_bytes = results["ddp_equivalent"]["global_wire_bytes"]
    rate_bytes = ddp_bytes / (wall * share / (1 - share))
    mbit = max(1, round(rate_bytes * 8 / 1e6))
    print(f"rate: DDP's global wire bytes per worker {ddp_bytes / 1e6:.1f} MB, none's wall {wall:.1f} s, link share "
          f"{share:.0%}: R = {ddp_bytes / 1e6:.1f} MB / ({wall:.1f} s * {share:.2f} / {1 - share:.2f}) = "
          f"{rate_bytes * 8 / 1e6:.1f} Mbit/s, taken as {mbit} Mbit/s", flush=True)
    return {"link_share": share, "none_wall": wall, "ddp_global_wire_bytes": ddp_bytes,
            "rate_bytes_per_s": rate_bytes, "rate": f"{mbit}mbit"}


def summarise(report: dict) -> dict:
    metric = report["workload"]["metric"]
    rate = report["net"]["rate_bytes_per_s"]
    runs = {m["method"]: m for m in report["methods"] if m["status"] == "complete"}
    ddp, none = runs.get("ddp"), runs.get("none")
    if ddp is None:
        raise SystemExit("comm_bound: DDP did not complete; nothing to compare against")
    timing = against_ddp(runs, metric)
    finals = [m["metric"] for name, m in runs.items() if name != "none"]
    common = max(finals) if metric == "perplexity" else min(finals)  # the worst final metric: every method reaches it
    link = ddp["global_wire_bytes"] / rate
    out = {"metric": metric, "rate_bytes_per_s": rate, "steps_factor": report.get("steps_factor", 1.0),
           "ddp_target": timing["target"], "ddp_seconds": timing["ddp_seconds"], "common_target": common,
           "ddp_link_seconds_predicted": link, "rows": []}
    if none is not None:  # training seconds, as the times: both runs evaluate as often, and that is not link time
        none_seconds, ddp_seconds = training_seconds(none["history"])[-1], timing["ddp_seconds"]
        out["none_wall"], out["none_seconds"] = none["wall_seconds"], none_seconds
        out["ddp_link_share_measured"] = (ddp_seconds - none_seconds) / ddp_seconds
        out["ddp_link_share_predicted"] = link / (link + none_seconds)
    ddp_common = reach(ddp["history"], common, metric)
    for name, m in runs.items():
        t, common_at = timing["methods"][name], reach(m["history"], common, metric)
        measured = m.get("measured") or {}
        out["rows"].append({
            "method": name, "steps": m["steps"], "metric": m["metric"], "global_wire_bytes": m["global_wire_bytes"],
            "wall_seconds": m["wall_seconds"], "training_seconds": training_seconds(m["history"])[-1],
            "eval_seconds": t["eval_seconds"], "evaluations": t["evaluations"],
            "to_ddp": t["to_ddp_seconds"], "to_ddp_previous": t["to_ddp_previous_seconds"],
            "to_ddp_step": t["to_ddp_step"], "to_ddp_ratio": t["to_ddp_ratio"],
            "at_ddp_time": t["at_ddp_time"], "at_ddp_time_step": t["at_ddp_time_step"],
            "to_common": None if common_at is None else common_at["seconds"],
            "to_common_ratio": (None if common_at is None or ddp_common is None
                                else common_at["seconds"] / ddp_common["seconds"]),
            "tx_vs_ledger": measured.get("ratio_to_ledger"), "payload_vs_expected": measured.get("payload_ratio")})
    return out


def fmt(v, spec=".1f", unit=""):
    return "–" if v is None else f"{v:{spec}}{unit}"


def table(result: dict, seeds: list[int]) -> list[str]:
    """The markdown lines that comm_bound prints and writes to table.md."""
    first = result["seeds"][seeds[0]]
    ppl = first["metric"] == "perplexity"
    name = "perplexity" if ppl else "accuracy"
    show = (lambda v: "–" if v is None else f"{v:.3f}") if ppl else (
        lambda v: "–" if v is None else f"{100 * v:.2f} %")
    factor = first["steps_factor"]
    lines = [f"{result['workload']} through {first['rate_bytes_per_s'] * 8 / 1e6:g} Mbit/s between 2 nodes; seeds "
             f"{','.join(map(str, seeds))}; every method but ddp and none ran {factor:g}x DDP's steps", ""]
    for seed in seeds:
        s = result["seeds"][seed]
        order = sorted((r for r in s["rows"] if r["to_ddp"] is not None and r["method"] != "ddp"),
                       key=lambda r: r["to_ddp"])
        lines.append(
            f"- seed {seed}: DDP's final {show(s['ddp_target'])} after {s['ddp_seconds']:.1f} s of training; common "
            f"level {show(s['common_target'])}; DDP's link share measured {fmt(s.get('ddp_link_share_measured'), '.1%')}"
            f" (predicted {fmt(s.get('ddp_link_share_predicted'), '.1%')}: {s['ddp_link_seconds_predicted']:.0f} s of "
            f"link, none's {fmt(s.get('none_seconds'), '.1f', ' s')} of training); first to DDP's {name}: "
            + (", ".join(f"{r['method']} ({r['to_ddp_ratio']:.2f}x)" for r in order) or "none but DDP"))
    lines += ["", f"| seed | method | steps | {name} | global wire | wall | to DDP's final (previous evaluation) "
                  f"| ÷ DDP's time | {name} at DDP's time | to the common level | ÷ DDP's | evaluations | tx ÷ ledger |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seed in seeds:
        for r in result["seeds"][seed]["rows"]:
            to = "not reached" if r["to_ddp"] is None else f"{r['to_ddp']:.1f} s ({r['to_ddp_previous']:.1f} s)"
            lines.append(
                f"| {seed} | {r['method']} | {r['steps']} | {show(r['metric'])} | {r['global_wire_bytes'] / 1e6:.1f} MB "
                f"| {r['wall_seconds']:.1f} s | {to} | {fmt(r['to_ddp_ratio'], '.2f')} | {show(r['at_ddp_time'])} "
                f"| {fmt(r['to_common'], '.1f', ' s')} | {fmt(r['to_common_ratio'], '.2f')} "
                f"| {r['evaluations']} ({r['eval_seconds']:.0f} s) | {fmt(r['tx_vs_ledger'], '.3f')} |")
    lines += ["", "Times are training seconds: wall less the evaluations before (their count and seconds in "
              "\"evaluations\"); not interpolated: the first evaluation at least as good, the previous one's time "
              "in brackets. DDP's time: its last evaluation's."]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="fashion-cnn")
    rate = ap.add_mutually_exclusive_group()
    rate.add_argument("--rate", default=None, help="node link rate, as tc writes it (default 20mbit)")
    rate.add_argument("--link-share", type=float, default=None, metavar="S",
                      help="derive the rate at which DDP's run is this share link time, e.g. 0.83 (docstring)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--steps-factor", type=float, default=1.0, metavar="F",
                    help="every method but ddp and none runs F times DDP's steps (abtrain bench --steps-factor)")
    ap.add_argument("--eval-every", type=int, default=None, metavar="E",
                    help="evaluate every E steps, every method (default: the workload's steps / 12)")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/comm-bound-WORKLOAD (comm-bound-stepsF-WORKLOAD with a factor)")
    args = ap.parse_args()
    if args.link_share is not None and not 0 < args.link_share < 1:
        ap.error("--link-share must be between 0 and 1, e.g. 0.83")
    workload = get_workload(args.workload)
    args.eval_every = args.eval_every or max(1, workload.steps // 12)
    tag = "" if args.steps_factor == 1 else f"steps{args.steps_factor:g}".replace(".", "") + "-"
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", f"comm-bound-{tag}{args.workload}")
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"command": " ".join(["benchmarks/comm_bound.py", *sys.argv[1:]]), "workload": args.workload,
              "description": workload.description, "methods": args.methods, "steps_factor": args.steps_factor,
              "eval_every": args.eval_every, "seeds": {}}
    if args.link_share is not None:
        result["rate_derivation"] = derive_rate(args, seeds[0])
        args.rate = result["rate_derivation"]["rate"]
    result["rate"] = args.rate = args.rate or "20mbit"
    for seed in seeds:
        result["seeds"][seed] = summarise(bench(args, args.methods, args.rate, seed, os.path.join(args.out, f"s{seed}")))
    result["namespaces_left"] = stale_namespaces()

    lines = table(result, seeds)
    print("\n" + "\n".join(lines))
    print(f"network namespaces left: {len(result['namespaces_left'])}")
    with open(os.path.join(args.out, "comm_bound.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.join(args.out, 'comm_bound.json')} and table.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
