"""EF21: error feedback with a top-k compressor of the change of each worker's gradient estimate.

Richtárik, Sokolov, Fatkhullin, "EF21: A New, Simpler, Theoretically Better,
and Practically Faster Error Feedback" (NeurIPS 2021), Algorithm 1. Worker
``i`` keeps an estimate ``g_i`` of its own gradient; every worker keeps the
same global estimate ``g = mean_i g_i``, which is what the optimizer sees. At
each step, with ``grad_i`` the worker's fresh gradient::

    c_i = TopK(grad_i - g_i)      k = ceil(fraction * numel) largest |.| of each tensor
    g_i = g_i + c_i
    g   = g + mean_i c_i          (every worker adds the same gathered messages in the same order)

The messages travel in one all-gather per step over all workers: each worker
contributes ``K = sum of the tensors' k`` float32 values and ``K`` int32 flat
indices, packed in one int32 buffer of ``2K`` elements (the values' bits as
they are; :class:`~abtrain.compress.topk.TopKCodec`). Counted: payload
``8K`` bytes, wire ``(p - 1) * 8K`` bytes per worker. The first
``warmup_steps`` steps (1 by default: EF21's ``g_i^0 = grad_i(x^0)``)
all-reduce the full gradients and set ``g_i = grad_i``, ``g = mean_i grad_i``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.topology import Topology
from ..compress.topk import TopKCodec
from ..validate import Options, opt
from .gradient import GradientMethod
from .registry import MethodSpec, register
from .resume import Writer


@dataclass
class EF21Config(Options):
    """Options of EF21; the CLI exposes each as ``--ef21-<name>``."""

    section = "ef21"
    fraction: float = opt(0.01, "k of the top-k compressor as a fraction of each tensor's elements, in (0, 1]: k = ceil(fraction * numel)")
    warmup_steps: int = opt(1, "full-precision all-reduce steps before compression (they set g_i = grad_i; 0 starts from g_i = 0)")

    def check(self) -> None:
        self.require("fraction", 0 < self.fraction <= 1, "in (0, 1], e.g. 0.01 for 1 %")
        self.require("warmup_steps", self.warmup_steps >= 0, "an integer >= 0")


class EF21(GradientMethod):
    """EF21 with a per-tensor top-k compressor (phases ``warmup`` then ``train``)."""

    name = "ef21"
    own_state = ("local",)

    def __init__(self, comm: Communicator, topo: Topology, config: EF21Config | None = None,
                 **options: Any) -> None:
        self.cfg = config if config is not None else EF21Config(**options)
        super().__init__(comm, topo, self.cfg.warmup_steps)
        self.local = torch.zeros(0)  # g_i
        self.estimate = torch.zeros(0)  # g, the same on every worker
        self.codec: TopKCodec | None = None
        self.ks: list[int] = []

    def build(self, numel: int) -> None:
        if numel >= 2 ** 31:
            raise ValueError(f"EF21 sends int32 indices: a model of {numel:,} parameters is too large for it")
        device = self.topo.device
        self.local = torch.zeros(numel, device=device)
        self.estimate = torch.zeros(numel, device=device)
        self.codec = TopKCodec(self.numels, self.cfg.fraction)
        self.ks = self.codec.ks

    @property
    def message_elements(self) -> int:
        """int32 elements each worker contributes per compressed step: K values and K indices."""
        return 2 * sum(self.ks)

    def warmup(self, own: torch.Tensor, average: torch.Tensor) -> None:
        self.local.copy_(own)
        self.estimate.copy_(average)

    def exchange(self, flat: torch.Tensor) -> torch.Tensor:
        assert self.codec is not None, "prepare() first"
        message = self.codec.encode(flat - self.local)
        value, index = self.codec.entries(message)
        self.local.index_add_(0, index, value)  # g_i += c_i
        # Gathered as int32 words (the same bytes): the ledger's rows keep the dtype they have always had.
        gathered = self.comm.all_gather(message.view(torch.int32), self.topo.world)
        delta = torch.zeros_like(self.estimate)
        for m in gathered:  # group-rank order on every worker: the same sums everywhere
            value, index = self.codec.entries(m.view(torch.uint8))
            delta.index_add_(0, index, value)
        self.estimate.add_(delta.div_(len(gathered)))  # g += mean_i c_i
        return self.estimate

    def extra_results(self) -> dict[str, Any]:
        k = sum(self.ks)
        return {"ef21": {**asdict(self.cfg), "k": k, "numel": sum(self.numels),
                         "message_bytes": 4 * self.message_elements}}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "local": self.local.clone(), "estimate": self.estimate.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["local"].shape != self.local.shape:
            raise ValueError(f"checkpoint's EF21 state holds {state['local'].numel():,} elements, the model "
                             f"{self.local.numel():,}")
        self.t = state["t"]
        self.local.copy_(state["local"])
        self.estimate.copy_(state["estimate"])

    def adopt_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> None:
        """Another worker's state: g, the same everywhere, taken; this worker's g_i rebuilt so that the mean of
        every worker's stays g (EF21 adds the mean of the changes to g, so a gap would stay for good): where the
        writer is in this world and keeps its own, (p·g − g_writer)/(p − 1) on the others, else g."""
        p = self.topo.world_size
        estimate = state["estimate"]
        local = ((estimate * p - state["local"]) / (p - 1) if writer.same_layout(self.topo) and p > 1 else estimate)
        self.load_state_dict({**state, "local": local})

    def given_up(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
        return ["every other worker's own gradient estimate g_i (rebuilt from the shared one, so that their mean "
                "stays the estimate the optimizer sees)"] if state["t"] else []


register(MethodSpec("ef21", EF21, "EF21", "error feedback (EF21) with a top-k compressor: k values and k indices per "
                    "worker and tensor, all-gathered every step", options=EF21Config, order=70, bench=5))
