"""What AB-training's step costs on a model, written as DDP: two probe methods and the table that compares them.

    .venv/bin/python benchmarks/ab_step_probe.py --workload fashion-cnn --seeds 0,1 [--out DIR]

In an AB phase each factorised weight W moves by its two factors, each trained by one half of the
workers. At full rank the short factor (A, m×m, of a wide m×n W; B of a tall one) moves W only inside W's
row space (column space for a tall W), while the long factor's changes reach every direction. With a sync at
every step the merged step (the tangent merge, its shared part averaged) is then W's gradient averaged over
every worker inside that space and over the long factor's half of the workers outside it: every direction
outside it sees half the batch. Two methods put that one difference into DDP, all
else (one model, one optimizer and its momentum, every other parameter's gradient over every worker)
left as it is:

- ``ddp-half-grad``: the gradient of every weight AB-training factorises averaged over the first half of
  the workers only (the whole of W sees half the batch);
- ``ddp-half-outside``: that gradient's part inside W's row space (column space) averaged over every
  worker, its part outside it over the first half only: AB-training's merged step at full rank and a sync at
  every step, with DDP's optimizer state.

Run as a script it regenerates the table of ``benchmarks/ab_configs.py`` with DDP, the two probes and
(unless ``--no-ab``) AB-training at full rank with a sync at every step (the flags below) on the workload, over the seeds;
a run whose results.json exists in OUT is reused. Imported through ``ABTRAIN_METHOD_MODULES=ab_step_probe``
(with this directory on PYTHONPATH, as the script sets) it registers the two methods.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from abtrain.methods.ab import lowrank  # noqa: E402
from abtrain.methods.ab.config import ABConfig  # noqa: E402
from abtrain.methods.ddp import DDPMethod  # noqa: E402
from abtrain.methods.registry import MethodSpec, register  # noqa: E402

#: AB-training with every layer at full rank and a sync at every step, each change sent whole
AB_EVERY_STEP = "--method ab --ab-sync-every 1 --ab-rank-cap none --ab-rank-fraction 1.0 --ab-sync-rank 256"


def factorised(model: nn.Module) -> dict[str, bool]:
    """The weights AB-training's defaults factorise in ``model``, each with whether its matrix is wide."""
    cfg = ABConfig()
    records = lowrank.prepare_model(copy.deepcopy(model), full_rank_patterns=cfg.patterns, min_rank=cfg.min_rank)
    return {fp.name: fp.shape[0] < fp.shape.numel() // fp.shape[0] for fp in records}


def inside_short_span(w: torch.Tensor, g: torch.Tensor, wide: bool) -> torch.Tensor:
    """The part of gradient ``g`` the short factor's changes reach: g·V·Vᵀ for a wide W (W's row space),
    U·Uᵀ·g for a tall one (its column space), with U, V W's singular vectors of nonzero singular values."""
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    keep = s > s[0] * max(w.shape) * torch.finfo(w.dtype).eps
    if wide:
        v = vh[keep]
        return (g @ v.T) @ v
    u = u[:, keep]
    return u @ (u.T @ g)


class HalfGradDDP(DDPMethod):
    """DDP in which the factorised weights' gradients reach the all-reduce from the first half of the workers
    only (doubled there, zero on the others), so that the average is the first half's."""

    name = "ddp-half-grad"
    outside_only = False

    def prepare(self, model: nn.Module) -> nn.Module:
        if self.topo.world_size % 2:
            raise ValueError(f"{self.name} needs an even number of workers, got {self.topo.world_size}")
        first_half = self.topo.rank < self.topo.world_size // 2
        scale = 2.0 if first_half else 0.0
        wide = factorised(model)
        for name, p in model.named_parameters():
            if name in wide:
                p.register_hook(self._hook(p, scale, wide[name]))
        return super().prepare(model)

    def _hook(self, p: torch.Tensor, scale: float, wide: bool):
        def hook(g: torch.Tensor) -> torch.Tensor:
            if not self.outside_only:
                return g * scale
            w = p.detach().reshape(p.shape[0], -1).float()
            g2 = g.reshape(w.shape).float()
            inside = inside_short_span(w, g2, wide)
            return (inside + scale * (g2 - inside)).reshape(g.shape).to(g.dtype)
        return hook


class HalfOutsideDDP(HalfGradDDP):
    """DDP in which only the part of each factorised weight's gradient outside W's row space (a tall W: column
    space) comes from the first half of the workers; the part inside is every worker's, as in AB-training's
    merged step at full rank."""

    name = "ddp-half-outside"
    outside_only = True


register(MethodSpec("ddp-half-grad", HalfGradDDP, "DDP, half-batch factorised weights",
                    "probe: DDP with the weights AB-training factorises moved by the first half of the workers' "
                    "gradients", bucket_cap=True, order=900))
register(MethodSpec("ddp-half-outside", HalfOutsideDDP, "DDP, half-batch outside W's row space",
                    "probe: DDP with the part of each factorised weight's gradient outside W's row space (column "
                    "space of a tall W) moved by the first half of the workers", bucket_cap=True, order=901))


def main() -> None:
    import argparse
    import subprocess

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="fashion-cnn")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--no-ab", action="store_true",
                   help="DDP and the two probes only (AB-training's row decomposes every layer at full rank at every "
                        "step: on larger layers the slowest run of the table)")
    args = p.parse_args()
    env = dict(os.environ, ABTRAIN_METHOD_MODULES="ab_step_probe",
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    out = args.out or os.path.join(HERE, "results", f"ab-step-probe-{args.workload}")
    cmd = [sys.executable, os.path.join(HERE, "ab_configs.py"), "--workload", args.workload, "--seeds", args.seeds,
           "--method", "ddp", "--config", "ddp-half-grad=--method ddp-half-grad",
           "--config", "ddp-half-outside=--method ddp-half-outside",
           "--out", out] + ([] if args.no_ab else ["--config", f"ab-every-step-full={AB_EVERY_STEP}"])
    cmd += ["--quick"] if args.quick else []
    raise SystemExit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
