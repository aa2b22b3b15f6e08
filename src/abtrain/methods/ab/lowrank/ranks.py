"""Rank rules: how many singular values a factorised layer keeps, and whether its factors compress W."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


def factors_compress(m: int, n: int, r: int) -> bool:
    """True when rank-r factors of an m×n matrix hold fewer numbers than the matrix: r(m+n) < m·n."""
    return r * (m + n) < m * n


def paying_rank(m: int, n: int) -> int:
    """The largest rank whose factors hold fewer numbers than the m×n matrix: r(m+n) < m·n (0 if none does)."""
    return (m * n - 1) // (m + n)


def state_rank(m: int, n: int, moments: int, memory: float, extra: int = 0) -> int:
    """The largest rank at which the layer's training state on either role is no more than DDP's for W.

    DDP holds W, its gradient and ``moments`` per-element optimizer tensors: (2 + moments)·m·n numbers.
    A worker training one factor holds that factor, its gradient, its moments and its starting value (the
    tangent merge's), (3 + moments) copies of it, the frozen factor, ``memory`` times m·n numbers of error
    memory (the low-rank sync payload's: 1 in W's dtype, 0.5 in half its width, 0 without one), and ``extra``
    numbers whatever the rank (warm-start factors). The factor with the longer side, r·max(m, n), is the
    costlier to train.
    """
    budget = int((2 + moments - memory) * m * n) - extra
    return max(0, budget // ((3 + moments) * max(m, n) + min(m, n)))


@dataclass(frozen=True)
class RankRule:
    """How to pick a rank from singular values; set exactly one of tau, rank, fraction.

    tau: count of σ_i > τ·σ_1 (at least 1). rank: fixed rank. fraction: round(fraction·min(m,n)).
    ``max_rank`` caps any of them.
    """

    tau: float | None = None
    rank: int | None = None
    fraction: float | None = None
    max_rank: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("tau", "rank", "fraction") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one rank rule (tau, rank or fraction), got {given or 'none'}")
        if self.tau is not None and not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau must be in (0, 1) (relative cut-off of σ/σ_1, e.g. 0.15), got {self.tau}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1] (share of full rank), got {self.fraction}")
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
        else:
            assert self.fraction is not None
            r = round(self.fraction * full)
        if self.max_rank is not None:
            r = min(r, self.max_rank)
        return max(1, min(r, full))
