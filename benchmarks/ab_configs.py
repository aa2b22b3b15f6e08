"""AB-training configurations side by side with DDP on a bench workload, over several seeds.

    .venv/bin/python benchmarks/ab_configs.py --workload fashion-wide --seeds 0,1 \
        --config ddp="--method ddp" --config ab="--method ab" \
        --config ab-psgd="--method ab --ab-dense-comm powersgd"
    .venv/bin/python benchmarks/ab_configs.py --workload fashion-cnn --method ddp --method demo --method ab

A ``--method`` is a config with the flags `abtrain bench` gives that method on the workload. Each
(config, seed) runs as the `abtrain train` of the workload (same model, data, recipe,
workers, groups and step budget as `abtrain bench`), one after another; a run whose
results.json exists is reused, so an interrupted sweep continues where it stopped. Prints a
table (mean over seeds, with the spread max - min, and each seed's value) and writes JSON to
OUT/ab_configs.json.
The first config is the reference for the "vs" columns.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from abtrain.sidebyside.workloads import get_workload  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--workload", default="fashion-wide")
p.add_argument("--quick", action="store_true")
p.add_argument("--seeds", default="0,1")
p.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
               help="a named set of 'abtrain train' flags added to the workload's (repeatable)")
p.add_argument("--method", action="append", default=[], metavar="METHOD",
               help="a method with the flags 'abtrain bench' gives it on the workload (repeatable; before the "
                    "--config entries)")
p.add_argument("--out", default=None)
args = p.parse_args()

workload = get_workload(args.workload, args.quick)
seeds = [int(s) for s in args.seeds.split(",")]
configs = [[m, shlex.join(workload.args_for(m)[len(workload.train_args):])] for m in args.method]
configs += [c.split("=", 1) for c in args.config]
if not configs:
    p.error("give at least one --method or --config")
out = args.out or os.path.join(ROOT, "benchmarks", "results", f"ab-configs-{workload.name}")
abtrain = os.path.join(os.path.dirname(sys.executable), "abtrain")
metric = "test_perplexity" if workload.metric == "perplexity" else "test_accuracy"


def train_args(flags: str, seed: int) -> list[str]:
    base = list(workload.train_args)
    base[base.index("--seed") + 1] = str(seed)
    return [*base, *shlex.split(flags)]


# -- run ---------------------------------------------------------------------
results: dict[tuple[str, int], dict] = {}
for seed in seeds:
    for name, flags in configs:
        run_dir = os.path.join(out, f"{name}-s{seed}")
        path = os.path.join(run_dir, "results.json")
        if not os.path.exists(path):
            cmd = [abtrain, "train", *train_args(flags, seed), "--out", run_dir]
            print("$", " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
            if done.returncode != 0 or not os.path.exists(path):
                print(f"{name} seed {seed}: failed (exit {done.returncode}); see {run_dir}", flush=True)
                continue
        with open(path) as fh:
            results[(name, seed)] = json.load(fh)

# -- compare -----------------------------------------------------------------
def stats(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (max(values) - min(values) if len(values) > 1 else 0.0)


ref_name = configs[0][0]
rows = []
for name, flags in configs:
    done = [s for s in seeds if (name, s) in results]
    runs = [results[(name, s)] for s in done]
    refs = [results[(ref_name, s)] for s in seeds if (name, s) in results and (ref_name, s) in results]
    if not runs:
        continue
    value = [r["final"][metric] for r in runs]
    glob = [r["comm"]["by_scope"]["global"]["wire_bytes"] for r in runs]
    total = [r["comm"]["wire_bytes"] for r in runs]
    ref_value = [r["final"][metric] for r in refs]
    ref_glob = [r["comm"]["by_scope"]["global"]["wire_bytes"] for r in refs]
    row = {
        "config": name, "flags": flags, "seeds": done,
        metric: stats(value), f"{metric}_per_seed": value, "global_wire_bytes": stats(glob), "total_wire_bytes": stats(total),
        "delta_vs_ref": stats([a - b for a, b in zip(value, ref_value)]) if refs else None,
        "global_share_of_ref": stats([a / b for a, b in zip(glob, ref_glob)]) if refs else None,
        "wall_seconds": stats([r["wall_seconds"] for r in runs]),
        "compression_ratio": [r.get("compression_ratio") for r in runs],
        "model_params": [r.get("model_params", r["params"]) for r in runs],
        # the most a worker held after a step, and as a multiple of DDP's for the same model
        "training_state_bytes": [r.get("training_state_bytes") for r in runs],
        "state_vs_ddp": [r["training_state_bytes"] / r["ddp_equivalent"]["training_state_bytes"]
                         if r.get("training_state_bytes") and r["ddp_equivalent"].get("training_state_bytes")
                         else None for r in runs],
        "ranks": [[{"step": d["step"], "ratio": d["compression_ratio"], "layers": d["layers"]}
                   for d in r.get("ranks", [])] for r in runs],
        # what benchmarks/projection.py needs of each run: its evaluations and its ledger's rows
        "runs": [{"seed": s, "steps": r["steps"], "steps_per_epoch": r["steps_per_epoch"], "params": r["params"],
                  "world_size": r["world_size"], "history": [[h["step"], h[metric]] for h in r["history"]],
                  "comm_rows": [{k: row[k] for k in ("op", "scope", "phase", "group_size", "calls", "payload_bytes",
                                                     "wire_bytes")} for row in r["comm"]["rows"]]}
                 for s, r in zip(done, runs)],
    }
    rows.append(row)

unit = "ppl" if metric == "test_perplexity" else "%"
scale = 1.0 if metric == "test_perplexity" else 100.0
print(f"\n{workload.description}; seeds {args.seeds}; mean (spread max-min); reference {ref_name}")
print(f"{'config':16} {metric:>18} {'vs ref':>16} {'global wire':>20} {'share of ref':>16} {'compression':>14}"
      f" {'state vs DDP':>13}  per seed")
for r in rows:
    v, dv = r[metric]
    g, dg = r["global_wire_bytes"]
    d = r["delta_vs_ref"]
    sh = r["global_share_of_ref"]
    comp = ",".join(f"{c:.2f}" for c in r["compression_ratio"] if c) or "-"
    state = ",".join(f"{x:.2f}" for x in r["state_vs_ddp"] if x) or "-"
    print(f"{r['config']:16} {scale * v:9.2f} {unit} ±{scale * dv:4.2f} "
          f"{(f'{scale * d[0]:+7.2f} ±{scale * d[1]:4.2f}') if d else '-':>16} "
          f"{g / 1e6:10.1f} MB ±{dg / 1e6:6.1f} {(f'{100 * sh[0]:6.2f}% ±{100 * sh[1]:4.2f}') if sh else '-':>16} "
          f"{comp:>14} {state:>13}  " + ", ".join(f"{scale * x:.{3 if unit == 'ppl' else 2}f}" for x in r[f"{metric}_per_seed"]))
for r in rows:
    for seed, decomps in zip(r["seeds"], r["ranks"]):
        # one entry per run of decompositions that left the same ranks: "20-1980 (67): 63,63,... (1.0:1)"
        spans: list[list] = []
        for d in decomps:
            ranks = ",".join("-" if v is None else str(v) for v in d["layers"].values()) + f" ({d['ratio']:.1f}:1)"
            if spans and spans[-1][2] == ranks:
                spans[-1][1], spans[-1][3] = d["step"], spans[-1][3] + 1
            else:
                spans.append([d["step"], d["step"], ranks, 1])
        if spans:
            text = " | ".join((f"{a}" if n == 1 else f"{a}-{b} ({n})") + f": {ranks}" for a, b, ranks, n in spans)
            print(f"ranks {r['config']} seed {seed}: {text}")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "ab_configs.json"), "w") as fh:
    # The command as run from the repository root: script and paths inside it relative to it.
    argv = [os.path.relpath(a, ROOT) if os.path.isabs(a) and a.startswith(ROOT + os.sep) else a for a in sys.argv]
    argv[0] = "benchmarks/ab_configs.py"
    json.dump({"command": " ".join(shlex.quote(a) for a in argv), "workload": workload.description,
               "metric": metric, "rows": rows}, fh, indent=2)
print(f"\nwrote {os.path.join(out, 'ab_configs.json')}")

# -- the front: metric against global bytes, each point's compression written beside it ----------------
from plots import front  # noqa: E402  (beside this script)

points = []
for r in rows:
    comp = [c for c in r["compression_ratio"] if c]
    label = f"{r['config']} ({sum(comp) / len(comp):.1f}:1)" if comp else r["config"]
    points.append((label, r["global_wire_bytes"][0] / 1e6, scale * r[metric][0], scale * r[metric][1], "o"))
seeds_text = f"seeds {args.seeds}" if len(seeds) > 1 else f"seed {args.seeds}, no spread"
if front(points, os.path.join(out, "front.png"),
         ylabel=f"{'test perplexity' if unit == 'ppl' else 'test accuracy (%)'} (mean; bar: spread of the seeds)",
         title=f"{workload.name}: {'perplexity' if unit == 'ppl' else 'accuracy'}, bytes and compression "
               f"({seeds_text})"):
    print(f"wrote {os.path.join(out, 'front.png')}")
