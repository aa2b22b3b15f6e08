"""A method's state in the optimizer's state_dict, and any worker resumed from it.

While a method is attached, ``optimizer.state_dict()`` carries the method's state under ``"abtrain"``, with
the worker that wrote it (:class:`Writer`): the model's and the optimizer's state_dicts are a whole
checkpoint. Three ways of taking one end in the same code:

* **each worker its own file**: every worker loads the state it wrote, exactly;
* **rank 0's file**, as DDP scripts do: a worker that did not write the state takes what the workers share
  (the schedule, the global model, the agreed optimizer state) and rebuilds what was the writer's own from
  it (:meth:`~abtrain.methods.loop.LoopContract.adopt_state`); rank 0 says in one line what that gives up
  (:meth:`~abtrain.methods.loop.LoopContract.given_up`). After every worker called
  :meth:`~abtrain.methods.loop.LoopContract.gather_state`, rank 0's optimizer state_dict of that step takes
  DCP's form below with every worker's own part (:func:`gather_parts`), and each worker resumes its own;
* **torch.distributed.checkpoint**: DCP saves a key held by every rank once, from one of them, and loads
  into tensors of the shapes it is handed. Asked from inside DCP (:func:`dcp_call`), the state_dicts take
  another form: what differs between workers, and what changes shape (AB-training's factors), leaves the
  model's tensors (a placeholder, :data:`HELD`) for two byte strings in the optimizer's first parameter
  group, ``"shared"`` (the same on every worker: saved once) and ``"worker<rank>"`` (this worker's own:
  one per worker), each loaded whole. What every worker holds alike stays a tensor of the model, saved once.
"""

from __future__ import annotations

import hashlib
import io
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

#: the key under which the attached optimizer's ``state_dict()`` carries the method's state
STATE_KEY = "abtrain"
#: what a model's state_dict holds, under torch.distributed.checkpoint, in place of a tensor the optimizer's
#: state carries (a tensor of this worker's own, or one that changes shape)
HELD = "abtrain: held in the optimizer's state_dict"
SHARED = "shared"  # the key of the part of the method's state every worker holds alike


def worker_key(rank: int) -> str:
    """The key of worker ``rank``'s own part of the method's state under torch.distributed.checkpoint."""
    return f"worker{rank}"


@dataclass(frozen=True)
class Writer:
    """The worker that wrote a method's state: its rank and the layout of its world."""

    rank: int
    world_size: int
    group_size: int
    group: int

    @classmethod
    def of(cls, topo: Any) -> "Writer":
        return cls(topo.rank, topo.world_size, topo.group_size, topo.group_index)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "Writer":
        return cls(int(saved["rank"]), int(saved["world_size"]), int(saved["group_size"]), int(saved["group"]))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def same_layout(self, topo: Any) -> bool:
        return self.world_size == topo.world_size and self.group_size == topo.group_size

    def is_worker(self, topo: Any) -> bool:
        """``topo``'s worker wrote the state (the same rank in the same layout)."""
        return self.same_layout(topo) and self.rank == topo.rank

    def same_group(self, topo: Any) -> bool:
        return self.same_layout(topo) and self.group == topo.group_index

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} workers in groups of {self.group_size}"


def dcp_call() -> str | None:
    """``"load"`` when ``torch.distributed.checkpoint.load`` asks for a state_dict now, ``"save"`` when another
    part of torch.distributed.checkpoint does (``save``, ``async_save``, the ``state_dict`` helpers), else None.

    Read from the call stack, as :func:`~abtrain.methods.loop.ddp_calling` finds a DDP wrapper: DCP hands the
    state_dict methods no argument that says who calls them."""
    if "torch.distributed.checkpoint" not in sys.modules:
        return None
    frame = sys._getframe(1)
    kind = None
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name.startswith("torch.distributed.checkpoint"):
            if name == "torch.distributed.checkpoint.state_dict_loader":
                return "load"
            kind = "save"
        frame = frame.f_back
    return kind


