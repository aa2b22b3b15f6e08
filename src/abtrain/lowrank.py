"""Low-rank factorisation of weights for AB-training.

Every factorisable weight W (shape S) is viewed as the matrix m×n with
m = S[0] and n = prod(S[1:]) (a conv kernel (C_out, C_in/groups, kh, kw) becomes
(C_out, C_in/groups·kh·kw)). :func:`prepare_model` puts a :class:`LowRankWeight`
parametrization (``torch.nn.utils.parametrize``) on each such weight, so the owning
module -- ``nn.Linear``, any ``nn.Conv*``, ``nn.MultiheadAttention`` -- keeps calling
``self.weight`` and gets either W itself (mode ``"full"``) or ``(A @ B).reshape(S)``
(mode ``"lowrank"``).

The factors A (m×r) and B (r×n) are parameters of the parametrization from the
start (as 0-size placeholders), so an optimizer built once over
``model.parameters()`` after :func:`prepare_model` sees every parameter it will
ever need. Decomposition and recomposition only swap ``.data`` of those same
Parameter objects; :func:`resize_state` (called by :func:`decompose` when given
the optimizer) keeps the optimizer's moment buffers in step with the new ranks.

This module is single-process. Where workers must agree (the rank of each layer),
the pieces are exposed separately: :func:`svd` -> :func:`choose_rank` ->
all-reduce(MAX) by the caller -> :func:`decompose_with` / :func:`decompose_all`.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = [
    "DEFAULT_FULL_RANK_PATTERNS",
    "FactorizedParam",
    "LowRankWeight",
    "RankRule",
    "SVD",
    "SVDError",
    "ab_param_count",
    "choose_rank",
    "compression_ratio",
    "decompose",
    "decompose_all",
    "decompose_with",
    "decision_lines",
    "describe",
    "format_ratio",
    "full_param_count",
    "log_decisions",
    "ortho_sigma_init",
    "output_weights",
    "pays",
    "plain_state_dict",
    "prepare_model",
    "recompose",
    "reset_state",
    "resize_state",
    "set_mode",
    "set_trainable",
    "svd",
]

logger = logging.getLogger(__name__)

Mode = Literal["full", "lowrank"]
Factor = Literal["A", "B"]
Split = Literal["sqrt", "sigma"]

#: Parameter-name patterns (fnmatch, on the full dotted name) kept full rank by
#: default: the first layer that sees the input and the classifier head.
DEFAULT_FULL_RANK_PATTERNS: tuple[str, ...] = ("stem.*", "head.*", "tok_emb.*", "pos_emb.*", "*embed*")

_MODES = ("full", "lowrank")
_ROLES = ("A", "B", "both", "full")


class LowRankWeight(nn.Module):
    """Parametrization of one weight W of shape S, viewed as the m×n matrix.

    Mode ``"full"`` returns the original W (the gradient flows to W).
    Mode ``"lowrank"`` returns ``(A @ B).reshape(S)``; A (m×r) and B (r×n) are
    parameters of this module and W gets no gradient.
    """

    def __init__(self, shape: Sequence[int], *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.shape = torch.Size(shape)
        self.m = int(self.shape[0])
        self.n = math.prod(self.shape[1:])
        # 0-size placeholders: present in model.parameters() before the first decomposition.
        self.A = nn.Parameter(torch.empty(self.m, 0, dtype=dtype, device=device), requires_grad=False)
        self.B = nn.Parameter(torch.empty(0, self.n, dtype=dtype, device=device), requires_grad=False)
        self.mode: str = "full"
        #: Why the layer is in its current mode; shown by :func:`log_decisions`.
        self.note: str = "not decomposed yet"

    @property
    def rank(self) -> int:
        """Current rank r (0 before the first decomposition)."""
        return int(self.A.shape[1])

    def forward(self, original: Tensor) -> Tensor:
        if self.mode == "full":
            return original
        return (self.A @ self.B).reshape(self.shape)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, matrix=({self.m}, {self.n}), mode={self.mode}, rank={self.rank}"

    # The mode travels with the state_dict (key ``..._extra_state``) so a checkpoint
    # restores both the factors and whether they are in use.
    def get_extra_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "note": self.note}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if state.get("mode") not in _MODES:
            raise ValueError(f"low-rank layer state holds an unknown mode {state.get('mode')!r}")
        self.mode = state["mode"]
        self.note = str(state.get("note", self.note))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A and B change shape with the rank; adopt the checkpoint's shapes before
        # the default loader copies values (it rejects shape mismatches).
        for name in ("A", "B"):
            saved = state_dict.get(prefix + name)
            param = getattr(self, name)
            if isinstance(saved, Tensor) and saved.shape != param.shape:
                param.data = torch.empty(saved.shape, dtype=param.dtype, device=param.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


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
        """The stored full-rank W (stale while in lowrank mode, until :func:`recompose`)."""
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


# ---------------------------------------------------------------------------
# Preparation


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
    if not pays(m, n, floor):
        return (f"too small to gain: factors at the rank floor {floor} hold {floor * (m + n)} numbers, "
                f"W ({m}x{n}) holds {m * n}")
    return None


def prepare_model(
    model: nn.Module,
    *,
    full_rank_patterns: Sequence[str] = DEFAULT_FULL_RANK_PATTERNS,
    min_rank: int = 1,
) -> list[FactorizedParam]:
    """Put a :class:`LowRankWeight` (mode ``"full"``) on every factorisable weight of ``model``.

    Factorisable: every parameter whose name ends in ``weight`` (``weight``,
    ``in_proj_weight``, ...) with ≥2 dims, except Embedding weights, weights shared
    by several modules, names matching a ``full_rank_patterns`` fnmatch pattern and
    matrices too small to gain anything: factors at the rank floor ``min_rank`` would
    hold at least as many numbers as W (:func:`pays`). The model computes
    exactly the same function afterwards. Build the optimizer after this call.
    Records come in ``model.named_modules()`` order.
    """
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
    excluded: list[tuple[str, str]] = []
    for mod_name, mod in model.named_modules():
        for pname, param in list(mod._parameters.items()):
            if param is None or not pname.endswith("weight") or param.ndim < 2:
                continue
            name = f"{mod_name}.{pname}" if mod_name else pname
            reason = _excluded_reason(mod, name, param, full_rank_patterns, min_rank)
            if reason is None and owners[id(param)] > 1:
                reason = "shared by several modules"
            if reason is None:
                chosen.append((name, mod, pname, param))
            else:
                excluded.append((name, reason))

    for name, reason in excluded:
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
        lr = LowRankWeight(param.shape, dtype=param.dtype, device=param.device)
        parametrize.register_parametrization(mod, pname, lr)
        records.append(FactorizedParam(name, mod, pname, lr.shape, lr.m, lr.n, lr))
    return records


# ---------------------------------------------------------------------------
# Rank rules


def pays(m: int, n: int, r: int, min_compression: float = 1.0) -> bool:
    """True when factors of rank r hold fewer than m·n / min_compression numbers: r(m+n) < m·n/ρ."""
    if min_compression <= 0:
        raise ValueError(f"min_compression must be > 0, got {min_compression}")
    return r * (m + n) * min_compression < m * n


@dataclass(frozen=True)
class RankRule:
    """How to pick a rank from singular values; set exactly one of tau, rank, fraction, energy.

    tau: count of σ_i > τ·σ_1 (at least 1). rank: fixed rank. fraction: round(fraction·min(m,n)).
    energy: smallest r with Σ_{i<r} σ_i² ≥ energy·Σσ². ``max_rank`` caps any of them.
    """

    tau: float | None = None
    rank: int | None = None
    fraction: float | None = None
    energy: float | None = None
    max_rank: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("tau", "rank", "fraction", "energy") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one rank rule (tau, rank, fraction or energy), got {given or 'none'}"
            )
        if self.tau is not None and not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau must be in (0, 1) (relative cut-off of σ/σ_1, e.g. 0.15), got {self.tau}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1] (share of full rank), got {self.fraction}")
        if self.energy is not None and not 0.0 < self.energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1] (share of Σσ² kept), got {self.energy}")
        if self.max_rank is not None and self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {self.max_rank}")

    def choose(self, sigma: Tensor) -> int:
        """Rank for the descending singular values ``sigma`` (length min(m, n))."""
        full = int(sigma.numel())
        if full == 0:
            raise ValueError("sigma is empty")
        s = sigma.detach().double()
        if self.tau is not None:
            r = int((s > self.tau * s[0]).sum())
        elif self.rank is not None:
            r = self.rank
        elif self.fraction is not None:
            r = round(self.fraction * full)
        else:
            assert self.energy is not None
            mass = torch.cumsum(s * s, 0)
            # Comparing with the last cumulative sum (not a separate sum) makes energy=1 reach full rank.
            r = int(torch.searchsorted(mass, self.energy * mass[-1])) + 1
        if self.max_rank is not None:
            r = min(r, self.max_rank)
        return max(1, min(r, full))


def choose_rank(
    sigma: Tensor,
    *,
    tau: float | None = None,
    rank: int | None = None,
    fraction: float | None = None,
    energy: float | None = None,
    max_rank: int | None = None,
) -> int:
    """Rank from singular values by exactly one rule; see :class:`RankRule`."""
    return RankRule(tau=tau, rank=rank, fraction=fraction, energy=energy, max_rank=max_rank).choose(sigma)


# ---------------------------------------------------------------------------
# Decomposition


class SVD(NamedTuple):
    """Thin SVD of W as m×n, float32: W = U·diag(S)·Vh."""

    U: Tensor
    S: Tensor
    Vh: Tensor


class SVDError(RuntimeError):
    """A weight could not be decomposed (non-finite values, or no SVD in float32 nor float64)."""


def svd(fp: FactorizedParam) -> SVD:
    """Thin SVD of the current W (viewed m×n) in float32, retried in float64 if float32 fails."""
    w = fp.effective_weight().reshape(fp.m, fp.n)
    if not torch.isfinite(w).all():
        raise SVDError(f"cannot decompose {fp.name}: its weight holds inf or nan")
    for dtype in (torch.float32, torch.float64):
        try:
            u, s, vh = torch.linalg.svd(w.to(dtype), full_matrices=False)
        except RuntimeError as err:  # LinAlgError (no convergence) is a RuntimeError
            logger.warning("SVD of %s failed in %s: %s", fp.name, dtype, err)
            continue
        if all(bool(torch.isfinite(t).all()) for t in (u, s, vh)):
            return SVD(u.float(), s.float(), vh.float())
        logger.warning("SVD of %s in %s gave non-finite values", fp.name, dtype)
    raise SVDError(f"SVD of {fp.name} ({fp.m}x{fp.n}) failed in float32 and float64")


def _set_grads_none(*params: nn.Parameter) -> None:
    for p in params:
        p.grad = None


def decompose_with(
    fp: FactorizedParam,
    usv: SVD,
    rank: int | None = None,
    *,
    split: Split = "sqrt",
    trained: Factor | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Cut a precomputed SVD at ``rank`` (None: full rank) into A, B and switch to lowrank mode.

    split="sqrt": A = U·√σ, B = √σ·Vᵀ. split="sigma": σ goes to the ``trained``
    factor (A = U·σ, B = Vᵀ for "A"; A = U, B = σ·Vᵀ for "B"). A and B keep their
    Parameter identity; their grads are cleared, W's too. If ``optimizer`` is given,
    the state of A and B is resized to the new rank (:func:`resize_state`).
    """
    u, s, vh = usv
    full = int(s.numel())
    r = full if rank is None else int(rank)
    if not 1 <= r <= full:
        raise ValueError(f"rank for {fp.name} must be in [1, {full}], got {rank}")
    if split == "sqrt":
        root = s[:r].sqrt()
        a = u[:, :r] * root
        b = root[:, None] * vh[:r]
    elif split == "sigma":
        if trained == "A":
            a, b = u[:, :r] * s[:r], vh[:r]
        elif trained == "B":
            a, b = u[:, :r], s[:r, None] * vh[:r]
        else:
            raise ValueError(f'split="sigma" needs trained="A" or trained="B", got {trained!r}')
    else:
        raise ValueError(f'split must be "sqrt" or "sigma", got {split!r}')

    w = fp.weight
    fp.A.data = a.to(dtype=w.dtype, device=w.device).contiguous()
    fp.B.data = b.to(dtype=w.dtype, device=w.device).contiguous()
    _set_grads_none(fp.A, fp.B, w)
    if optimizer is not None:
        resize_state(optimizer, fp.A, factor="A", new_rank=r)
        resize_state(optimizer, fp.B, factor="B", new_rank=r)
    fp.param.note = f"rank {r} of {full}"
    set_mode([fp], "lowrank")


