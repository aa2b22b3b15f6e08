"""Gradient reducers in one process against the recording communicator: exact math, exact bytes.

The simulated workers of :class:`LocalWorld` are threads whose collectives meet
in memory; the cross-worker invariants on real processes (one model everywhere,
torch's hook computes the same) are in test_baselines.py and test_ddp.py.
"""

import pytest
import torch

from abtrain.comm.recording import LocalWorld, RecordingCommunicator
from abtrain.methods.ab.dense import build_dense_reducer
from abtrain.compress.powersgd import PowerSGDReducer, orthogonalize
from abtrain.compress.reducer import AllReduce, BF16AllReduce

SHAPES = {"fc.weight": (24, 32), "conv.weight": (16, 4, 3, 3), "fc.bias": (24,), "tiny.weight": (2, 3)}


def _grads(rank: int, step: int, dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [(name, torch.randn(*shape, generator=gen, dtype=dtype)) for name, shape in SHAPES.items()]


def test_powersgd_is_exact_when_the_rank_covers_the_matrix():
    world = LocalWorld(3)
    common = torch.randn(24, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # every worker's gradient lies in the same 2-dimensional column space, so their mean has rank 2
    own = [common @ torch.randn(2, 32, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
           for r in range(3)]
    mean = sum(own) / 3

    def worker(comm):
        grads = [("w", own[comm.rank].clone())]
        PowerSGDReducer(comm, rank=2).reduce(grads, world.group)
        return (grads[0][1] - mean).abs().max().item()

    assert max(world.run(worker)) < 1e-12


def test_powersgd_error_feedback_carries_the_residual_and_bytes_follow_the_formula():
    world, r, steps = LocalWorld(2), 2, 3

    def worker(comm):
        reducer = PowerSGDReducer(comm, rank=r)
        out = {"after": [], "identity": [], "residual": []}
        for step in range(steps):
            grads = _grads(comm.rank, step, torch.float64)
            before = {n: g.clone() for n, g in grads}
            old = {n: e.clone() for n, e in reducer.errors.items()}
            reducer.reduce(grads, world.group)
            out["after"].append({n: g.clone() for n, g in grads})
            for n, g in grads:  # what was delivered plus what is kept equals the input plus the old error
                out["identity"].append(float((g + reducer.errors[n] - before[n] - old.get(n, 0)).abs().max()))
            out["residual"].append(float(reducer.errors["fc.weight"].abs().max()))
        out["summary"], out["calls"] = comm.ledger.summary(), comm.calls
        out["stats"] = (reducer.numel_before, reducer.numel_after)
        return out

    outs = world.run(worker)
    for a, b in zip(outs[0]["after"], outs[1]["after"]):
        assert all(torch.equal(a[n], b[n]) for n in a)  # one result on every worker
    assert max(outs[0]["identity"]) < 1e-12
    assert min(outs[0]["residual"]) > 0.1  # rank 2 cannot deliver a random 24x32 matrix: the rest is kept
    compressed, plain = [(24, 32), (16, 36)], 24 + 6
    per_step = sum(r * (m + n) for m, n in compressed) + plain
    assert outs[0]["summary"]["payload_bytes"] == steps * 8 * per_step
    # per step: the Ps (summed) with the uncompressed tensors (averaged) in one collective, then the Qs (averaged)
    assert [c.numel for c in outs[0]["calls"][:2]] == [r * (24 + 16) + plain, r * (32 + 36)]
    assert len(outs[0]["calls"]) == 2 * steps
    inputs = [dict(_grads(rank, 0, torch.float64)) for rank in range(2)]
    for name in ("fc.bias", "tiny.weight"):  # riding with the Ps, they still arrive as the exact mean
        assert torch.equal(outs[0]["after"][0][name], (inputs[0][name] + inputs[1][name]) / 2)
    assert outs[0]["stats"] == (steps * sum(torch.Size(s).numel() for s in SHAPES.values()), steps * per_step)


def test_powersgd_warm_start_draws_random_qs_once_per_set_of_tensors():
    world = LocalWorld(2)

    def worker(comm):
        reducer = PowerSGDReducer(comm, rank=2, seed=3)
        reducer.reduce(_grads(comm.rank, 0), world.group)
        first = reducer.rng.get_state()[2]
        reducer.reduce(_grads(comm.rank, 1), world.group)
        return first, reducer.rng.get_state()[2], {n: q.clone() for n, q in reducer.qs.items()}

    (a1, a2, qa), (b1, b2, qb) = world.run(worker)
    assert a1 == a2 == b1 == b2  # the second call reused its Qs: no new draw
    assert set(qa) == {"fc.weight", "conv.weight"} and all(torch.equal(qa[n], qb[n]) for n in qa)


def test_orthogonalize_gives_orthonormal_columns_for_both_algorithms():
    for rank in (2, 4):  # Gram-Schmidt, QR
        m = torch.randn(1, 30, rank, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        orthogonalize(m)
        assert torch.allclose(m[0].T @ m[0], torch.eye(rank, dtype=torch.float64), atol=1e-12)


def test_bf16_reducer_rounds_as_torchs_hook_and_halves_the_bytes():
    world = LocalWorld(3)

    def worker(comm):
        grads = _grads(comm.rank, 0)
        BF16AllReduce(comm).reduce(grads, world.group)
        return grads, comm.ledger.summary()

    outs = world.run(worker)
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    assert outs[0][1]["payload_bytes"] == 2 * numel and outs[0][1]["rows"][0]["dtype"] == "bfloat16"
    for i, (name, _) in enumerate(_grads(0, 0)):
        sent = [_grads(r, 0)[i][1].to(torch.bfloat16).div_(3) for r in range(3)]
        expected = (sent[0] + sent[1] + sent[2]).float()  # the sum in bf16, in rank order, then back to fp32
        for grads, _ in outs:
            assert torch.equal(grads[i][1], expected), name


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_async_and_sync_reductions_agree(kind):
    world = LocalWorld(2)

    def worker(comm):
        sync, asynchronous = _grads(comm.rank, 0), _grads(comm.rank, 0)
        build_dense_reducer(kind, comm).reduce(sync, world.group)
        build_dense_reducer(kind, comm).reduce_async(asynchronous, world.group).wait()
        return all(torch.equal(a, b) for (_, a), (_, b) in zip(sync, asynchronous)), comm.calls

    for same, calls in world.run(worker):
        assert same and calls[0] == calls[1]


def test_a_world_of_one_sends_nothing():
    comm = RecordingCommunicator()
    grads = _grads(0, 0)
    before = [g.clone() for _, g in grads]
    for reducer in (AllReduce(comm), BF16AllReduce(comm), PowerSGDReducer(comm)):
        reducer.reduce(grads, LocalWorld(1).group)
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, grads))
    assert comm.calls == [] and comm.ledger.summary()["calls"] == 0


def test_powersgd_in_bf16_halves_the_bytes_and_keeps_the_rounding_in_the_error_memory():
    world, r, steps = LocalWorld(2), 2, 3

    def worker(comm):
        reducer = PowerSGDReducer(comm, rank=r, wire_dtype=torch.bfloat16)
        out = {"after": [], "identity": []}
        for step in range(steps):
            grads = _grads(comm.rank, step)
            before = {n: g.clone() for n, g in grads}
            old = {n: e.clone() for n, e in reducer.errors.items()}
            reducer.reduce(grads, world.group)
            out["after"].append({n: g.clone() for n, g in grads})
            for n, g in grads:  # delivered + kept == input + old error: the bf16 rounding is kept, not lost
                out["identity"].append(float((g + reducer.errors[n] - before[n] - old.get(n, 0)).abs().max()))
        out["summary"], out["calls"] = comm.ledger.summary(), comm.calls
        return out

    outs = world.run(worker)
    for a, b in zip(outs[0]["after"], outs[1]["after"]):
        assert all(torch.equal(a[n], b[n]) for n in a)  # one result on every worker
    assert max(outs[0]["identity"]) < 1e-5
    compressed, plain = [(24, 32), (16, 36)], 24 + 6
    per_step = sum(r * (m + n) for m, n in compressed) + plain
    assert outs[0]["summary"]["payload_bytes"] == steps * 2 * per_step
    assert {c.dtype for c in outs[0]["calls"]} == {torch.bfloat16} and len(outs[0]["calls"]) == 2 * steps

    def in_fp32(comm):
        grads = _grads(comm.rank, 0)
        PowerSGDReducer(comm, rank=r).reduce(grads, world.group)
        return dict(grads)["fc.weight"]

    # bf16 was really on the wire: the first step's result is near, not equal to, the fp32 reduction's
    exact, rounded = world.run(in_fp32)[0], outs[0]["after"][0]["fc.weight"]
    assert not torch.equal(exact, rounded) and torch.allclose(exact, rounded, rtol=0.05, atol=0.05)
