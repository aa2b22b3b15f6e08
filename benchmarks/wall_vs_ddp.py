"""AB-training's wall time against DDP's on one machine: the bench's workloads and a user's script.

    .venv/bin/python benchmarks/wall_vs_ddp.py                                  # every workload, seeds 0 and 1
    .venv/bin/python benchmarks/wall_vs_ddp.py --workloads user-script,fashion-cnn --seeds 0
    .venv/bin/python benchmarks/wall_vs_ddp.py --ab-flags "--ab-min-sync-every 1"    # another AB configuration

For each workload and seed, DDP and AB-training run one after another (DDP first), each as the
workload's own command: `abtrain train` with the flags `abtrain bench` gives the method for
`fashion-cnn`, `fashion-wide` and `shakespeare-gpt`, and `benchmarks/user_script.py` under
torchrun (4 workers: a conv stem, Linear(6272, 512), Linear(512, 512), a head, AdamW, OneCycle,
clipping, 2 micro-batches under no_sync, bf16 autocast, one epoch of Fashion-MNIST) for
`user-script`. The wall is the training loop's (results.json's `wall_seconds`, the script's
`train_seconds`), so start-up and data loading are left out of both. Prints a table (each seed,
AB's wall as a multiple of DDP's, AB's time in its decompositions and syncs) and writes
benchmarks/results/wall_vs_ddp.json. Run it on an otherwise idle machine: the walls are what it
measures.

The JSON is written again after every pair of runs, so an interrupted sweep keeps the pairs it finished
(``"complete": false``), and the same command run again goes on: a seed whose DDP and AB runs both finished
under --out is read back, not run again (a pair is never split: where only one of the two finished, both run
again, one after the other).
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from abtrain.sidebyside.workloads import get_workload  # noqa: E402

WORKLOADS = ("user-script", "fashion-cnn", "fashion-wide", "shakespeare-gpt")
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
p.add_argument("--seeds", default="0,1")
p.add_argument("--ab-flags", default="", help="flags added to AB-training's command (abtrain train flags; for "
               "user-script, KEY=VALUE options of abtrain.setup, space-separated)")
p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "wall_vs_ddp"))
args = p.parse_args()
bin_dir = os.path.dirname(sys.executable)
os.makedirs(args.out, exist_ok=True)


def run(cmd: list[str], log: str) -> None:
    print("$", shlex.join(cmd), flush=True)
    with open(log, "w") as fh:
        subprocess.run(cmd, check=True, stdout=fh, stderr=subprocess.STDOUT)


def finished(workload: str, method: str, seed: int) -> bool:
    """The run's figures are under --out (it ran to its end before)."""
    tag = os.path.join(args.out, f"{workload}-{method}-s{seed}")
    return os.path.exists(tag + ".json" if workload == "user-script" else os.path.join(tag, "results.json"))


def one(workload: str, method: str, seed: int, reuse: bool) -> dict:
    """One run's figures (``reuse``: read back from --out): the training loop's wall, and AB-training's time in
    decompositions and syncs."""
    tag = os.path.join(args.out, f"{workload}-{method}-s{seed}")
    if reuse:
        print(f"{workload} {method} seed {seed}: read back from {tag}", flush=True)
    elif workload == "user-script" and os.path.exists(tag + ".json"):
        os.remove(tag + ".json")
    if workload == "user-script":
        cmd = [os.path.join(bin_dir, "torchrun"), "--standalone", "--nproc-per-node", "4",
               os.path.join(ROOT, "benchmarks", "user_script.py"), "--method", method, "--seed", str(seed),
               "--out", tag + ".json"]
        if method == "ab":
            cmd += [x for o in shlex.split(args.ab_flags) for x in ("--option", o)]
        if not reuse:
            run(cmd, tag + ".log")
        r = json.load(open(tag + ".json"))
        return {"wall_seconds": r["train_seconds"], "metric": r["test_accuracy"],
                "svd_seconds": r.get("svd_seconds"), "sync_seconds": r.get("sync_seconds"), "syncs": r.get("syncs")}
    w = get_workload(workload, False)
    flags = list(w.args_for(method))
    flags[flags.index("--seed") + 1] = str(seed)
    if method == "ab":
        flags += shlex.split(args.ab_flags)
    if not reuse:
        if os.path.exists(tag):
            shutil.rmtree(tag)  # a run that did not finish: abtrain train would resume it
        run([os.path.join(bin_dir, "abtrain"), "train", *flags, "--out", tag], tag + ".log")
    r = json.load(open(os.path.join(tag, "results.json")))
    metric = r["final"].get("test_perplexity", r["final"].get("test_accuracy"))
    return {"wall_seconds": r["wall_seconds"], "metric": metric, "svd_seconds": r.get("svd_seconds"),
            "sync_seconds": r.get("sync_seconds"), "syncs": r.get("syncs")}


def write(rows: list[dict], complete: bool) -> str:
    out = os.path.join(args.out, "wall_vs_ddp.json")
    with open(out + ".tmp", "w") as fh:
        json.dump({"command": shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "ab_flags": args.ab_flags,
                   "complete": complete, "rows": rows}, fh, indent=1)
    os.replace(out + ".tmp", out)
    return out


rows = []
print(f"{'workload':<16} {'seed':>4} {'DDP s':>8} {'AB s':>8} {'AB/DDP':>7} {'SVD s':>7} {'sync s':>7} {'syncs':>5}")
for workload in args.workloads.split(","):
    if workload not in WORKLOADS:
        p.error(f"unknown workload {workload!r}: choose from {', '.join(WORKLOADS)}")
    for seed in (int(s) for s in args.seeds.split(",")):
        reuse = finished(workload, "ddp", seed) and finished(workload, "ab", seed)
        ddp, ab = one(workload, "ddp", seed, reuse), one(workload, "ab", seed, reuse)
        row = {"workload": workload, "seed": seed, "ddp": ddp, "ab": ab, "ratio": ab["wall_seconds"] / ddp["wall_seconds"]}
        rows.append(row)
        print(f"{workload:<16} {seed:>4} {ddp['wall_seconds']:>8.1f} {ab['wall_seconds']:>8.1f} {row['ratio']:>6.2f}x "
              f"{ab['svd_seconds'] or 0:>7.1f} {ab['sync_seconds'] or 0:>7.1f} {ab['syncs'] or 0:>5}", flush=True)
        write(rows, complete=False)
print(f"\nwrote {write(rows, complete=True)}")
