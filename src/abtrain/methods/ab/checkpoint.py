"""AB-training's state in a checkpoint: this worker's own, or another worker's adopted (rank 0's file).

What the workers share: the schedule's position, the ranks, the full-rank parameters of the warm-up and the
rebounds with their optimizer state, W's optimizer state, the warm start of the PowerSGD reducers, the outer
step's momenta and starting points. What is a
worker's own: during an AB phase the A-groups train A (B frozen), the B-groups B, from the split of one SVD
W = U·σ·Vᵀ each role holds (the tangent split: A-workers (U·σ + ΔA, Vᵀ) keeping U, B-workers
(U, σ·Vᵀ + ΔB) keeping Vᵀ, σ kept by both); the optimizer state of the factor a role trains; the full-rank
phases' PowerSGD error memories (each worker's) and the low-rank sync's (each group's).

A worker that adopts the state of another role rebuilds its own split of the phase's start from the writer's
U, σ and Vᵀ (the tangent split's A·B at the phase start, bit for bit where W is float32), starts its factor's
optimizer state afresh and drops the memories that were not its group's; its group's AB steps since the
phase began are lost, and the next sync brings every worker to one model again. With the sigma or sqrt
split, which keep no singular vectors, it trains its factor against the writer's current one. Nothing is
sent, and nothing beyond one worker's state is kept.

The factors' fingerprints (:func:`fingerprint`) travel with the method's state, so that a model state_dict and
an optimizer state_dict that were not saved together are refused in one line instead of merged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..loop import LoopContract
from ..resume import Writer, float_buffer_names, has_state
from . import lowrank
from .lowrank.layers import replace_data

#: ``m`` below is the :class:`~.method.ABTraining` whose state is saved or loaded (typed Any: this module is one of
#: its parts, which it imports)

#: entries of the state that are this worker's own: its role and what it keeps of its split, the error memories
OWN_STATE = ("role", "frozen", "vectors", "fingerprints", "dense.errors", "sync_compressor.errors")
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: Tensor) -> list[int]:
    """Sums of the tensor's bits read as integers (all of them, every 7th, every 3rd from the second): the same
    on any device and in any order of summation, and different for the factors of another worker or step."""
    flat = t.detach().reshape(-1)
    ints = flat.view(_INTS[flat.element_size()])
    return [int(part.sum(dtype=torch.int64)) for part in (ints, ints[::7], ints[1::3])]


def fingerprints(records: list[lowrank.FactorizedParam]) -> dict[str, list[int]]:
    return {fp.name: fingerprint(fp.A) + fingerprint(fp.B) for fp in records if fp.mode == "lowrank"}


def check_factors(m: Any, saved: dict[str, list[int]] | None) -> None:
    """The model holds the factors the method's state was saved with (None: a state that does not say)."""
    if saved is None:
        return
    held = fingerprints(m.state.records)
    for name in sorted(set(saved) | set(held)):
        if saved.get(name) != held.get(name):
            raise ValueError(f"the model does not hold the factors the optimizer's state_dict was saved with "
                             f"({name}): load the model's state_dict first, then the optimizer's, both of one "
                             f"checkpoint")


def state_dict(m: Any) -> dict[str, Any]:
    """The phase state, the gradient and sync compressors' memories and the factors' fingerprints. Factors, W
    and the layers' modes live in the model's state_dict."""
    return {**m.state.state_dict(), "output_searched": m.output.searched, "dense": m.dense.state_dict(),
            "sync_compressor": m.compressor.state_dict() if m.compressor is not None else None,
            "outer": m.syncer.outer.state_dict() if m.syncer.outer is not None else None,
            "fingerprints": fingerprints(m.state.records)}


def load(m: Any, state: dict[str, Any]) -> None:
    """This worker's own state, after the model's state_dict was loaded (it brings the factors and each layer's
    mode)."""
    check_factors(m, state.get("fingerprints"))
    m.state.load_state_dict(state)
    if state["output_searched"]:
        m.output.stop()  # the output layer was looked for before the checkpoint
    m.dense.load_state_dict(state["dense"])
    if m.compressor is not None and state["sync_compressor"] is not None:
        m.compressor.load_state_dict(state["sync_compressor"])
    if m.syncer.outer is not None and state["outer"] is not None:
        m.syncer.outer.load_state_dict(state["outer"])  # the same on every worker: agreed starts, averaged changes
    settle(m)


def follow_modes(m: Any) -> None:
    """requires_grad is not part of a state_dict: derive it from the layers' modes and this worker's role."""
    for fp in m.state.records:
        lowrank.set_mode([fp], fp.mode)
    lowrank.set_trainable(m.state.records, m.state.role)


def settle(m: Any) -> None:
    """After the method's state was loaded: what trains, what the in-group averaging watches; the layers'
    record of whose factors they were loaded with, consumed."""
    follow_modes(m)
    for fp in m.state.records:
        fp.param.loaded_trains = None
    m._watch_gradients()


def model_loaded(m: Any, module: torch.nn.Module, incompatible: Any) -> None:
    """The model's state_dict was loaded: what trains follows its modes at once (the method's state may not
    follow; :func:`check_loaded_model` refuses at the next step what would be wrong)."""
    LoopContract._model_loaded(m, module, incompatible)
    follow_modes(m)