def decompose(
    fp: FactorizedParam,
    rank: int | None = None,
    *,
    split: Split = "sqrt",
    trained: Factor | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """SVD of W, then :func:`decompose_with` at ``rank`` (None: full rank, no truncation)."""
    decompose_with(fp, svd(fp), rank, split=split, trained=trained, optimizer=optimizer)


def decompose_all(
    records: Sequence[FactorizedParam],
    ranks: Sequence[int | None],
    svds: Sequence[SVD] | None = None,
    *,
    min_compression: float | None = 1.0,
    split: Split = "sqrt",
    trained: Factor | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[bool]:
    """Decompose each record at its (already agreed) rank where it pays; return which were.

    A layer whose rank does not pay (:func:`pays` with ``min_compression``) is
    recomposed if needed and stays in full mode for this AB phase. Pass
    ``min_compression=None`` to factorise everything (the first, untruncated
    decomposition: full rank never pays). ``svds`` defaults to fresh :func:`svd` calls.
    """
    if len(ranks) != len(records) or (svds is not None and len(svds) != len(records)):
        raise ValueError("records, ranks and svds must have the same length")
    done = []
    for i, fp in enumerate(records):
        usv = svds[i] if svds is not None else None
        r = ranks[i]
        r_eff = min(fp.m, fp.n) if r is None else r
        if min_compression is not None and not pays(fp.m, fp.n, r_eff, min_compression):
            if fp.mode == "lowrank":
                recompose(fp)
            fp.param.note = (
                f"does not pay at rank {r_eff}: r(m+n)={r_eff * (fp.m + fp.n)} "
                f">= m*n/{min_compression:g}={fp.m * fp.n / min_compression:g}"
            )
            done.append(False)
            continue
        decompose_with(fp, usv if usv is not None else svd(fp), r, split=split, trained=trained, optimizer=optimizer)
        done.append(True)
    return done


def recompose(fp: FactorizedParam) -> None:
    """W = (A @ B).reshape(shape) in W's dtype, in place; switch to full mode.

    A and B keep their values (and optimizer state); their grads are cleared.
    """
    if fp.rank == 0:
        raise ValueError(f"{fp.name} has no factors to recompose; call decompose first")
    w = fp.weight
    with torch.no_grad():
        w.copy_((fp.A @ fp.B).reshape(fp.shape).to(w.dtype))
    _set_grads_none(fp.A, fp.B, w)
    fp.param.note = "recomposed"
    set_mode([fp], "full")


def set_mode(records: Iterable[FactorizedParam], mode: Mode) -> None:
    """Switch the forward pass to W ("full") or A@B ("lowrank"), with matching requires_grad.

    This does not move values: use :func:`decompose` / :func:`recompose` for that.
    Lowrank mode trains A and B (narrow with :func:`set_trainable`); full mode trains W.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    for fp in records:
        if mode == "lowrank" and fp.rank == 0:
            raise ValueError(f"{fp.name} has no factors yet; call decompose before switching to lowrank")
        fp.param.mode = mode
        low = mode == "lowrank"
        fp.weight.requires_grad_(not low)
        fp.A.requires_grad_(low)
        fp.B.requires_grad_(low)


def set_trainable(records: Iterable[FactorizedParam], role: str) -> None:
    """Choose which factor trains: role "A" (B frozen), "B" (A frozen), "both" or "full".

    Applies to layers in lowrank mode; layers in full mode always train W (and
    role "full" requires every layer to be in full mode). Frozen tensors get
    ``requires_grad=False`` and so no gradient, which optimizers skip.
    """
    if role not in _ROLES:
        raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
    for fp in records:
        if fp.mode == "full":
            fp.weight.requires_grad_(True)
            fp.A.requires_grad_(False)
            fp.B.requires_grad_(False)
            continue
        if role == "full":
            raise ValueError(f'{fp.name} is in lowrank mode; recompose it before role "full"')
        fp.weight.requires_grad_(False)
        fp.A.requires_grad_(role in ("A", "both"))
        fp.B.requires_grad_(role in ("B", "both"))
        if not fp.A.requires_grad:
            fp.A.grad = None
        if not fp.B.requires_grad:
            fp.B.grad = None


# ---------------------------------------------------------------------------
# Optimizer state


def resize_state(optimizer: torch.optim.Optimizer, param: Tensor, *, factor: Factor, new_rank: int) -> None:
    """Fit the optimizer state of factor ``param`` to ``new_rank``.

    Every 2-D state tensor shaped like the factor at some rank (m×k for "A", k×n for
    "B": momentum_buffer, exp_avg, exp_avg_sq, max_exp_avg_sq, ...) keeps its first
    ``new_rank`` columns (A) / rows (B), zero-padded when the rank grows. Scalars
    (``step``) are untouched. The fixed dimension is read from ``param``, so this
    may be called before or after the factor's ``.data`` changes.
    """
    if factor not in ("A", "B"):
        raise ValueError(f'factor must be "A" or "B", got {factor!r}')
    if new_rank < 0:
        raise ValueError(f"new_rank must be >= 0, got {new_rank}")
    state = optimizer.state.get(param)
    if not state:
        return
    dim = 1 if factor == "A" else 0
    fixed = param.shape[1 - dim]
    for key, value in state.items():
        if not isinstance(value, Tensor) or value.ndim != 2 or value.shape[1 - dim] != fixed:
            continue
        k = value.shape[dim]
        if k == new_rank:
            continue
        if k > new_rank:
            state[key] = value.narrow(dim, 0, new_rank).clone()
        else:
            pad_shape = list(value.shape)
            pad_shape[dim] = new_rank - k
            state[key] = torch.cat([value, value.new_zeros(pad_shape)], dim=dim)


def reset_state(optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> None:
    """Drop the optimizer state of ``params``; it is recreated lazily on their next step."""
    for p in params:
        optimizer.state.pop(p, None)


# ---------------------------------------------------------------------------
# Initialisation


@torch.no_grad()
def ortho_sigma_init(records: Iterable[FactorizedParam]) -> None:
    """Set every singular value of each W to 1, keeping W's singular vectors: W = U·Vᵀ.

    Applied to the model's default initialisation, this keeps its random
    directions and gives every factorisable layer a flat spectrum. Workers
    that start from the same weights end with the same weights. Call while
    the layers are in full mode.
    """
    for fp in records:
        if fp.mode != "full":
            raise ValueError(f"{fp.name} is in lowrank mode; ortho_sigma_init sets full-rank weights")
        w = fp.weight
        u, _, vh = torch.linalg.svd(w.detach().reshape(fp.m, fp.n).float(), full_matrices=False)
        w.copy_((u @ vh).reshape(fp.shape).to(dtype=w.dtype, device=w.device))


def output_weights(output: Tensor, records: Sequence[FactorizedParam]) -> list[FactorizedParam]:
    """The factorisable layers whose weights produce ``output``: the model's output layer(s).

    A breadth-first walk from ``output.grad_fn`` stops at the first depth where
    the gradient reaches any weight (a parameter of ≥ 2 dims); the records among
    those weights are returned (W in full mode, A or B in low-rank mode). A model
    with two output layers gives both; one whose nearest weight is not a record
    (kept full rank by name, tied to an embedding) gives none. Works whatever
    the layer is called and whatever follows it (a division by a temperature, a
    reshape). Empty when ``output`` has no autograd graph.
    """
    owner = {id(t): fp for fp in records for t in (fp.weight, fp.A, fp.B)}
    frontier = [output.grad_fn] if output.grad_fn is not None else []
    seen: set[int] = set()
    while frontier:
        weights: list[Tensor] = []
        following = []
        for node in frontier:
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)
            if variable is not None and variable.ndim >= 2:
                weights.append(variable)
            following.extend(next_node for next_node, _ in node.next_functions)
        if weights:
            found = [owner[id(w)] for w in weights if id(w) in owner]
            return list({id(fp): fp for fp in found}.values())
        frontier = following
    return []


# ---------------------------------------------------------------------------
# Counting and reporting


def _factor_ids(records: Iterable[FactorizedParam]) -> set[int]:
    return {id(p) for fp in records for p in (fp.A, fp.B)}


def full_param_count(model: nn.Module, records: Sequence[FactorizedParam]) -> int:
    """Parameters of the full-rank model: every parameter, factors A and B excluded."""
    factors = _factor_ids(records)
    return sum(p.numel() for p in model.parameters() if id(p) not in factors)


def ab_param_count(model: nn.Module, records: Sequence[FactorizedParam]) -> int:
    """Parameters during the AB phase: A and B of lowrank layers (not their W), plus everything else."""
    skip = _factor_ids(records) | {id(fp.weight) for fp in records if fp.mode == "lowrank"}
    kept = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return kept + sum(fp.A.numel() + fp.B.numel() for fp in records if fp.mode == "lowrank")


def compression_ratio(model: nn.Module, records: Sequence[FactorizedParam]) -> float:
    """full_param_count / ab_param_count, for the model's current modes."""
    return full_param_count(model, records) / ab_param_count(model, records)


def format_ratio(x: float) -> str:
    """Compression ratio as printed in reports: ``"12.3:1"``."""
    return f"{x:.1f}:1"


def describe(records: Iterable[FactorizedParam]) -> list[dict[str, Any]]:
    """One row per layer: name, shape, matrix (m, n), mode, rank, params_full, params_lowrank, note."""
    rows = []
    for fp in records:
        low = fp.mode == "lowrank"
        rows.append(
            {
                "name": fp.name,
                "shape": tuple(fp.shape),
                "matrix": (fp.m, fp.n),
                "mode": fp.mode,
                "rank": fp.rank if low else None,
                "params_full": fp.m * fp.n,
                "params_lowrank": fp.rank * (fp.m + fp.n) if low else None,
                "note": fp.param.note,
            }
        )
    return rows


def decision_lines(records: Iterable[FactorizedParam]) -> list[str]:
    """One line per layer: its rank and parameter counts, or why it is full rank."""
    lines = []
    for row in describe(records):
        m, n = row["matrix"]
        if row["mode"] == "lowrank":
            lines.append(f"{row['name']} {row['shape']} as {m}x{n}: rank {row['rank']}, "
                         f"{row['params_full']} -> {row['params_lowrank']} params")
        else:
            lines.append(f"{row['name']} {row['shape']} as {m}x{n}: full rank: {row['note']}")
    return lines


def log_decisions(records: Iterable[FactorizedParam], log: logging.Logger | None = None) -> None:
    """Log :func:`decision_lines` at INFO."""
    log = log or logger
    for line in decision_lines(records):
        log.info("%s", line)



@torch.no_grad()
def plain_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every parametrized weight replaced by the weight its forward uses.

    ``features.3.parametrizations.weight.original`` (and the factors ``...weight.0.A``,
    ``...0.B``, the mode in ``..._extra_state``) become one ``features.3.weight``
    holding W in full mode or ``(A @ B).reshape(shape)`` in low-rank mode: the
    keys and shapes of the model before :func:`prepare_model`, so the result loads
    into a freshly built instance of the user's model class.
    """
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if ".parametrizations." not in f".{key}":
            out[key] = value
            continue
        owner, _, rest = f".{key}".rpartition(".parametrizations.")
        pname, _, leaf = rest.partition(".")
        if leaf != "original":
            continue  # factors and modes: folded into the weight below
        module = model.get_submodule(owner.lstrip("."))
        out[f"{owner.lstrip('.')}.{pname}".lstrip(".")] = getattr(module, pname).detach().clone()
    return out
