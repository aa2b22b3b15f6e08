"""A real training loop's habits with AB-training: clipping, a cosine LR schedule, bf16 autocast, gradient
accumulation, torch.compile, and DDP's checkpoint: rank 0 saves, every worker resumes from its file.

    torchrun --standalone --nproc-per-node 4 examples/own_loop_habits.py
    torchrun --standalone --nproc-per-node 4 examples/own_loop_habits.py --stop-after 30 --ckpt-dir ckpt
    torchrun --standalone --nproc-per-node 4 examples/own_loop_habits.py --resume --ckpt-dir ckpt

Each habit is written as under DDP; the lines marked ``# abtrain`` are what changes (docs/own-loop.md):
``method.no_sync()`` where DDP has ``model.no_sync()``, and nothing else. The gradient is averaged when
``backward()`` returns, so ``clip_grad_norm_`` clips what the optimizer applies; the optimizer's
state_dict, saved after ``method.attach(opt)``, carries the method's state, so the model's and the
optimizer's state_dicts are the whole checkpoint. Rank 0's file resumes every worker: inside an AB phase the
workers of the other role go on from the phase's start, and rank 0 says what that gives up. ``--gather``
adds one line before the save, ``method.gather_state()`` on every worker, and rank 0's file then resumes each
worker as it was: the same bits as the uninterrupted run. ``--per-rank`` saves each worker's file as well and
resumes each from its own: the same bits too.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import abtrain  # abtrain
from abtrain.data import make_synthetic

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch", type=int, default=32, help="samples per worker and optimizer step")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--clip", type=float, default=0.5, help="gradient norm clipped to (0: no clipping)")
parser.add_argument("--compile", default="inductor", help="torch.compile backend ('none': eager)")
parser.add_argument("--no-bf16", action="store_true", help="no bf16 autocast")
parser.add_argument("--ckpt-dir", help="save a checkpoint here every --ckpt-every steps")
parser.add_argument("--ckpt-every", type=int, default=10)
parser.add_argument("--stop-after", type=int, help="stop after this many steps (as if killed after a checkpoint)")
parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --ckpt-dir")
parser.add_argument("--per-rank", action="store_true",
                    help="each worker saves its own file too, and resumes from it (bit-identical inside an AB phase)")
parser.add_argument("--gather", action="store_true",
                    help="every worker calls method.gather_state() before rank 0 saves: rank 0's file then resumes "
                         "each worker bit for bit")
parser.add_argument("--out", help="rank 0 writes the exported weights and the run's figures here (a .pt file)")
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(32, 128)
        self.body = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU())
        self.classifier = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.stem(x))
        return self.classifier(h + self.body(h))


dist.init_process_group("gloo")
rank = dist.get_rank()
data = make_synthetic(seed=0)
train_set = TensorDataset(data.train.x, data.train.y)
sampler = DistributedSampler(train_set, shuffle=True, seed=0)
loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, drop_last=True)
total = args.epochs * len(loader)

torch.manual_seed(0)
method = abtrain.setup("ab", total_steps=total, rank_fraction=0.25)  # abtrain
model = method.prepare(Net())  # abtrain (was: model = DDP(Net()))
if args.compile != "none":
    model = torch.compile(model, backend=args.compile)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
warmup = max(1, total // 20)
sched = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
method.attach(opt)  # abtrain
applied = []  # the gradient norm each optimizer step applies, seen by a hook of the script's own
opt.register_step_pre_hook(lambda o, *_: applied.append(torch.linalg.vector_norm(torch.stack(
    [p.grad.norm() for g in o.param_groups for p in g["params"] if p.grad is not None])).item()))

step = 0
path = os.path.join(args.ckpt_dir, "ckpt.pt") if args.ckpt_dir else None  # rank 0 writes it
own = os.path.join(args.ckpt_dir, f"rank{rank}.pt") if args.ckpt_dir and args.per_rank else None
if path:
    os.makedirs(args.ckpt_dir, exist_ok=True)
if args.resume:
    state = torch.load(own or path)  # every worker loads rank 0's file (the default weights_only load: plain data)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])  # brings the method's state too (saved while attached)
    sched.load_state_dict(state["scheduler"])
    step = state["step"]

autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16)
while step < total and step != args.stop_after:
    epoch, skip = divmod(step, len(loader))
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        if i < skip:
            continue  # resumed inside this epoch: the batches before the checkpoint were trained on
        opt.zero_grad()
        for j, (xs, ys) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate))):
            last = j == args.accumulate - 1
            with autocast, (method.no_sync() if not last else torch.enable_grad()):  # abtrain (was: model.no_sync())
                loss = F.cross_entropy(model(xs), ys) / args.accumulate
                loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        step += 1
        if path and step % args.ckpt_every == 0:
            if args.gather:
                method.gather_state()  # abtrain, every worker: rank 0's file then carries each worker's own part
            for file in [path] * (rank == 0) + [own] * (own is not None):
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": step}, file + ".tmp")
                os.replace(file + ".tmp", file)  # a kill while saving leaves the previous checkpoint whole
        if step == total or step == args.stop_after:
            break

if step == args.stop_after and step < total:
    method.detach(finalize=False)  # stopped to be resumed: the workers may still differ
    dist.destroy_process_group()
    raise SystemExit(0)

method.detach()  # the last sync: one model on every worker
low_rank = sum(r is not None for r in method.ranks[-1]["layers"].values()) if method.ranks else 0
with torch.no_grad():
    model.eval()
    accuracy = (model(data.test.x).argmax(1) == data.test.y).float().mean().item()
if rank == 0:
    print(method.summary())
    print(f"low-rank layers at the end: {low_rank}; largest gradient norm applied: {max(applied):.4f}; "
          f"test accuracy {accuracy:.4f}")
    if args.out:
        torch.save({"weights": method.export(), "results": method.results(), "applied": applied,
                    "low_rank": low_rank, "accuracy": accuracy}, args.out)
dist.destroy_process_group()
