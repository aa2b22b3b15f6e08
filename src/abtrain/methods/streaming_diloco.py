"""Streaming DiLoCo: DiLoCo whose outer step runs fragment by fragment, staggered, overlapped and in 4 bits.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch" (2025, arXiv 2501.18512). As :mod:`.diloco` (the user's
optimizer is the inner one, an outer Nesterov SGD owned here updates a global
copy of the parameters), with the paper's three changes:

- **Fragments.** The modules that hold parameters, in model order, are dealt
  out to ``P`` fragments in turn (module ``u`` to fragment ``u mod P``: the
  paper's strided pattern). Fragment ``p`` meets every ``H`` steps, at the steps
  ``t`` with ``t mod H = p * H // P``: each outer exchange carries about 1/P
  of the model, and over ``H`` steps the whole model travels once, as in DiLoCo.
- **Overlap.** The fragment's outer gradient ``global - local`` is sent at step
  ``t``; its outer step's result is merged ``tau`` inner steps later as
  ``local = alpha * local + (1 - alpha) * global``, keeping the local progress
  of those ``tau`` steps. The collective itself blocks here (gloo); the
  schedule is the paper's, the wall-clock overlap is not realised.
- **4-bit outer gradients (E3M0).** Each code is a sign bit and a 3-bit exponent
  ``e``: the value ``0`` for ``e = 0``, else ``s * 2**(e - 7)`` with ``s`` the
  largest magnitude of its block of ``block`` elements (float32, sent along);
  magnitudes are rounded in log2. Summation is float32, as in the paper, in a
  ring all-reduce's two halves: an **all_to_all** sends slice ``j`` of the
  padded outer gradient (``L`` elements, whole blocks) to worker ``j``, which
  decodes the ``p`` versions, averages them in float32 and encodes the mean
  again; an **all_gather** hands every worker every mean slice. Every worker
  decodes the same bytes, so every global copy stays the same. Per exchange
  and worker, ``m = L/2 + 4L/block`` bytes: all_to_all payload ``p*m``, wire
  ``(p-1)*m``; all_gather payload ``m``, wire ``(p-1)*m``. ``quantize = "fp32"``
  sends DiLoCo's float32 all-reduce instead.

With ``P = 1``, ``tau = 0`` and ``fp32`` this is :class:`.diloco.DiLoCo`, bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.e3m0 import e3m0_decode, e3m0_encode
from ..compress.wire import as_floats
from ..validate import Options, opt
from .base import Method
from .registry import MethodSpec, register


@dataclass
class StreamingDiLoCoConfig(Options):
    """Options of Streaming DiLoCo; the CLI exposes each as ``--streaming-diloco-<name>``."""

    section = "streaming_diloco"
    h: int = opt(20, "inner steps between two outer steps of one fragment (H)")
    fragments: int = opt(4, "fragments P: the modules holding parameters, dealt out in turn; fragment p meets at the steps t with t mod H = p*H//P")
    overlap: int = opt(1, "inner steps tau between sending a fragment's outer gradient and merging the outer step's result (0: at once)")
    alpha: float = opt(0.5, "merge of an overlapped fragment: local = alpha * local + (1 - alpha) * global")
    outer_lr: float = opt(0.7, "learning rate of the outer SGD on the averaged outer gradient")
    outer_momentum: float = opt(0.9, "Nesterov momentum of the outer SGD (0: plain SGD)")
    quantize: str = opt("e3m0", "outer gradients on the wire: e3m0 (4 bits, one float32 scale per block) or fp32 (DiLoCo's all-reduce)", choices=("e3m0", "fp32"))
    block: int = opt(256, "elements sharing one scale under e3m0 (even)", high=1 << 16)  # each tensor pads to p blocks

    def check(self) -> None:
        self.require("h", self.h >= 1, "a positive integer")
        self.require("fragments", 1 <= self.fragments <= self.h,
                     f"in [1, H = {self.h}] (one fragment per step at most)")
        self.require("overlap", 0 <= self.overlap < self.h,
                     f"in [0, H) = [0, {self.h}) (merged before the fragment's next exchange)")
        self.require("alpha", 0 <= self.alpha < 1, "in [0, 1)")
        self.require("outer_lr", self.outer_lr > 0, "> 0")
        self.require("outer_momentum", 0 <= self.outer_momentum < 1, "in [0, 1)")
        self.require("block", self.block >= 2 and self.block % 2 == 0, "an even integer >= 2")


def parameter_units(model: nn.Module) -> list[list[int]]:
    """Indices (in ``model.parameters()`` order) of the parameters each module holds itself, modules in model order."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    seen: set[int] = set()
    units = []
    for module in model.modules():
        own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in module.parameters(recurse=False))
        if own:
            units.append(own)
    return units