def dcp_saved_keys() -> set[str] | None:
    """The keys of the checkpoint ``torch.distributed.checkpoint.load`` is reading now (its storage reader's
    metadata), None where they cannot be read: a template may then ask only for keys the checkpoint holds."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict_loader":
            reader = frame.f_locals.get("storage_reader")
            if reader is None:
                return None
            try:
                return set(reader.read_metadata().state_dict_metadata)
            except Exception:  # noqa: BLE001 - a reader that cannot be asked twice: ask for the usual keys
                return None
        frame = frame.f_back
    return None


def pack(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _copy_dicts(value: Any) -> Any:
    return {k: _copy_dicts(v) for k, v in value.items()} if isinstance(value, dict) else value


def split_state(state: dict[str, Any], paths: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state`` without the entries at ``paths`` (dotted: ``"dense.errors"``), and those entries by path."""
    shared = _copy_dicts(state)
    own: dict[str, Any] = {}
    for path in paths:
        *parents, leaf = path.split(".")
        node: Any = shared
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            own[path] = node.pop(leaf)
    return shared, own


def merge_state(shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_state`."""
    state = _copy_dicts(shared)
    for path, value in own.items():
        *parents, leaf = path.split(".")
        node = state
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return state


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The optimizer's parameters in the order of its state_dict's indices."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def float_buffer_names(module: nn.Module) -> set[str]:
    """State_dict keys of the module's floating-point buffers (BatchNorm statistics, per worker under DDP)."""
    return {name for name, b in module.named_buffers(remove_duplicate=False) if b.is_floating_point()}


def join_phrases(phrases: list[str]) -> str:
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def has_state(optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> bool:
    """Whether the optimizer keeps any per-element state of ``params``."""
    return any(torch.is_tensor(v) and v.numel() > 1 for p in params for v in optimizer.state.get(p, {}).values())


#: the checkpoints of a user's loop that resume every worker exactly
EXACT = ("per-rank files, torch.distributed.checkpoint, or rank 0's file saved after method.gather_state() on "
         "every worker")


def resume_line(method: str, steps: int, writer: Writer, phrases: list[str], same_layout: bool, exact: str) -> str:
    """Rank 0's one line: what a worker that resumes from another's state gives up, and what resumes exactly
    (``exact``, the checkpoints that do; ``same_layout``: the resuming world has the writer's layout)."""
    where = "" if same_layout else " in the layout that wrote it"
    return (f"{method} state of step {steps}, saved by {writer.describe()}: a worker resuming from it in place of "
            f"its own gives up {join_phrases(phrases)}; a worker that loads its own state ({exact}){where} "
            f"resumes exactly")


# -- the form torch.distributed.checkpoint gets --------------------------------------------------------------------
_SECTION_OWN = ("writer", "state", "ledger")  # the parts of the method's section each worker has of its own


def split_parts(method: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any], section: dict[str, Any]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, own): ``state`` (the optimizer's state_dict, ``section`` the method's part of it) cut into what
    every worker holds alike and what is this worker's own: the optimizer's per-parameter state and the model's
    tensors :meth:`~.loop.LoopContract.dcp_split` names, the method's state by its ``own_state`` paths."""
    own_names, held = method.dcp_split()
    names = {id(p): name for name, p in method.module.named_parameters(remove_duplicate=False)}
    params = optimizer_params(optimizer)
    own_opt, shared_opt = {}, {}
    for pos, param_state in state["state"].items():
        (own_opt if names.get(id(params[pos])) in own_names else shared_opt)[pos] = param_state
    model = method._plain_module_state()
    shared_state, own_state = split_state(section["state"], method.own_state)
    shared = {**{k: v for k, v in section.items() if k not in _SECTION_OWN}, "state": shared_state,
              "optimizer": shared_opt, "model": {n: model[n] for n in held - own_names if n in model}}
    own = {"writer": section["writer"], "state": own_state, "ledger": section["ledger"], "optimizer": own_opt,
           "model": {n: model[n] for n in own_names if n in model}}
    return shared, own


def to_dcp(method: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any], section: dict[str, Any],
           workers: dict[str, bytes] | None = None) -> None:
    """``state`` (the optimizer's state_dict, ``section`` the method's part of it) in the form DCP saves: the
    two parts of :func:`split_parts` as two byte strings in the first parameter group, :data:`SHARED` and this
    worker's :func:`worker_key` (the per-parameter entries stay, empty: torch's ``set_state_dict`` wants one for
    each trained parameter). ``workers``: every worker's own byte string by its key, with the tensors they
    refer to (:func:`gather_parts`), in place of this worker's."""
    shared, own = split_parts(method, optimizer, state, section)
    state["state"] = {pos: {} for pos in state["state"]}
    blobs = workers or {worker_key(method.topo.rank): pack(own)}
    state["param_groups"][0][STATE_KEY] = {SHARED: pack(shared), **blobs}


def own_part(method: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This worker's own part of the state (what a per-rank file or DCP keeps per worker)."""
    state = optimizer.state_dict()
    section = state.pop(STATE_KEY)
    return split_parts(method, optimizer, state, section)[1]


# -- every worker's own part in rank 0's file (gather_state) --------------------------------------------------------
TENSORS = "tensors"  # the key, beside the workers', of the tensors their parts share in a gathered file
_REF = "abtrain-tensor:"  # a worker's part refers to one of those tensors by this prefix and its digest


def _digest(t: Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _by_reference(value: Any, tensors: dict[str, Tensor]) -> Any:
    """``value`` with each tensor replaced by a reference to it, the tensors put in ``tensors`` by digest."""
    if torch.is_tensor(value):
        key = _digest(value)
        if key not in tensors:  # a view of a larger buffer alone (torch.save would write the whole buffer)
            whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
            tensors[key] = value if whole else value.clone()
        return _REF + key
    if isinstance(value, dict):
        return {k: _by_reference(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_by_reference(v, tensors) for v in value)
    return value


def _resolved(value: Any, tensors: dict[str, Tensor]) -> Any:
    """The inverse of :func:`_by_reference`: each reference a tensor of its own (a copy: two entries that held
    equal values must not share storage)."""
    if isinstance(value, str) and value.startswith(_REF):
        return tensors[value[len(_REF):]].clone()
    if isinstance(value, dict):
        return {k: _resolved(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_resolved(v, tensors) for v in value)
    return value


def _bytes_of(comm: Any, group: Any, blob: bytes, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """``blob`` as a tensor on ``device`` and every member's length (an all-gather of 8 bytes each)."""
    mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
    lengths = comm.all_gather(torch.tensor([mine.numel()], dtype=torch.int64, device=device), group)
    return mine.to(device), [int(n) for n in lengths]


def gather_parts(comm: Any, group: Any, own: dict[str, Any], device: torch.device, dst: int = 0
                 ) -> dict[str, bytes] | None:
    """Every member's ``own`` part on global rank ``dst``, None elsewhere: ``{"worker<r>": part, ...,
    "tensors": ...}``, each part with its tensors by reference into the tensors the parts hold (once each:
    the workers of a group hold the same factors and optimizer state). Each worker first sends every other
    the digests of its tensors (an all-gather, a few bytes per tensor), then sends ``dst`` only the tensors
    no worker before it holds (``dst`` sends none): what reaches ``dst`` is each distinct tensor once."""
    tensors: dict[str, Tensor] = {}
    part = pack(_by_reference(own, tensors))
    index, lengths = _bytes_of(comm, group, pack(sorted(tensors)), device)
    indices = comm.all_gather(torch.nn.functional.pad(index, (0, max(lengths) - index.numel())), group)
    digests = [unpack(bytes(t[:n].cpu().numpy().tobytes())) for t, n in zip(indices, lengths)]
    ranks = list(group.ranks) if group.ranks else list(range(group.size))
    me, root = comm.rank_in(group), ranks.index(dst)
    held = set(digests[root])
    for i in range(me):
        if i != root:
            held.update(digests[i])
    mine = {} if me == root else {key: value for key, value in tensors.items() if key not in held}
    blob, sizes = _bytes_of(comm, group, pack({"part": part, TENSORS: mine}), device)
    received = comm.gather(blob, group, sizes, dst=dst)
    if received is None:
        return None
    parts, pool = {worker_key(root): part}, dict(tensors)
    for i, t in enumerate(received):
        if i != root:
            sent = unpack(bytes(t.cpu().numpy().tobytes()))
            parts[worker_key(i)] = sent["part"]
            pool.update(sent[TENSORS])
    return {**{worker_key(i): parts[worker_key(i)] for i in range(len(received))}, TENSORS: pack(pool)}


def dcp_template(method: Any, state: dict[str, Any]) -> None:
    """``state`` as the template DCP loads into: the two byte strings' keys, this worker's own where the
    checkpoint holds it, else rank 0's (a worker of a larger world adopts its state); nothing of the method's
    where the checkpoint holds none of it."""
    saved = dcp_saved_keys()
    own = worker_key(method.topo.rank)
    state["state"] = {pos: {} for pos in state["state"]}
    if saved is not None:
        parts = {key.rsplit(".", 1)[-1] for key in saved if f".{STATE_KEY}." in f".{key}"}
        if SHARED not in parts:
            return
        workers = sorted((int(p[len("worker"):]) for p in parts if p.startswith("worker") and p[6:].isdigit()))
        method._dcp_every_worker = all(r in workers for r in range(method.topo.world_size))
        if own not in parts and workers:
            own = worker_key(workers[0])
    state["param_groups"][0][STATE_KEY] = {SHARED: b"", own: b""}


def in_dcp_form(state: Any) -> bool:
    """Whether an optimizer's state_dict is in DCP's form (:func:`to_dcp`: torch.distributed.checkpoint's, or rank
    0's after gather_state()), the method's parts in its first parameter group."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    return bool(groups) and isinstance(groups[0], Mapping) and STATE_KEY in groups[0]


def shared_section(state: dict[str, Any]) -> dict[str, Any]:
    """What every worker shares of the method's section of a state_dict in DCP's form (its name, the schedule)."""
    return unpack(state["param_groups"][0][STATE_KEY][SHARED])


def from_dcp(method: Any, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's state_dict and the method's section from DCP's form (:func:`to_dcp`), the model's
    tensors of the two byte strings loaded into the module on the way."""
    groups = [dict(g) for g in state["param_groups"]]
    blobs = groups[0].pop(STATE_KEY)
    own_blob = blobs.get(worker_key(method.topo.rank)) or next(
        (v for k, v in blobs.items() if k.startswith("worker") and v), b"")
    if not blobs.get(SHARED) or not own_blob:
        raise ValueError("the optimizer's state_dict holds the keys of abtrain's state under torch.distributed."
                         "checkpoint but not their values: load it with torch.distributed.checkpoint.load")
    if all(worker_key(r) in blobs for r in range(method.topo.world_size)):
        method._dcp_every_worker = True  # each worker its own part: nobody adopts another's, nothing to say
    shared, own = unpack(blobs[SHARED]), unpack(own_blob)
    if blobs.get(TENSORS):  # gathered into rank 0's file: the part's tensors by reference
        own = _resolved(own, unpack(blobs[TENSORS]))
    section = {**{k: v for k, v in shared.items() if k not in ("state", "optimizer", "model")},
               "writer": own["writer"], "state": merge_state(shared["state"], own["state"]), "ledger": own["ledger"]}
    keys = [k for g in groups for k in g["params"]]
    per_param = {**shared["optimizer"], **own["optimizer"]}
    entries = {**shared["model"], **own["model"]}
    if entries:
        method.module.load_state_dict(entries, strict=False)
    return {**state, "param_groups": groups,
            "state": {keys[pos]: value for pos, value in per_param.items() if pos < len(keys)}}, section
