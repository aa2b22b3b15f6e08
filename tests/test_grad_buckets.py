"""In-group gradient averaging started during backward (AB phases), on simulated workers in one process."""

import copy

import pytest
import torch
from torch import nn

from abtrain.comm.recording import LocalWorld
from abtrain.methods.ab.buckets import OverlappedAverage


torch.manual_seed(0)
_TEMPLATE = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))


def _model():
    # a copy: the simulated workers are threads, and a seeded initialisation would race on the global RNG
    return copy.deepcopy(_TEMPLATE)


def _backward(model, rank, step=0):
    gen = torch.Generator().manual_seed(10 * rank + step)
    model(torch.randn(4, 6, generator=gen)).square().sum().backward()


@pytest.mark.parametrize("workers", [2, 3])
def test_buckets_start_during_backward_and_give_the_flat_average(workers):
    world = LocalWorld(workers)

    def worker(comm):
        model, reference = _model(), _model()
        overlap = OverlappedAverage(comm, bucket_bytes=100)  # several buckets for this model
        overlap.watch(list(model.parameters()))
        overlap.start(world.group)
        _backward(model, comm.rank)
        started = len(comm.calls)  # every bucket filled during backward, so every one has started
        overlap.finish()
        _backward(reference, comm.rank)
        comm.all_reduce_tensors([p.grad for p in reference.parameters()], world.group, average=True)
        same = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
        return started, len(overlap.buckets), same, [c.numel for c in comm.calls[:started]]

    for started, buckets, same, sizes in world.run(worker):
        assert buckets > 2 and started == buckets
        assert sum(sizes) == sum(p.numel() for p in _model().parameters())
        # sum then divide, element by element, as one flat all-reduce of every gradient
        assert same


def test_a_parameter_without_gradient_and_a_second_backward_still_give_the_mean():
    world = LocalWorld(2)

    def worker(comm):
        model = _model()
        unused = nn.Parameter(torch.zeros(3))
        overlap = OverlappedAverage(comm, bucket_bytes=100)
        overlap.watch(list(model.parameters()) + [unused])
        overlap.start(world.group)
        _backward(model, comm.rank, 0)
        _backward(model, comm.rank, 1)  # gradients accumulated again after their buckets left
        overlap.finish()
        return [p.grad.clone() for p in model.parameters()], unused.grad

    outs = world.run(worker)
    expected = []
    for rank in range(2):
        model = _model()
        _backward(model, rank, 0)
        _backward(model, rank, 1)
        expected.append([p.grad for p in model.parameters()])
    for grads, unused_grad in outs:
        assert unused_grad is None
        for g, a, b in zip(grads, *expected):
            assert torch.allclose(g, (a + b) / 2, atol=1e-6)


def test_idle_without_a_group_and_removable():
    world = LocalWorld(2)

    def worker(comm):
        model = _model()
        overlap = OverlappedAverage(comm)
        overlap.watch(list(model.parameters()))
        overlap.start(None)
        _backward(model, comm.rank)
        overlap.finish()
        overlap.close()  # the hooks are gone: armed again, a backward starts nothing
        overlap.start(world.group)
        _backward(model, comm.rank)
        return comm.calls

    for calls in world.run(worker):
        assert calls == []
