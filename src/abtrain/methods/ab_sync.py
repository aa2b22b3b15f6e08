"""AB-training's sync: every worker leaves it with one model (W = Ā·B̄), in one of four modes."""

from __future__ import annotations

import torch
from torch import nn

from .. import lowrank
from ..comm import Communicator, Group


def full_rank_tensors(module: nn.Module, records: list[lowrank.FactorizedParam]) -> list[torch.Tensor]:
    """Parameters not represented by factors this phase (full-mode W, biases, norms, kept layers)."""
    factor_ids = {id(t) for fp in records for t in (fp.A, fp.B)}
    low_ids = {id(fp.weight) for fp in records if fp.mode == "lowrank"}
    return [p for p in module.parameters() if id(p) not in factor_ids and id(p) not in low_ids]


@torch.no_grad()
def average_models(comm: Communicator, world: Group, mode: str, low: list[lowrank.FactorizedParam],
                   rest: list[torch.Tensor], buffers: list[torch.Tensor], wire: torch.dtype | None, *,
                   in_a: bool, n_a: int, one_group: bool) -> None:
    """Average the factors of the ``low`` layers and ``rest`` over ``world`` as the sync ``mode`` says.

    ``in_a``: this worker trained A; ``n_a``: workers that trained A; ``one_group``:
    only-b trained B over one group of every worker, so only the buffers drifted apart.
    """
    if mode == "with-stale":
        comm.all_reduce_tensors([t for fp in low for t in (fp.A, fp.B)] + rest, world, wire_dtype=wire)
    elif mode == "only-learned":
        _average_learned(comm, world, low, rest, wire, in_a=in_a, n_a=n_a)
    elif mode == "full":
        for fp in low:
            lowrank.recompose(fp)
        comm.all_reduce_tensors([fp.weight for fp in low] + rest, world, wire_dtype=wire)
    elif one_group:
        # only-b over one group of everyone: nothing drifts apart but BatchNorm statistics
        comm.all_reduce_tensors(buffers, world, wire_dtype=wire)
    else:  # only-b in groups: A is the same frozen factor everywhere; B and the rest are averaged
        comm.all_reduce_tensors([fp.B for fp in low] + rest, world, wire_dtype=wire)


def _average_learned(comm: Communicator, world: Group, low: list[lowrank.FactorizedParam],
                     rest: list[torch.Tensor], wire: torch.dtype | None, *, in_a: bool, n_a: int) -> None:
    """only-learned: mean of A over the A-groups, mean of B over the B-groups, the rest over everyone.

    One summed all-reduce (the bytes of with-stale): each worker contributes its
    trained factor divided by the number of workers that trained it, zeros for
    its frozen factor, and the rest divided by the world size.
    """
    n_b = world.size - n_a
    contrib = []
    for fp in low:
        contrib.append(fp.A / n_a if in_a else torch.zeros_like(fp.A))
        contrib.append(fp.B / n_b if not in_a else torch.zeros_like(fp.B))
    contrib += [t / world.size for t in rest]
    comm.all_reduce_tensors(contrib, world, average=False, wire_dtype=wire)
    for fp, a, b in zip(low, contrib[0::2], contrib[1::2]):
        fp.A.copy_(a)
        fp.B.copy_(b)
    for t, mean in zip(rest, contrib[2 * len(low):]):
        t.copy_(mean)
