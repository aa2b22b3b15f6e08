"""AB-training's streaming syncs (--ab-sync-fragments): the schedule, the fragments, and a real 4-worker world.

The world trains one small network under the defaults with the whole model synced at once and in two fragments,
then stops the fragmented run mid-period and resumes it from each worker's own checkpoint and from rank 0's.
"""

import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import abtrain
from abtrain.methods.ab import ABConfig
from abtrain.methods.ab.fragments import SyncFragments
from abtrain.methods.ab.schedule import Schedule, check_run
from helpers import BNNet, run_world

T_W, K, STEPS = 3, 6, 20  # fragment 0 syncs after steps 6, 12, 18, fragment 1 after 9 and 15; the last sync at 20
STOP = 10


def Net():
    """The first and the last layer kept full rank, body and body2 factorised, a BatchNorm after the first."""
    return BNNet(16, 16)


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 16, generator=g), torch.randint(0, 16, (16,), generator=g)


def test_fragments_sync_at_staggered_steps_and_the_run_ends_with_one_last_sync():
    cfg = ABConfig(warmup_steps=T_W, sync_every=K, sync_fragments=2)
    sched = Schedule.from_config(cfg, STEPS)
    assert [(t, sched.fragments_due(t)) for t in range(STEPS + 1) if sched.fragments_due(t)] == \
        [(6, [0]), (9, [1]), (12, [0]), (15, [1]), (18, [0])]
    assert all(not sched.events(t)[0] for t in range(STEPS + 1))  # no whole-model sync on the way
    assert [t for t in range(STEPS + 1) if sched.events(t)[1]] == [T_W]  # one decomposition of every layer
    assert sched.syncs() == 6  # five fragment syncs and the last one, of the whole model
    assert "sync every 6 in 2 fragments (staggered: one every 3 steps)" in sched.describe()
    assert Schedule.from_config(ABConfig(warmup_steps=T_W, sync_every=K), STEPS).fragments_due(6) == []


@pytest.mark.parametrize("options, message", [
    ({"sync_fragments": 0}, "--ab-sync-fragments must be a positive integer"),
    ({"sync_fragments": 2, "sync": "with-stale", "split": "sqrt"}, "needs the tangent merge"),
    ({"sync_fragments": 2, "outer_momentum": 0.9}, "use one or the other"),
])
def test_options_fragments_cannot_run_with_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ABConfig(warmup_steps=T_W, sync_every=K, **options)


@pytest.mark.parametrize("options, message", [
    ({"rebound_steps": 2}, "no rebound and no learning-rate ramp"),
    ({"sync_every": 3, "sync_fragments": 4}, "choose at most 3"),
])
def test_schedules_fragments_cannot_run_with_are_refused(options, message):
    cfg = ABConfig(**{"warmup_steps": T_W, "sync_every": K, "sync_fragments": 2, **options})
    with pytest.raises(ValueError, match=message):
        Schedule.from_config(cfg, STEPS)


def test_more_fragments_than_layers_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="--ab-sync-fragments 5: the model has 4 layers"):
        check_run(ABConfig(warmup_steps=T_W, sync_every=K, sync_fragments=5), Net(), STEPS)


