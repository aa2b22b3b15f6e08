"""Whether every worker holds the same tensors, from a digest: 32 bytes instead of the tensors themselves."""

from __future__ import annotations

import hashlib

import torch

from .communicator import Communicator
from .group import Group


@torch.no_grad()
def same_everywhere(comm: Communicator, group: Group, tensors: list[torch.Tensor]) -> bool:
    """Whether every worker of ``group`` holds the same bits in ``tensors`` (the same shapes and dtypes, in order).

    Each worker hashes its tensors' bytes (BLAKE2b, 128 bits, shapes and dtypes included) into two int64 words;
    one all-reduce(MAX) of the words and their bitwise complements (32 bytes) gives every worker the largest
    and, complemented back, the smallest word of each: equal everywhere exactly when the largest is the
    smallest. Two different models share a digest with probability 2**-128. A group of one agrees with itself.
    """
    if group.size <= 1:
        return True
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        digest.update(f"{tuple(t.shape)}{t.dtype};".encode())
        digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    words = torch.frombuffer(bytearray(digest.digest()), dtype=torch.int64)
    both = torch.cat([words, torch.bitwise_not(words)]).to(comm_device(tensors))
    both = comm.all_reduce(both, group, op="max")
    return bool(torch.equal(both[:2], torch.bitwise_not(both[2:])))


def comm_device(tensors: list[torch.Tensor]) -> torch.device:
    """Where a small collective about ``tensors`` runs: their device (NCCL needs CUDA tensors), else the CPU."""
    return tensors[0].device if tensors else torch.device("cpu")
