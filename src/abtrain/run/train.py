"""The worker: build from the plan, train_step, evaluate, checkpoint, finish, close."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..comm.communicator import Communicator
from ..comm.ledger import Ledger
from ..comm.topology import Topology
from ..config import TrainConfig
from ..data import batches, shard_indices
from ..methods.memory import moments_per_element, scalar_state_bytes
from ..models import count_parameters
from . import checkpoint as ckpt
from .plan import Plan, build_optimizer, forward_precision, lr_lambda, method_options, preflight
from .progress import Progress, eval_line
from .results import TensorBoard, count_multiply_adds, gather_memory, peak_rss_bytes, results_record, summary_table, write_metrics_csv
from .rundir import write_status
from .safefile import NoSpaceError, is_no_space, read_text, write_json


class Trainer:
    """One worker's training run.

    ``plan``: the preflight's (a worker that joined a torchrun world in the
    launcher's process reuses it); without one, the worker makes its own.
    With ``resume=True`` it continues from the run directory's last complete
    checkpoint: every worker loads its own shard, and the run goes on exactly
    as if it had never stopped.
    """

    def __init__(self, cfg: TrainConfig, topo: Topology, run_dir: str, resume: bool = False,
                 plan: Plan | None = None) -> None:
        self.cfg, self.topo, self.run_dir = cfg, topo, run_dir
        os.makedirs(run_dir, exist_ok=True)  # now, once: a run directory removed later is not made again
        self.is_main = topo.rank == 0
        torch.set_num_threads(cfg.threads or max(1, len(os.sched_getaffinity(0)) // topo.local_world_size))
        plan = plan if plan is not None else preflight(cfg, topo.world_size, topo.local_world_size)
        self.dataset = plan.dataset
        self.ledger = Ledger(enabled=cfg.ledger)
        self.comm = Communicator(self.ledger, topo.device)
        self.model = plan.model.to(topo.device)
        self.params = count_parameters(self.model)
        self.param_tensors = sum(1 for p in self.model.parameters() if p.requires_grad)  # the dense model's
        torch.manual_seed(cfg.seed * 1000 + 1 + topo.rank)  # per-worker stream (dropout)
        self.method = cfg.method_spec.build(self.comm, topo, **method_options(cfg))
        self.forward_module = self.method.prepare(self.model)
        self.optimizer = build_optimizer(cfg, self.model)
        self.steps_per_epoch = plan.steps_per_epoch
        self.total_steps = plan.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_steps))
        self.method.set_total_steps(self.total_steps)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._train_loss_sum = 0.0
        self._train_loss_count = 0
        self.wall = 0.0
        self._start = 0.0  # perf_counter at the (virtual) start of the run: now - wall time so far
        self.eval_due = False  # an evaluation fell due and waits for the workers to agree on one model
        self.last_checkpoint: int | None = None
        self.guard = ckpt.LossGuard(self.dataset.num_classes)  # judges each checkpoint by the training loss
        self.multiply_adds: dict[str, int] = {}  # by phase: one step's forward and backward on this worker
        self.resumes: list[dict[str, Any]] = []  # resumes that changed --lr / --grad-clip, with the step
        self.on_step: Callable[[int], None] | None = None  # called after every optimizer step
        self.saved_config = self._read_saved_config() if self.is_main else None
        self.progress: Progress | None = None
        self.tensorboard: TensorBoard | None = None
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
        self.forward_module.train()
        x, y = x.to(self.topo.device, non_blocking=True), y.to(self.topo.device, non_blocking=True)
        with count_multiply_adds(self.multiply_adds, self.method.phase):  # the first step of each phase
            with forward_precision(self.cfg, self.topo.device):
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
            raise ckpt.Diverged(f"the training loss became {value} at step {self.step}"
                                     f"{ckpt.divergence_advice(self.run_dir, self.cfg.lr)}")
        self._train_loss_sum += value
        self._train_loss_count += 1
        self.guard.add(value)
        self.method.observe_loss(value)
        return value

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Test loss and accuracy over the whole test split, each worker a disjoint part, reduced over all."""
        with self.ledger.in_phase("eval"), self.method.evaluation():
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
        self._announce()
        self.progress = Progress(self.is_main, self.total_steps, self.cfg.log_every, initial=self.step)
        self.tensorboard = TensorBoard(self.run_dir) if self.is_main else None
        self._start = time.perf_counter() - self.wall  # wall time of the run, across resumes
        self.method.attach(self.optimizer)
        try:
            stopped = self._train_to_end_or_stop()
        except BaseException:
            self.method.detach(finalize=False)  # a final collective could hang when other workers did not fail
            raise
        # The end of training runs the method's final step (one model on every worker); a stop does not.
        self.method.detach(finalize=not stopped)
        if stopped:
            self._close_outputs()
            self._report_stop()
            return None
        self._evaluate_and_report()  # after the final step: every worker holds one model
        self._close_outputs()
        self.wall = time.perf_counter() - self._start
        return self.finish()

    def _announce(self) -> None:
        if not self.is_main:
            return
        cfg = self.cfg
        print(f"abtrain: {cfg.method} | model {cfg.model} ({self.params:,} parameters) | {cfg.dataset} "
              f"({len(self.dataset.train):,} train / {len(self.dataset.test):,} test) | "
              f"{self.topo.world_size} workers ({self.topo.backend}, {self.topo.device.type}) | "
              f"{self.total_steps} steps ({self.steps_per_epoch} per epoch) | run dir {self.run_dir}", flush=True)
        if self.step:
            print(f"abtrain: continuing from the checkpoint of step {self.step}", flush=True)

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This worker's batches from the current step to the end of the run."""
        while self.step < self.total_steps:
            # Every epoch has exactly steps_per_epoch batches, so the step says where the data order is.
            epoch, done = divmod(self.step, self.steps_per_epoch)
            order = shard_indices(len(self.dataset.train), self.topo.rank, self.topo.world_size, epoch, self.cfg.seed)
            yield from batches(self.dataset.train, order[done * self.cfg.batch_size:], self.cfg.batch_size)

    def _train_to_end_or_stop(self) -> bool:
        """The steps of the run with their evaluations and checkpoints; True when --stop-after ended it."""
        cfg = self.cfg
        eval_every = cfg.eval_every or self.steps_per_epoch
        assert self.progress is not None
        for x, y in self._batches():
            loss = self.train_step(x, y)
            if self.on_step is not None:
                self.on_step(self.step)
            self.progress.step(self.step, {"phase": self.method.phase, "loss": loss,
                                           "wire": self.ledger.wire_total, "global": self.ledger.global_wire_total})
            self.eval_due = self.eval_due or self.step % eval_every == 0
            # Evaluate a model every worker holds: methods whose workers drift apart
            # (AB phases) defer the evaluation to their next point of agreement.
            if self.eval_due and self.step < self.total_steps and self.method.ready_for_evaluation():
                self._evaluate_and_report()
                self.eval_due = False
            if self.step >= self.total_steps:
                break
            if self.step == cfg.stop_after:
                self.save_checkpoint()
                return True
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        # The state right after the last optimizer step, before the method's final step: a worker
        # that dies during the final evaluation restarts from here and finishes the same way.
        if self.last_checkpoint != self.step:
            self.save_checkpoint()
        return False

    def _evaluate_and_report(self) -> None:
        self.wall = time.perf_counter() - self._start
        row = self.evaluate()
        # The evaluation's own seconds, so that a time to accuracy can leave out the evaluations before it:
        # how often a run evaluates is the bench's choice, not the method's cost.
        row["eval_seconds"] = time.perf_counter() - self._start - self.wall
        if self.progress is not None:
            self.progress.message(eval_line(row))
        if self.tensorboard is not None:
            self.tensorboard.add(row)

    def _close_outputs(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _report_stop(self) -> None:
        if self.is_main:
            write_status(self.run_dir, "stopped", step=self.step, resume=f"abtrain train --resume {self.run_dir}")
            print(f"abtrain: stopped after step {self.step} of {self.total_steps}; checkpoint in "
                  f"{ckpt.checkpoint_root(self.run_dir)}; continue with: abtrain train --resume {self.run_dir}",
                  flush=True)

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
            "guard": self.guard.state_dict(),
            "settings": self.settings(),
            "resumes": self.resumes,
            "peak_state": self.method.peak_state,
            "multiply_adds": self.multiply_adds,
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
        self.method.peak_state = dict(state.get("peak_state", {}))
        self.multiply_adds = dict(state.get("multiply_adds", {}))
        ckpt.set_rng_state(state["rng"])
        self.step = state["step"]
        self.history = list(state["history"])
        self._train_loss_sum, self._train_loss_count = state["train_loss"]
        self.eval_due = state["eval_due"]
        self.wall = state["wall_seconds"]
        self.guard.load_state_dict(state.get("guard"))
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
        expected = {k: v for k, v in self._meta().items() if k != "params"}
        state = ckpt.load(self.run_dir, self.topo.rank, expected)
        try:
            self.load_state_dict(state)
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"checkpoint of step {state['step']} lacks or garbles its {exc} entry") from None
        self.last_checkpoint = self.step

    def _read_saved_config(self) -> dict[str, Any] | None:
        try:
            saved = json.loads(read_text(os.path.join(self.run_dir, "config.json")))
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, dict) else None

    def save_checkpoint(self) -> None:
        """Write this worker's shard; rank 0 declares the checkpoint complete once every worker has written."""
        self.wall = time.perf_counter() - self._start
        ckpt.check_finite(self.model, self.run_dir, self.cfg.lr, f"after step {self.step}; no checkpoint written")
        good, loss = self.guard.judge()
        manifest = None
        if self.is_main:
            manifest = {**{k: v for k, v in self._meta().items() if k != "params"},
                        "config": self.saved_config, "settings": self.settings(), "train_loss": loss}
        ckpt.save(self.run_dir, self.step, self.topo.rank, self.state_dict(), lambda: self.comm.barrier(self.topo.world),
                  manifest, self.topo.world_size, good, loss)
        self.last_checkpoint = self.step

    # -- the end -----------------------------------------------------------
    def finish(self) -> dict[str, Any] | None:
        """Rank 0 writes results.json, metrics.csv and model.pt (collective: the ledger's mean over workers)."""
        with self.ledger.in_phase("eval"):
            # every worker's peak RSS and training state (the groups of AB-training differ)
            memory = gather_memory(self.comm, self.topo.world, self.topo.device, peak_rss_bytes(),
                                   self.method.peak_state, self.multiply_adds)
            comm = self.comm.mean_summary(self.topo.world)
        if not self.is_main:
            return None
        memory["moments_per_element"] = moments_per_element(self.optimizer)
        memory["scalar_state_bytes"] = scalar_state_bytes(self.optimizer)
        memory["param_tensors"] = self.param_tensors
        results = results_record(self.cfg, self.topo, self.history, self.step, self.steps_per_epoch, self.params,
                                 self.wall, memory.pop("peak_rss_bytes"), comm, self.method.extra_results(),
                                 self.resumes, memory)
        ckpt.check_finite(self.model, self.run_dir, self.cfg.lr, "at the end of training")
        try:
            # Plain weights (W = A·B where low rank) that load into the model class; checkpoints keep the factors.
            ckpt.save_shard(os.path.join(self.run_dir, "model.pt"), self.method.export())
            write_metrics_csv(os.path.join(self.run_dir, "metrics.csv"), self.history)
            write_json(os.path.join(self.run_dir, "results.json"), results)
        except (OSError, RuntimeError) as exc:
            if not is_no_space(exc):
                raise
            previous = ckpt.last_good(self.run_dir)
            raise NoSpaceError(f"no space left on device while writing the results in {self.run_dir}; "
                               + (f"the checkpoint of step {previous[0]} is intact: free space and continue with "
                                  f"'abtrain train --resume {self.run_dir}'" if previous else
                                  "no checkpoint exists")) from None
        write_status(self.run_dir, "complete")
        print(summary_table(results, self.run_dir), flush=True)
        return results

    def close(self) -> None:
        self.topo.close()
