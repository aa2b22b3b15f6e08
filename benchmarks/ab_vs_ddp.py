"""AB-training side by side with DDP: same data, seed, workers, step budget and accounting.

    .venv/bin/python benchmarks/ab_vs_ddp.py                    # Fashion-MNIST CNN, 4 workers in 2 groups of 2
    .venv/bin/python benchmarks/ab_vs_ddp.py --epochs 1 --ab-args "--ab-rank-fraction 0.1"

Each method runs as `abtrain train` in its own run directory, one after the
other. Prints a table and writes JSON (default benchmarks/results/ab_vs_ddp.json).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--workers", type=int, default=4)
p.add_argument("--group-size", type=int, default=2)
p.add_argument("--model", default="cnn")
p.add_argument("--dataset", default="fashion-mnist")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--common-args", default="", help="extra flags for every run")
p.add_argument("--ab-args", default="", help="extra flags for the AB run (on top of abtrain's defaults)")
p.add_argument("--skip-ddp", metavar="RESULTS_JSON", help="reuse this DDP results.json instead of running DDP")
p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ab_vs_ddp"))
args = p.parse_args()

# -- run ---------------------------------------------------------------------
common = ["--workers", str(args.workers), "--group-size", str(args.group_size), "--model", args.model,
          "--dataset", args.dataset, "--epochs", str(args.epochs), "--seed", str(args.seed),
          *shlex.split(args.common_args)]
stamp = time.strftime("%Y%m%d-%H%M%S")
runs = {}
plan = [("ddp", ["--method", "ddp"]), ("ab", ["--method", "ab", *shlex.split(args.ab_args)])]
for name, extra in plan:
    if name == "ddp" and args.skip_ddp:
        runs[name] = args.skip_ddp
        continue
    run_dir = os.path.join(args.out, f"{name}-{stamp}")
    cmd = [os.path.join(os.path.dirname(sys.executable), "abtrain"), "train", *common, *extra, "--out", run_dir]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)
    runs[name] = os.path.join(run_dir, "results.json")

# -- compare -----------------------------------------------------------------
res = {k: json.load(open(v)) for k, v in runs.items()}
ddp = res["ddp"]
rows = []
for name, r in res.items():
    g = r["comm"]["by_scope"]["global"]["wire_bytes"]
    rows.append({
        "method": name,
        "test_accuracy": r["final"]["test_accuracy"],
        "global_wire_bytes": g,
        "total_wire_bytes": r["comm"]["wire_bytes"],
        "global_vs_ddp": g / ddp["comm"]["by_scope"]["global"]["wire_bytes"],
        "accuracy_vs_ddp_points": 100 * (r["final"]["test_accuracy"] - ddp["final"]["test_accuracy"]),
        "compression_ratio": r.get("compression_ratio"),
        "wall_seconds": r["wall_seconds"],
        "wall_vs_ddp": r["wall_seconds"] / ddp["wall_seconds"],
        "steps": r["steps"],
        "results": runs[name],
    })

print(f"\n{args.model} on {args.dataset}, {args.workers} workers in groups of {args.group_size}, "
      f"{ddp['steps']} steps, seed {args.seed}")
print(f"{'method':8} {'test acc':>9} {'vs DDP':>8} {'global wire':>12} {'vs DDP':>7} {'total wire':>11} "
      f"{'compr.':>7} {'wall s':>7} {'vs DDP':>7}")
for r in rows:
    comp = f"{r['compression_ratio']:.1f}:1" if r["compression_ratio"] else "-"
    print(f"{r['method']:8} {100 * r['test_accuracy']:8.2f}% {r['accuracy_vs_ddp_points']:+7.2f}p "
          f"{r['global_wire_bytes'] / 1e6:9.1f} MB {r['global_vs_ddp']:6.1%} {r['total_wire_bytes'] / 1e6:8.1f} MB "
          f"{comp:>7} {r['wall_seconds']:7.1f} {r['wall_vs_ddp']:6.2f}x")
os.makedirs(args.out, exist_ok=True)
summary = os.path.join(args.out, "ab_vs_ddp.json")
with open(summary, "w") as fh:
    json.dump({"command": " ".join(shlex.quote(a) for a in sys.argv), "rows": rows}, fh, indent=2)
print(f"\nwrote {summary}")
