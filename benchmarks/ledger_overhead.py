"""What counting costs: step time with the communication ledger on and off.

    .venv/bin/python benchmarks/ledger_overhead.py [--steps 150] [--repeats 2]

1. Micro: the cost of one ledger record (what every collective pays), times the collectives per
   step, against the measured step time.
2. Macro: the same DDP run (Fashion-MNIST CNN, 4 workers) with --ledger and --no-ledger,
   alternating, step time = training wall time / steps.
Target: accounting <= 3 % of step time. Writes benchmarks/results/ledger_overhead.json.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from abtrain.comm.group import Group
from abtrain.comm.ledger import Ledger

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=150)
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--workers", type=int, default=4)
args = p.parse_args()

# -- micro: one record ---------------------------------------------------------
ledger, group, t = Ledger(), Group("world", 4, "global"), torch.zeros(1000)
n = 100_000
start = time.perf_counter()
for _ in range(n):
    ledger.record("all_reduce", group, t, 0.0)
record_us = (time.perf_counter() - start) / n * 1e6
print(f"one ledger record: {record_us:.2f} us")

# -- macro: ledger on / off --------------------------------------------------
abtrain = os.path.join(os.path.dirname(sys.executable), "abtrain")
times = {"on": [], "off": []}
calls_per_step = None
for rep in range(args.repeats):
    for mode in ("on", "off"):
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([abtrain, "train", "--workers", str(args.workers), "--steps", str(args.steps),
                            "--eval-every", str(10 * args.steps), "--log-every", str(args.steps),
                            "--ledger" if mode == "on" else "--no-ledger", "--out", d], check=True,
                           stdout=subprocess.DEVNULL)
            r = json.load(open(os.path.join(d, "results.json")))
        train_seconds = r["history"][-1]["wall_seconds"]
        times[mode].append(train_seconds / r["steps"])
        if mode == "on":
            calls_per_step = r["comm"]["by_phase"]["train"]["calls"] / r["steps"]
        print(f"repeat {rep} ledger {mode:3}: {1000 * times[mode][-1]:.1f} ms/step", flush=True)

on, off = min(times["on"]), min(times["off"])
micro_share = record_us * 1e-6 * calls_per_step / off
print(f"\nstep time, best of {args.repeats}: ledger on {1000 * on:.1f} ms, off {1000 * off:.1f} ms "
      f"-> difference {100 * (on - off) / off:+.2f} % (run-to-run noise included)")
print(f"ledger records per step: {calls_per_step:.0f} x {record_us:.2f} us = {100 * micro_share:.4f} % of a step")
print(f"target <= 3 %: {'met' if max(micro_share, (on - off) / off) <= 0.03 else 'MISSED'}")
os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
with open(os.path.join(ROOT, "benchmarks", "results", "ledger_overhead.json"), "w") as fh:
    json.dump({"record_us": record_us, "calls_per_step": calls_per_step, "step_seconds": times,
               "best_on": on, "best_off": off, "micro_share": micro_share}, fh, indent=2)
