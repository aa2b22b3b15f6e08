"""AB-training's parts, each on its own in one process: the phase state, the decomposer, the syncer, the sync
compressor, the loss watch, the output layer, the options' derived defaults and the schedule's rule.

Simulated workers (:class:`abtrain.comm.recording.LocalWorld`: threads whose collectives meet in memory) stand
in for a world where a part communicates; test_ab.py runs the whole method on real gloo processes.
"""

import dataclasses

import pytest
import torch
from torch import nn

from abtrain.comm.recording import LocalWorld, RecordingCommunicator
from abtrain.comm.topology import Topology
from abtrain.compress.allreduce import slice_length
from abtrain.compress.codec import build_codec
from abtrain.methods.ab import ABConfig, Schedule, lowrank
from abtrain.methods.ab.compressor import SyncCompressor
from abtrain.methods.ab.decomposer import LOSS_JUMP, LOSS_WINDOW, Decomposer, LossWatch
from abtrain.methods.ab.prepare import OutputLayer, factorise_layers
from abtrain.methods.ab.state import PhaseState
from abtrain.methods.ab.syncer import Syncer

SHAPES = {"fc.weight": (24, 32), "conv.weight": (16, 4, 3, 3), "fc.bias": (24,), "tiny.weight": (2, 3)}


