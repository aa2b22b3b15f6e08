"""Time to accuracy where communication dominates: `abtrain bench --net` at a rate that makes DDP's run mostly link time.

    sudo .venv/bin/python benchmarks/comm_bound.py                       # fashion-cnn, 20 Mbit/s, seeds 0 and 1
    sudo .venv/bin/python benchmarks/comm_bound.py --workload shakespeare-gpt --rate 14mbit   # its rate: about 9 h

Runs, for each seed, `abtrain bench --workload W --methods none,ddp,powersgd,localsgd,diloco,ab --net
rate=R --extra "--seed S" --out OUT/sS` (2 nodes of 2 workers on the bench workloads; a seed whose
OUT/sS/report.json exists is reused, so an interrupted sweep continues). Then prints one table and writes
OUT/comm_bound.json:

- DDP's link share: (DDP's wall − none's wall) / DDP's wall, measured, and the ledger's prediction
  link / (link + none's wall), link = DDP's global wire bytes per worker / R (what each node's link carries);
- per method and seed: the final metric, global wire bytes per worker, wall, the wall seconds at the first
  evaluation as good as DDP's final metric and its ratio to DDP's, the same for the "common" level (the
  worst final metric of the methods other than none, which every one of them reaches), and the node link's
  measured tx bytes against the ledger's global bytes;
- network namespaces of the bench (`abtb-*`) still present afterwards.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from abtrain.sidebyside.netns import our_namespaces  # noqa: E402
from abtrain.sidebyside.report import time_to_reach  # noqa: E402

METHODS = "none,ddp,powersgd,localsgd,diloco,ab"


def run_seed(args, seed: int) -> dict:
    out = os.path.join(args.out, f"s{seed}")
    path = os.path.join(out, "report.json")
    if not os.path.exists(path):
        cmd = [sys.executable, "-m", "abtrain.cli", "bench", "--workload", args.workload, "--methods", args.methods,
               "--net", f"rate={args.rate}", f"--extra=--seed {seed}", "--out", out]
        print("$ " + " ".join(cmd), flush=True)
        done = subprocess.run(cmd, cwd=ROOT)
        if done.returncode not in (0, 1) or not os.path.exists(path):
            raise SystemExit(f"comm_bound: the bench of seed {seed} stopped (exit {done.returncode})")
    with open(path) as f:
        return json.load(f)


def summarise(report: dict) -> dict:
    metric = report["workload"]["metric"]
    rate = report["net"]["rate_bytes_per_s"]
    runs = {m["method"]: m for m in report["methods"] if m["status"] == "complete"}
    ddp, none = runs.get("ddp"), runs.get("none")
    if ddp is None:
        raise SystemExit("comm_bound: DDP did not complete; nothing to compare against")
    finals = [m["metric"] for name, m in runs.items() if name != "none"]
    common = max(finals) if metric == "perplexity" else min(finals)  # the worst final metric: every method reaches it
    link = ddp["global_wire_bytes"] / rate
    out = {"metric": metric, "rate_bytes_per_s": rate, "ddp_target": ddp["metric"], "common_target": common,
           "ddp_link_seconds_predicted": link, "rows": []}
    if none is not None:
        out["none_wall"] = none["wall_seconds"]
        out["ddp_link_share_measured"] = (ddp["wall_seconds"] - none["wall_seconds"]) / ddp["wall_seconds"]
        out["ddp_link_share_predicted"] = link / (link + none["wall_seconds"])
    t_ddp, t_ddp_common = time_to_reach(ddp["history"], ddp["metric"], metric), time_to_reach(ddp["history"], common, metric)
    for name, m in runs.items():
        t, tc = time_to_reach(m["history"], ddp["metric"], metric), time_to_reach(m["history"], common, metric)
        measured = m.get("measured") or {}
        out["rows"].append({
            "method": name, "metric": m["metric"], "global_wire_bytes": m["global_wire_bytes"],
            "wall_seconds": m["wall_seconds"], "to_ddp": t, "to_ddp_ratio": None if t is None else t / t_ddp,
            "to_common": tc, "to_common_ratio": None if tc is None else tc / t_ddp_common,
            "tx_vs_ledger": measured.get("ratio_to_ledger"), "payload_vs_expected": measured.get("payload_ratio")})
    return out


def fmt(v, spec=".1f", unit=""):
    return "–" if v is None else f"{v:{spec}}{unit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="fashion-cnn")
    ap.add_argument("--rate", default="20mbit", help="node link rate, as tc writes it (default 20mbit)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--out", default=None, help="default benchmarks/results/comm-bound-WORKLOAD")
    args = ap.parse_args()
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", f"comm-bound-{args.workload}")
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"workload": args.workload, "rate": args.rate, "methods": args.methods, "seeds": {}}
    for seed in seeds:
        result["seeds"][seed] = summarise(run_seed(args, seed))
    result["namespaces_left"] = our_namespaces()

    first = result["seeds"][seeds[0]]
    name = "perplexity" if first["metric"] == "perplexity" else "accuracy"
    show = (lambda v: f"{v:.3f}") if name == "perplexity" else (lambda v: f"{100 * v:.2f} %")
    print(f"\n{args.workload} through {first['rate_bytes_per_s'] * 8 / 1e6:g} Mbit/s between 2 nodes; seeds {args.seeds}")
    for seed in seeds:
        s = result["seeds"][seed]
        print(f"seed {seed}: DDP's final {show(s['ddp_target'])}, common level {show(s['common_target'])}; DDP's link "
              f"share measured {fmt(s.get('ddp_link_share_measured'), '.1%')} (predicted "
              f"{fmt(s.get('ddp_link_share_predicted'), '.1%')}: {s['ddp_link_seconds_predicted']:.0f} s of link, "
              f"none's wall {fmt(s.get('none_wall'), '.1f', ' s')})")
    print(f"| seed | method | {name} | global wire | wall | to DDP's final | ÷ DDP's | to the common level | ÷ DDP's "
          "| tx ÷ ledger |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed in seeds:
        for r in result["seeds"][seed]["rows"]:
            print(f"| {seed} | {r['method']} | {show(r['metric'])} | {r['global_wire_bytes'] / 1e6:.1f} MB | "
                  f"{r['wall_seconds']:.1f} s | {fmt(r['to_ddp'], '.1f', ' s')} | {fmt(r['to_ddp_ratio'], '.2f')} | "
                  f"{fmt(r['to_common'], '.1f', ' s')} | {fmt(r['to_common_ratio'], '.2f')} | "
                  f"{fmt(r['tx_vs_ledger'], '.3f')} |")
    print(f"network namespaces left: {len(result['namespaces_left'])}")
    path = os.path.join(args.out, "comm_bound.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
