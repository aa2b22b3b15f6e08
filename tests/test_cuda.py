"""On a GPU: AB-training's steps on CUDA tensors, collective times from CUDA events, worlds of 2 on CUDA tensors.

The CUDA cases are skipped on a machine without CUDA (benchmarks/gpu_check.py runs them on one);
the CPU cases run the same test bodies everywhere, so that what the GPU runs is known to work.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import abtrain
from abtrain.comm.group import Group
from abtrain.comm.ledger import Ledger

from helpers import run_world

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per worker: needs 2 GPUs")


def _model() -> nn.Module:
    """A convolution and two linear layers: every kind of weight AB-training factorises."""
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def _train(method: abtrain.methods.Method, steps: int, seed: int) -> tuple[nn.Module, list[float]]:
    dev = method.topo.device
    model = method.prepare(_model().to(dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    method.attach(opt)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 3, 8, 8, generator=gen).to(dev), torch.randint(10, (8,), generator=gen).to(dev)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    method.detach()
    return model, losses


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_ab_training_steps_on_the_device_in_one_process(device):
    """only-b runs in a world of one: warm-up, a decomposition, AB steps, syncs, all on the device's tensors."""
    torch.manual_seed(0)
    method = abtrain.setup("ab", total_steps=9, device=device, quiet=True, sync="only-b", warmup_steps=2,
                           sync_every=3, min_rank=1)
    assert method.topo.device.type == device
    model, losses = _train(method, 9, seed=0)
    assert all(math.isfinite(v) for v in losses)
    assert {p.device.type for p in model.parameters()} == {device}
    assert len(method.ranks) >= 2 and method.state.syncs >= 2  # the first decomposition and truncations after syncs
    assert any(r is not None for r in method.ranks[-1]["layers"].values())  # something trained low rank
    assert method.peak_state.keys() >= {"warmup", "ab"} and method.peak_state_bytes > 0
    exported = method.export()
    assert {t.device.type for t in exported.values()} == {device}
    method.close()


@CUDA
def test_collective_times_on_the_gpu_come_from_cuda_events():
    """device_timing: the ledger keeps the event pair and reads it at the summary, a time close to the host's."""
    ledger = Ledger()
    x = torch.randn(2048, 2048, device="cuda")
    x @ x  # the first matmul loads the kernels
    torch.cuda.synchronize()
    host = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        x = (x @ x) / 2048
    end.record()
    ledger.record("all_reduce", Group("world", 2, "global"), x, 0.0, (start, end))
    assert ledger.device_times.pending  # nothing read yet
    seconds = ledger.summary()["seconds"]
    host = time.perf_counter() - host  # the summary waited for the end event
    assert not ledger.device_times.pending
    assert 0 < seconds <= host


def _train_in_world(name: str, device: str, backend: str) -> dict:
    torch.manual_seed(0)
    options = {"warmup_steps": 2, "sync_every": 3, "min_rank": 1} if name == "ab" else {}
    method = abtrain.setup(name, total_steps=9, device=device, backend=backend, quiet=True, **options)
    model, losses = _train(method, 9, seed=dist.get_rank())
    comm = method.comm.ledger.summary()
    out = {"weights": {k: v.detach().cpu() for k, v in method.export().items()}, "losses": losses,
           "devices": {p.device.type for p in model.parameters()}, "backend": method.topo.backend,
           "device_index": method.topo.device.index, "calls": comm["calls"], "seconds": comm["seconds"],
           "syncs": method.state.syncs if name == "ab" else None}
    method.close()
    return out


@pytest.mark.parametrize("name", ["ddp", "ab"])
@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), pytest.param("cuda", "gloo", marks=CUDA),
                                             pytest.param("cuda", "nccl", marks=[CUDA, TWO_GPUS])])
def test_a_world_of_two_on_the_device_ends_with_one_model(name, device, backend):
    """Gloo takes CUDA tensors (it stages them through pinned host memory), so two workers can share one GPU;
    NCCL needs one GPU per worker."""
    outs = run_world(_train_in_world, 2, name, device, backend)
    for o in outs:
        assert o["devices"] == {device} and o["backend"] == backend and o["calls"] > 0 and o["seconds"] > 0
    if backend == "nccl":
        assert [o["device_index"] for o in outs] == [0, 1]
    assert outs[0]["losses"] != outs[1]["losses"]  # each worker its own data
    if name == "ab":
        assert outs[0]["syncs"] >= 2
    for key, value in outs[0]["weights"].items():
        torch.testing.assert_close(value, outs[1]["weights"][key], rtol=1e-5, atol=1e-6)
