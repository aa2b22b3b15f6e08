"""A user's own torchrun script with a wide layer, under DDP or converted to an abtrain method.

    torchrun --standalone --nproc-per-node 4 benchmarks/user_script.py --method ddp
    torchrun --standalone --nproc-per-node 4 benchmarks/user_script.py --method ab --out ab.json

The habits of a real DDP script: a small conv stem, then Linear(6272, 512) and Linear(512, 512) and
a head on Fashion-MNIST; AdamW, OneCycleLR, gradient clipping, 2 micro-batches per optimizer step
(the first under no_sync), bf16 autocast, one epoch (234 optimizer steps of 4 x 64 samples).
``--method ddp`` is the script as written for DistributedDataParallel; any other method is the
same script with the 6 lines of docs/own-loop.md changed. Rank 0 writes the run's figures
(wall, time inside each phase of the method, accuracy, bytes) to ``--out`` as JSON.
``benchmarks/wall_vs_ddp.py`` runs it for several methods and prints the table. With ``--ckpt FILE
--stop-after N`` rank 0 saves the model's, the optimizer's and the scheduler's state_dicts after N steps, as DDP
scripts do, and the run stops; ``--ckpt FILE --resume`` loads that file on every worker and goes on.
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import abtrain
from abtrain.data import load_fashion_mnist, make_synthetic

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--method", default="ab", help="ddp (plain DistributedDataParallel) or an abtrain method")
parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the method's abtrain.setup (repeatable; values as Python literals)")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--batch", type=int, default=64, help="samples per worker and optimizer step")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data-dir", help="Fashion-MNIST's IDX files (default: where abtrain finds them)")
parser.add_argument("--synthetic", action="store_true", help="generated data of the same shape (tests)")
parser.add_argument("--limit", type=int, help="use only the first N training samples")
parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: cores / workers)")
parser.add_argument("--out", help="rank 0 writes the run's figures here (JSON)")
parser.add_argument("--ckpt", help="DDP's checkpoint habit: rank 0 saves the model's, the optimizer's and the scheduler's "
                    "state_dicts here after --stop-after steps, and --resume loads that file on every worker")
parser.add_argument("--stop-after", type=int, metavar="N", help="save --ckpt after N optimizer steps and stop")
parser.add_argument("--resume", action="store_true", help="continue from --ckpt")
parser.add_argument("--gather", action="store_true", help="every worker calls method.gather_state() before rank 0 "
                    "saves --ckpt (rank 0's file then carries each worker's own part)")
parser.add_argument("--profile", type=int, default=0, metavar="N",
                    help="rank 0 prints the N functions with the most time inside them (cProfile, cumulative)")
args = parser.parse_args()


class Net(nn.Module):
    """Conv stem (1 -> 32 channels, 28 x 28 -> 14 x 14), then 6272 -> 512 -> 512 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 14 * 14, 512)
        self.fc2 = nn.Linear(512, 512)
        self.classifier = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.stem(x)), 2).flatten(1)
        return self.classifier(F.relu(self.fc2(F.relu(self.fc1(h)))))


def literal(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if args.threads or torch.get_num_threads() > 1:
    import os
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
data = (make_synthetic(n_train=args.limit or 4096, n_test=512, dim=28 * 28, num_classes=10, seed=0)
        if args.synthetic else load_fashion_mnist(args.data_dir))
x_train, x_test = data.train.x.view(-1, 1, 28, 28), data.test.x.view(-1, 1, 28, 28)
x_train, y_train = x_train[:args.limit], data.train.y[:args.limit]
steps_per_epoch = len(x_train) // (world * args.batch)
total = args.epochs * steps_per_epoch

torch.manual_seed(args.seed)
net = Net()
if args.method == "ddp":
    method = None
    model = DDP(net)
    no_sync = model.no_sync
else:
    options = {k: literal(v) for k, v in (o.split("=", 1) for o in args.option)}
    method = abtrain.setup(args.method, total_steps=total, **options)
    model = method.prepare(net)
    no_sync = method.no_sync
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=total)
if method is not None:
    method.attach(opt)
done = 0  # optimizer steps taken, a resumed run's included
if args.resume:
    saved = torch.load(args.ckpt)  # every worker loads rank 0's file
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])  # with an abtrain method attached: its state too
    sched.load_state_dict(saved["sched"])
    done = saved["step"]

autocast = torch.autocast("cpu", dtype=torch.bfloat16)
profiler = None
if args.profile and rank == 0:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
start = time.perf_counter()
step_seconds: dict[str, float] = {}
for epoch in range(args.epochs):
    g = torch.Generator().manual_seed(args.seed + epoch)
    order = torch.randperm(len(x_train), generator=g)[:steps_per_epoch * world * args.batch]
    mine = order.view(steps_per_epoch, world, args.batch)[:, rank]
    for k, idx in enumerate(mine):
        if epoch * steps_per_epoch + k < done:
            continue  # taken before the checkpoint
        if done == args.stop_after:
            break
        t0 = time.perf_counter()
        phase = method.phase if method is not None else "ddp"
        x, y = x_train[idx], y_train[idx]
        opt.zero_grad()
        for j, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
            with autocast, (no_sync() if j == 0 else contextlib.nullcontext()):
                loss = F.cross_entropy(model(xs), ys) / 2
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # with an abtrain method attached: its syncs and decompositions run in this call
        sched.step()
        done += 1
        step_seconds[phase] = step_seconds.get(phase, 0.0) + time.perf_counter() - t0
if done == args.stop_after:
    if args.gather and method is not None:
        method.gather_state()
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": done},
                   args.ckpt)
    # what each worker sent for the checkpoint (the ledger's phase "checkpoint"; gather_state() only)
    sent = method.comm.ledger.summary()["by_phase"].get("checkpoint", {}).get("wire_bytes", 0.0) if method else 0.0
    every: list[float] = [0.0] * world
    dist.all_gather_object(every, sent)
    if rank == 0:
        print(json.dumps({"checkpoint_bytes": os.path.getsize(args.ckpt), "checkpoint_wire_bytes": every}))
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)
if method is not None:
    method.detach()
train_seconds = time.perf_counter() - start
if profiler is not None:
    import pstats
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)

with torch.no_grad():
    model.eval()
    logits = torch.cat([model(xb) for xb in x_test.split(1000)])
    accuracy = (logits.argmax(1) == data.test.y).float().mean().item()
if rank == 0:
    figures = {"method": args.method, "options": args.option, "seed": args.seed, "steps": total,
               "train_seconds": train_seconds, "seconds_by_phase": step_seconds, "test_accuracy": accuracy}
    if method is not None:
        res = method.results()
        figures.update({k: res.get(k) for k in ("svd_seconds", "sync_seconds", "syncs", "compression_ratio")})
        figures["global_wire_bytes"] = res["comm"]["by_scope"]["global"]["wire_bytes"]
        figures["wire_bytes"] = res["comm"]["wire_bytes"]
    print(json.dumps(figures))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
if method is not None:
    method.close()
dist.destroy_process_group()