def _grads(rank: int, step: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [(name, torch.randn(*shape, generator=gen)) for name, shape in SHAPES.items()]


def _compressor(comm, keep_factors=False, error_dtype=None):
    return SyncCompressor(comm, 2, wire_dtype=None, error_dtype=error_dtype, keep_factors=keep_factors)


def _layer(m: int, n: int, spectrum: list[float], seed: int) -> tuple[nn.Module, lowrank.FactorizedParam]:
    """A prepared nn.Linear(n, m) whose W has the given singular values (the rest zero)."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=gen))
    s = torch.zeros(min(m, n))
    s[:len(spectrum)] = torch.tensor(spectrum)
    model = nn.Sequential(nn.Linear(n, m))
    with torch.no_grad():
        model[0].weight.copy_(u[:, :len(s)] * s @ v[:, :len(s)].T)
    (fp,) = lowrank.prepare_model(model, full_rank_patterns=(), min_rank=1)
    return model, fp


# -- the sync compressor ------------------------------------------------------------------------------
def test_sync_compressor_keeps_the_factors_of_what_it_delivered_when_asked():
    world = LocalWorld(2)

    def worker(comm):
        compressor = _compressor(comm, keep_factors=True)
        grads = _grads(comm.rank, 0)
        compressor.reduce(grads, world.group)
        factors = compressor.take_factors()
        again = compressor.take_factors()
        compressor.reduce([("fc.bias", torch.ones(24))], world.group)  # nothing compressed: no factors
        plain = _compressor(comm)
        plain.reduce(_grads(comm.rank, 0), world.group)
        return dict(grads), factors, again, compressor.take_factors(), plain.take_factors()

    for got, factors, again, after_plain, not_kept in world.run(worker):
        assert set(factors) == {"fc.weight", "conv.weight"}
        for name, (p, q) in factors.items():
            m = got[name].reshape(got[name].shape[0], -1)
            assert p.shape == (m.shape[0], 2) and q.shape == (m.shape[1], 2)
            torch.testing.assert_close(p @ q.T, m, rtol=1e-6, atol=1e-7)  # the delivered tensor is P·Qᵀ
        assert again == {} and after_plain == {} and not_kept == {}


def test_sync_compressor_memory_in_bf16_is_the_rounded_residual_and_the_delivery_unchanged():
    world = LocalWorld(2)

    def worker(comm):
        wide, narrow = _compressor(comm), _compressor(comm, error_dtype=torch.bfloat16)
        out = []
        for compressor in (wide, narrow):
            grads = _grads(comm.rank, 0)
            compressor.reduce(grads, world.group)
            out.append((dict(grads), dict(compressor.errors)))
            compressor.reduce(_grads(comm.rank, 1), world.group)  # the bf16 memory adds into an fp32 change
        return out, narrow.memory_share(torch.float32), wide.memory_share(torch.float32)

    for ((got, errors), (got16, errors16)), narrow_share, wide_share in world.run(worker):
        assert all(torch.equal(got[n], got16[n]) for n in got)  # the memory only changes later syncs
        assert set(errors16) == set(errors) and all(e.dtype == torch.bfloat16 for e in errors16.values())
        assert all(torch.equal(errors16[n], errors[n].to(torch.bfloat16)) for n in errors)
        assert (narrow_share, wide_share) == (0.5, 1.0)  # the rank cap's count of the memory


# -- the phase state ----------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["A", "B"])
def test_phase_state_basis_is_the_kept_vectors_and_the_frozen_factor(role):
    _, fp = _layer(6, 8, [3.0, 2.0, 1.0], seed=0)
    usv = lowrank.svd(fp)
    lowrank.decompose(fp, 3, usv=usv, split="sigma", sigma_in=role)  # the tangent split: σ in the trained factor
    state = PhaseState(role=role, records=[fp])
    kept = usv.U[:, :3] if role == "A" else usv.Vh[:3]
    state.bases = {fp.name: (kept, usv.S[:3])}
    u, s, vh = state.basis(fp)
    assert torch.equal(s, usv.S[:3]) and torch.equal(u if role == "A" else vh, kept)
    frozen = vh if role == "A" else u
    torch.testing.assert_close(frozen, usv.Vh[:3] if role == "A" else usv.U[:, :3])
    with torch.no_grad():
        (fp.B if role == "A" else fp.A).zero_()  # the sync overwrites the factors: the basis is a copy
    assert frozen.abs().sum() > 0


def test_phase_state_round_trips_and_refuses_another_role():
    state = PhaseState(role="A", t=7, switch_step=6, ranks=[{"step": 3, "layers": {"w": 2}}], ratio=1.5, syncs=2,
                       bases={"w": (torch.ones(4, 2), torch.ones(2))}, frozen={"w": torch.zeros(2, 3)})
    saved = state.state_dict()
    other = PhaseState(role="A")
    other.load_state_dict(saved)
    assert other.state_dict().keys() == saved.keys()
    assert (other.t, other.switch_step, other.ranks, other.ratio, other.syncs) == (7, 6, saved["ranks"], 1.5, 2)
    assert torch.equal(other.bases["w"][0], state.bases["w"][0]) and torch.equal(other.frozen["w"], state.frozen["w"])
    with pytest.raises(ValueError, match="saved by a worker that trains A, this worker trains B: load it with the optimizer.s state_dict"):
        PhaseState(role="B").load_state_dict(saved)


# -- the decomposer -----------------------------------------------------------------------------------
def test_decomposer_agrees_on_the_largest_rank_any_worker_chose_and_keeps_the_tangent_bases():
    """Two workers whose W differ choose different ranks by the rule; both split at the larger, in one
    all-reduce (MAX) of one integer per layer, and keep what the tangent merge needs of their SVD."""
    world = LocalWorld(2)
    cfg = ABConfig(tau=0.1, min_rank=1, rank_cap="none", sync="only-learned", split="tangent")

    def worker(comm):
        model, fp = _layer(8, 12, [1.0, 0.5, 0.3][:2 + comm.rank], seed=comm.rank)  # rank 2 or 3 by the rule
        state = PhaseState(role="A" if comm.rank == 0 else "B", records=[fp], t=5)
        said: list[str] = []
        decomposer = Decomposer(cfg, comm, world.group, torch.device("cpu"), state, None, said.append)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        decomposer.decompose(model, optimizer, truncate=True, dense_follows=False)
        return fp.rank, fp.mode, state, comm.calls, said, fp.A.requires_grad, fp.B.requires_grad

    for rank, (r, mode, state, calls, said, a_trains, b_trains) in enumerate(world.run(worker)):
        assert (r, mode) == (3, "lowrank")
        assert [(c.op, c.numel, c.dtype) for c in calls] == [("all_reduce", 1, torch.int64)]
        assert state.ranks == [{"step": 5, "layers": {"0.weight": 3}, "compression_ratio": state.ratio,
                                "model_params": 3 * (8 + 12) + 8}]
        vectors, sigma = state.bases["0.weight"]
        assert vectors.shape == ((8, 3) if rank == 0 else (3, 12)) and sigma.shape == (3,)
        assert (a_trains, b_trains) == ((True, False) if rank == 0 else (False, True))
        assert said[0].startswith("AB-training: decomposition at step 5") and "rank 3" in said[1]


def test_decomposer_caps_the_rank_where_the_factors_would_not_pay_and_says_so_once():
    cfg = ABConfig(min_rank=1, rank_cap="pays", sync="with-stale")
    model, fp = _layer(8, 8, [1.0] * 8, seed=0)
    state = PhaseState(role="A", records=[fp])
    said: list[str] = []
    topo = Topology()
    decomposer = Decomposer(cfg, RecordingCommunicator(), topo.world, topo.device, state, None, said.append)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    decomposer.decompose(model, optimizer, truncate=False, dense_follows=True)
    assert fp.rank == lowrank.paying_rank(8, 8) == 3  # 3·16 < 64 <= 4·16
    capped = [line for line in said if "--ab-rank-cap" in line]
    assert capped == ["AB-training: 0.weight at rank 3, not the 8 its rule chose: factors of rank 8 would hold "
                      "128 numbers, W 64 (--ab-rank-cap)"]
    lowrank.recompose(fp)
    decomposer.decompose(model, optimizer, truncate=False, dense_follows=True)
    assert fp.rank == 3 and len([line for line in said if "--ab-rank-cap" in line]) == 1


def test_loss_watch_reports_a_cut_that_lifts_the_loss_past_the_jump():
    watch = LossWatch()
    watch.cut(3)  # no loss seen yet: nothing to compare with
    assert all(watch.observe(1.0, t) is None for t in range(1, LOSS_WINDOW + 1))
    watch.cut(LOSS_WINDOW)
    after = [watch.observe(LOSS_JUMP * 1.1, LOSS_WINDOW + i) for i in range(1, LOSS_WINDOW + 1)]
    assert after[:-1] == [None] * (LOSS_WINDOW - 1)
    assert after[-1] == (LOSS_WINDOW, 1.0, pytest.approx(LOSS_JUMP * 1.1))
    assert watch.observe(9.0, 3 * LOSS_WINDOW) is None  # one report per cut
    watch.cut(3 * LOSS_WINDOW)
    assert [watch.observe(1.0, 3 * LOSS_WINDOW + i) for i in range(1, LOSS_WINDOW + 1)] == [None] * LOSS_WINDOW


# -- the syncer ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["with-stale", "only-learned"])
def test_syncer_leaves_every_worker_with_the_averaged_model(mode):
    """Four workers in two groups: with-stale multiplies the mean of every A by the mean of every B;
    only-learned the mean of the A-workers' A by the mean of the B-workers' B. One all-reduce either way,
    of the factors and the bias; the layer leaves the sync in full mode, trainable."""
    world = LocalWorld(4)
    cfg = ABConfig(sync=mode, split="sqrt", rank=2, rank_cap="none", sync_codec="fp32", optimizer_state="keep")
    factors = [_layer(5, 7, [2.0, 1.0], seed=r)[1] for r in range(4)]
    for fp in factors:
        lowrank.decompose(fp, 2)
    a = [fp.A.detach().clone() for fp in factors]
    b = [fp.B.detach().clone() for fp in factors]

    def worker(comm):
        model, fp = _layer(5, 7, [2.0, 1.0], seed=comm.rank)
        lowrank.decompose(fp, 2)
        topo = Topology(rank=comm.rank, world_size=4, local_world_size=4, group_size=2)
        state = PhaseState(role="A" if comm.rank < 2 else "B", records=[fp])
        syncer = Syncer(cfg, comm, topo, state, topo.group, None)
        syncer.sync(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return fp.weight.detach().clone(), fp.mode, fp.weight.requires_grad, state.syncs, comm.calls

    if mode == "with-stale":
        expected = (sum(a) / 4) @ (sum(b) / 4)
    else:
        expected = (sum(a[:2]) / 2) @ (sum(b[2:]) / 2)
    outs = world.run(worker)
    for w, mode_after, trains, syncs, calls in outs:
        assert torch.equal(w, outs[0][0]) and (mode_after, trains, syncs) == ("full", True, 1)
        torch.testing.assert_close(w, expected)
        assert [(c.op, c.numel) for c in calls] == [("all_reduce", 5 * 2 + 2 * 7 + 5)]


def test_syncer_tangent_merge_adds_both_groups_changes_to_the_svd_they_started_from():
    """split="tangent" with only-learned: an A-worker moved A away from U·σ, a B-worker B away from σ·Vᵀ; the
    sync sends each change of W once and every worker's W is U·σ·Vᵀ plus the mean change of either group."""
    world = LocalWorld(2)
    cfg = ABConfig(sync="only-learned", split="tangent", sync_payload="factors", tangent_core="sum", rank=2,
                   rank_cap="none", sync_codec="fp32", optimizer_state="keep")
    _, start = _layer(6, 9, [2.0, 1.0], seed=0)
    u, s, vh = lowrank.svd(start)
    u, s, vh = u[:, :2].contiguous(), s[:2].clone(), vh[:2].contiguous()
    da = torch.randn(6, 2, generator=torch.Generator().manual_seed(1)) * 0.1
    db = torch.randn(2, 9, generator=torch.Generator().manual_seed(2)) * 0.1

    def worker(comm):
        role = "A" if comm.rank == 0 else "B"
        model, fp = _layer(6, 9, [2.0, 1.0], seed=0)
        lowrank.decompose(fp, 2, usv=lowrank.SVD(u, s, vh), split="sigma", sigma_in=role)
        with torch.no_grad():
            (fp.A if role == "A" else fp.B).add_(da if role == "A" else db)
        state = PhaseState(role=role, records=[fp], bases={fp.name: (u if role == "A" else vh, s)})
        topo = Topology(rank=comm.rank, world_size=2, local_world_size=2, group_size=1)
        Syncer(cfg, comm, topo, state, topo.group, None).sync(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return fp.weight.detach().clone(), state.bases

    outs = world.run(worker)
    expected = (u * s) @ vh + da @ vh + u @ db  # the start point, plus the change of A and the change of B
    for w, bases in outs:
        assert torch.equal(w, outs[0][0]) and bases == {}
        torch.testing.assert_close(w, expected)


@pytest.mark.parametrize("codec", ["int8", "e3m0"])
def test_quantised_sync_delivers_one_model_and_keeps_what_it_did_not_deliver(codec):
    """--ab-sync-codec int8/e3m0 in 4 workers (2 groups of 2), a layer PowerSGD compresses (24x40 at q = 4) and
    one it does not (6x9): every worker ends the sync with the same W; the delivered change plus the mean of
    the workers' error memories is the groups' summed change (nothing lost, only delayed); the P with the
    small layer's change, then the Q, travel as one compressed all-reduce each (all_to_all of p messages of
    the codec's size for a slice, all_gather of one), the bias in bfloat16."""
    world, block, q = LocalWorld(4), 16, 4
    cfg = ABConfig(sync="only-learned", split="tangent", sync_payload="lowrank", tangent_core="sum", rank=3,
                   rank_cap="none", sync_codec=codec, scale_block=block, sync_rank=q, optimizer_state="keep",
                   svd="full")
    shapes = [(24, 40), (6, 9)]
    starts = []
    for i, (m, n) in enumerate(shapes):
        _, fp = _layer(m, n, [3.0, 2.0, 1.0], seed=10 + i)
        u, s, vh = lowrank.svd(fp)
        starts.append((u[:, :3].contiguous(), s[:3].clone(), vh[:3].contiguous()))

    def moved(rank: int, i: int, shape: tuple[int, ...]) -> torch.Tensor:
        # the groups average inside themselves: the two workers of a group hold the same trained factor
        return 0.05 * torch.randn(*shape, generator=torch.Generator().manual_seed(100 * (rank // 2) + i))

    def worker(comm):
        role = "A" if comm.rank < 2 else "B"
        model = nn.Sequential(nn.Linear(40, 24), nn.Linear(9, 6))
        records = lowrank.prepare_model(model, full_rank_patterns=(), min_rank=1)
        for i, (fp, (u, s, vh)) in enumerate(zip(records, starts)):
            lowrank.decompose(fp, 3, usv=lowrank.SVD(u, s, vh), split="sigma", sigma_in=role)
            with torch.no_grad():
                trained = fp.A if role == "A" else fp.B
                trained.add_(moved(comm.rank, i, trained.shape))
        bases = {fp.name: (u if role == "A" else vh, s) for fp, (u, s, vh) in zip(records, starts)}
        state = PhaseState(role=role, records=records, bases=bases)
        topo = Topology(rank=comm.rank, world_size=4, local_world_size=4, group_size=2)
        compressor = SyncCompressor(comm, q, wire_dtype=None, error_dtype=None, keep_factors=False,
                                    codec=build_codec(codec, block))
        Syncer(cfg, comm, topo, state, topo.group, compressor).sync(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return ([fp.weight.detach().clone() for fp in records], {k: v.clone() for k, v in compressor.errors.items()},
                comm.calls)

    outs = world.run(worker)
    names = ["0.weight", "1.weight"]
    for i, (u, s, vh) in enumerate(starts):
        # the summed change: the A-group's (mean over its workers, both equal) and the B-group's
        change = moved(0, i, (u.shape[0], 3)) @ vh + u @ moved(2, i, (3, vh.shape[1]))
        delivered = outs[0][0][i] - (u * s) @ vh
        memory = sum(o[1][names[i]] for o in outs) / 4
        assert all(torch.equal(o[0][i], outs[0][0][i]) for o in outs)
        torch.testing.assert_close(delivered + memory, change, atol=2e-6, rtol=1e-5)
        assert float((delivered - change).norm()) > 1e-4  # the codes lost something, which the memories hold
    codec_obj = build_codec(codec, block)
    first = 24 * q + 6 * 9  # the big layer's P, the small layer's change
    slice_bytes = [codec_obj.message_bytes(slice_length(n, 4, block)) for n in (first, 40 * q)]
    calls = [(c.op, c.payload_bytes) for c in outs[0][2]]
    assert calls == [("all_reduce", 2 * (24 + 6)),  # the biases, bf16: the only full-rank tensors
                     ("all_to_all", 4 * slice_bytes[0]), ("all_gather", slice_bytes[0]),
                     ("all_to_all", 4 * slice_bytes[1]), ("all_gather", slice_bytes[1])]


def test_outer_step_applies_nesterov_momentum_to_the_averaged_change():
    """--ab-outer-lr 0.7 --ab-outer-momentum 0.9: the tangent merge's W_new becomes W_start + η·(Δ + μ·u) with
    u = Δ at the first sync, and each full-rank parameter moves from its value at the decomposition the same way;
    one model on both workers; the default (η = 1, μ = 0) builds no outer step."""
    topo = Topology(rank=0, world_size=4, local_world_size=4, group_size=2)
    assert Syncer(ABConfig(), None, topo, PhaseState(role="A"), topo.group, None).outer is None
    world, lr, mu = LocalWorld(2), 0.7, 0.9
    cfg = ABConfig(sync="only-learned", split="tangent", sync_payload="factors", tangent_core="sum", rank=2,
                   rank_cap="none", sync_codec="fp32", optimizer_state="keep", outer_lr=lr, outer_momentum=mu)
    _, start = _layer(6, 9, [2.0, 1.0], seed=0)
    u, s, vh = lowrank.svd(start)
    u, s, vh = u[:, :2].contiguous(), s[:2].clone(), vh[:2].contiguous()
    da = torch.randn(6, 2, generator=torch.Generator().manual_seed(1)) * 0.1
    db = torch.randn(2, 9, generator=torch.Generator().manual_seed(2)) * 0.1

    def worker(comm):
        role = "A" if comm.rank == 0 else "B"
        model, fp = _layer(6, 9, [2.0, 1.0], seed=0)
        lowrank.decompose(fp, 2, usv=lowrank.SVD(u, s, vh), split="sigma", sigma_in=role)
        state = PhaseState(role=role, records=[fp], bases={fp.name: (u if role == "A" else vh, s)})
        topo = Topology(rank=comm.rank, world_size=2, local_world_size=2, group_size=1)
        syncer = Syncer(cfg, comm, topo, state, topo.group, None)
        with torch.no_grad():
            model[0].bias.copy_(torch.linspace(-1.0, 1.0, 6))  # the same on both workers (its init draws from torch's RNG)
        syncer.agreed(model)  # the decomposition: the bias's W_start
        bias = model[0].bias.detach().clone()
        with torch.no_grad():
            (fp.A if role == "A" else fp.B).add_(da if role == "A" else db)
            model[0].bias.add_(float(comm.rank + 1))  # the workers' biases move by 1 and 2: the mean by 1.5
        syncer.sync(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return fp.weight.detach().clone(), model[0].bias.detach().clone(), bias

    outs = world.run(worker)
    change = da @ vh + u @ db
    for w, b, bias in outs:
        assert torch.equal(w, outs[0][0]) and torch.equal(b, outs[0][1])
        torch.testing.assert_close(w, (u * s) @ vh + lr * (1 + mu) * change)
        torch.testing.assert_close(b, bias + lr * (1 + mu) * 1.5)


# -- preparing the model, the options, the schedule ------------------------------------------------------
def test_output_layer_is_found_at_the_first_training_forward_and_kept():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 12))
    state = PhaseState(role="A")
    factorise_layers(model, ABConfig(min_rank=1), state)
    assert [fp.name for fp in state.records] == ["0.weight", "2.weight"]
    said: list[str] = []
    output = OutputLayer(state, said.append)
    output.watch(model)
    with torch.no_grad():
        model(torch.randn(2, 16))  # not a training forward: nothing found yet
    assert not output.searched and state.kept == []
    model(torch.randn(2, 16))
    assert output.searched and state.kept == ["2.weight"] and "keeping 2.weight full rank" in said[0]
    model(torch.randn(2, 16))
    assert len(said) == 1  # looked for once


def test_derived_defaults_are_resolved_once_and_check_computes_nothing():
    cfg = ABConfig()
    assert (cfg.tau, cfg.split, cfg.sync_payload, cfg.tangent_core, cfg.svd) == (0.05, "tangent", "lowrank", "mean",
                                                                                  "update")
    assert cfg.derived() == {}  # resolved when built: nothing is left to derive
    stale = ABConfig(sync="with-stale", rank=4)
    assert (stale.tau, stale.split, stale.sync_payload, stale.tangent_core, stale.svd) == (None, "sqrt", "factors",
                                                                                           "sum", "full")
    for built in (cfg, stale):
        before = dataclasses.asdict(built)
        built.check()
        assert dataclasses.asdict(built) == before
    assert ABConfig(split="sigma").split == "sigma"  # a given option is never replaced


def test_the_schedule_holds_its_own_rule():
    ABConfig(rebound_steps=4, sync_every=4)  # options; the schedule they give is what must hold
    for build in (lambda: Schedule(warmup=0, sync_every=4, rebound=4, lr_rebound=0),
                  lambda: Schedule.from_config(ABConfig(warmup_steps=2, rebound_steps=4, sync_every=4), None),
                  lambda: Schedule.from_config(ABConfig(rebound_steps=3, sync_fraction=0.01, min_sync_every=1), 300)):
        with pytest.raises(ValueError, match=r"^--ab-rebound-steps \(F=\d\) must be smaller than the period"):
            build()
