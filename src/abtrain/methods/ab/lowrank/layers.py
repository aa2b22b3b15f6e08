"""The factorisable layers: a parametrization W or A·B per weight, and the records that find them.

:func:`prepare_model` puts a :class:`LowRankWeight` on each factorisable weight;
:func:`set_mode` and :func:`set_trainable` choose what the forward pass uses and
what trains (:func:`abtrain.methods.loop.plain_state_dict` folds the parametrizations back into plain weights).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .ranks import factors_compress

logger = logging.getLogger(__name__)

Mode = Literal["full", "lowrank"]
Orientation = Literal["as-is", "tall"]
Factor = Literal["A", "B"]
Split = Literal["sqrt", "sigma"]
Apply = Literal["weight", "factors", "auto"]

#: How a low-rank ``nn.Linear`` applies A·B to its input (:func:`prepare_model`'s ``apply``).
APPLY_MODES: tuple[str, ...] = ("weight", "factors", "auto")
#: Which matrix of a wide weight is factorised (:func:`prepare_model`'s ``orientation``).
ORIENTATIONS: tuple[str, ...] = ("as-is", "tall")

#: Parameter-name patterns (fnmatch, on the full dotted name) kept full rank by
#: default: the first layer that sees the input and the classifier head.
DEFAULT_FULL_RANK_PATTERNS: tuple[str, ...] = ("stem.*", "head.*", "tok_emb.*", "pos_emb.*", "*embed*")

_MODES = ("full", "lowrank")


class LowRankWeight(nn.Module):
    """Parametrization of one weight W of shape S, factorised as the m×n matrix M.

    M is W viewed as S[0] × prod(S[1:]), or, with ``transposed`` (a wide weight turned tall, as the AB-training
    authors' code does), that view's transpose: m = prod(S[1:]), n = S[0] (:meth:`matrix`, :meth:`weight_of`).
    Mode ``"full"`` returns the original W (the gradient flows to W).
    Mode ``"lowrank"`` returns W of M = A @ B; A (m×r) and B (r×n) are
    parameters of this module, and W gets no gradient and holds no numbers: its
    storage is released by the decomposition (:func:`release_weight`) and
    allocated again by the recomposition, so a layer in lowrank mode costs the
    memory of its factors alone.
    """

    def __init__(self, shape: Sequence[int], *, dtype: torch.dtype, device: torch.device | str,
                 transposed: bool = False) -> None:
        super().__init__()
        self.shape = torch.Size(shape)
        self.transposed = transposed
        rows, cols = int(self.shape[0]), math.prod(self.shape[1:])
        self.m, self.n = (cols, rows) if transposed else (rows, cols)
        # 0-size placeholders: present in model.parameters() before the first decomposition.
        self.A = nn.Parameter(torch.empty(self.m, 0, dtype=dtype, device=device), requires_grad=False)
        self.B = nn.Parameter(torch.empty(0, self.n, dtype=dtype, device=device), requires_grad=False)
        self.mode: str = "full"
        #: How an ``nn.Linear`` owner applies A·B in lowrank mode (:data:`APPLY_MODES`); other owners form W.
        self.apply: str = "weight"
        #: Why the layer is in its current mode; shown by :func:`log_decisions`.
        self.note: str = "not decomposed yet"
        #: the factor the worker that saved the last state_dict loaded into the layer trained ("A", "B", "both";
        #: None: none, or nothing loaded since the method took the state): whose split the factors are
        self.loaded_trains: str | None = None

    @property
    def rank(self) -> int:
        """Current rank r (0 before the first decomposition)."""
        return int(self.A.shape[1])

    def matrix(self, weight: Tensor) -> Tensor:
        """A tensor of W's shape as the factorised m×n matrix (a view: W.T's where the layer is turned tall)."""
        rows = weight.reshape(self.shape[0], -1)
        return rows.T if self.transposed else rows

    def weight_of(self, matrix: Tensor) -> Tensor:
        """An m×n matrix as a tensor of W's shape (:meth:`matrix`'s inverse)."""
        return (matrix.T if self.transposed else matrix).reshape(self.shape)

    def forward(self, original: Tensor) -> Tensor:
        if self.mode == "full":
            return original
        return self.weight_of(self.A @ self.B)

    def extra_repr(self) -> str:
        return (f"shape={tuple(self.shape)}, matrix=({self.m}, {self.n}){', transposed' if self.transposed else ''}, "
                f"mode={self.mode}, rank={self.rank}")

    # The mode travels with the state_dict (key ``..._extra_state``) so a checkpoint
    # restores both the factors and whether they are in use; and the factor trained, which says whose split of W
    # the factors are (AB-training's A- and B-workers hold different ones).
    def get_extra_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "note": self.note, "transposed": self.transposed, "trains": self.trains}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if state.get("mode") not in _MODES:
            raise ValueError(f"low-rank layer state holds an unknown mode {state.get('mode')!r}")
        self.mode = state["mode"]
        self.note = str(state.get("note", self.note))
        self.loaded_trains = state.get("trains")

    @property
    def trains(self) -> str | None:
        """The factor that trains now: "A", "B", "both", or None (full mode, or both frozen)."""
        if self.mode != "lowrank":
            return None
        a, b = self.A.requires_grad, self.B.requires_grad
        return "both" if a and b else "A" if a else "B" if b else None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, dict) and extra.get("transposed", False) != self.transposed:
            raise ValueError(f"a checkpoint's low-rank layer of shape {tuple(self.shape)} was factorised "
                             f"{'turned tall' if extra.get('transposed') else 'as it is'}, this one "
                             f"{'turned tall' if self.transposed else 'as it is'}: continue with the "
                             "--ab-orientation the checkpoint was written with")
        # A and B change shape with the rank; adopt the checkpoint's shapes before
        # the default loader copies values (it rejects shape mismatches).
        for name in ("A", "B"):
            saved = state_dict.get(prefix + name)
            param = getattr(self, name)
            if isinstance(saved, Tensor) and saved.shape != param.shape:
                replace_data(param, torch.empty(saved.shape, dtype=param.dtype, device=param.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def factors_cheaper(m: int, n: int, r: int, rows: int) -> bool:
    """Whether x·Bᵀ·Aᵀ needs fewer multiply-adds than forming W = A·B and x·Wᵀ, for ``rows`` rows of x.

    Forming W costs m·r·n whatever the batch, applying it rows·m·n; the factors
    cost rows·r·(m + n). The backward pass needs products of the same sizes (the
    input's gradient and the trained factor's: about two of each), so the choice
    holds for it approximately.
    """
    return rows * r * (m + n) < m * r * n + rows * m * n


def _linear_forward(self: nn.Linear, input: Tensor) -> Tensor:
    """``nn.Linear.forward`` of a prepared layer: in lowrank mode, x·Wᵀ through the factors where that is chosen.

    W = A·B as it is (x·Bᵀ·Aᵀ), or W = (A·B)ᵀ turned tall (x·A·B). The same function as forming W (up to
    rounding), with the gradients reaching A and B; in full mode, or when W is chosen, exactly
    ``nn.Linear.forward``.
    """
    lr = self.parametrizations.weight[0]  # type: ignore[union-attr,index]
    if lr.mode == "lowrank" and lr.apply != "weight":
        rows = max(1, input.numel() // self.in_features)
        if lr.apply == "factors" or factors_cheaper(lr.m, lr.n, lr.rank, rows):
            if lr.transposed:
                return F.linear(F.linear(input, lr.A.T), lr.B.T, self.bias)
            return F.linear(F.linear(input, lr.B), lr.A, self.bias)
    return nn.Linear.forward(self, input)


def replace_data(param: nn.Parameter, data: Tensor) -> None:
    """``param.data = data`` for data of any shape, also while an earlier step's graph is alive.

    A leaf keeps one cached gradient accumulator while any graph that used it
    lives (a training loop's ``loss`` variable holds the last step's), and that
    accumulator remembers the old shape: the next backward would refuse the new
    one. Assigning data of another dtype first is what makes ``set_data`` drop
    the cached accumulator (it does so on a dtype or device change only).
    """
    if data.shape != param.shape:
        other = torch.float32 if param.dtype == torch.float64 else torch.float64
        param.data = torch.empty(0, dtype=other, device=data.device)
    param.data = data


def release_weight(fp: "FactorizedParam") -> None:
    """Free the stored W of a layer about to train as A·B (a 0-size tensor of W's dtype takes its place).

    W is stale while the factors train and is written whole by the recomposition,
    so nothing is lost; the layer's memory is then its factors'. The Parameter keeps
    its identity, so the optimizer (and its state for W, where the caller keeps it)
    still knows it.
    """
    w = fp.weight
    if w.numel():
        replace_data(w, torch.empty(0, dtype=w.dtype, device=w.device))
        w.grad = None


def restore_weight(fp: "FactorizedParam") -> nn.Parameter:
    """W of its full shape again (values undefined until written), for the recomposition to fill."""
    w = fp.weight
    if w.shape != fp.shape:
        replace_data(w, torch.empty(fp.shape, dtype=w.dtype, device=w.device))
    return w


def _adopt_saved_shape(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load hook of a parametrized weight: W is stored 0-size while its layer is low rank, so a checkpoint
    may hold it released or whole, whichever the model holds now; take the checkpoint's shape first."""
    saved = state_dict.get(prefix + "original")
    original = getattr(module, "original", None)
    if isinstance(saved, Tensor) and isinstance(original, Tensor) and saved.shape != original.shape:
        replace_data(original, torch.empty(saved.shape, dtype=original.dtype, device=original.device))


@dataclass
class FactorizedParam:
    """One factorisable weight: where it lives and its parametrization.

    ``name`` is the weight's dotted name in the unprepared model (``"features.3.weight"``).
    After preparation the raw tensors are ``module.parametrizations[pname].original`` (W),
    ``...[pname][0].A`` and ``...[pname][0].B``; ``getattr(module, pname)`` is the
    weight the forward pass uses.
    """

    name: str
    module: nn.Module
    pname: str
    shape: torch.Size
    m: int
    n: int
    param: LowRankWeight

    @property
    def weight(self) -> nn.Parameter:
        """The stored full-rank W (0-size while in lowrank mode, until :func:`recompose`)."""
        return self.module.parametrizations[self.pname].original  # type: ignore[index,union-attr]

    @property
    def A(self) -> nn.Parameter:
        return self.param.A

    @property
    def B(self) -> nn.Parameter:
        return self.param.B

    @property
    def mode(self) -> str:
        return self.param.mode

    @property
    def rank(self) -> int:
        return self.param.rank

    def effective_weight(self) -> Tensor:
        """The weight as the forward pass sees it (W, or A@B reshaped), detached."""
        with torch.no_grad():
            return getattr(self.module, self.pname).detach()

    def matrix(self) -> Tensor:
        """:meth:`effective_weight` as the factorised m×n matrix (:meth:`LowRankWeight.matrix`)."""
        return self.param.matrix(self.effective_weight())


def _excluded_reason(
    module: nn.Module, name: str, param: Tensor, patterns: Sequence[str], min_rank: int
) -> str | None:
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding"
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return f"full-rank pattern {pattern!r}"
    m = int(param.shape[0])
    n = math.prod(param.shape[1:])
    floor = min(min_rank, m, n)
    if not factors_compress(m, n, floor):
        return (f"too small to gain: factors at the rank floor {floor} hold {floor * (m + n)} numbers, "
                f"W ({m}x{n}) holds {m * n}")
    return None


def prepare_model(
    model: nn.Module,
    *,
    full_rank_patterns: Sequence[str] = DEFAULT_FULL_RANK_PATTERNS,
    min_rank: int = 1,
    apply: Apply = "weight",
    orientation: Orientation = "as-is",
    excluded: list[tuple[str, str]] | None = None,
) -> list[FactorizedParam]:
    """Put a :class:`LowRankWeight` (mode ``"full"``) on every factorisable weight of ``model``.

    Factorisable: every parameter whose name ends in ``weight`` (``weight``,
    ``in_proj_weight``, ...) with ≥2 dims, except Embedding weights, weights shared
    by several modules, names matching a ``full_rank_patterns`` fnmatch pattern and
    matrices too small to gain anything: factors at the rank floor ``min_rank`` would
    hold at least as many numbers as W (:func:`factors_compress`). The model computes
    exactly the same function afterwards. Build the optimizer after this call.
    Records come in ``model.named_modules()`` order.

    ``apply`` is how the weight of an ``nn.Linear`` (one whose class keeps
    ``nn.Linear.forward``) is applied in lowrank mode: ``"weight"`` forms W = A·B at
    every call, as every other owner (convolutions, attention) does; ``"factors"``
    multiplies the input by Bᵀ, then by Aᵀ, and never forms the m×n product;
    ``"auto"`` picks, at each call, whichever needs fewer multiply-adds for that
    call's number of input rows (:func:`factors_cheaper`). The three compute the
    same function, up to rounding.

    ``orientation`` is which matrix a wide weight (S[0] < prod(S[1:]): most convolutions) is factorised as:
    ``"as-is"``, its S[0] × prod(S[1:]) view; ``"tall"``, that view's transpose, as the AB-training authors'
    code turns every weight tall before its SVD, so that B (r × min) is the short factor. The factors of a
    weight hold the same numbers either way; which group trains the larger one changes.

    ``excluded``, when given, receives ``(name, reason)`` for every weight of ≥ 2 dims left full rank.
    """
    if apply not in APPLY_MODES:
        raise ValueError(f"apply must be one of {APPLY_MODES}, got {apply!r}")
    if orientation not in ORIENTATIONS:
        raise ValueError(f"orientation must be one of {ORIENTATIONS}, got {orientation!r}")
    if any(isinstance(mod, LowRankWeight) for mod in model.modules()):
        raise ValueError("model is already prepared for low-rank training; call prepare_model once per model")
    if min_rank < 1:
        raise ValueError(f"min_rank must be >= 1, got {min_rank}")

    owners: dict[int, int] = {}
    for mod in model.modules():
        for param in mod._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1

    chosen: list[tuple[str, nn.Module, str, Tensor]] = []
    report = excluded is None  # a caller that collects the reasons reports them itself
    excluded = [] if excluded is None else excluded
    for mod_name, mod in model.named_modules():
        for pname, param in list(mod._parameters.items()):
            if param is None or not pname.endswith("weight") or param.ndim < 2:
                continue
            name = f"{mod_name}.{pname}" if mod_name else pname
            reason = _excluded_reason(mod, name, param, full_rank_patterns, min_rank)
            if reason is None and owners[id(param)] > 1:
                reason = "shared by several modules (tied weights)"
            if reason is None:
                chosen.append((name, mod, pname, param))
            else:
                excluded.append((name, reason))

    for name, reason in excluded if report else ():
        logger.info("%s kept full rank: %s", name, reason)
    if not chosen:
        detail = "; ".join(f"{name} ({reason})" for name, reason in excluded) or "none"
        raise ValueError(
            "nothing to factorise: no parameter named '*weight' with >=2 dims is left "
            f"(full_rank_patterns={tuple(full_rank_patterns)}; excluded: {detail}). "
            "Loosen full_rank_patterns or lower min_rank."
        )

    records = []
    # Registration mutates the module tree, so it happens after the walk above.
    for name, mod, pname, param in chosen:
        wide = param.shape[0] < math.prod(param.shape[1:])
        lr = LowRankWeight(param.shape, dtype=param.dtype, device=param.device,
                           transposed=orientation == "tall" and wide)
        linear = isinstance(mod, nn.Linear) and pname == "weight" and type(mod).forward is nn.Linear.forward
        parametrize.register_parametrization(mod, pname, lr)
        mod.parametrizations[pname].register_load_state_dict_pre_hook(_adopt_saved_shape)  # type: ignore[index,union-attr]
        if linear and apply != "weight":
            lr.apply = apply
            # An instance attribute: nn.Module.__call__ runs self.forward, so only this module changes.
            mod.forward = types.MethodType(_linear_forward, mod)
        records.append(FactorizedParam(name, mod, pname, lr.shape, lr.m, lr.n, lr))
    return records

