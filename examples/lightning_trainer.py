"""AB-training under PyTorch Lightning: a Lightning DDP script, converted in 3 lines.

    pip install 'abtrain[lightning]'
    python examples/lightning_trainer.py                                   # Lightning starts the 4 CPU workers
    torchrun --standalone --nproc-per-node 4 examples/lightning_trainer.py

The lines marked ``# abtrain`` are the whole conversion (docs/lightning.md shows the diff): the import,
the strategy in place of "ddp", the exported weights saved. The LightningModule, its OneCycleLR,
gradient clipping, gradient accumulation and the validation every epoch stay as they were.
"""
import os
import tempfile

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from abtrain.data import make_synthetic
from abtrain.integrations.lightning import AbtrainStrategy  # abtrain

EPOCHS, BATCH, WORKERS = 6, 16, 4


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.classifier = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1,
                                                    total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


data = make_synthetic(seed=0)
train = DataLoader(TensorDataset(data.train.x, data.train.y), batch_size=BATCH, shuffle=True, drop_last=True)
val = DataLoader(TensorDataset(data.test.x, data.test.y), batch_size=128)

torch.manual_seed(0)
model = Net()
strategy = AbtrainStrategy("ab", rank_fraction=0.25)  # abtrain (was: strategy = "ddp")
trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORKERS, max_epochs=EPOCHS, gradient_clip_val=1.0,
                     accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, train, val)

# fit ends with every worker holding one model (the method's last sync and consensus()).
if trainer.is_global_zero:
    path = os.path.join(tempfile.gettempdir(), f"lightning_trainer_{os.getpid()}.pt")
    torch.save(trainer.strategy.method.export(), path)  # abtrain (was: torch.save(model.state_dict(), path))

    # What the conversion promises: the exported weights load into the plain class and score the same.
    plain = Net()
    plain.load_state_dict(torch.load(path))
    os.remove(path)
    with torch.no_grad():
        plain_acc = (plain(data.test.x).argmax(1) == data.test.y).float().mean().item()
    print(f"validation accuracy {trainer.callback_metrics['val_acc']:.3f}; "
          f"plain Net from the exported weights {plain_acc:.3f}; "
          f"compression {trainer.strategy.method.extra_results()['compression_ratio']:.2f}:1")
