"""AB-training: independent groups train low-rank factors A or B, periodic sync, full-rank rebound.

A context manager around the user's optimizer. The schedule is counted in
optimizer steps ``t`` and, by default, scales with the run (the fractions of
:class:`ABConfig`; absolute steps are options):

* ``t < T_w``: full-rank DP over all workers (phase ``warmup``).
* ``t == T_w``: every factorisable weight is split by SVD into A·B (full rank
  the first time), phase ``ab`` starts: A-groups train A, B-groups train B,
  gradients averaged inside the group only.
* at every multiple of ``cycle_steps`` after ``T_w``: sync (phase ``sync``:
  factors and full-rank parameters averaged over all workers, W = Ā·B̄), then
  F steps of full-rank DP (phase ``rebound``), then a truncated decomposition
  and AB steps until the next multiple of ``cycle_steps``. With F = 0 the sync
  and the truncated decomposition follow each other at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import lowrank
from ..registry import MethodSpec, register
from .sync_batchnorm import convert_sync_batchnorm
from .config import ABConfig, check_topology, group_layout
from .consensus import ABConsensus
from .core import LOSS_JUMP, LOSS_WINDOW
from .decomposition import ABDecomposition
from .schedule import check_run
from .sync import ABSync

log = logging.getLogger(__name__)


class ABTraining(ABConsensus, ABSync, ABDecomposition):
    """AB-training around the user's optimizer. See the module docstring for the schedule.

    Built as ``ABTraining(comm, topo, config)`` or with the options as keywords
    (:class:`~.core.ABCore`'s ``__init__``). This class holds the hooks the
    optimizer and the loop call; the decomposition, the sync and the consensus
    are its parts (:mod:`.decomposition`, :mod:`.sync`, :mod:`.consensus`).
    """

    name = "ab"
    averages_gradients = True

    # -- preparation -------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        model = self.unwrap(model)  # torch.compile's or DDP's wrapper: its module is factorised
        self.records = lowrank.prepare_model(model, full_rank_patterns=self.cfg.patterns, min_rank=self.cfg.min_rank,
                                             apply=self.cfg.linear_apply, excluded=self.excluded)
        factorisable = {id(p) for fp in self.records for p in (fp.weight, fp.A, fp.B)} | {
            id(p) for name, p in model.named_parameters() if any(name == e for e, _ in self.excluded)}
        self.others = sum(1 for p in model.parameters() if id(p) not in factorisable)
        if self.cfg.init == "ortho-sigma":
            lowrank.ortho_sigma_init(self.records)
        if self.cfg.sync_batchnorm:
            model = self._sync_batchnorm(model)
        lowrank.set_trainable(self.records, "full")
        if self.cfg.keep_output:
            self._output_hook = model.register_forward_hook(self._find_output_layer)
        return super().prepare(model)

    def _sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """sync_batchnorm: every BatchNorm layer takes its statistics over all workers (the authors' SyncBatchNorm)."""
        model, count = convert_sync_batchnorm(model, self.comm, self.topo.world)
        if count:
            self.say(f"AB-training: {count} BatchNorm layer{'s' if count > 1 else ''} normalise with the statistics "
                     f"of all {self.topo.world_size} workers' batches at every training step (--ab-sync-batchnorm)")
        elif self.topo.rank == 0:
            log.warning("AB-training: --ab-sync-batchnorm found no BatchNorm layer in the model: it changes nothing")
        return model

    def _find_output_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        """At the first training forward: keep the layer(s) producing the output full rank from now on."""
        if not (module.training and torch.is_grad_enabled()):
            return
        self._stop_output_search()
        found = lowrank.output_weights(output, self.records)
        self.kept = [fp.name for fp in found]
        for fp in found:
            fp.param.note = "produces the model's output"
        if found:
            self.say(f"AB-training: keeping {', '.join(self.kept)} full rank: "
                     f"{'it produces' if len(found) == 1 else 'they produce'} the model's output "
                     f"(keep_output=False / --no-ab-keep-output factorises it)")

    def _stop_output_search(self) -> None:
        self.output_searched = True
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None

    def _kept_records(self) -> list[lowrank.FactorizedParam]:
        return [fp for fp in self.records if fp.name in self.kept]

    # -- the hooks ----------------------------------------------------------
    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """A warm-up of 0 steps: decompose before the first forward."""
        self._sched()
        self._optimizer = optimizer
        if self.t == 0 and self.phase_at(0) == "ab" and not self.ranks:
            self._decompose(optimizer, truncate=False)
            self._switch_step = 0
        self._watch_gradients()

    def reduce_gradients(self) -> None:
        """Average this step's gradients over the workers the phase requires (idempotent per step)."""
        if self._reduced:
            return
        self._reduced = True
        if self.phase == "ab":
            self.overlap.finish()  # idle in groups of one worker
        else:
            self.dense.reduce([(n, p.grad) for n, p in self.module.named_parameters() if p.grad is not None],
                              self.topo.world)

    def _watch_gradients(self) -> None:
        """Arm the in-group averaging for the coming step when it is an AB step (its trained tensors may be new)."""
        in_group = self.phase == "ab" and self.train_group.size > 1
        if in_group and self.module is not None:
            self.overlap.watch([p for p in self.module.parameters() if p.requires_grad])
        self.overlap.start(self.train_group if in_group else None)

    def _unhook(self) -> None:
        super()._unhook()
        self.overlap.close()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside the block: no bucket of the in-group averaging starts."""
        with super().no_sync():
            self.overlap.paused = True
            try:
                yield
            finally:
                self.overlap.paused = False

    def _resumed(self) -> None:
        if self._attached is not None:  # the restored step may be an AB step: arm its in-group averaging
            self._optimizer = self._attached[0]
            self._watch_gradients()

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.reduce_gradients()
        self._saved_lrs = [g["lr"] for g in optimizer.param_groups]
        scale = self.lr_scale()
        if scale < 1.0:
            for g in optimizer.param_groups:
                g["lr"] = self.cfg.lr_floor + (g["lr"] - self.cfg.lr_floor) * scale

    def lr_scale(self) -> float:
        """Linear ramp from the floor back to the scheduled LR over R steps after each phase switch."""
        R = self._sched().lr_rebound
        if R == 0 or self._switch_step is None:
            return 1.0
        return min(1.0, (self.t - self._switch_step + 1) / R)

    def observe_loss(self, value: float) -> None:
        """Watch the training loss around truncations; rank 0 reports a cut that lifts it well above its level."""
        self._losses.append(value)
        if self._cut is None or self.t - self._cut[0] < LOSS_WINDOW:
            return
        step, level = self._cut
        after = sum(self._losses) / len(self._losses)
        self._cut = None
        if self.topo.rank == 0 and after > LOSS_JUMP * level:
            log.warning("AB-training: the training loss rose from %.4f to %.4f over the %d steps after the truncation "
                        "at step %d (compression %s); a smaller --ab-tau or a larger --ab-min-rank cuts less",
                        level, after, LOSS_WINDOW, step, lowrank.format_ratio(self.ratio or 1.0))

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        for g, lr in zip(optimizer.param_groups, self._saved_lrs):
            g["lr"] = lr  # the user's schedule continues from its own value
        self.t += 1
        if any(fp.mode == "lowrank" for fp in self._kept_records()):
            self._keep_output_full()
        sync, decompose = self._sched().events(self.t)
        decompose = decompose and self._sched().decomposes_at(self.t)
        if sync:
            self._sync(optimizer)
        if decompose:
            self._decompose(optimizer, truncate=bool(self.ranks))  # the first decomposition keeps full rank
        self._parts = {}  # W changes at the next step
        if sync or decompose or self.phase_at(self.t) != self.phase_at(self.t - 1):
            self._switch_step = self.t
        self._watch_gradients()

    @torch.no_grad()
    def _keep_output_full(self) -> None:
        """Warm-up 0 found the output layer after decomposing it: W = A·B (exact at full rank), trained full."""
        for fp in self._kept_records():
            if fp.mode == "lowrank":
                lowrank.recompose(fp)
                fp.param.note = "produces the model's output"
        lowrank.set_trainable(self.records, self._trained_role())

    # -- results and checkpoints -------------------------------------------
    def dense_size(self) -> tuple[int, int]:
        """The dense model the factorised layers stand for: each W at its full size, A and B left out."""
        if self.module is None or not self.records:
            return super().dense_size()
        return lowrank.full_param_count(self.module, self.records), lowrank.full_tensor_count(self.module, self.records)

    def extra_results(self) -> dict[str, Any]:
        sched = self._sched()
        return {
            "compression_ratio": self.ratio,
            **({"model_params": self.ranks[-1]["model_params"]} if self.ranks else {}),
            "ranks": self.ranks,
            "phases": sched.ranges(self.t),
            "schedule": {"warmup_steps": sched.warmup, "cycle_steps": sched.cycle_steps, "rebound_steps": sched.rebound,
                         "lr_rebound_steps": sched.lr_rebound},
            "kept_output_layers": self.kept,
            "svd_seconds": self.svd_seconds,
            "svd_counts": dict(self.svd_counts),
            "sync_seconds": self.sync_seconds,
            "syncs": self.syncs,
            "role": self.role,
        }

    def state_dict(self) -> dict[str, Any]:
        """Schedule position, ranks and timers. Factors, W and the layers' modes live in the model's state_dict."""
        return {"t": self.t, "switch_step": self._switch_step, "ranks": self.ranks, "role": self.role,
                "kept": self.kept, "output_searched": self.output_searched, "svd_seconds": self.svd_seconds, "sync_seconds": self.sync_seconds, "syncs": self.syncs,
                "svd_counts": dict(self.svd_counts), "ratio": self.ratio, "dense": self.dense.state_dict(), "frozen": dict(self._frozen),
                "vectors": dict(self._bases),
                "sync_compressor": self._compressor.state_dict() if self._compressor is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after the model's state_dict was loaded (it brings the factors and each layer's mode)."""
        if state.get("role", self.role) != self.role:
            raise ValueError(f"checkpoint was written by a worker of role {state['role']}, this worker trains "
                             f"{self.role}: the group layout differs (--group-size, number of workers)")
        self.t = state["t"]
        self._switch_step = state["switch_step"]
        self.ranks = state["ranks"]
        self.kept = list(state["kept"])
        if state["output_searched"]:
            self._stop_output_search()  # the output layer was looked for before the checkpoint
        self.svd_seconds = state["svd_seconds"]
        self.sync_seconds = state["sync_seconds"]
        self.syncs = int(state.get("syncs", 0))
        self.svd_counts = dict(state.get("svd_counts", {"full": 0, "updated": 0}))
        self.ratio = state["ratio"]
        self.dense.load_state_dict(state["dense"])
        self._frozen = dict(state.get("frozen", {}))
        self._bases = {name: tuple(b) for name, b in state.get("vectors", {}).items()}
        if state.get("bases"):  # a checkpoint that holds each layer's whole SVD, not only the vectors kept here
            a_role = self._trained_role() == "A"
            self._bases = {name: (u if a_role else vh, s) for name, (u, s, vh) in state["bases"].items()}
        if self._compressor is not None and state.get("sync_compressor") is not None:
            if "errors" not in state["sync_compressor"]:
                raise ValueError("checkpoint holds the low-rank sync's memories in an earlier layout; "
                                 "resume it with the abtrain that wrote it or start the run again")
            self._compressor.load_state_dict(state["sync_compressor"])
        # requires_grad is not part of a state_dict: derive it from the restored modes and this worker's role.
        for fp in self.records:
            lowrank.set_mode([fp], fp.mode)
        lowrank.set_trainable(self.records, self._trained_role())
        self._watch_gradients()


register(MethodSpec("ab", ABTraining, "AB-training", "low-rank factors trained by independent groups, periodic sync "
                    "and full-rank rebound (docs/ab-training.md); the schedule scales with the run unless given "
                    "in steps", options=ABConfig, order=20, bench=8,
                    short_run_args=("--ab-warmup-steps", "2", "--ab-cycle-steps", "3", "--ab-rebound-steps", "1",
                                    "--ab-lr-rebound-steps", "0"),
                    check_topology=check_topology, check_run=check_run, group_layout=group_layout))

