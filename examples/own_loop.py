"""AB-training in your own loop: a plain torchrun + DDP script, converted in 6 lines.

    torchrun --standalone --nproc-per-node 4 examples/own_loop.py

The lines marked ``# abtrain`` are the whole conversion (docs/own-loop.md shows
the diff): import, setup, prepare instead of DDP, attach, evaluate inside
consensus(), save the exported weights. Everything else -- the model (grouped
and depthwise Conv1d, MultiheadAttention, a classifier not called ``head``),
DistributedSampler, OneCycleLR, evaluation every epoch -- stays yours.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: F401  (the script before conversion used it)
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import abtrain  # abtrain
from abtrain.data import make_synthetic

EPOCHS, BATCH = 8, 32


class Net(nn.Module):
    """32 features -> 16 channels x 8 positions -> grouped and depthwise convs -> attention -> classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(32, 128)
        self.conv = nn.Conv1d(16, 32, 3, padding=1, groups=4)
        self.depthwise = nn.Conv1d(32, 32, 3, padding=1, groups=32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.body = nn.Linear(256, 128)
        self.classifier = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x)).view(-1, 16, 8)
        h = F.relu(self.depthwise(F.relu(self.conv(h)))).transpose(1, 2)  # (batch, 8 positions, 32)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.classifier(F.relu(self.body(h.flatten(1))))


@torch.no_grad()
def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    net.eval()
    acc = (net(x).argmax(1) == y).float().mean().item()
    net.train()
    return acc


dist.init_process_group("gloo")
rank = dist.get_rank()
data = make_synthetic(seed=0)
train_set = TensorDataset(data.train.x, data.train.y)
sampler = DistributedSampler(train_set, shuffle=True, seed=0)
loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler, drop_last=True)

torch.manual_seed(0)
model = Net()
method = abtrain.setup("ab", total_steps=EPOCHS * len(loader), rank_fraction=0.25)  # abtrain
model = method.prepare(model)  # abtrain (was: model = DDP(model))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=EPOCHS * len(loader))
method.attach(opt)  # abtrain

for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with method.consensus(): acc = evaluate(model, data.test.x, data.test.y)  # abtrain (was: acc = evaluate(...))
    if rank == 0:
        print(f"epoch {epoch + 1}: test accuracy {acc:.3f} (phase {method.phase}, LR applied {method.last_lr:.4f})")

# The last consensus() came after the last step: every worker holds the same model.
path = os.path.join(tempfile.gettempdir(), f"own_loop_{os.getpid()}.pt")
if rank == 0:
    torch.save(method.export(), path)  # abtrain (was: torch.save(model.module.state_dict(), path))

    # What the conversion promises: the exported weights load into the plain class and score the same.
    plain = Net()
    plain.load_state_dict(torch.load(path))
    os.remove(path)
    comm = method.comm.ledger.summary()
    print(f"test accuracy {acc:.3f}; plain {type(plain).__name__} from the exported weights {evaluate(plain, data.test.x, data.test.y):.3f}; "
          f"compression {method.extra_results()['compression_ratio']:.2f}:1; wire bytes per worker {comm['wire_bytes']:.0f} "
          f"(global {comm['by_scope']['global']['wire_bytes']:.0f})")
dist.destroy_process_group()
