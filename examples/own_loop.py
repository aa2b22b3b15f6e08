"""AB-training inside your own training loop.

    torchrun --standalone --nproc-per-node 4 examples/own_loop.py

Your model, optimizer, scheduler and loop stay yours: abtrain prepares the
model once and hooks the optimizer; phase changes need no rebuilt optimizer.
"""
import torch
import torch.nn.functional as F
from torch import nn

import abtrain
from abtrain.data import make_synthetic, shard_indices

STEPS, BATCH = 120, 32

# The schedule scales with the run: warm-up 25 % of the steps, a sync every 6 %, rebounds of 10 % of a cycle.
method = abtrain.setup("ab", total_steps=STEPS, group_size=2, rank_fraction=0.25)
rank, world = method.topo.rank, method.topo.world_size

torch.manual_seed(0)  # same initial model everywhere (prepare() also broadcasts rank 0's)
model = nn.Sequential()
model.add_module("stem", nn.Linear(32, 128))
model.add_module("act1", nn.ReLU())
model.add_module("body", nn.Linear(128, 128))
model.add_module("act2", nn.ReLU())
model.add_module("head", nn.Linear(128, 4))
model = method.prepare(model)  # factorisable layers become low-rank capable

opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
data = make_synthetic(seed=0)

step, epoch = 0, 0
with method.attach(opt):  # averaging, syncs, rebounds, decompositions, LR rebound
    while step < STEPS:
        order = shard_indices(len(data.train), rank, world, epoch, seed=0)
        for i in range(0, len(order) - BATCH + 1, BATCH):
            idx = order[i:i + BATCH]
            loss = F.cross_entropy(model(data.train.x[idx]), data.train.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step == STEPS:
                break
        epoch += 1
# Leaving the block ended with a sync: every worker holds the same model now.

with torch.no_grad():
    acc = (model(data.test.x).argmax(1) == data.test.y).float().mean().item()
comm = method.comm.ledger.summary()
if rank == 0:
    print(f"test accuracy {acc:.3f}; compression {method.extra_results()['compression_ratio']:.2f}:1; "
          f"wire bytes per worker {comm['wire_bytes']:.0f} (global {comm['by_scope']['global']['wire_bytes']:.0f})")
method.close()