def test_a_fragment_holds_whole_layers_with_their_buffers_dealt_out_over_the_depth():
    model = Net()
    frags = SyncFragments(model, 2)
    of = {name: frags.of[name] for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    assert of == {"stem.weight": 0, "stem.bias": 0, "norm.weight": 0, "norm.bias": 0, "norm.running_mean": 0,
                  "norm.running_var": 0, "norm.num_batches_tracked": 0, "body.weight": 1, "body.bias": 1,
                  "body2.weight": 0, "body2.bias": 0, "head.weight": 1, "head.bias": 1}
    assert frags.sizes == [16 * 48 + 48 + 2 * 48 + 40 * 48 + 48, 48 * 40 + 40 + 48 * 16 + 16]


def _train(fragments, ckpt, stop=None, resume=None):
    """The defaults on Net with the period K (``fragments`` sync fragments), each worker its own batches; stopped
    after ``stop`` steps (every worker saving its own file) or resumed from ``resume`` ("own": each worker's file,
    "rank0": rank 0's on every worker)."""
    torch.manual_seed(0)
    method = abtrain.setup("ab", total_steps=STEPS, quiet=True, group_size=2, warmup_steps=T_W, sync_every=K,
                           sync_fragments=fragments)
    rank = method.topo.rank
    model = method.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    method.attach(opt)
    start, lines = 0, []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("abtrain").addHandler(handler)
    logging.getLogger("abtrain").setLevel(logging.INFO)
    if resume is not None:
        state = torch.load(os.path.join(ckpt, f"rank{rank if resume == 'own' else 0}.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    logging.getLogger("abtrain").removeHandler(handler)
    probe = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    out = {"rank": rank, "sync_bytes": {}, "kept": {}, "evaluated": {}, "restored": {}, "lines": lines}
    sync_before = 0.0
    for step in range(start, STEPS if stop is None else stop):
        x, y = _batch(step, rank)
        model.train()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sync_now = method.comm.ledger.summary()["by_phase"].get("sync", {}).get("wire_bytes", 0.0)
        if sync_now > sync_before:
            out["sync_bytes"][method.t] = sync_now - sync_before
        sync_before = sync_now
        out["kept"][method.t] = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
                                 if n.startswith(("stem.", "norm.", "head."))}
        if fragments > 1 and method.t in (10, 16):  # between two syncs: the model the workers agree on, then their own
            held = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
            assert method.ready_for_evaluation()
            model.eval()
            with torch.no_grad(), method.evaluation():
                out["evaluated"][method.t] = model(probe)
            out["restored"][method.t] = all(torch.equal(a, b) for a, b in
                                            zip(held, [*model.parameters(), *model.buffers()]))
    if stop is not None:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": stop},
                   os.path.join(ckpt, f"rank{rank}.pt"))
        dist.barrier()
        method.detach(finalize=False)
        return out
    method.detach()
    out["weights"] = {k: v.clone() for k, v in method.export().items()}
    out["results"] = method.extra_results()
    out["peak"] = method.comm.ledger.summary()["peak_global_step_bytes"]
    return out


def _all(ckpt):
    out = {"whole": _train(1, ckpt), "fragments": _train(2, ckpt)}
    _train(2, ckpt, stop=STOP)
    out["own"] = _train(2, ckpt, resume="own")
    out["rank0"] = _train(2, ckpt, resume="rank0")
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return run_world(_all, 4, str(tmp_path_factory.mktemp("fragments")))


def test_each_fragment_is_one_model_right_after_its_sync_and_the_others_go_on_apart(worlds):
    outs = [w["fragments"] for w in worlds]
    assert sorted(outs[0]["sync_bytes"]) == [6, 9, 12, 15, 18]
    ours = {6: ("stem.", "norm."), 9: ("head.",), 12: ("stem.", "norm."), 15: ("head.",)}
    for t, prefixes in ours.items():
        for name, value in outs[0]["kept"][t].items():
            same = all(torch.equal(value, o["kept"][t][name]) for o in outs[1:])
            if name.startswith(prefixes):
                assert same, (t, name)
            elif not name.endswith("num_batches_tracked"):
                assert not same, (t, name)  # trained apart since its own fragment's sync


def test_the_fragments_together_send_what_one_whole_sync_sends_and_each_step_carries_less(worlds):
    whole, frag = worlds[0]["whole"], worlds[0]["fragments"]
    assert sorted(whole["sync_bytes"]) == [6, 12, 18]
    # the first sync of each fragment follows the same decomposition as the whole model's first sync
    assert frag["sync_bytes"][6] + frag["sync_bytes"][9] == pytest.approx(whole["sync_bytes"][6], rel=1e-12)
    assert max(frag["sync_bytes"].values()) < whole["sync_bytes"][6]
    assert frag["peak"] < whole["peak"]
    assert whole["results"]["syncs"] == 4 and frag["results"]["syncs"] == 6  # the last sync of the run included
    assert frag["results"]["schedule"]["sync_fragments"] == 2


def test_between_syncs_every_worker_evaluates_the_model_they_agree_on_and_keeps_its_own(worlds):
    outs = [w["fragments"] for w in worlds]
    for t in (10, 16):
        for o in outs:
            assert o["restored"][t]
            # the two roles form U·σ·Vᵀ as (U·σ)·Vᵀ and U·(σ·Vᵀ): the same model up to that product's rounding
            torch.testing.assert_close(o["evaluated"][t], outs[0]["evaluated"][t], rtol=1e-5, atol=1e-5)


def test_the_run_ends_with_one_model_on_every_worker(worlds):
    for run in ("whole", "fragments", "own", "rank0"):
        ref = worlds[0][run]["weights"]
        for w in worlds[1:]:
            assert all(torch.equal(w[run]["weights"][k], v) for k, v in ref.items()), run


def test_a_fragmented_run_resumes_bit_for_bit_from_each_workers_own_checkpoint(worlds):
    for w in worlds:
        assert all(torch.equal(w["own"]["weights"][k], v) for k, v in w["fragments"]["weights"].items())


def test_rank_0s_file_resumes_every_worker_saying_what_the_fragments_give_up(worlds):
    line = [x for x in worlds[0]["rank0"]["lines"] if "a worker resuming from it" in x]
    assert len(line) == 1 and "AB steps since each fragment's last sync (at most 5, since step 5)" in line[0], line
