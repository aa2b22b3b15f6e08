"""The worker: build, train_step, evaluate, results, close."""

from __future__ import annotations

import logging
import math
import os
import json
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint as ckpt
from .comm import Communicator, Ledger
from .config import SECTIONS, TrainConfig
from .data import Dataset, batches, load_dataset, shard_indices, steps_per_epoch
from . import lowrank
from .methods import METHODS, build_method
from .methods.ab import Schedule, check_topology, default_group_size
from ._version import __version__
from .models import build_model, count_parameters
from .progress import Progress, eval_line
from .results import (NoSpaceError, TensorBoard, ddp_equivalent, is_no_space, peak_rss_bytes, summary_table, write_json,
                      write_metrics_csv, write_status)
from .topology import Topology, resolve_backend

log = logging.getLogger(__name__)


def method_options(cfg: TrainConfig) -> dict[str, Any]:
    """The options of ``cfg.method`` taken from the flat config."""
    options: dict[str, Any] = {}
    if cfg.method in ("ddp", "ddp-bf16", "powersgd"):
        options["bucket_cap_mb"] = cfg.bucket_cap_mb
    if cfg.method in SECTIONS:  # methods with an options section (--<method>-*)
        options["config"] = getattr(cfg, cfg.method)
    return options


def launch_id(environ: dict[str, str] | None = None) -> str | None:
    """An id every worker of this launch shares: torchrun's rendezvous id, else Slurm's job and step ids."""
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":  # torchrun's default --rdzv-id is the string "none"
        return run_id
    if env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"] + (f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else "")
    return None


def default_run_dir(cfg: TrainConfig, environ: dict[str, str] | None = None) -> str:
    """``runs/<method>-<model>-<dataset>-<id>``, the same on every worker of a launch.

    The id is the launch's (:func:`launch_id`); without one, a time stamp, which
    workers started by torchrun share through the elastic agent's store (each
    computing its own could straddle a second, or differ between nodes).
    """
    env = os.environ if environ is None else environ
    tag = launch_id(env)
    if tag is None:
        tag = time.strftime("%Y%m%d-%H%M%S")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR"):
            import datetime

            import torch.distributed as dist
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=cfg.timeout))
            # The first worker to get here sets it; a restarted worker finds the same one.
            tag = store.compare_set("abtrain/run_dir_stamp", "", tag).decode()
    return os.path.join("runs", f"{cfg.method}-{cfg.model}-{cfg.dataset}-{tag}")


def group_layout(cfg: TrainConfig, world_size: int, local_world_size: int) -> tuple[int, str | None]:
    """The group size this run uses, and a line saying so when abtrain chose it for AB-training on one node."""
    if cfg.group_size is not None:
        return cfg.group_size, None
    local = local_world_size if world_size % max(1, local_world_size) == 0 else world_size
    if cfg.method != "ab":
        return local, None
    g = default_group_size(world_size, local, cfg.ab)
    if g == local:
        return g, None
    return g, f"AB-training: one node of {world_size} workers: {world_size // g} groups of {g} (--group-size to choose)"


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW; no weight decay on 1-D parameters (biases, norms)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999))


