"""AB-training's streaming syncs (``--ab-sync-fragments F``): each fragment of the model synced at its own steps.

The layers are cut as Streaming DiLoCo cuts them (:func:`~abtrain.methods.fragments.fragments_of`, the paper's
strided pattern: contiguous groups of layers of about equal size dealt out in turn), on the model as the user
built it, so a fragment holds whole layers: a factorised weight with its bias and the norm after it, a layer kept
full rank, the buffers of its modules. Fragment ``f`` syncs at the steps ``t`` with ``t mod K = f * K // F``
(:meth:`~.schedule.Schedule.fragments_due`) and is decomposed again right after, while the other fragments go on
training apart: the bytes of one sync are spread over the period, and so is its decomposition.

Between two syncs no worker holds the model all workers agree on. What they do agree on is each layer as its
fragment's last sync left it: a low-rank layer's W is the SVD its phase started from (U·σ·Vᵀ, kept by the tangent
split), and :attr:`~.state.PhaseState.agreed` keeps the full-rank tensors and buffers as they were then
(a copy of each: counted in the training state). :class:`AgreedModel`
lends that model to an evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..fragments import fragments_of
from . import lowrank
from .state import PhaseState


@dataclass
class Part:
    """What one sync takes: its factorised layers (in any mode), and its full-rank parameters (biases, norms, layers
    kept or left full rank) and floating-point buffers by name in the prepared module."""

    records: list[lowrank.FactorizedParam]
    params: list[tuple[str, Tensor]]
    buffers: list[tuple[str, Tensor]]

    @property
    def low(self) -> list[lowrank.FactorizedParam]:
        """The part's layers in low-rank mode now."""
        return [fp for fp in self.records if fp.mode == "lowrank"]


def part_of(module: nn.Module, records: list[lowrank.FactorizedParam],
            member: Callable[[str], bool] | None = None) -> Part:
    """The tensors of ``module`` whose name (a factorised layer's: its record's) ``member`` takes; all with None.
    In the module's order, so that the whole model's part is what one sync has always averaged."""
    factor = {id(t) for fp in records for t in (fp.A, fp.B)}
    low = {id(fp.weight) for fp in records if fp.mode == "lowrank"}
    record_of = {id(fp.weight): fp.name for fp in records}
    params = [(name, p) for name, p in module.named_parameters()
              if id(p) not in factor and id(p) not in low and (member is None or member(record_of.get(id(p), name)))]
    buffers = [(name, b) for name, b in module.named_buffers()
               if b.is_floating_point() and (member is None or member(name))]
    return Part([fp for fp in records if member is None or member(fp.name)], params, buffers)


class SyncFragments:
    """Which fragment every parameter and floating-point buffer belongs to, by its name in the user's model.

    A factorised layer is found by its record's name (:attr:`lowrank.FactorizedParam.name`); every other tensor
    keeps its name when the model is prepared. A buffer goes with the first parameter of its module, or, in a
    module without parameters, with the last fragment.
    """

    def __init__(self, model: nn.Module, count: int) -> None:
        named = list(model.named_parameters())
        names = [name for name, _ in named]
        self.count = count
        self.of: dict[str, int] = {}
        self.sizes = [0] * count  # numbers each fragment holds, for the schedule line
        for f, ids in enumerate(fragments_of(model, count, option="--ab-sync-fragments")):
            for i in ids:
                self.of[names[i]] = f
                self.sizes[f] += named[i][1].numel()
        for name, _ in model.named_buffers():
            owner = name.rpartition(".")[0]
            first = next((p for p in names if p.rpartition(".")[0] == owner), None)
            self.of[name] = self.of[first] if first is not None else count - 1

    def part(self, f: int, module: nn.Module, records: list[lowrank.FactorizedParam]) -> Part:
        """Fragment ``f`` of the prepared ``module``."""
        return part_of(module, records, lambda name: self.of.get(name, self.count - 1) == f)


class AgreedModel:
    """``with AgreedModel(module, state):`` the module holds the model every worker agrees on, as of each layer's last
    sync: a low-rank layer's trained factor set to its phase's start (so that A·B = U·σ·Vᵀ), every full-rank
    tensor to the copy its fragment's last sync kept (:attr:`PhaseState.agreed`); put back as they were on leaving. The tangent split's two roles form U·σ·Vᵀ
    as (U·σ)·Vᵀ and U·(σ·Vᵀ): the workers' models agree up to the rounding of that product."""

    def __init__(self, module: nn.Module, state: PhaseState) -> None:
        self.module, self.state = module, state
        self.stash: list[tuple[Tensor, Tensor]] = []

    @torch.no_grad()
    def __enter__(self) -> nn.Module:
        st = self.state
        for fp in st.records:
            if fp.mode != "lowrank" or fp.name not in st.bases:
                continue
            vectors, sigma = st.bases[fp.name]
            trained, start = (fp.A, vectors * sigma) if st.role == "A" else (fp.B, sigma[:, None] * vectors)
            self._lend(trained, start)
        tensors = dict(self.module.named_parameters())
        tensors.update(self.module.named_buffers())
        for name, agreed in st.agreed.items():
            if name in tensors:
                self._lend(tensors[name], agreed)
        return self.module

    def _lend(self, t: Tensor, value: Tensor) -> None:
        self.stash.append((t, t.detach().clone()))
        t.copy_(value.to(t.dtype))

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> None:
        for t, saved in self.stash:
            t.copy_(saved)
        self.stash = []
