"""The optimizer state of a layer's factors when its decomposition changes: resized, mapped or dropped."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import Tensor

from .layers import Factor, FactorizedParam

logger = logging.getLogger(__name__)


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


#: State tensors that are sums of gradients (mapped linearly) and of squared gradients (mapped through T∘T).
FIRST_MOMENTS = ("momentum_buffer", "exp_avg")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
PINV_RTOL = 1e-6
ORTHONORMAL_ATOL = 1e-4  # largest |Gram - I| entry of a frozen factor map_state reads as orthonormal


@torch.no_grad()
def map_state(optimizer: torch.optim.Optimizer, fp: FactorizedParam, *, factor: Factor, frozen: Tensor,
              orthonormal: bool = False) -> None:
    """Carry the optimizer state of trained ``factor`` into the basis of the new A and B (already in place).

    The state was gathered as gradients of W = A·B₀ with respect to A, i.e.
    G·B₀ᵀ, with B₀ = ``frozen`` (for ``factor="B"``: A₀ᵀ·G). A new SVD gives
    factors in another basis (singular vectors rotate, signs flip, the rank can
    shrink), in which the old moments point the wrong way. Reading G back as
    M·(B₀ᵀ)⁺ gives them in the new basis: M' = M·T with T = (B₀ᵀ)⁺·B'ᵀ
    (for B: M' = T·M with T = A'ᵀ·(A₀ᵀ)⁺). When the new factors are only a
    re-parametrisation of the old ones (A' = A₀R, B' = R⁻¹B₀), T is R⁻ᵀ (Rᵀ for
    B), exactly how a gradient transforms. Second moments, averages of squared
    gradients, go through T∘T (exact for a signed permutation, and never
    negative). Other state (Adam's ``step``) is kept; state of other shapes is resized.

    ``orthonormal``: the frozen factor has orthonormal rows (B₀) or columns (A₀), as the
    tangent split's Vᵀ and U have, so its pseudo-inverse is its transpose: checked
    (k×k Gram matrix against the identity), the SVD of a pseudo-inverse saved where it holds.
    """
    param = fp.A if factor == "A" else fp.B
    state = optimizer.state.get(param)
    if not state:
        return
    f = frozen.to(torch.float32)
    rows = f if factor == "A" else f.T  # the frozen factor's k vectors, as rows
    if orthonormal:
        gram = rows @ rows.T
        orthonormal = bool((gram - torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)).abs().max()
                           < ORTHONORMAL_ATOL)
    inverse = f if orthonormal else _pinv(f.T)  # (f^T)^+
    if inverse is None:
        logger.warning("the optimizer state of %s's factor %s could not be carried into the new basis (no "
                       "pseudo-inverse of the frozen %s x %s factor in float32 nor float64): it starts again",
                       fp.name, factor, *f.shape)
        reset_state(optimizer, [param])
        return
    if factor == "A":  # frozen B₀: k×n, new B': r×n; T: k×r, applied on the right of the m×k moments
        t = inverse @ fp.B.detach().to(torch.float32).T
        expected = (fp.A.shape[0], f.shape[0])
    else:  # frozen A₀: m×k, new A': m×r; T: r×k, applied on the left of the k×n moments
        t = fp.A.detach().to(torch.float32).T @ inverse
        expected = (f.shape[1], fp.B.shape[1])
    for key, value in list(state.items()):
        if isinstance(value, Tensor) and tuple(value.shape) == expected and key in FIRST_MOMENTS + SECOND_MOMENTS:
            op = t if key in FIRST_MOMENTS else t * t
            v = value.to(torch.float32)
            state[key] = (v @ op if factor == "A" else op @ v).to(value.dtype)
    resize_state(optimizer, param, factor=factor, new_rank=fp.rank)  # state of any other shape


def _pinv(m: Tensor) -> Tensor | None:
    """``m``'s pseudo-inverse in float32, else float64 (LAPACK's SVD can fail to converge in float32 where the
    singular values cluster, as they do for a factor that is nearly but not quite orthonormal), else None.

    rtol: directions the frozen factor does not span carry no gradient, and must not blow up rounding."""
    for dtype in (torch.float32, torch.float64):
        try:
            return torch.linalg.pinv(m.to(dtype), rtol=PINV_RTOL).to(torch.float32)
        except RuntimeError:  # LinAlgError (no convergence) is a RuntimeError
            continue
    return None


def reset_state(optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> None:
    """Drop the optimizer state of ``params``; it is recreated lazily on their next step."""
    for p in params:
        optimizer.state.pop(p, None)
