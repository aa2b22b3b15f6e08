"""Streaming DiLoCo: DiLoCo whose outer step runs fragment by fragment, staggered, overlapped and in 4 bits.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch" (2025, arXiv 2501.18512). As :mod:`.diloco` (the user's
optimizer is the inner one; an outer Nesterov SGD, :class:`.diloco.OuterStep`,
one per fragment, updates a global copy of the parameters; the schedule is
:class:`.periodic.PeriodicMethod`'s), with the paper's three changes:

- **Fragments.** The paper's strided pattern (``pattern="strided"``): the
  model's layers, in model order, are cut into ``K * P`` contiguous groups of
  about equal size and group ``g`` goes to fragment ``g mod P``, so that each
  fragment holds ``K`` groups spread over the depth (the paper's groups are
  transformer blocks; :func:`layer_groups`). ``pattern="modules"`` deals the
  modules that hold parameters out in turn instead (module ``u`` to fragment
  ``u mod P``). Fragment ``p`` meets every ``H`` steps, at the steps ``t`` with
  ``t mod H = p * H // P``: each outer exchange carries one fragment, and over
  ``H`` steps the whole model travels once, as in DiLoCo.
- **Overlap.** The fragment's outer gradient ``global - local`` is sent at step
  ``t``; its outer step's result is merged ``tau`` inner steps later as
  ``local = alpha * local + (1 - alpha) * global``, keeping the local progress
  of those ``tau`` steps. The collective itself blocks here (gloo); the
  schedule is the paper's, the wall-clock overlap is not realised.
- **4-bit outer gradients (E3M0).** Each code is a sign bit and a 3-bit exponent
  ``e``: the value ``0`` for ``e = 0``, else ``s * 2**(e - 7)`` with ``s`` the
  largest magnitude of its block of ``block`` elements (float32, sent along:
  :class:`~abtrain.compress.codec.E3M0Codec`); magnitudes are rounded in log2.
  Summation is float32, as in the paper, in a ring all-reduce's two halves
  (:func:`~abtrain.compress.allreduce.compressed_all_reduce`, no error
  feedback): an **all_to_all** sends slice ``j`` of the padded outer gradient
  (``L`` elements, whole blocks) to worker ``j``, which decodes the ``p``
  versions, averages them in float32 and encodes the mean again; an
  **all_gather** hands every worker every mean slice. Every worker decodes the
  same bytes, so every global copy stays the same. Per exchange and worker,
  ``m = L/2 + 4L/block`` bytes: all_to_all payload ``p*m``, wire ``(p-1)*m``;
  all_gather payload ``m``, wire ``(p-1)*m``. ``quantize = "fp32"`` sends
  DiLoCo's float32 all-reduce instead.

With ``P = 1``, ``tau = 0`` and ``fp32`` this is :class:`.diloco.DiLoCo`, bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.allreduce import compressed_all_reduce
from ..compress.codec import build_codec
from ..validate import Options, opt
from .diloco import OuterStep
from .fragments import fragments_of
from .periodic import PeriodicMethod
from .registry import MethodSpec, register
from .resume import Writer


PATTERNS = ("strided", "modules")


@dataclass
class StreamingDiLoCoConfig(Options):
    """Options of Streaming DiLoCo; the CLI exposes each as ``--streaming-diloco-<name>``."""

    section = "streaming_diloco"
    sync_every: int = opt(20, "inner steps between two outer steps of one fragment (H)")
    fragments: int = opt(4, "fragments P; fragment p meets at the steps t with t mod H = p*H//P")
    pattern: str = opt("strided", "how the model is cut into fragments: strided (the paper's: the layers cut into K*P contiguous groups of about equal size, group g in fragment g mod P) or modules (the modules holding parameters dealt out in turn)", choices=PATTERNS)
    fragment_groups: int = opt(2, "K, contiguous groups per fragment under --streaming-diloco-pattern strided (fewer where the model has fewer than K*P layers); 1 is the paper's sequential pattern")
    overlap: int = opt(1, "inner steps tau between sending a fragment's outer gradient and merging the outer step's result (0: at once)")
    alpha: float = opt(0.5, "merge of an overlapped fragment: local = alpha * local + (1 - alpha) * global")
    outer_lr: float = opt(0.7, "learning rate of the outer SGD on the averaged outer gradient")
    outer_momentum: float = opt(0.9, "Nesterov momentum of the outer SGD (0: plain SGD)")
    quantize: str = opt("e3m0", "outer gradients on the wire: e3m0 (4 bits, one float32 scale per block) or fp32 (DiLoCo's all-reduce)", choices=("e3m0", "fp32"))
    scale_block: int = opt(256, "elements sharing one scale under e3m0 (even)", high=1 << 16)  # each tensor pads to p blocks

    def check(self) -> None:
        self.require("sync_every", self.sync_every >= 1, "a positive integer")
        self.require("fragments", 1 <= self.fragments <= self.sync_every,
                     f"in [1, H = {self.sync_every}] (one fragment per step at most)")
        self.require("overlap", 0 <= self.overlap < self.sync_every,
                     f"in [0, H) = [0, {self.sync_every}) (merged before the fragment's next exchange)")
        self.require("alpha", 0 <= self.alpha < 1, "in [0, 1)")
        self.require("outer_lr", self.outer_lr > 0, "> 0")
        self.require("outer_momentum", 0 <= self.outer_momentum < 1, "in [0, 1)")
        self.require("scale_block", self.scale_block >= 2 and self.scale_block % 2 == 0, "an even integer >= 2")
        self.require("fragment_groups", self.fragment_groups >= 1, "a positive integer")


class StreamingDiLoCo(PeriodicMethod):
    """DiLoCo with staggered fragments, overlapped merges and 4-bit outer gradients (phases ``inner`` / ``outer``)."""

    name = "streaming-diloco"
    local_phase, sync_phase = "inner", "outer"
    syncs_buffers = False  # an exchange carries parameters only: consensus averages the buffers
    optimizer_apart = "inner optimizer state"

    def __init__(self, comm: Communicator, topo: Topology, config: StreamingDiLoCoConfig | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else StreamingDiLoCoConfig(**options)
        super().__init__(comm, topo, self.cfg.sync_every, self.cfg.fragments)
        self.codec = build_codec(self.cfg.quantize, self.cfg.scale_block)
        self.fragment_syncs = [0] * self.cfg.fragments  # outer steps of each fragment
        self.pending: list[int | None] = [None] * self.cfg.fragments  # step at which an exchanged fragment is merged
        self.fragments: list[list[int]] = []
        self.outer: list[OuterStep] = []

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        self.fragments = fragments_of(model, self.cfg.fragments, self.cfg.pattern, self.cfg.fragment_groups)
        # The outer optimizers' parameters: the global model, identical on every worker after the broadcast.
        params = list(model.parameters())
        self.outer = [OuterStep([params[i] for i in ids], self.cfg.outer_lr, self.cfg.outer_momentum)
                      for ids in self.fragments]
        return model

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The global copy of every parameter, in ``model.parameters()`` order."""
        by_index = {i: g for ids, outer in zip(self.fragments, self.outer) for i, g in zip(ids, outer.params)}
        return [by_index[i] for i in sorted(by_index)]

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Merges due at this step come first: a fragment exchanged again now sends what the merge made.
        for f, due in enumerate(self.pending):
            if due == self.t + 1:
                self._merge(f)
        super().after_step(optimizer)

    def _params(self, f: int) -> list[torch.Tensor]:
        assert self.module is not None, "prepare() first"
        params = list(self.module.parameters())
        return [params[i] for i in self.fragments[f]]

    @torch.no_grad()
    def synchronize_fragments(self, fragments: list[int]) -> None:
        """One exchange of the outer gradients of ``fragments`` and their outer steps; each is merged ``overlap``
        steps later (now when 0)."""
        local = [p for f in fragments for p in self._params(f)]
        pseudo = [d for f in fragments for d in self.outer[f].pseudo_gradients(self._params(f))]
        flat = torch.cat([d.reshape(-1).float() for d in pseudo])
        with torch.profiler.record_function("abtrain::streaming-diloco::outer"), self.comm.ledger.in_phase("outer"):
            average = self.average(flat)
        chunks = iter(average.split([p.numel() for p in local]))
        for f in fragments:
            self.outer[f].step([next(chunks) for _ in self.fragments[f]])
            self.fragment_syncs[f] += 1
            self.pending[f] = self.t + self.cfg.overlap
            if self.cfg.overlap == 0:
                self._merge(f, alpha=0.0)

    def _merge(self, f: int, alpha: float | None = None) -> None:
        """``local = alpha * local + (1 - alpha) * global`` for fragment ``f`` (alpha 0: take the global one)."""
        self.outer[f].merge(self._params(f), self.cfg.alpha if alpha is None else alpha)
        self.pending[f] = None

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` over all workers as the wire carries it: the same tensor on every worker."""
        return compressed_all_reduce(self.comm, self.topo.world, flat, self.codec)

    # -- agreement ---------------------------------------------------------------------------------
    def in_consensus(self) -> bool:
        return super().in_consensus() and all(d is None for d in self.pending)

    def ready_for_evaluation(self) -> bool:
        return True  # the trainer evaluates the global model (see evaluation()), the same on every worker

    def agree(self) -> None:
        """Merge what is pending now, then one exchange of every fragment not in agreement; all take the global model."""
        for f, due in enumerate(self.pending):
            if due is not None and self.last_sync[f] != self.t:
                self._merge(f)
        if not super().in_consensus():
            super().agree()
        for f, due in enumerate(self.pending):
            if due is not None:  # exchanged at this very step: its global is the newest
                self._merge(f, alpha=0.0)

    def evaluation(self) -> "_GlobalModel":
        return _GlobalModel(self)

    # -- results and checkpoints ---------------------------------------------------------------------
    @property
    def fragment_numels(self) -> list[int]:
        return [sum(g.numel() for g in outer.params) for outer in self.outer]

    def extra_results(self) -> dict[str, Any]:
        return {"streaming_diloco": {**asdict(self.cfg), "offsets": self.offsets,
                                     "fragment_numels": self.fragment_numels, "fragment_syncs": self.fragment_syncs}}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fragment_syncs": list(self.fragment_syncs),
                "fragments": [list(f) for f in self.fragments], "pending": [-1 if d is None else d for d in self.pending],
                "global_params": [g.clone() for g in self.global_params],
                "outer": [o.optimizer.state_dict() for o in self.outer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["outer"]) != len(self.outer):
            raise ValueError(f"checkpoint's Streaming DiLoCo state has {len(state['outer'])} fragments, this run "
                             f"{len(self.outer)}")
        if state["fragments"] != self.fragments:  # each fragment's outer momentum is laid out by its parameters
            raise ValueError("checkpoint's Streaming DiLoCo fragments hold other parameters than this run's: "
                             "continue with the --streaming-diloco-pattern and -fragment-groups it was written with")
        super().load_state_dict(state)
        self.fragment_syncs = list(state["fragment_syncs"])
        self.pending = [None if d < 0 else d for d in state["pending"]]
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global_params"]):
                g.copy_(saved)
        for o, saved in zip(self.outer, state["outer"]):
            o.optimizer.load_state_dict(saved)

    def adopt_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> None:
        """Another worker's state: the global model and the outer optimizers', each fragment's inner steps since
        its last outer step given up (the local model starts again from the global one; a pending merge of a
        fragment then keeps it)."""
        self.load_state_dict(state)
        for f in range(len(self.outer)):
            self.outer[f].merge(self._params(f))

    def apart_since(self, steps: int, since: int, writer: Writer) -> str:
        return (f"every other worker's inner steps since each fragment's last outer step ({steps} at most; they go "
                f"on from the global model)")


class _GlobalModel:
    """Inside the block the module holds the global parameters (every worker's are the same); the local ones after."""

    def __init__(self, method: StreamingDiLoCo) -> None:
        self.method = method
        self.stash: list[torch.Tensor] = []

    @torch.no_grad()
    def __enter__(self) -> StreamingDiLoCo:
        assert self.method.module is not None, "prepare() first"
        params = list(self.method.module.parameters())
        self.stash = [p.detach().clone() for p in params]
        for p, g in zip(params, self.method.global_params):
            p.copy_(g)
        return self.method

    @torch.no_grad()
    def __exit__(self, *exc: object) -> None:
        assert self.method.module is not None
        for p, saved in zip(self.method.module.parameters(), self.stash):
            p.copy_(saved)
        self.stash = []


def _check_run(options: StreamingDiLoCoConfig, model: nn.Module, total_steps: int) -> None:
    fragments_of(model, options.fragments, options.pattern, options.fragment_groups)


register(MethodSpec("streaming-diloco", StreamingDiLoCo, "Streaming DiLoCo",
                    "DiLoCo whose outer step runs fragment by fragment at staggered steps, overlapped with the next "
                    "inner steps, its outer gradients sent in 4 bits", options=StreamingDiLoCoConfig, order=65,
                    bench=4, check_run=_check_run,
                    short_run_args=("--streaming-diloco-sync-every", "2", "--streaming-diloco-fragments", "2")))