def lr_lambda(cfg: TrainConfig, total_steps: int):
    """Linear warm-up, then cosine decay to zero (or constant)."""
    warm = cfg.warmup_lr_steps

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def preflight(cfg: TrainConfig, world_size: int) -> Dataset:
    """Every check that can fail on user input, before any worker starts."""
    resolve_backend(cfg.backend, cfg.device)
    ds = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, block_size=cfg.block_size,
                      limit_train=cfg.limit_train, limit_test=cfg.limit_test)
    shard = len(ds.train) // world_size
    if cfg.batch_size > shard:
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than each worker's shard of the training set "
                         f"({len(ds.train)} samples / {world_size} workers = {shard}); use a smaller batch or fewer workers")
    model = build_model(cfg.model, ds)  # raises for a model that does not fit the dataset
    total = cfg.steps if cfg.steps is not None else cfg.epochs * steps_per_epoch(len(ds.train), world_size, cfg.batch_size)
    if cfg.stop_after is not None and cfg.stop_after >= total:
        raise ValueError(f"--stop-after {cfg.stop_after} must be smaller than the run's {total} steps")
    if cfg.method not in METHODS:
        raise ValueError(f"unknown method {cfg.method!r}; choose one of: {', '.join(METHODS)}")
    group_size, _ = group_layout(cfg, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if world_size % group_size:
        raise ValueError(f"{world_size} workers cannot be split into groups of {group_size}: "
                         f"choose a --group-size that divides the number of workers")
    if cfg.method == "ab":
        check_topology(cfg.ab, world_size, group_size)
        Schedule.from_config(cfg.ab, total)  # a rebound as long as the cycle fails here, not in the workers
        lowrank.prepare_model(model, full_rank_patterns=cfg.ab.patterns, min_rank=cfg.ab.min_rank)
    return ds


#: A checkpoint is "good" when the training loss since the previous one is finite and at most this many
#: times the smaller of the best earlier checkpoint's loss and the loss of guessing (ln of the classes).
DIVERGENCE_FACTOR = 3.0


class _Stopped(Exception):
    """--stop-after reached: leave the method's block without its end-of-training finalize."""


class Trainer:
    """One worker's training run.

    With ``resume=True`` it continues from the run directory's last complete
    checkpoint: every worker loads its own shard, and the run goes on exactly
    as if it had never stopped.
    """

    def __init__(self, cfg: TrainConfig, topo: Topology, run_dir: str, resume: bool = False) -> None:
        self.cfg, self.topo, self.run_dir = cfg, topo, run_dir
        self.is_main = topo.rank == 0
        torch.set_num_threads(cfg.threads or max(1, len(os.sched_getaffinity(0)) // topo.local_world_size))
        self.dataset = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, block_size=cfg.block_size,
                                    limit_train=cfg.limit_train, limit_test=cfg.limit_test)
        self.ledger = Ledger(enabled=cfg.ledger)
        self.comm = Communicator(self.ledger, topo.device)
        torch.manual_seed(cfg.seed)  # identical initial weights on every worker
        self.model = build_model(cfg.model, self.dataset).to(topo.device)
        self.params = count_parameters(self.model)
        torch.manual_seed(cfg.seed * 1000 + 1 + topo.rank)  # per-worker stream (dropout)
        self.method = build_method(cfg.method, self.comm, topo, **method_options(cfg))
        self.forward_module = self.method.prepare(self.model)
        self.optimizer = build_optimizer(cfg, self.model)
        self.steps_per_epoch = steps_per_epoch(len(self.dataset.train), topo.world_size, cfg.batch_size)
        self.total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * self.steps_per_epoch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_steps))
        self.method.plan(self.total_steps)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._train_loss_sum = 0.0
        self._train_loss_count = 0
        self.wall = 0.0
        self.eval_due = False  # an evaluation fell due and waits for the workers to agree on one model
        self.last_checkpoint: int | None = None
        self._interval_loss = [0.0, 0]  # this worker's training loss since the last checkpoint
        self.best_loss: float | None = None  # training loss of the best good checkpoint so far
        self.resumes: list[dict[str, Any]] = []  # resumes that changed --lr / --grad-clip, with the step
        self.on_step: Callable[[int], None] | None = None  # called after every optimizer step
        self.saved_config = self._read_saved_config() if self.is_main else None
        if cfg.stop_after is not None and cfg.stop_after >= self.total_steps:
            raise ValueError(f"--stop-after {cfg.stop_after} must be smaller than the run's {self.total_steps} steps")
        if resume:
            self.load_checkpoint()
            # Every worker must have its shard before any trains: a worker whose shard is refused leaves
            # here, and the others' barrier fails on one line instead of deep inside the first step.
            self.comm.barrier(topo.world)
            if cfg.stop_after is not None and cfg.stop_after <= self.step:
                raise ValueError(f"--stop-after {cfg.stop_after}: the run is already at step {self.step}")

    # -- the loop ----------------------------------------------------------
    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.dataset.task == "lm":
            output, y = output.reshape(-1, output.shape[-1]), y.reshape(-1)
        return F.cross_entropy(output, y, label_smoothing=self.cfg.label_smoothing)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.ledger.phase = self.method.phase
        self.forward_module.train()
        x, y = x.to(self.topo.device, non_blocking=True), y.to(self.topo.device, non_blocking=True)
        loss = self.loss(self.forward_module(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip is not None:
            self.method.reduce_gradients()  # clip the averaged gradient, not this worker's
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        value = loss.detach().item()
        if not math.isfinite(value):
            raise FloatingPointError(f"the training loss became {value} at step {self.step}{self._advice()}")
        self._train_loss_sum += value
        self._train_loss_count += 1
        self._interval_loss[0] += value
        self._interval_loss[1] += 1
        self.method.observe_loss(value)
        return value

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Test loss and accuracy over the whole test split, each worker a disjoint part, reduced over all."""
        with self.ledger.in_phase("eval"):
            self.method.sync_buffers()
            self.forward_module.eval()
            test = self.dataset.test
            mine = torch.arange(self.topo.rank, len(test), self.topo.world_size)
            loss_sum = correct = count = 0.0
            for chunk in mine.split(max(256, self.cfg.batch_size)):
                x, y = test.x[chunk].to(self.topo.device), test.y[chunk].to(self.topo.device)
                out = self.model(x)
                if self.dataset.task == "lm":
                    out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
                loss_sum += F.cross_entropy(out, y, reduction="sum").item()
                correct += (out.argmax(-1) == y).sum().item()
                count += y.numel()
            # Bytes so far ride along: the history shows the mean over workers (groups may differ).
            totals = torch.tensor([loss_sum, correct, count, self._train_loss_sum, self._train_loss_count,
                                   self.ledger.wire_total, self.ledger.global_wire_total],
                                  dtype=torch.float64, device=self.topo.device)
            self.comm.all_reduce(totals, self.topo.world)
        loss_sum, correct, count, tl_sum, tl_count, wire_sum, global_sum = totals.tolist()
        self._train_loss_sum, self._train_loss_count = 0.0, 0
        test_loss = loss_sum / max(1.0, count)
        row = {
            "step": self.step,
            "epoch": round(self.step / self.steps_per_epoch, 4),
            "test_accuracy": correct / max(1.0, count),
            "test_loss": test_loss,
            "test_perplexity": math.exp(min(test_loss, 50.0)) if self.dataset.task == "lm" else None,
            "train_loss": tl_sum / tl_count if tl_count else None,
            "wire_bytes": wire_sum / self.topo.world_size,
            "global_wire_bytes": global_sum / self.topo.world_size,
            "wall_seconds": self.wall,
            # The LR the last step applied (AB's ramp included), not the scheduler's value for the next one.
            "lr": self.method.last_lr if self.method.last_lr is not None else self.scheduler.get_last_lr()[0],
            "phase": self.method.phase,
        }
        self.history.append(row)
        return row

    def run(self) -> dict[str, Any] | None:
        """Train to the end (returns rank 0's results) or to --stop-after (returns None)."""
        cfg = self.cfg
        if self.is_main:
            print(f"abtrain: {cfg.method} | model {cfg.model} ({self.params:,} parameters) | {cfg.dataset} "
                  f"({len(self.dataset.train):,} train / {len(self.dataset.test):,} test) | "
                  f"{self.topo.world_size} workers ({self.topo.backend}, {self.topo.device.type}) | "
                  f"{self.total_steps} steps ({self.steps_per_epoch} per epoch) | run dir {self.run_dir}", flush=True)
            if self.step:
                print(f"abtrain: continuing from the checkpoint of step {self.step}", flush=True)
        progress = Progress(self.is_main, self.total_steps, cfg.log_every, initial=self.step)
        tb = TensorBoard(self.run_dir) if self.is_main else None
        eval_every = cfg.eval_every or self.steps_per_epoch
        start = time.perf_counter() - self.wall  # wall time of the run, across resumes

        def evaluate() -> None:
            self.wall = time.perf_counter() - start
            row = self.evaluate()
            progress.message(eval_line(row))
            if tb is not None:
                tb.add(row)

        def checkpoint() -> None:
            self.wall = time.perf_counter() - start
            self.save_checkpoint()

        try:
            with self.method.attach(self.optimizer):
                while self.step < self.total_steps:
                    # Every epoch has exactly steps_per_epoch batches, so the step says where the data order is.
                    epoch, done = divmod(self.step, self.steps_per_epoch)
                    order = shard_indices(len(self.dataset.train), self.topo.rank, self.topo.world_size, epoch, cfg.seed)
                    for x, y in batches(self.dataset.train, order[done * cfg.batch_size:], cfg.batch_size):
                        loss = self.train_step(x, y)
                        if self.on_step is not None:
                            self.on_step(self.step)
                        progress.step(self.step, {"phase": self.method.phase, "loss": loss,
                                                  "wire": self.ledger.wire_total, "global": self.ledger.global_wire_total})
                        self.eval_due = self.eval_due or self.step % eval_every == 0
                        # Evaluate a model every worker holds: methods whose workers drift apart
                        # (AB phases) defer the evaluation to their next point of agreement.
                        if self.eval_due and self.step < self.total_steps and self.method.ready_for_evaluation():
                            evaluate()
                            self.eval_due = False
                        if self.step >= self.total_steps:
                            break
                        if self.step == cfg.stop_after:
                            checkpoint()
                            raise _Stopped
                        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                            checkpoint()
                # The state right after the last optimizer step, before the method's finalize: a worker
                # that dies during the final evaluation restarts from here and finishes the same way.
                if self.last_checkpoint != self.step:
                    checkpoint()
        except _Stopped:
            progress.close()
            if tb is not None:
                tb.close()
            if self.is_main:
                write_status(self.run_dir, "stopped", step=self.step,
                             resume=f"abtrain train --resume {self.run_dir}")
                print(f"abtrain: stopped after step {self.step} of {self.total_steps}; checkpoint in "
                      f"{ckpt.checkpoint_root(self.run_dir)}; continue with: abtrain train --resume {self.run_dir}",
                      flush=True)
            return None
        evaluate()  # after the block: the method's finalize has brought every worker to one model
        progress.close()
        self.wall = time.perf_counter() - start
        return self.finish(tb)

    # -- checkpoints -------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        """What a checkpoint must match to be continued by this run."""
        return {"method": self.cfg.method, "model": self.cfg.model, "dataset": self.cfg.dataset,
                "world_size": self.topo.world_size, "group_size": self.topo.group_size, "params": self.params}

    def state_dict(self) -> dict[str, Any]:
        """This worker's whole state after optimizer step ``self.step`` (tensors and plain containers only)."""
        epoch, done = divmod(self.step, self.steps_per_epoch)
        return {
            "format": ckpt.FORMAT,
            "version": ckpt.VERSION,
            "meta": {**self._meta(), "rank": self.topo.rank},
            "step": self.step,
            "data": {"epoch": epoch, "batch": done},
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "method": self.method.state_dict(),
            "ledger": self.ledger.state_dict(),
            "rng": ckpt.rng_state(),
            "history": self.history,
            "train_loss": [self._train_loss_sum, self._train_loss_count],
            "eval_due": self.eval_due,
            "wall_seconds": self.wall,
            "guard": {"interval_loss": list(self._interval_loss), "best_loss": self.best_loss},
            "settings": self.settings(),
            "resumes": self.resumes,
        }

    def settings(self) -> dict[str, Any]:
        """The options a resume may change after a divergence, as this worker trains with them."""
        return {"lr": self.cfg.lr, "grad_clip": self.cfg.grad_clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta = state.get("meta", {})
        expected = {**self._meta(), "rank": self.topo.rank}
        for key, value in expected.items():
            if meta.get(key) != value:
                raise ValueError(f"checkpoint was written for {key.replace('_', ' ')} {meta.get(key)!r}, this run has "
                                 f"{value!r}; it cannot be continued with these settings")
        epoch, done = divmod(state["step"], self.steps_per_epoch)
        if state["data"] != {"epoch": epoch, "batch": done}:
            raise ValueError(f"checkpoint's data position {state['data']} does not match step {state['step']} "
                             f"with {self.steps_per_epoch} steps per epoch (--batch-size or the dataset changed)")
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise ValueError(f"checkpoint does not fit the model {self.cfg.model}: "
                             f"{str(exc).strip().splitlines()[0][:200]}") from None
        self.method.load_state_dict(state["method"])  # after the model: AB's factors and modes come with it
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.ledger.load_state_dict(state["ledger"])
        ckpt.set_rng_state(state["rng"])
        self.step = state["step"]
        self.history = list(state["history"])
        self._train_loss_sum, self._train_loss_count = state["train_loss"]
        self.eval_due = state["eval_due"]
        self.wall = state["wall_seconds"]
        guard = state.get("guard") or {}
        self._interval_loss = list(guard.get("interval_loss", [0.0, 0]))
        self.best_loss = guard.get("best_loss")
        self.resumes = list(state.get("resumes", []))
        before = state.get("settings") or {"lr": self.scheduler.base_lrs[0], "grad_clip": self.cfg.grad_clip}
        changed = {k: v for k, v in self.settings().items() if before.get(k) != v}
        if changed:
            self._apply_lr()
            self.resumes.append({"step": self.step, **changed,
                                 "before": {k: before.get(k) for k in changed}})

    def _apply_lr(self) -> None:
        """Put ``cfg.lr`` into the restored schedule: the same warm-up and decay, another peak."""
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.scheduler.base_lrs = [self.cfg.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.cfg.lr
            group["lr"] = self.cfg.lr * factor

    def load_checkpoint(self) -> None:
        """Load this worker's shard of the run directory's last complete checkpoint."""
        manifest = ckpt.read_manifest(self.run_dir)
        if manifest is None:
            raise ValueError(f"run directory {self.run_dir} has no complete checkpoint to continue from")
        ckpt.check_manifest(manifest, {k: v for k, v in self._meta().items() if k != "params"},
                            ckpt.checkpoint_root(self.run_dir))
        state = ckpt.load_shard(ckpt.shard_path(self.run_dir, manifest, self.topo.rank))
        if state.get("step") != manifest["step"]:
            raise ValueError(f"checkpoint shard of worker {self.topo.rank} is for step {state.get('step')}, "
                             f"the manifest for step {manifest['step']}")
        try:
            self.load_state_dict(state)
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"checkpoint of step {manifest['step']} lacks or garbles its {exc} entry") from None
        self.last_checkpoint = self.step

    def _non_finite(self) -> str | None:
        """Name of the first parameter or buffer holding inf or nan, if any."""
        for name, t in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                return name
        return None

    def _read_saved_config(self) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.run_dir, "config.json")) as fh:
                saved = json.load(fh)
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, dict) else None

    def _good(self) -> tuple[int, float | None] | None:
        """Step and training loss of the run's last good checkpoint (the one the manifest names)."""
        try:
            manifest = ckpt.read_manifest(self.run_dir)
        except ValueError:
            return None
        return None if manifest is None else (manifest["step"], manifest.get("train_loss"))

    def _kept(self) -> str:
        good = self._good()
        if good is None:
            return ""
        return f" (the last good checkpoint, of step {good[0]}, is kept in {ckpt.checkpoint_root(self.run_dir)})"

    def _advice(self) -> str:
        """How to continue after a divergence: resume the last good checkpoint with a lower LR or a clip."""
        good = self._good()
        if good is None:
            return "; lower --lr or set --grad-clip"
        loss = f" (training loss {good[1]:.4g})" if isinstance(good[1], float) else ""
        return (f"; the last good checkpoint, of step {good[0]}{loss}, is kept: continue with a lower learning "
                f"rate, 'abtrain train --resume {self.run_dir} --lr {self.cfg.lr / 10:g}', or with --grad-clip")

    def _judge(self) -> tuple[bool, float | None]:
        """Is this checkpoint good? Rank 0's training loss since the previous checkpoint against the limit."""
        total, count = self._interval_loss
        if not count:
            return True, None
        loss = total / count
        guess = math.log(max(2, self.dataset.num_classes))
        reference = guess if self.best_loss is None else min(self.best_loss, guess)
        return loss <= DIVERGENCE_FACTOR * reference, loss

    def save_checkpoint(self) -> None:
        """Write this worker's shard; rank 0 declares the checkpoint complete once every worker has written."""
        bad = self._non_finite()
        if bad is not None:
            raise FloatingPointError(f"{bad} holds inf or nan after step {self.step}; no checkpoint written"
                                     f"{self._advice()}")
        good, loss = self._judge()
        if good and loss is not None:
            self.best_loss = loss if self.best_loss is None else min(self.best_loss, loss)
        self._interval_loss = [0.0, 0]
        directory = ckpt.step_dir(self.run_dir, self.step)
        try:
            ckpt.save_shard(os.path.join(directory, ckpt.shard_name(self.topo.rank)), self.state_dict())
            # A plain barrier (no data, not in the ledger): the manifest may only name shards that exist.
            self.comm.barrier(self.topo.world)
            if self.is_main and good:
                ckpt.write_manifest(self.run_dir, self.step, self.topo.world_size,
                                    {**{k: v for k, v in self._meta().items() if k != "params"},
                                     "config": self.saved_config, "settings": self.settings(), "train_loss": loss})
        except (OSError, RuntimeError) as exc:
            if not is_no_space(exc):
                raise
            shutil.rmtree(directory, ignore_errors=True)  # never named by the manifest: free the space
            previous = self._good()
            raise NoSpaceError(f"no space left on device while writing the checkpoint of step {self.step} in "
                               f"{ckpt.checkpoint_root(self.run_dir)}; " + (
                                   f"the checkpoint of step {previous[0]} is intact" if previous
                                   else "no earlier checkpoint exists")) from None
        if self.is_main and not good:
            shutil.rmtree(directory, ignore_errors=True)
            previous = self._good()
            print(f"abtrain: warning: training loss {loss:.4g} since the previous checkpoint is far above the "
                  f"run's best; the checkpoint of step {self.step} is not kept as good"
                  + (f" (the last good one is of step {previous[0]})" if previous else ""), flush=True)
        self.last_checkpoint = self.step

    def finish(self, tb: TensorBoard | None) -> dict[str, Any] | None:
        with self.ledger.in_phase("eval"):
            rss = torch.tensor([peak_rss_bytes()], dtype=torch.float64, device=self.topo.device)
            self.comm.all_reduce(rss, self.topo.world, op="max")
            comm = self.comm.mean_summary(self.topo.world)
        if tb is not None:
            tb.close()
        if not self.is_main:
            return None
        last = self.history[-1]
        results = {
            "status": "complete",
            "method": self.cfg.method,
            "model": self.cfg.model,
            "dataset": self.cfg.dataset,
            "world_size": self.topo.world_size,
            "group_size": self.topo.group_size,
            "backend": self.topo.backend,
            "device": self.topo.device.type,
            "steps": self.step,
            "epochs": round(self.step / self.steps_per_epoch, 4),
            "steps_per_epoch": self.steps_per_epoch,
            "params": self.params,
            "final": {k: last[k] for k in ("test_accuracy", "test_loss", "test_perplexity", "train_loss")},
            "wall_seconds": self.wall,
            "peak_rss_bytes": int(rss.item()),
            "comm": comm,
            "ddp_equivalent": ddp_equivalent(self.params, self.topo.world_size, self.topo.group_size, self.step),
            **self.method.extra_results(),
            "resumes": self.resumes,
            "history": self.history,
            "config": self.cfg.to_dict(),
            "abtrain_version": __version__,
            "torch_version": torch.__version__,
        }
        bad = self._non_finite()
        if bad is not None:
            raise FloatingPointError(f"{bad} holds inf or nan at the end of training{self._kept()}")
        try:
            # Plain weights (W = A·B where low rank) that load into the model class; checkpoints keep the factors.
            ckpt.save_shard(os.path.join(self.run_dir, "model.pt"), self.method.export())
            write_metrics_csv(os.path.join(self.run_dir, "metrics.csv"), self.history)
            write_json(os.path.join(self.run_dir, "results.json"), results)
        except (OSError, RuntimeError) as exc:
            if not is_no_space(exc):
                raise
            previous = self._good()
            raise NoSpaceError(f"no space left on device while writing the results in {self.run_dir}; "
                                   + (f"the checkpoint of step {previous[0]} is intact: free space and continue with "
                                      f"'abtrain train --resume {self.run_dir}'" if previous else
                                      "no checkpoint exists")) from None
        write_status(self.run_dir, "complete")
        print(summary_table(results, self.run_dir), flush=True)
        return results

    def close(self) -> None:
        self.topo.close()
