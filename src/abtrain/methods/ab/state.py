"""What AB-training's parts share: one :class:`PhaseState`, handed to each of them.

The decomposer (:mod:`.decomposer`) and the syncer (:mod:`.syncer`) change the model's layers and what a phase
keeps of them; :class:`~.method.ABTraining` counts the steps and decides when each part runs. What more than one
of them reads or writes lives here, and nowhere else: the factorised layers and this worker's role, the step
count and the steps at which the phase last switched and the workers last agreed, what the phase keeps of the
SVD it started from, and the record of every decomposition and sync. What a part needs besides comes as
arguments, so the dependencies between the parts are those of their signatures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from . import lowrank


@dataclass
class PhaseState:
    """The state AB-training's parts share; built once per method, checkpointed by :meth:`state_dict`."""

    #: the factor this worker trains in an AB phase: "A" or "B" (every worker trains B with ``sync="only-b"``)
    role: str
    records: list[lowrank.FactorizedParam] = field(default_factory=list)  # the factorisable layers
    kept: list[str] = field(default_factory=list)  # layers kept full rank because they produce the model's output
    excluded: list[tuple[str, str]] = field(default_factory=list)  # weights never factorised, and why
    others: int = 0  # parameters below 2 dims (biases, norms): trained as they are
    t: int = 0  # optimizer steps taken
    switch_step: int | None = None  # step of the last phase switch, for the LR rebound
    agreed_at: int | None = None  # step at which consensus() last brought the workers together
    ranks: list[dict[str, Any]] = field(default_factory=list)  # every decomposition: its step, ranks and sizes
    ratio: float | None = None  # the compression of the last decomposition
    #: optimizer_state="map": this worker's frozen factors as they were at the last sync, by layer
    frozen: dict[str, Tensor] = field(default_factory=dict)
    #: split="tangent": each low-rank layer's singular vectors its frozen factor does not hold (U or Vᵀ), and σ
    bases: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    #: svd="update": each layer's W as the SVD its phase started from plus the sync's rank-q change, from the
    #: sync to the decomposition that follows it in the same step (never across a step, so never checkpointed)
    parts: dict[str, lowrank.LowRankSum] = field(default_factory=dict)
    #: --ab-sync-fragments: the full-rank parameters and buffers as their fragment's last sync left them, by name
    #: in the module (the same on every worker: what an evaluation between syncs is lent, :mod:`.fragments`)
    agreed: dict[str, Tensor] = field(default_factory=dict)
    svd_seconds: float = 0.0
    sync_seconds: float = 0.0
    syncs: int = 0  # syncs so far, consensus() and the last one included
    svd_counts: dict[str, int] = field(default_factory=lambda: {"full": 0, "updated": 0})

    def basis(self, fp: lowrank.FactorizedParam) -> lowrank.SVD:
        """The SVD the layer's phase started from, (U, σ, Vᵀ), from the kept singular vectors and the frozen
        factor (copied: the sync overwrites the factors before the merge reads the basis)."""
        vectors, sigma = self.bases[fp.name]
        if self.role == "A":
            return lowrank.SVD(vectors, sigma, fp.B.detach().clone())
        return lowrank.SVD(fp.A.detach().clone(), sigma, vectors)

    def low(self) -> list[lowrank.FactorizedParam]:
        """The layers in low-rank mode now."""
        return [fp for fp in self.records if fp.mode == "lowrank"]

    def kept_records(self) -> list[lowrank.FactorizedParam]:
        return [fp for fp in self.records if fp.name in self.kept]

    def state_dict(self) -> dict[str, Any]:
        """Schedule position, ranks, timers and what the phase keeps; the factors live in the model's state_dict."""
        return {"t": self.t, "switch_step": self.switch_step, "agreed_at": self.agreed_at, "ranks": self.ranks,
                "role": self.role, "kept": self.kept, "svd_seconds": self.svd_seconds,
                "sync_seconds": self.sync_seconds, "syncs": self.syncs, "svd_counts": dict(self.svd_counts),
                "ratio": self.ratio, "frozen": dict(self.frozen), "vectors": dict(self.bases),
                "agreed": dict(self.agreed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This worker's own state (a worker that adopts another's hands its own role: :mod:`.checkpoint`)."""
        if state["role"] != self.role:
            raise ValueError(f"this AB-training state was saved by a worker that trains {state['role']}, this "
                             f"worker trains {self.role}: load it with the optimizer's state_dict "
                             f"(opt.load_state_dict, after the model's), which rebuilds this worker's own factors "
                             f"from it")
        self.t, self.switch_step, self.agreed_at = state["t"], state["switch_step"], state.get("agreed_at")
        self.ranks, self.kept, self.ratio = state["ranks"], list(state["kept"]), state["ratio"]
        self.svd_seconds, self.sync_seconds = state["svd_seconds"], state["sync_seconds"]
        self.syncs, self.svd_counts = int(state["syncs"]), dict(state["svd_counts"])
        self.frozen = dict(state["frozen"])
        self.agreed = dict(state.get("agreed", {}))
        self.bases = {name: (vectors, sigma) for name, (vectors, sigma) in state["vectors"].items()}

