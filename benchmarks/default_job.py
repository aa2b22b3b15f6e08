"""The default job's targets: >= 88 % Fashion-MNIST test accuracy in 3 epochs; one epoch with 4 workers < 2 min.

    .venv/bin/python benchmarks/default_job.py [extra abtrain train flags, e.g. --method ddp]

Runs exactly `abtrain train` (the default job: AB-training, 4 workers in 2 groups), then prints
accuracy and wall time per epoch from its results.json, the bytes against what DDP would have sent
for the same steps, and writes benchmarks/results/default_job.json.
"""
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out_root = os.path.join(ROOT, "benchmarks", "results")
extra = sys.argv[1:]
run_dir = os.path.join(out_root, f"default-job-{time.strftime('%Y%m%d-%H%M%S')}")
cmd = [os.path.join(os.path.dirname(sys.executable), "abtrain"), "train", "--out", run_dir, *extra]
print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
subprocess.run(cmd, check=True)

r = json.load(open(os.path.join(run_dir, "results.json")))
print(f"\n{r['method']} | {r['model']} on {r['dataset']} | {r['world_size']} workers | {r['steps']} steps")
print(f"{'epoch':>6} {'test acc':>9} {'test loss':>10} {'epoch s':>8}")
prev = 0.0
rows = []
for h in r["history"]:
    rows.append({"epoch": h["epoch"], "test_accuracy": h["test_accuracy"], "test_loss": h["test_loss"],
                 "epoch_seconds": h["wall_seconds"] - prev})
    print(f"{h['epoch']:6.2f} {100 * h['test_accuracy']:8.2f}% {h['test_loss']:10.4f} {h['wall_seconds'] - prev:8.1f}")
    prev = h["wall_seconds"]
final = r["final"]["test_accuracy"]
slowest = max(row["epoch_seconds"] for row in rows)
print(f"\ntarget >= 88 % after 3 epochs: {100 * final:.2f} % -> {'met' if final >= 0.88 else 'MISSED'}")
print(f"target epoch < 120 s with 4 workers: slowest {slowest:.1f} s -> {'met' if slowest < 120 else 'MISSED'}")
comm, ddp = r["comm"], r["ddp_equivalent"]
for scope, ours, theirs in (("global", comm["by_scope"]["global"]["wire_bytes"], ddp["global_wire_bytes"]),
                            ("total", comm["wire_bytes"], ddp["wire_bytes"])):
    print(f"{scope} wire bytes per worker: {ours / 1e6:.1f} MB, DDP for the same steps {theirs / 1e6:.1f} MB"
          + (f" ({theirs / ours:.2f}x fewer)" if ours > 0 and theirs > 0 else ""))
os.makedirs(out_root, exist_ok=True)
with open(os.path.join(out_root, "default_job.json"), "w") as fh:
    json.dump({"command": " ".join(cmd), "rows": rows, "final_test_accuracy": final,
               "wall_seconds": r["wall_seconds"], "wire_bytes": comm["wire_bytes"],
               "global_wire_bytes": comm["by_scope"]["global"]["wire_bytes"], "ddp_equivalent": ddp, "results": os.path.join(run_dir, "results.json")}, fh, indent=2)
