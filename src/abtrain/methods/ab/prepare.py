"""The model as AB-training prepares it: its factorisable layers, SyncBatchNorm, the output layer kept full rank.

:func:`factorise_layers` puts a :class:`~.lowrank.LowRankWeight` on every factorisable weight (the layers
trained full until the first decomposition); :func:`sync_batchnorm` swaps BatchNorm for
:class:`~.sync_batchnorm.SyncBatchNorm` (``--ab-sync-batchnorm``). ``keep_output``: the layer that produces the model's output
stays full rank; its name varies from model to model (``fc``, ``head``, ``lm_head``, ``classifier``...), so
:class:`OutputLayer` finds it from the autograd graph of the first training forward
(:func:`~.lowrank.report.output_weights`), whatever it is called, and keeps it out of every decomposition from
then on (:attr:`PhaseState.kept <.state.PhaseState.kept>`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...comm.communicator import Communicator
from ...comm.topology import Topology
from . import lowrank
from .config import ABConfig
from .state import PhaseState
from .sync_batchnorm import convert_sync_batchnorm

log = logging.getLogger(__name__)


def factorise_layers(model: nn.Module, cfg: ABConfig, state: PhaseState) -> None:
    """Every factorisable weight of ``model`` parametrized (in full mode, trainable) into ``state.records``; the
    weights left out, and why, in ``state.excluded``; the parameters of fewer than 2 dims counted in
    ``state.others``. ``init="ortho-sigma"`` sets each W's singular values to 1 (``init_scope="all"``: of every
    parameter of 2 or more dims)."""
    state.records = lowrank.prepare_model(model, full_rank_patterns=cfg.patterns, min_rank=cfg.min_rank,
                                          apply=cfg.linear_apply, orientation=cfg.orientation,
                                          excluded=state.excluded)
    factorisable = {id(p) for fp in state.records for p in (fp.weight, fp.A, fp.B)} | {
        id(p) for name, p in model.named_parameters() if any(name == e for e, _ in state.excluded)}
    state.others = sum(1 for p in model.parameters() if id(p) not in factorisable)
    if cfg.init == "ortho-sigma" and cfg.init_scope == "factorised":
        lowrank.ortho_sigma_init(state.records)
    elif cfg.init == "ortho-sigma":  # the factors are 0-size placeholders until the first decomposition
        for p in model.parameters():
            if p.ndim >= 2 and p.numel():
                lowrank.unit_spectrum(p)


def sync_batchnorm(model: nn.Module, comm: Communicator, topo: Topology, say: Callable[[str], None]) -> nn.Module:
    """sync_batchnorm: every BatchNorm layer takes its statistics over all workers (the authors' SyncBatchNorm)."""
    model, count = convert_sync_batchnorm(model, comm, topo.world)
    if count:
        say(f"AB-training: {count} BatchNorm layer{'s' if count > 1 else ''} normalise with the statistics "
            f"of all {topo.world_size} workers' batches at every training step (--ab-sync-batchnorm)")
    elif topo.rank == 0:
        log.warning("AB-training: --ab-sync-batchnorm found no BatchNorm layer in the model: it changes nothing")
    return model


class OutputLayer:
    """Looks for the output layer(s) at the first training forward and keeps them full rank in ``state``."""

    def __init__(self, state: PhaseState, say: Callable[[str], None]) -> None:
        self.state = state
        self.say = say
        self.searched = False  # the first training forward looked for the output layer
        self._hook: Any = None

    def watch(self, model: nn.Module) -> None:
        """Look at ``model``'s next training forward."""
        self._hook = model.register_forward_hook(self._found)

    def stop(self) -> None:
        """Look no more (found, or a checkpoint says it was looked for)."""
        self.searched = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _found(self, module: nn.Module, args: Any, output: Any) -> None:
        """At the first training forward: keep the layer(s) producing the output full rank from now on."""
        if not (module.training and torch.is_grad_enabled()):
            return
        self.stop()
        found = lowrank.output_weights(output, self.state.records)
        self.state.kept = [fp.name for fp in found]
        for fp in found:
            fp.param.note = "produces the model's output"
        if found:
            self.say(f"AB-training: keeping {', '.join(self.state.kept)} full rank: "
                     f"{'it produces' if len(found) == 1 else 'they produce'} the model's output "
                     f"(keep_output=False / --no-ab-keep-output factorises it)")

    @torch.no_grad()
    def keep_full(self) -> None:
        """Warm-up 0 found the output layer after decomposing it: W = A·B (exact at full rank), trained full."""
        kept = self.state.kept_records()
        if not any(fp.mode == "lowrank" for fp in kept):
            return
        for fp in kept:
            if fp.mode == "lowrank":
                lowrank.recompose(fp)
                fp.param.note = "produces the model's output"
        lowrank.set_trainable(self.state.records, self.state.role)