def fragments_of(model: nn.Module, count: int) -> list[list[int]]:
    """The parameter indices of each fragment: module ``u`` goes to fragment ``u mod count`` (strided)."""
    units = parameter_units(model)
    if len(units) < count:
        raise ValueError(f"--streaming-diloco-fragments {count}: the model has {len(units)} modules with parameters; "
                         f"choose at most {len(units)}")
    return [sorted(i for u in units[f::count] for i in u) for f in range(count)]


class StreamingDiLoCo(Method):
    """DiLoCo with staggered fragments, overlapped merges and 4-bit outer gradients (phases ``inner`` / ``outer``)."""

    name = "streaming-diloco"

    def __init__(self, comm: Communicator, topo: Topology, config: StreamingDiLoCoConfig | None = None,
                 **options: Any) -> None:
        super().__init__(comm, topo)
        self.cfg = config if config is not None else StreamingDiLoCoConfig(**options)
        h, count = self.cfg.h, self.cfg.fragments
        self.offsets = [f * h // count for f in range(count)]
        self.t = 0  # optimizer steps taken
        self.exchanges = [0] * count  # outer steps of each fragment
        self.last_sent = [0] * count  # step of each fragment's last exchange (0: prepare's broadcast)
        self.pending: list[int | None] = [None] * count  # step at which an exchanged fragment is merged
        self.fragments: list[list[int]] = []
        self.global_params: list[torch.Tensor] = []
        self.outer: list[torch.optim.Optimizer] = []

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        self.fragments = fragments_of(model, self.cfg.fragments)
        # The outer optimizers' parameters: the global model, identical on every worker after the broadcast.
        self.global_params = [p.detach().clone() for p in model.parameters()]
        m = self.cfg.outer_momentum
        self.outer = [torch.optim.SGD([self.global_params[i] for i in ids], lr=self.cfg.outer_lr, momentum=m,
                                      nesterov=m > 0) for ids in self.fragments]
        return model

    def _due(self, step: int) -> list[int]:
        return [f for f, o in enumerate(self.offsets) if step >= 1 and step % self.cfg.h == o]

    @property
    def phase(self) -> str:
        return "outer" if self._due(self.t + 1) else "inner"

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.t += 1
        for f, due in enumerate(self.pending):
            if due == self.t:
                self._merge(f)
        due = self._due(self.t)
        if due:
            self._exchange(due, merge_at=self.t + self.cfg.overlap)

    # -- the outer step ---------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        assert self.module is not None, "prepare() first"
        return list(self.module.parameters())

    @torch.no_grad()
    def _exchange(self, frags: list[int], merge_at: int) -> None:
        """One exchange of the outer gradients of ``frags``, their outer steps, their merge now or at ``merge_at``."""
        params = self._params()
        ids = [i for f in frags for i in self.fragments[f]]
        pseudo = torch.cat([(self.global_params[i] - params[i].detach()).reshape(-1).float() for i in ids])
        with torch.profiler.record_function("abtrain::streaming-diloco::outer"), self.comm.ledger.in_phase("outer"):
            average = self.average(pseudo)
        for i, chunk in zip(ids, average.split([self.global_params[i].numel() for i in ids])):
            self.global_params[i].grad = chunk.view_as(self.global_params[i]).to(self.global_params[i].dtype)
        for f in frags:
            self.outer[f].step()
            self.outer[f].zero_grad(set_to_none=True)
            self.exchanges[f] += 1
            self.last_sent[f] = self.t
            self.pending[f] = merge_at
            if merge_at == self.t:
                self._merge(f, alpha=0.0)

    @torch.no_grad()
    def _merge(self, f: int, alpha: float | None = None) -> None:
        """``local = alpha * local + (1 - alpha) * global`` for fragment ``f`` (alpha 0: take the global one)."""
        a = self.cfg.alpha if alpha is None else alpha
        params = self._params()
        for i in self.fragments[f]:
            if a == 0.0:
                params[i].copy_(self.global_params[i])
            else:
                params[i].mul_(a).add_(self.global_params[i], alpha=1.0 - a)
        self.pending[f] = None

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` over all workers as the wire carries it: the same tensor on every worker."""
        world = self.topo.world
        if self.cfg.quantize == "fp32":
            return self.comm.all_reduce(flat, world, average=True)
        p, block, n = world.size, self.cfg.block, flat.numel()
        length = -(-n // (p * block)) * block  # L: whole blocks per slice
        padded = torch.zeros(p * length, dtype=torch.float32, device=flat.device)
        padded[:n] = flat
        codes, scales = e3m0_encode(padded, block)
        if p == 1:  # one process: the same rounding, nothing sent
            return e3m0_decode(codes, scales, block)[:n]
        per = length // block
        send = torch.cat([codes.view(p, length // 2), scales.view(p, per).view(torch.uint8)], dim=1)
        received = self.comm.all_to_all(send.reshape(-1), world).view(p, -1)
        total = torch.zeros(length, dtype=torch.float32, device=flat.device)
        for row in received:  # rank order: every worker adds its slice the same way
            total += e3m0_decode(row[:length // 2], as_floats(row[length // 2:]), block)
        codes, scales = e3m0_encode(total.div_(p), block)
        gathered = self.comm.all_gather(torch.cat([codes, scales.view(torch.uint8)]), world)
        return torch.cat([e3m0_decode(g[:length // 2], as_floats(g[length // 2:]), block) for g in gathered])[:n]

    # -- agreement ---------------------------------------------------------------------------------
    def in_consensus(self) -> bool:
        return all(s == self.t for s in self.last_sent) and all(d is None for d in self.pending)

    def ready_for_evaluation(self) -> bool:
        return True  # the trainer evaluates the global model (see evaluation()), the same on every worker

    def agree(self) -> None:
        """Merge what is pending now, then one exchange of every fragment not in agreement; all take the global model."""
        for f, due in enumerate(self.pending):
            if due is not None and self.last_sent[f] != self.t:
                self._merge(f)
        dirty = [f for f in range(len(self.fragments)) if self.last_sent[f] != self.t]
        if dirty:
            self._exchange(dirty, merge_at=self.t)
        for f, due in enumerate(self.pending):
            if due is not None:  # exchanged at this very step: its global is the newest
                self._merge(f, alpha=0.0)

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.in_consensus():
            self.agree()

    def evaluation(self) -> "_GlobalModel":
        return _GlobalModel(self)

    # -- results and checkpoints ---------------------------------------------------------------------
    @property
    def fragment_numels(self) -> list[int]:
        return [sum(self.global_params[i].numel() for i in ids) for ids in self.fragments]

    def extra_results(self) -> dict[str, Any]:
        return {"streaming_diloco": {**asdict(self.cfg), "offsets": self.offsets,
                                     "fragment_numels": self.fragment_numels, "outer_steps": self.exchanges}}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "exchanges": list(self.exchanges), "last_sent": list(self.last_sent),
                "pending": [-1 if d is None else d for d in self.pending],
                "global_params": [g.clone() for g in self.global_params],
                "outer": [o.state_dict() for o in self.outer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["outer"]) != len(self.outer):
            raise ValueError(f"checkpoint's Streaming DiLoCo state has {len(state['outer'])} fragments, this run "
                             f"{len(self.outer)}")
        self.t = state["t"]
        self.exchanges = list(state["exchanges"])
        self.last_sent = list(state["last_sent"])
        self.pending = [None if d < 0 else d for d in state["pending"]]
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global_params"]):
                g.copy_(saved)
        for o, saved in zip(self.outer, state["outer"]):
            o.load_state_dict(saved)


class _GlobalModel:
    """Inside the block the module holds the global parameters (every worker's are the same); the local ones after."""

    def __init__(self, method: StreamingDiLoCo) -> None:
        self.method = method
        self.stash: list[torch.Tensor] = []

    @torch.no_grad()
    def __enter__(self) -> StreamingDiLoCo:
        params = self.method._params()
        self.stash = [p.detach().clone() for p in params]
        for p, g in zip(params, self.method.global_params):
            p.copy_(g)
        return self.method

    @torch.no_grad()
    def __exit__(self, *exc: object) -> None:
        for p, saved in zip(self.method._params(), self.stash):
            p.copy_(saved)
        self.stash = []


def _check_run(options: StreamingDiLoCoConfig, model: nn.Module, total_steps: int) -> None:
    fragments_of(model, options.fragments)


register(MethodSpec("streaming-diloco", StreamingDiLoCo, "Streaming DiLoCo",
                    "DiLoCo whose outer step runs fragment by fragment at staggered steps, overlapped with the next "
                    "inner steps, its outer gradients sent in 4 bits", options=StreamingDiLoCoConfig, order=65,
                    bench=4, check_run=_check_run,
                    short_run_args=("--streaming-diloco-h", "2", "--streaming-diloco-fragments", "2")))
