"""Before a run trains: the preflight's checks and the plan it hands the workers, the method's options, the
optimizer and its learning-rate schedule."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import topology
from ..config import TrainConfig
from ..data import DataError, Dataset, load_dataset, steps_per_epoch
from ..models import build_model


def method_options(cfg: TrainConfig) -> dict[str, Any]:
    """The keyword options ``cfg.method_spec.build`` takes, from the flat config."""
    spec = cfg.method_spec
    options: dict[str, Any] = {}
    if spec.bucket_cap:
        options["bucket_cap_mb"] = cfg.bucket_cap_mb
    if spec.options is not None:  # methods with an options section (--<method>-*)
        options["config"] = cfg.options()
    return options


def group_layout(cfg: TrainConfig, world_size: int, local_world_size: int) -> tuple[int, str | None]:
    """The group size this run uses (:func:`abtrain.comm.topology.group_layout`: --group-size, else the method's
    choice, else one group per node), and a line to print when the method chose it."""
    spec = cfg.method_spec
    preferred = functools.partial(spec.group_layout, cfg.options()) if spec.group_layout is not None else None
    return topology.group_layout(world_size, local_world_size, cfg.group_size, preferred)


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW; no weight decay on 1-D parameters (biases, norms) unless ``weight_decay_all``."""
    decay = [p for p in model.parameters() if p.ndim >= 2 or cfg.weight_decay_all]
    no_decay = [p for p in model.parameters() if p.ndim < 2 and not cfg.weight_decay_all]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999))


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """The learning rate of step ``i`` (0-based) as a share of ``cfg.lr``: a linear warm-up over T steps, then a
    cosine decay over the rest (or constant).

    Without ``min_lr``, warm-up step i takes lr·(i+1)/T and the cosine ends at 0. With it, timm's schedule with
    warmup_lr = min_lr (the authors' runs): warm-up step i takes min_lr + (lr − min_lr)·i/T, the peak falls at
    step T, and the cosine falls from lr to min_lr.
    """
    warm = cfg.warmup_lr_steps or round(cfg.warmup_lr_fraction * total_steps)
    floor = (cfg.min_lr or 0.0) / cfg.lr
    start = 1 if cfg.min_lr is None else 0  # abtrain's own warm-up reaches the peak on its last step

    def factor(step: int) -> float:
        if step < warm:
            return floor + (1.0 - floor) * (step + start) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def forward_precision(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The context of a training forward pass and its loss: bf16 autocast on ``device`` with ``precision="bf16"``
    (the backward then runs in the dtypes the forward chose), nothing with fp32."""
    if cfg.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class Plan:
    """What the preflight found and built, for the workers to use instead of building it again."""

    dataset: Dataset
    model: nn.Module  # built on the CPU right after torch.manual_seed(cfg.seed): the same on every worker
    world_size: int
    group_size: int
    group_note: str | None  # the method chose the group size: a line for rank 0 to print
    steps_per_epoch: int
    total_steps: int


def check_samples(ds: Dataset, model: nn.Module, name: str) -> None:
    """Every split's samples have the dataset's shape, and the model takes them and gives one output per class:
    data of the wrong shape is refused now (one line) instead of failing at the first step or evaluation."""
    for what, split in (("training", ds.train), ("test", ds.test)):
        if tuple(split.x.shape[1:]) != tuple(ds.input_shape):
            raise DataError(f"the {what} samples of {ds.name} have shape {tuple(split.x.shape[1:])}, the dataset's "
                            f"are {tuple(ds.input_shape)}: the files do not belong together")
    training = model.training
    model.eval()  # no dropout, no running statistics updated: the weights stay as built
    try:
        with torch.no_grad():
            for what, split in (("training", ds.train), ("test", ds.test)):
                if not len(split):
                    continue
                try:
                    out = model(split.x[:2])
                except (RuntimeError, ValueError, IndexError) as exc:
                    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
                    raise DataError(f"model {name} cannot take the {what} samples of {ds.name} (shape "
                                    f"{tuple(split.x.shape[1:])}): {first}") from None
                if out.shape[-1] != ds.num_classes:
                    raise DataError(f"model {name} gives {out.shape[-1]} outputs per sample, {ds.name} has "
                                    f"{ds.num_classes} classes")
    finally:
        model.train(training)


def preflight(cfg: TrainConfig, world_size: int, local_world_size: int | None = None) -> Plan:
    """Every check that can fail on user input, before any worker starts; returns the run's plan."""
    spec = cfg.method_spec
    topology.resolve_backend(cfg.backend, cfg.device)
    ds = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, block_size=cfg.block_size,
                      limit_train=cfg.limit_train, limit_test=cfg.limit_test)
    shard = len(ds.train) // world_size
    if cfg.batch_size > shard:
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than each worker's shard of the training set "
                         f"({len(ds.train)} samples / {world_size} workers = {shard}); use a smaller batch or fewer workers")
    torch.manual_seed(cfg.seed)  # identical initial weights on every worker
    model = build_model(cfg.model, ds)  # raises for a model that does not fit the dataset
    check_samples(ds, model, cfg.model)
    per_epoch = steps_per_epoch(len(ds.train), world_size, cfg.batch_size)
    total = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    if cfg.stop_after is not None and cfg.stop_after >= total:
        raise ValueError(f"--stop-after {cfg.stop_after} must be smaller than the run's {total} steps")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if local_world_size is None else local_world_size
    group_size, note = group_layout(cfg, world_size, local)
    topology.check_group_size(world_size, group_size)
    if spec.check_topology is not None:
        spec.check_topology(cfg.options(), world_size, group_size)
    if spec.check_run is not None:
        spec.check_run(cfg.options(), model, total)
    return Plan(ds, model, world_size, group_size, note, per_epoch, total)
