"""Decomposition: W = U·diag(S)·Vᵀ cut into factors A and B, and back to W (their optimizer state: :mod:`.optimizer_state`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ...registry import MethodInputError
from .layers import Factor, FactorizedParam, Split, release_weight, replace_data, restore_weight
from .modes import set_mode
from .optimizer_state import map_state, resize_state

logger = logging.getLogger(__name__)


class SVD(NamedTuple):
    """Thin SVD of W as m×n, float32: W = U·diag(S)·Vh."""

    U: Tensor
    S: Tensor
    Vh: Tensor


class SVDError(MethodInputError):
    """A weight could not be decomposed (non-finite values, or no SVD in float32 nor float64)."""


class NonFiniteWeight(SVDError, FloatingPointError):
    """The weight to decompose holds inf or nan: training diverged."""


def svd(fp: FactorizedParam) -> SVD:
    """Thin SVD of the current W as its factorised m×n matrix (:meth:`FactorizedParam.matrix`) in float32, retried
    in float64 if float32 fails.

    A wide W (m < n) is decomposed as its transpose, tall, and the result turned back: LAPACK's
    divide-and-conquer SVD first reduces a tall matrix to its m×m triangular factor by QR, and on the
    wide layout it does not (512×6272 in float32 on one core: 0.62 s wide, 0.14 s tall, the same values
    up to rounding). U and Vh come back contiguous, as on every worker, so that products with them take
    the same BLAS kernel, and so the same rounding, everywhere.
    """
    w = fp.matrix()
    if not torch.isfinite(w).all():
        raise NonFiniteWeight(f"cannot decompose {fp.name}: its weight holds inf or nan")
    wide = fp.m < fp.n
    for dtype in (torch.float32, torch.float64):
        try:
            u, s, vh = torch.linalg.svd((w.T if wide else w).to(dtype), full_matrices=False)
        except RuntimeError as err:  # LinAlgError (no convergence) is a RuntimeError
            logger.warning("SVD of %s failed in %s: %s", fp.name, dtype, err)
            continue
        if all(bool(torch.isfinite(t).all()) for t in (u, s, vh)):
            if wide:
                u, vh = vh.T, u.T
            return SVD(u.float().contiguous(), s.float(), vh.float().contiguous())
        logger.warning("SVD of %s in %s gave non-finite values", fp.name, dtype)
    raise SVDError(f"SVD of {fp.name} ({fp.m}x{fp.n}) failed in float32 and float64")


UPDATE_RTOL = 1e-4  # largest relative residual ‖(W − U·S·Vh)·X‖/‖W·X‖ an updated SVD may leave
CHECK_PROBES = 8  # random vectors X that check an updated SVD against W


class LowRankSum(NamedTuple):
    """W written as U·core·Vh + P·Qᵀ: U (m×r) and Vhᵀ (n×r) with orthonormal columns, core r×r, P m×q, Q n×q."""

    U: Tensor
    core: Tensor
    Vh: Tensor
    P: Tensor
    Q: Tensor


def tangent_parts(basis: SVD, p: Tensor, q: Tensor, core: float = 1.0) -> LowRankSum:
    """The tangent merge of a change P·Qᵀ into the SVD (U, σ, Vᵀ) its phase started from, as parts:
    UσVᵀ + PQᵀ − (1 − core)·U(UᵀPQᵀV)Vᵀ = U·(diag σ − (1 − core)·(UᵀP)(VᵀQ)ᵀ)·Vᵀ + P·Qᵀ
    (what :func:`recompose` computes from ``basis``, the change P·Qᵀ and ``core``)."""
    u, s, vh = basis
    middle = torch.diag(s)
    if core != 1.0:
        middle = middle - (1.0 - core) * ((u.T @ p) @ (vh @ q).T)
    return LowRankSum(u, middle, vh, p, q)


def _orthogonal_part(x: Tensor, basis: Tensor) -> Tensor:
    """x minus its projection on the orthonormal columns of ``basis``, projected twice ("twice is enough":
    one classical Gram-Schmidt pass loses orthogonality where x lies mostly inside the basis)."""
    x = x - basis @ (basis.T @ x)
    return x - basis @ (basis.T @ x)


def _range(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """(O, R) with O's columns an orthonormal basis of x's numerical range and x = O·R up to rounding.

    From x's SVD, keeping the singular values above max(rows, cols)·eps·``scale`` (numpy's matrix_rank
    tolerance, against the norm of what x was projected from): where x has fewer independent columns
    than columns (the part of P outside U when r + q > m), a QR would complete O with directions of
    rounding noise, which need not be orthogonal to the basis x was projected against; the directions
    dropped change W by less than that tolerance.
    """
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    keep = int((s > max(x.shape) * torch.finfo(x.dtype).eps * scale).sum())
    return u[:, :keep], s[:keep, None] * vh[:keep]


def svd_update(fp: FactorizedParam, parts: LowRankSum, rtol: float = UPDATE_RTOL) -> SVD | None:
    """The SVD of W = U·core·Vh + P·Qᵀ from those parts, checked against W; None where the check fails.

    After a sync whose change of W has rank q (the low-rank sync payload), W is the SVD the
    phase started from plus that change: its columns lie in span[U, P], its rows in
    span[Vhᵀ, Q]. P and Q are split into their parts inside and outside those bases
    (:func:`_range` of each outside part: k_p ≤ min(q, m − r) and k_q ≤ min(q, n − r) new
    directions); W's SVD is then the SVD of an (r+k_p)×(r+k_q) matrix carried back to m and n
    dimensions (Brand 2006, "Fast low-rank modifications of the thin singular value
    decomposition"), exact up to rounding, in about (m + n)·(r+q)² multiply-adds where W's own
    SVD takes about 4·max(m, n)·min(m, n)² (fc1 of 512×6272 at r = 473, q = 64: 0.07 s against
    0.14 s on one core). It holds also where r + q reaches min(m, n): one side's new directions
    are then fewer than q.

    The result is checked against the weight itself, on 8 random vectors X (a fixed seed):
    where the relative residual ‖(W − U·S·Vh)·X‖_F / ‖W·X‖_F exceeds ``rtol`` (at least 4
    ulps of W's dtype) (W changed since the parts were taken, or rounding went wrong), None
    is returned and the caller falls back to :func:`svd`.

    U and Vh hold min(r+k_p, r+k_q) singular vectors; S is padded with zeros to min(m, n)
    values (W's other singular values are zero), so that rank rules see the length they see
    after a full SVD. A rank above the vectors held needs :func:`svd`.
    """
    stored = fp.effective_weight()
    w = fp.param.matrix(stored).float()
    rtol = max(rtol, 4 * torch.finfo(stored.dtype).eps)  # W held in a narrow dtype is only that close to the sum
    u, core, vh = parts.U.float(), parts.core.float(), parts.Vh.float()
    p, q = parts.P.float(), parts.Q.float()
    if not all(bool(torch.isfinite(t).all()) for t in (u, core, vh, p, q)):
        return None  # W or its change holds inf or nan: the full SVD says so, as the divergence it is
    v = vh.T
    pu, qv = u.T @ p, vh @ q  # the parts of P and Q inside the bases
    try:
        op, rp = _range(_orthogonal_part(p, u), torch.linalg.matrix_norm(p))
        oq, rq = _range(_orthogonal_part(q, v), torch.linalg.matrix_norm(q))
        middle = torch.cat([torch.cat([core + pu @ qv.T, pu @ rq.T], 1),
                            torch.cat([rp @ qv.T, rp @ rq.T], 1)], 0)
        uk, s, vkh = torch.linalg.svd(middle, full_matrices=False)
    except RuntimeError as err:  # no convergence (of any of the three small SVDs): the full SVD decides
        logger.info("updated SVD of %s failed (%s): full SVD instead", fp.name, err)
        return None
    new_u = torch.cat([u, op], 1) @ uk
    new_vh = vkh @ torch.cat([vh, oq.T], 0)
    if not all(bool(torch.isfinite(t).all()) for t in (new_u, s, new_vh)):
        return None
    # W against the result on a few random vectors, drawn from a fixed seed so that every worker decides alike:
    # ‖E·X‖_F² estimates ‖E‖_F² times their number, at a fraction of forming U·S·Vh (m·n·(r+q) multiply-adds)
    probes = torch.randn(fp.n, CHECK_PROBES, generator=torch.Generator(device=w.device).manual_seed(0),
                         device=w.device, dtype=w.dtype)
    wx = w @ probes
    residual = (torch.linalg.matrix_norm(wx - new_u @ (s[:, None] * (new_vh @ probes)))
                / torch.linalg.matrix_norm(wx).clamp_min(1e-30))
    if float(residual) > rtol:
        logger.info("updated SVD of %s leaves a relative residual of %.2e (> %.0e): full SVD instead",
                    fp.name, float(residual), rtol)
        return None
    padded = torch.zeros(min(fp.m, fp.n), dtype=s.dtype, device=s.device)
    padded[:s.numel()] = s
    return SVD(new_u, padded, new_vh)


def _set_grads_none(*params: nn.Parameter) -> None:
    for p in params:
        p.grad = None


def decompose(
    fp: FactorizedParam,
    rank: int | None = None,
    *,
    usv: SVD | None = None,
    split: Split = "sqrt",
    sigma_in: Factor = "A",
    optimizer: torch.optim.Optimizer | None = None,
    moments_against: tuple[Factor, Tensor] | None = None,
    frozen_orthonormal: bool = False,
) -> None:
    """Cut the SVD of W (``usv`` if already computed, else :func:`svd`) at ``rank`` (None: full rank) into A, B.

    split="sqrt": A = U·√σ, B = √σ·Vᵀ. split="sigma": σ goes to factor ``sigma_in``
    (A = U·σ, B = Vᵀ for "A"; A = U, B = σ·Vᵀ for "B"). A and B keep their
    Parameter identity; their grads are cleared, W's too. If ``optimizer`` is given,
    the state of A and B is resized to the new rank (:func:`resize_state`); with
    ``moments_against`` = (factor trained, the frozen factor it was trained against)
    the trained factor's state is instead mapped into the new factors' basis
    (:func:`map_state`; ``frozen_orthonormal``: its argument). The layer switches to lowrank mode.
    """
    u, s, vh = usv if usv is not None else svd(fp)
    full = int(s.numel())
    r = full if rank is None else int(rank)
    if not 1 <= r <= full:
        raise ValueError(f"rank for {fp.name} must be in [1, {full}], got {rank}")
    if r > u.shape[1]:
        raise ValueError(f"{fp.name}: the SVD given holds {u.shape[1]} singular vectors (an updated SVD), "
                         f"rank {r} needs the full one (svd)")
    if split == "sqrt":
        root = s[:r].sqrt()
        a = u[:, :r] * root
        b = root[:, None] * vh[:r]
    elif split == "sigma":
        if sigma_in == "A":
            a, b = u[:, :r] * s[:r], vh[:r]
        elif sigma_in == "B":
            a, b = u[:, :r], s[:r, None] * vh[:r]
        else:
            raise ValueError(f'split="sigma" needs sigma_in="A" or sigma_in="B", got {sigma_in!r}')
    else:
        raise ValueError(f'split must be "sqrt" or "sigma", got {split!r}')

    w = fp.weight
    # clone: a slice of U or Vh would keep the whole SVD's storage alive
    replace_data(fp.A, a.to(dtype=w.dtype, device=w.device).clone(memory_format=torch.contiguous_format))
    replace_data(fp.B, b.to(dtype=w.dtype, device=w.device).clone(memory_format=torch.contiguous_format))
    _set_grads_none(fp.A, fp.B, w)
    release_weight(fp)
    if optimizer is not None:
        mapped = moments_against[0] if moments_against is not None else None
        if mapped is not None:
            map_state(optimizer, fp, factor=mapped, frozen=moments_against[1], orthonormal=frozen_orthonormal)
        for name, factor in (("A", fp.A), ("B", fp.B)):
            if name != mapped:
                resize_state(optimizer, factor, factor=name, new_rank=r)
    fp.param.note = f"rank {r} of {full}"
    set_mode([fp], "lowrank")


def decompose_all(
    records: Sequence[FactorizedParam],
    ranks: Sequence[int | None],
    svds: Sequence[SVD] | None = None,
    *,
    split: Split = "sqrt",
    sigma_in: Factor = "A",
    optimizer: torch.optim.Optimizer | None = None,
    moments_against: dict[str, tuple[Factor, Tensor]] | None = None,
    frozen_orthonormal: bool = False,
) -> None:
    """Decompose each record at its (already agreed) rank (None: full rank).

    ``svds`` defaults to fresh :func:`svd` calls. ``moments_against`` (by layer name) and
    ``frozen_orthonormal`` are :func:`decompose`'s.
    """
    if len(ranks) != len(records) or (svds is not None and len(svds) != len(records)):
        raise ValueError("records, ranks and svds must have the same length")
    for i, fp in enumerate(records):
        decompose(fp, ranks[i], usv=svds[i] if svds is not None else None, split=split, sigma_in=sigma_in,
                  optimizer=optimizer, moments_against=(moments_against or {}).get(fp.name),
                  frozen_orthonormal=frozen_orthonormal)


def recompose(fp: FactorizedParam, basis: SVD | None = None, change: Tensor | None = None,
              core: float = 1.0, parts: LowRankSum | None = None) -> None:
    """W of the matrix A @ B (:meth:`LowRankWeight.weight_of`) in W's dtype, in place; switch to full mode.

    With ``basis`` = (U, σ, Vᵀ), the rank-r SVD the factors started from, W is instead
    the tangent merge UσVᵀ + (A − Uσ)·Vᵀ + U·(B − σVᵀ): the start
    point plus the change of A (trained against B = Vᵀ) and the change of B (trained
    against A = U), each in W's space, without the product of the two changes.
    ``change`` (with ``basis``): those two changes already summed, as one m×n tensor
    (a sync that sent W's change instead of the factors): W = UσVᵀ + change.
    ``core`` (with ``basis``): the weight of the part of the change both factors can
    make, U·(Uᵀ·change·V)·Vᵀ (1: as it came; 0.5: halved, so that where an A-group
    and a B-group each moved W by its gradient projected on their factor's space,
    the sum is the gradient projected on the tangent space, counted once).
    ``parts`` (instead of the three above): W = U·core·Vh + P·Qᵀ, a :class:`LowRankSum`
    (:func:`tangent_parts` of a change that arrived as P·Qᵀ): the same W up to rounding, in
    m·n·(r+q) + m·r² multiply-adds where basis, change and a halved core take about
    3·m·n·r + (m+n)·r² (the wide model's fc1 at rank 660, q = 64: 1.6 G against 4.3 G).
    A and B hold no numbers afterwards (their optimizer state stays); their grads are cleared.
    """
    if fp.rank == 0:
        raise ValueError(f"{fp.name} has no factors to recompose; call decompose first")
    if change is not None and basis is None:
        raise ValueError(f"{fp.name}: a change of W is added to the SVD the factors started from; pass basis too")
    if parts is not None and (basis is not None or change is not None):
        raise ValueError(f"{fp.name}: give the merge as parts or as basis and change, not both")
    w = restore_weight(fp)
    with torch.no_grad():
        if parts is not None:
            merged = (parts.U @ parts.core) @ parts.Vh + parts.P @ parts.Q.T
        elif basis is None:
            merged = fp.A @ fp.B
        else:
            u, s, vh = basis
            if u.shape != fp.A.shape or vh.shape != fp.B.shape:
                raise ValueError(f"{fp.name}: basis of rank {s.numel()} does not match factors of rank {fp.rank}")
            start = u * s
            if change is not None:
                change = change.reshape(fp.m, fp.n)
            else:
                change = (fp.A - start) @ vh + u @ (fp.B - s[:, None] * vh)
            if core != 1.0:
                change = change - (1.0 - core) * (u @ (u.T @ change @ vh.T) @ vh)
            merged = start @ vh + change
        w.copy_(fp.param.weight_of(merged).to(w.dtype))
    _set_grads_none(fp.A, fp.B, w)
    # The factors' values are replaced by the next decomposition, so they hold no numbers in between (their
    # optimizer state stays, for the next decomposition to resize or map): a full-rank layer costs W alone.
    replace_data(fp.A, fp.A.new_empty(fp.m, 0))
    replace_data(fp.B, fp.B.new_empty(0, fp.n))
    fp.param.note = "recomposed"
    set_mode([fp], "full")


@torch.no_grad()
def unit_spectrum(w: Tensor) -> None:
    """W (viewed as W.shape[0] × the rest) = U·Vᵀ from its own SVD, in place: every singular value 1, the singular
    vectors kept (a matrix of one row or column, one singular value, scaled to unit norm). The matrix's
    transpose gives the same result."""
    u, _, vh = torch.linalg.svd(w.detach().reshape(w.shape[0], -1).float(), full_matrices=False)
    w.copy_((u @ vh).reshape(w.shape).to(dtype=w.dtype, device=w.device))


@torch.no_grad()
def ortho_sigma_init(records: Iterable[FactorizedParam]) -> None:
    """Set every singular value of each W to 1, keeping W's singular vectors: W = U·Vᵀ (:func:`unit_spectrum`).

    Applied to the model's default initialisation, this keeps its random
    directions and gives every factorisable layer a flat spectrum. Workers
    that start from the same weights end with the same weights. Call while
    the layers are in full mode.
    """
    for fp in records:
        if fp.mode != "full":
            raise ValueError(f"{fp.name} is in lowrank mode; ortho_sigma_init sets full-rank weights")
        unit_spectrum(fp.weight)
