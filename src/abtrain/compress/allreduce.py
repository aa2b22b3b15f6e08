"""The mean of a flat buffer over a group, sent in a codec's format: one all-reduce whichever the codec.

A compressed ring all-reduce in its two halves (1-bit Adam's ``compressed_allreduce``, Streaming DiLoCo's
4-bit outer gradients): the buffer, zero-padded to ``p`` slices of ``L`` elements (``L`` a multiple of the
codec's ``align``), is encoded slice by slice;

1. **all_to_all**: slice ``j``'s message goes to worker ``j``, which decodes the ``p`` versions of its
   slice in rank order, averages them in float32 and encodes the mean again;
2. **all_gather**: every worker receives every mean slice's message and decodes the same bytes the same
   way, so every worker returns the same mean.

With ``m`` the message bytes of one slice (``codec.message_bytes(L)``), per call and worker:
all_to_all payload ``p*m``, wire ``(p-1)*m``; all_gather payload ``m``, wire ``(p-1)*m``. A summable
codec (float32, bfloat16) goes through one all_reduce in its ``wire_dtype`` instead: payload
``message_bytes(numel)``, wire ``2(p-1)/p`` of it. Every collective runs through the communicator, so the
ledger counts every byte.

Error feedback is optional and explicit, at both ends: ``worker_error`` (``p*L`` elements, the padding
included; for a summable codec ``numel``) is added to the buffer before it is encoded and keeps what the
encoding lost; ``server_error`` (``L`` elements, this worker's slice) is added to the mean slice before it
is encoded again and keeps what that lost. 1-bit compression uses both; Streaming DiLoCo neither. A
summable codec has no second encoding, so no server error.
"""

from __future__ import annotations

import torch

from ..comm.communicator import Communicator
from ..comm.group import Group
from .codec import Codec


def slice_length(numel: int, slices: int, align: int) -> int:
    """``L``: the elements of each of ``slices`` slices that hold ``numel``, a whole multiple of ``align``."""
    return -(-numel // (slices * align)) * align


@torch.no_grad()
def compressed_all_reduce(comm: Communicator, group: Group, flat: torch.Tensor, codec: Codec, *,
                          worker_error: torch.Tensor | None = None,
                          server_error: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of float32 ``flat`` over ``group`` as ``codec`` carries it: a new tensor, the same on every worker.

    ``flat`` is left as it is; the error memories, when given, are updated in place (see the module docstring).
    """
    p, n = group.size, flat.numel()
    if codec.summable:
        if server_error is not None:
            raise ValueError(f"codec {codec.name} is summed by the all_reduce itself: it has no server error")
        return _summed(comm, group, flat, codec, worker_error)
    length = slice_length(n, p, codec.align)
    if worker_error is not None and worker_error.numel() != p * length:
        raise ValueError(f"worker_error holds {worker_error.numel()} elements, {p} slices of {length} need "
                         f"{p * length}")
    if server_error is not None and server_error.numel() != length:
        raise ValueError(f"server_error holds {server_error.numel()} elements, a slice {length}")
    if worker_error is not None:
        x = worker_error.clone()
        x[:n] += flat
    else:
        x = torch.zeros(p * length, dtype=torch.float32, device=flat.device)
        x[:n] = flat
    codecs = codec.for_slices(length, p)
    messages = [c.encode(s) for c, s in zip(codecs, x.view(p, length))]
    if worker_error is not None:
        worker_error.copy_(x.sub_(torch.cat([c.decode(m) for c, m in zip(codecs, messages)])))
    received = comm.all_to_all(torch.cat(messages), group).view(p, -1)

    # This worker's slice: the mean of the p workers' versions, added in rank order (the same sums everywhere).
    mine = codecs[comm.rank_in(group)]
    total = torch.zeros(length, dtype=torch.float32, device=flat.device)
    for row in received:
        total += mine.decode(row)
    mean = total.div_(p)
    if server_error is not None:
        mean.add_(server_error)
    message = mine.encode(mean)
    if server_error is not None:
        server_error.copy_(mean.sub_(mine.decode(message)))
    gathered = comm.all_gather(message, group)
    return torch.cat([c.decode(g) for c, g in zip(codecs, gathered)])[:n]


def _summed(comm: Communicator, group: Group, flat: torch.Tensor, codec: Codec,
            worker_error: torch.Tensor | None) -> torch.Tensor:
    """One all_reduce in the codec's dtype: a float32 sum is divided after it, a narrow one before (no overflow)."""
    x = flat.clone() if worker_error is None else flat + worker_error
    assert codec.wire_dtype is not None, "a summable codec names its wire dtype"
    sent = x if codec.wire_dtype == x.dtype else x.to(codec.wire_dtype)
    if worker_error is not None:
        worker_error.copy_(x - sent.to(x.dtype))
    if sent.dtype == torch.float32:
        comm.all_reduce(sent, group, average=True)
    else:
        comm.all_reduce(sent.div_(group.size), group)
    return sent.to(torch.float32)
