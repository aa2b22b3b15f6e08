"""Gradient reducers on a real 2-worker gloo world: identical results, exact bytes, error feedback."""

import torch

from abtrain.comm import Communicator
from abtrain.reducers import BF16AllReduce, PowerSGDReducer
from abtrain.topology import Topology
from helpers import run_world

SHAPES = {"fc.weight": (24, 32), "conv.weight": (16, 4, 3, 3), "fc.bias": (24,), "tiny.weight": (2, 3)}


def _grads(rank: int, step: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [(name, torch.randn(*shape, generator=gen)) for name, shape in SHAPES.items()]


def _reduce(kind: str, steps: int = 3):
    topo = Topology.from_env(backend="gloo", device="cpu")
    comm = Communicator()
    reducer = PowerSGDReducer(comm, rank=2) if kind == "powersgd" else BF16AllReduce(comm)
    out = {"after": [], "identity": []}
    for step in range(steps):
        grads = _grads(topo.rank, step)
        before = {n: g.clone() for n, g in grads}
        old_err = {n: e.clone() for n, e in getattr(reducer, "errors", {}).items()}
        reducer.reduce(grads, topo.world)
        out["after"].append({n: g.clone() for n, g in grads})
        if kind == "powersgd":
            for n, g in grads:
                if n in reducer.errors:  # what was sent plus what is kept equals the input plus the old error
                    lhs = g.reshape(g.shape[0], -1) + reducer.errors[n]
                    rhs = before[n].reshape(g.shape[0], -1) + old_err.get(n, 0)
                    out["identity"].append(float((lhs - rhs).abs().max()))
    out["summary"] = comm.ledger.summary()
    topo.close()
    return out


def test_powersgd_reducer_agrees_counts_and_carries_the_error():
    outs = run_world(_reduce, 2, "powersgd")
    for a, b in zip(outs[0]["after"], outs[1]["after"]):
        for n in a:
            assert torch.equal(a[n], b[n]), n
    assert outs[0]["identity"] and max(outs[0]["identity"]) < 1e-5
    # per step: P (m*r) and Q (n*r) of the compressible matrices, the rest uncompressed; 4 bytes each
    r = 2
    compressed = [(24, 32), (16, 36)]
    plain = 24 + 6
    per_step = sum(r * (m + n) for m, n in compressed) + plain
    assert outs[0]["summary"]["payload_bytes"] == 3 * 4 * per_step
    assert outs[0]["summary"]["calls"] == 3 * 2  # two collectives a step


def test_bf16_reducer_halves_the_bytes_and_agrees():
    outs = run_world(_reduce, 2, "bf16", 2)
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    assert outs[0]["summary"]["payload_bytes"] == 2 * 2 * numel
    assert outs[0]["summary"]["rows"][0]["dtype"] == "bfloat16"
    for a, b in zip(outs[0]["after"], outs[1]["after"]):
        for n in a:
            assert torch.equal(a[n], b[n]), n
            mean = (_grads(0, 0)[0][1] + _grads(1, 0)[0][1]) / 2 if n == "fc.weight" else None
            if mean is not None and a is outs[0]["after"][0]:
                assert torch.allclose(a[n], mean, atol=0.05)
