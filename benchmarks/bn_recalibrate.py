"""Test accuracy of finished Fashion-MNIST runs as saved, and with BatchNorm statistics recomputed.

    .venv/bin/python benchmarks/bn_recalibrate.py benchmarks/results/tangent-cnn/ab-s0 ...

A sync that merges the groups' weights (AB-training, local SGD) leaves running BatchNorm
statistics gathered with weights the merged model no longer has. This reads each RUN_DIR's
model.pt (the exported model) and config.json, evaluates it on the test split, recomputes
every BatchNorm layer's statistics over --images training images in training mode
(torch.optim.swa_utils.update_bn: a cumulative average, not a running one), and evaluates it
again. Prints a table and writes JSON to --out.
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from abtrain.data import load_dataset  # noqa: E402
from abtrain.models import build_model  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
p.add_argument("--images", type=int, default=4096, help="training images the statistics are recomputed on")
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--data-dir", default=None)
p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bn_recalibrate.json"))
args = p.parse_args()

dataset = load_dataset("fashion-mnist", data_dir=args.data_dir)


@torch.no_grad()
def accuracy(model: torch.nn.Module) -> float:
    model.eval()
    correct = 0
    for x, y in zip(dataset.test.x.split(1000), dataset.test.y.split(1000)):
        correct += (model(x).argmax(-1) == y).sum().item()
    return 100.0 * correct / len(dataset.test)


rows = []
for run in args.run_dirs:
    for name in ("model.pt", "config.json"):
        if not os.path.isfile(os.path.join(run, name)):
            sys.exit(f"{run}: no {name}; pass the directory of a finished 'abtrain train' run")
    with open(os.path.join(run, "config.json")) as fh:
        config = json.load(fh)
    if config.get("dataset") != "fashion-mnist":
        sys.exit(f"{run}: trained on {config.get('dataset')!r}; this script evaluates Fashion-MNIST runs")
    model_name = config["model"]
    model = build_model(model_name, dataset)
    model.load_state_dict(torch.load(os.path.join(run, "model.pt"), weights_only=True))
    saved = accuracy(model)
    torch.manual_seed(0)
    pick = torch.randperm(len(dataset.train))[:args.images]
    torch.optim.swa_utils.update_bn(dataset.train.x[pick].split(args.batch_size), model)
    rows.append({"run": os.path.relpath(run, ROOT), "model": model_name, "saved": saved, "recomputed": accuracy(model)})
    print(f"{run}: {saved:.2f} % as saved, {rows[-1]['recomputed']:.2f} % with BatchNorm statistics recomputed",
          flush=True)

os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
with open(args.out, "w") as fh:
    json.dump({"images": args.images, "rows": rows}, fh, indent=1)
print(f"wrote {args.out}")