def adopt(m: Any, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> None:
    """Another worker's state: the shared parts taken, this worker's own split rebuilt (module docstring)."""
    check_factors(m, state.get("fingerprints"))
    dense = {**state["dense"], "errors": {}} if "errors" in state["dense"] else state["dense"]
    sync = state["sync_compressor"]
    if sync is not None and not writer.same_group(m.topo):  # the low-rank sync's memories are the group's
        sync = {**sync, "errors": {}}
    own = {**state, "dense": dense, "sync_compressor": sync, "role": m.state.role, "fingerprints": None}
    if state["role"] != m.state.role:
        own["frozen"] = {}  # what optimizer_state="map" maps the writer's factor state with: not this worker's
        own["vectors"] = rebuild_split(m.state.records, state["role"], state["vectors"])
        lowrank.reset_state(optimizer, [t for fp in m.state.records for t in (fp.A, fp.B)])
    load(m, own)


@torch.no_grad()
def rebuild_split(records: list[lowrank.FactorizedParam], role: str,
                  vectors: dict[str, tuple[Tensor, Tensor]]) -> dict[str, tuple[Tensor, Tensor]]:
    """The tangent split of the other role at the phase's start, from a ``role`` worker's factors and the
    singular vectors it kept; the vectors the other role keeps, by layer. The products are those of the
    decomposition (:func:`lowrank.decompose`), in the same layout, so the factors are its bits."""
    kept: dict[str, tuple[Tensor, Tensor]] = {}
    for fp in records:
        if fp.mode != "lowrank" or fp.name not in vectors:
            continue
        vector, sigma = (v.to(fp.A.device) for v in vectors[fp.name])
        if role == "A":  # the writer's A = U·σ + its change, B = Vᵀ; it kept U: this worker's A = U, B = σ·Vᵀ
            vh = fp.B.detach().float()
            a, b, mine = vector, sigma[:, None] * vh, vh
        else:  # the writer's A = U, B = σ·Vᵀ + its change; it kept Vᵀ: this worker's A = U·σ, B = Vᵀ
            u = fp.A.detach().float()
            a, b, mine = u * sigma, vector, u
        kept[fp.name] = (mine.clone(memory_format=torch.contiguous_format), sigma.clone())
        replace_data(fp.A, a.to(fp.A.dtype).clone(memory_format=torch.contiguous_format))
        replace_data(fp.B, b.to(fp.B.dtype).clone(memory_format=torch.contiguous_format))
    return kept


def given_up(m: Any, state: dict[str, Any], optimizer: torch.optim.Optimizer, writer: Writer) -> list[str]:
    """What a worker adopting ``state`` loses (``optimizer``: the writer's), for rank 0's line."""
    t, switch, agreed = state["t"], state["switch_step"], state.get("agreed_at")
    sched, cfg = m.schedule, m.cfg
    phase = sched.phase_at(t)
    out = []
    if phase == "ab" and t not in (switch, agreed) and m.train_group is not m.topo.world:
        since = max([s for s in (switch, agreed) if s is not None and s <= t] or [0])
        if m.fragments is not None:  # streaming syncs: each fragment since its own last sync
            since = max(since, t - sched.sync_every + 1)
            out.append(f"every other group's AB steps since each fragment's last sync (at most {t - since}, "
                       f"since step {since})")
        else:
            out.append(f"every other group's {t - since} AB steps since step {since}")
    elif (cfg.dense_comm == "local" and phase != "ab" and t > 0 and sched.phase_at(t - 1) != "ab"
          and agreed != t):
        out.append(f"every other worker's own full-rank steps of this phase (they go on from rank {writer.rank}'s "
                   f"model)")
    if cfg.sync != "only-b" and has_state(optimizer, [x for fp in m.state.records for x in (fp.A, fp.B)]):
        other = "B" if state["role"] == "A" else "A"
        out.append(f"the {other}-groups' optimizer state of {other}")
    if state["dense"].get("errors"):
        out.append("every other worker's error memories of the full-rank steps' PowerSGD")
    if (state["sync_compressor"] or {}).get("errors") and m.topo.num_groups > 1:
        out.append(f"the error memories of the low-rank sync of every group but group {writer.group}")
    return out


def dcp_split(m: Any) -> tuple[set[str], set[str]]:
    """(own, held) keys of the module's state_dict (:meth:`~abtrain.methods.loop.LoopContract.dcp_split`): the
    factors and the layers' modes change shape or differ between roles, W changes shape; the full-rank
    parameters are each group's own while the groups train apart."""
    assert m.module is not None, "prepare() first"
    named = list(m.module.named_parameters(remove_duplicate=False))
    names = {id(p): n for n, p in named}
    factors = {id(t) for fp in m.state.records for t in (fp.A, fp.B)}
    own, held = float_buffer_names(m.module), set()
    for fp in m.state.records:
        a, b = names[id(fp.A)], names[id(fp.B)]
        extra = a[:-len("A")] + "_extra_state"
        own |= {a, b, extra}
        held |= {a, b, extra, names[id(fp.weight)]}
    if not m.in_consensus() or (not m.cfg.sync_moments and m.state.syncs > 0):
        own |= {n for n, p in named if id(p) not in factors}
    return own, held


def check_loaded_model(m: Any) -> None:
    """A model state_dict loaded with no method state after it: refused where its factors are not this worker's
    (another role's split, or low-rank layers this method has no state of)."""
    low = m.state.low()
    if low and not m.state.ranks:
        raise ValueError("the model's state_dict holds AB-training's low-rank factors and this AB-training has no "
                         "state of them: load the optimizer's state_dict saved with it (after the model's, and "
                         "after method.attach(opt)); it carries the method's state")
    for fp in low:
        trains = fp.param.loaded_trains
        if trains is not None and trains != m.state.role:
            raise ValueError(f"the model's state_dict holds the factors of a worker that trains {trains} "
                             f"({fp.name}), this worker trains {m.state.role}: load the optimizer's state_dict "
                             f"saved with it too, after the model's (it carries what this worker rebuilds its own "
                             f"factors from), or each worker's own checkpoint")
