"""What a factorised layer computes and trains: its mode (W, or A·B) and, in lowrank mode, which factor trains."""

from __future__ import annotations

from collections.abc import Iterable

from .layers import _MODES, FactorizedParam, Mode

_ROLES = ("A", "B", "both", "full")


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
