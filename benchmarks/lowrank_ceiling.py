"""What rank-r factors reach when trained jointly on every sample: a ceiling for any low-rank method.

    .venv/bin/python benchmarks/lowrank_ceiling.py --workload fashion-wide --ranks 0,48,32 --seeds 0,1
    .venv/bin/python benchmarks/lowrank_ceiling.py --workload fashion-wide --ranks 48 --batch-share 0.5

One process trains the workload's model with its recipe (optimizer, learning rate and schedule, weight decay,
label smoothing, clipping) and step budget on the global batch (workers x batch size), every layer that
AB-training factorises by default (abtrain.methods.ab.lowrank.prepare_model: not the stem, head or
embeddings) split from W's initial SVD into factors A (m x r) and B (r x n) trained together at every step,
r = min(rank, the largest rank whose factors are smaller than W). Rank 0 trains the dense model. This is plain
low-rank training with every gradient averaged (what DDP on the factors would compute), so it bounds what a
method that trains the factors with less communication can reach at those ranks in the same budget.

--batch-share 0.5 trains on half the global batch (the same steps): each factor sees what one of two
AB-training groups gives it. Prints a table and writes JSON (OUT/lowrank_ceiling.json).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from abtrain.methods.ab import lowrank  # noqa: E402
from abtrain.sidebyside.workloads import get_workload  # noqa: E402
from abtrain.cli import build_parser, config_from_args  # noqa: E402
from abtrain.data import load_dataset, steps_per_epoch  # noqa: E402
from abtrain.models import build_model, criterion  # noqa: E402
from abtrain.methods.ab.config import ABConfig  # noqa: E402
from abtrain.run.plan import build_optimizer, lr_lambda  # noqa: E402

MIN_RANK = ABConfig().min_rank  # AB-training's rank floor: a layer it would not factorise stays whole here too


def factorise(model: nn.Module, rank: int) -> list[lowrank.FactorizedParam]:
    """Split every layer AB-training factorises (:func:`abtrain.methods.ab.lowrank.prepare_model`, the default
    full-rank patterns and rank floor) into A·B at min(rank, its paying rank) from W's SVD, both factors trained.
    Build the optimizer after this call."""
    records = lowrank.prepare_model(model, min_rank=MIN_RANK)
    lowrank.decompose_all(records, [min(rank, lowrank.paying_rank(fp.m, fp.n)) for fp in records])
    lowrank.set_trainable(records, "both")
    return records


def train(workload, rank: int, seed: int, share: float) -> dict:
    ns = build_parser().parse_args(["train", *workload.train_args])
    cfg = config_from_args(ns)
    torch.manual_seed(seed)
    ds = load_dataset(cfg.dataset, cfg.data_dir, seed=seed, block_size=cfg.block_size,
                      limit_train=cfg.limit_train, limit_test=cfg.limit_test)
    torch.manual_seed(seed)
    model = build_model(cfg.model, ds)
    dense = sum(p.numel() for p in model.parameters())
    records = factorise(model, rank) if rank > 0 else []
    params = lowrank.ab_param_count(model, records) if records else dense
    layers = [f"{fp.name} {fp.m}x{fp.n}: rank {fp.rank}" for fp in records]
    batch = max(1, round(share * cfg.workers * cfg.batch_size))
    total = cfg.steps if cfg.steps is not None else cfg.epochs * steps_per_epoch(len(ds.train), cfg.workers,
                                                                                  cfg.batch_size)
    optimizer = build_optimizer(cfg, model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total))
    loss_fn = criterion(ds.task)
    smoothing = cfg.label_smoothing if ds.task == "classify" else 0.0
    g = torch.Generator().manual_seed(seed)
    order, at = torch.randperm(len(ds.train), generator=g), 0
    start = time.perf_counter()
    model.train()
    for step in range(total):
        if at + batch > len(order):
            order, at = torch.randperm(len(ds.train), generator=g), 0
        idx = order[at:at + batch]
        at += batch
        out = model(ds.train.x[idx])
        if smoothing:
            loss = nn.functional.cross_entropy(out, ds.train.y[idx], label_smoothing=smoothing)
        else:
            loss = loss_fn(out, ds.train.y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        if (step + 1) % max(1, total // 10) == 0:
            print(f"  rank {rank} seed {seed}: step {step + 1}/{total}, loss {loss.item():.4f}", flush=True)
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ds.test), 500):
            x, y = ds.test.x[i:i + 500], ds.test.y[i:i + 500]
            out = model(x)
            loss_sum += loss_fn(out, y).item() * len(x)
            count += len(x)
            if ds.task == "classify":
                correct += int((out.argmax(-1) == y).sum())
    value = correct / count if ds.task == "classify" else math.exp(loss_sum / count)
    return {"rank": rank, "seed": seed, "batch": batch, "steps": total, "value": value, "params": params,
            "compression": dense / params, "layers": layers, "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="fashion-wide")
    p.add_argument("--ranks", default="0,48", help="comma-separated ranks; 0 is the dense model")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--batch-share", type=float, default=1.0,
                   help="share of the global batch each step trains on (0.5: one of two groups' worth)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not 0.0 < args.batch_share <= 1.0:
        p.error(f"--batch-share must be in (0, 1], got {args.batch_share}")
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = get_workload(args.workload)
    ranks = [int(r) for r in args.ranks.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    if any(r < 0 for r in ranks):
        p.error("ranks must be >= 0")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"lowrank-ceiling-{workload.name}")
    os.makedirs(out, exist_ok=True)
    metric = "test_accuracy" if workload.metric == "accuracy" else "test_perplexity"
    runs = []
    for rank in ranks:
        for seed in seeds:
            run = train(workload, rank, seed, args.batch_share)
            runs.append(run)
            shown = f"{run['value'] * 100:.2f} %" if metric == "test_accuracy" else f"{run['value']:.3f}"
            print(f"rank {rank} seed {seed}: {metric} {shown}, {run['compression']:.2f}:1, "
                  f"{run['seconds']:.0f} s", flush=True)
    print(f"\n{workload.description}; one process, batch {runs[0]['batch']} "
          f"(share {args.batch_share} of the global batch), every factor trained at every step")
    print(f"{'rank':>6}  {'compression':>11}  {metric + ' (mean, spread)':>32}  per seed")
    rows = []
    for rank in ranks:
        mine = [r for r in runs if r["rank"] == rank]
        values = [r["value"] for r in mine]
        scale = 100 if metric == "test_accuracy" else 1
        mean, spread = statistics.mean(values) * scale, (max(values) - min(values)) * scale
        print(f"{rank or 'dense':>6}  {mine[0]['compression']:>10.2f}:1  {mean:>24.3f} ±{spread:.3f}  "
              + ", ".join(f"{v * scale:.3f}" for v in values))
        rows.append({"rank": rank, "compression": mine[0]["compression"], "mean": mean, "spread": spread,
                     "per_seed": [v * scale for v in values], "layers": mine[0]["layers"]})
    path = os.path.join(out, "lowrank_ceiling.json")
    with open(path, "w") as fh:
        json.dump({"command": " ".join(["benchmarks/lowrank_ceiling.py", *sys.argv[1:]]),
                   "workload": workload.description, "metric": metric, "batch_share": args.batch_share,
                   "rows": rows, "runs": runs}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
