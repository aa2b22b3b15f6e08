"""PyTorch Lightning: ``Trainer(strategy=AbtrainStrategy("ab"))`` trains with an abtrain method instead of DDP.

The user's page is ``docs/lightning.md``. What the strategy does, in the order Lightning runs it:

* ``setup`` (fit): :func:`abtrain.setup` joins the process group Lightning initialised and
  ``method.prepare`` rewrites the LightningModule in place (AB-training's factorisable layers) or
  wraps it (the DDP-based methods: ``ddp``, ``ddp-bf16``, ``powersgd``); only then does Lightning call
  ``configure_optimizers``, so the optimizer holds the prepared module's parameters, AB-training's
  factors among them. ``total_steps`` is ``trainer.estimated_stepping_batches`` unless given.
* ``on_train_start``, after a checkpoint was restored: ``method.attach(optimizer)``.
* each optimizer step: the closure (forward, backward) runs first, then ``method.reduce_gradients()``,
  then Lightning's ``on_before_optimizer_step`` hooks, gradient clipping and the update, so clipping
  sees the averaged gradient. torch runs an optimizer's step pre-hooks before the closure handed
  to ``step``: the method's own pre-hook would average the gradients before they exist.
* the micro-batches of gradient accumulation that do not step: inside ``method.no_sync()`` (DDP's own
  ``no_sync`` for the DDP-based methods).
* validation during fit: ``method.consensus()`` first, so every worker evaluates one model.
* ``on_train_end``: ``method.detach()`` (the last sync or average) and ``consensus()``; rank 0 says
  the bytes sent by phase. ``teardown``: ``method.close()``.
* checkpoints: Lightning's own, written by rank 0; the method's state travels in the optimizer's. Lightning
  asks every worker for the optimizer's state (``optimizer_state``) when it checkpoints, and the strategy
  first calls ``method.gather_state()`` there (``gather_checkpoints=True``, the default), so rank 0's file holds
  every worker's own part and each worker resumes its own, exactly. Without it the file holds rank 0's
  (``optimizer_states[0]["abtrain"]``) and a worker that did not write it resumes from what the workers share
  (:meth:`abtrain.Method.restore`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import nn

try:
    import pytorch_lightning as pl
except ImportError as exc:  # the optional extra
    raise ImportError("abtrain's Lightning strategy needs PyTorch Lightning: pip install 'abtrain[lightning]'") from exc

from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn

from ..api import setup as setup_method
from ..methods import Method, registry
from ..methods import resume
from ..methods.resume import STATE_KEY
from ..methods.summary import ddp_equivalent, human_bytes

__all__ = ["AbtrainStrategy"]

UNSUPPORTED = {
    "streaming-diloco": "its workers never all hold one model between two outer steps, and validation and "
                        "checkpoints under Lightning assume they do after consensus()",
}


class AbtrainStrategy(DDPStrategy):
    """Lightning's DDP strategy with an abtrain method in place of the DDP wrapper.

    ``AbtrainStrategy("ab", warmup_steps=20)``: ``method`` and ``options`` are those of
    :func:`abtrain.setup` (for ``ab`` the fields of :class:`abtrain.ABConfig`); ``total_steps``
    defaults to the trainer's ``estimated_stepping_batches``. ``gather_checkpoints``: Lightning's checkpoint
    (written by rank 0) holds every worker's own part of the method's state (``method.gather_state()`` when
    Lightning asks each worker for its optimizer's state), so that every worker resumes exactly; False keeps
    rank 0's state alone (a smaller file, no bytes sent at checkpoints; a worker that did not write it resumes
    from what the workers share). The keyword arguments Lightning's
    :class:`~pytorch_lightning.strategies.DDPStrategy` takes for its launcher and process group
    (``start_method``, ``process_group_backend``, ``timeout``, ...) are accepted too.
    After ``trainer.fit``, :attr:`method` holds the method: ``method.comm.ledger`` (every byte
    sent), ``method.export()`` (the plain weights).
    """

    def __init__(
        self,
        method: str = "ab",
        *,
        total_steps: int | None = None,
        group_size: int | None = None,
        quiet: bool = False,
        gather_checkpoints: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Any,
    ) -> None:
        registry.get(method)  # a ValueError naming the choices, before any worker starts
        if method in UNSUPPORTED:
            raise ValueError(f"AbtrainStrategy does not run {method!r}: {UNSUPPORTED[method]}")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.method_name = method
        self.total_steps = total_steps
        self.group_size = group_size
        self.quiet = quiet
        self.gather_checkpoints = gather_checkpoints
        self.options = options
        #: the abtrain method, built when ``trainer.fit`` sets the strategy up
        self.method: Method | None = None
        #: trainable parameters of the user's module (DDP's payload per step, for :meth:`bytes_line`)
        self.param_count = 0
        self._closed = False
        self._accumulating = False  # a micro-batch's gradient waits for the next ones

    # -- setup -------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """A checkpoint holds the prepared module's tensors (AB's factors): restore it after :meth:`setup`."""
        return True

    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)  # evaluation: DDP's, which starts every worker from rank 0's weights
            return
        if self.method is not None:
            raise ValueError("this AbtrainStrategy has trained a model already: give each trainer.fit a new one")
        if self._layer_sync is not None:
            raise ValueError("sync_batchnorm=True sends BatchNorm statistics at every forward, past abtrain's "
                             "ledger: leave it off (consensus() averages the statistics before each validation)")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("precision='16-mixed' skips the optimizer step on workers whose gradients overflow, "
                             "and the method's schedule would then differ between workers: use 'bf16-mixed' or 32")
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._prepare(trainer)
        self.setup_optimizers(trainer)  # configure_optimizers sees the prepared module's parameters
        if len(self.optimizers) != 1:
            raise ValueError(f"configure_optimizers returned {len(self.optimizers)} optimizers; an abtrain method "
                             "hooks exactly one")
        if isinstance(self.optimizers[0], torch.optim.LBFGS):
            raise ValueError("LBFGS evaluates its closure several times per step; an abtrain method averages the "
                             "gradients of one backward per step: choose another optimizer")
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)

    def _prepare(self, trainer: pl.Trainer) -> nn.Module:
        """Build the method in the world Lightning initialised and prepare the LightningModule; the module to call."""
        module = self.lightning_module
        assert module is not None
        self.param_count = sum(p.numel() for p in module.parameters() if p.requires_grad)
        total = self.total_steps
        if total is None:
            estimated = trainer.estimated_stepping_batches  # inf (or -1) for an endless run
            total = int(estimated) if 0 < estimated < math.inf else None
        # abtrain finds the workers of one node in LOCAL_WORLD_SIZE: torchrun sets it, Lightning's launcher does not.
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(self.num_processes))
        self.method = setup_method(self.method_name, total_steps=total, group_size=self.group_size,
                                   device=self.root_device.type, quiet=self.quiet, **self.options)
        # a worker that adopted rank 0's state: rank 0's line names the checkpoint that resumes each exactly here
        self.method.exact_resume = ("Lightning's checkpoint with AbtrainStrategy(gather_checkpoints=True), the "
                                    "default")
        return self.method.prepare(module)

    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.method is not None
        self.method.attach(self.optimizers[0])  # after a checkpoint was restored, as abtrain's own trainer does

    # -- the step ------------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | nn.Module | None = None, **kwargs: Any) -> Any:
        if self.method is None or not self.method.attached:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # The closure first (forward, backward), then the average: Lightning clips and torch steps after it.
        # Optimizers that call their closure several times (LBFGS) are not supported.
        result = closure()
        self._accumulating = False
        self.method.reduce_gradients()
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The micro-batches of gradient accumulation that do not step send nothing."""
        self._accumulating = True
        with self.method.no_sync() if self.method is not None else super().block_backward_sync():
            yield

    def on_validation_start(self) -> None:
        super().on_validation_start()
        # Only while training: the sanity check runs before attach (on a fresh start the workers agree; on a
        # resume an extra consensus would change the run), and after fit the workers hold one model.
        if self.method is not None and self.method.attached:
            if self._accumulating:  # AB's consensus factorises again and would drop the gradient accumulated so far
                raise ValueError("validation fell between two micro-batches of one optimizer step: make "
                                 "val_check_interval a multiple of accumulate_grad_batches")
            self.method.consensus()

    def on_train_end(self) -> None:
        super().on_train_end()
        assert self.method is not None and self.lightning_module is not None
        self.method.detach()
        self.method.consensus()  # the buffers too (BatchNorm statistics stay per worker under DDP-like steps)
        self.method.say(self.bytes_line(self.lightning_module.trainer.global_step))

    def bytes_line(self, steps: int) -> str:
        """One line: what this worker sent, by phase, next to what DDP sends for ``steps`` steps of the same model."""
        assert self.method is not None
        summary = self.method.comm.ledger.summary()
        phases = ", ".join(f"{phase} {human_bytes(row['wire_bytes'])}" for phase, row in summary["by_phase"].items())
        topo = self.method.topo
        ddp = ddp_equivalent(self.param_count, topo.world_size, topo.group_size or topo.world_size, steps)
        return (f"{self.method.name} sent {human_bytes(summary['wire_bytes'])} from rank {topo.rank} in {steps} "
                f"optimizer steps ({phases}); DDP would send {human_bytes(ddp['wire_bytes'])}")

    def teardown(self) -> None:
        if self.method is not None and not self._closed:
            self.method.close()
            self._closed = True
        super().teardown()

    # -- checkpoints ---------------------------------------------------------------------------------
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Lightning asks every worker for it when it checkpoints (rank 0 writes the file): every worker's own part
        of the method's state goes to rank 0 first, whose optimizer state then carries them all."""
        if self.gather_checkpoints and self.method is not None and self.method.attached:
            self.method.gather_state()
        return super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str],
                        weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = self._method_state(checkpoint)
        name = self.method.name if self.method is not None else self.method_name
        if saved is not None and saved.get("method") != name:
            raise ValueError(f"{checkpoint_path} was written by {saved.get('method')!r}, this run trains {name!r}: "
                             f"resume it with the method that wrote it")
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The optimizer's state, then the method's that travels in it (the method attaches later, when training
        starts): rank 0's file resumes every worker (:meth:`abtrain.Method.restore`)."""
        saved = self._method_state(checkpoint)
        states = list(checkpoint.get("optimizer_states") or [])
        if self.method is not None and not self._closed and states and resume.in_dcp_form(states[0]):
            # every worker's own part (gather_state()): this worker's, with what the workers share
            states[0], saved = resume.from_dcp(self.method, states[0])
            checkpoint = {**checkpoint, "optimizer_states": states}
        super().load_optimizer_state_dict(checkpoint)
        if self.method is not None and not self._closed and saved is not None:
            self.method.restore(saved, self.optimizers[0])

    @staticmethod
    def _method_state(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
        """The method's state in the checkpoint's first optimizer state (saved while the method was attached);
        of a file that holds every worker's part, what they share (the method's name, the schedule)."""
        states = checkpoint.get("optimizer_states") or [{}]
        if not isinstance(states[0], Mapping):
            return None
        if resume.in_dcp_form(states[0]):
            return resume.shared_section(states[0])
        saved = states[0].get(STATE_KEY)
        return saved if isinstance(saved, dict) else None
