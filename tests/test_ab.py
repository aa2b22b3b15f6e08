"""AB-training on a real gloo world: sync identity, roles, groups, exact bytes, sync modes, ranks.

One spawned world of 4 workers (2 groups of 2) trains every configuration in
turn, sharing the process groups, so the file spawns one world instead of one
per test.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import abtrain
from abtrain.comm.communicator import Communicator
from abtrain.comm.topology import Topology
from abtrain.config import merge
from abtrain.methods.ab import PAPER, ABConfig, ABTraining
from abtrain.methods.loop import STATE_VERSION
from abtrain.methods.memory import dense_training_state_bytes, training_state_parts
from helpers import BNNet as Net
from helpers import run_world

T_W, K, F = 3, 6, 2  # syncs at the multiples of K: after steps 6, 12, 18; rebounds 6-7, 12-13; truncation at 8 and 14
STEPS = 19


def _snapshot(method, model):
    """What a worker holds, by kind: each factorised layer's stored W and factors A, B (by the layer's name),
    the model's other parameters and its buffers."""
    records = method.records
    factorised = {id(t) for fp in records for t in (fp.weight, fp.A, fp.B)}
    return {"W": {fp.name: fp.weight.detach().clone() for fp in records},
            "A": {fp.name: fp.A.detach().clone() for fp in records},
            "B": {fp.name: fp.B.detach().clone() for fp in records},
            "other": {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in factorised},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()}}


def _full_moments(method, model, opt):
    """The optimizer's per-element state of the parameters trained full rank (not factors, not a low-rank W)."""
    skip = {id(t) for fp in method.records for t in (fp.A, fp.B)}
    skip |= {id(fp.weight) for fp in method.records if fp.mode == "lowrank"}
    return {f"{n}.{k}": v for n, p in model.named_parameters() if id(p) not in skip
            for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v) and v.shape == p.shape}


def _tensors(snapshot):
    """Every tensor of a snapshot, keyed by (kind, name)."""
    return {(kind, name): v for kind, part in snapshot.items() for name, v in part.items()}


def _moments(method, opt):
    """The first moment (SGD momentum or Adam's exp_avg) of the factor each layer trains on this worker."""
    out = {}
    for fp in method.records:
        state = opt.state.get(fp.A if method.role == "A" else fp.B, {})
        moment = state.get("momentum_buffer", state.get("exp_avg"))
        if moment is not None:
            out[fp.name] = moment.clone()
    return out


def _tangent_first_sync(outs, name):
    """A tangent run's first sync, layer ``name``: W at the decomposition that started the phase (U·σ times Vᵀ),
    the change the tangent merge adds to it, (Ā − Uσ)·Vᵀ + U·(B̄ − σVᵀ), and the means Ā and B̄."""
    sync = [o["syncs"][0] for o in outs]
    a_mean = (sync[0]["before"][name][0] + sync[1]["before"][name][0]) / 2  # A over the A-groups
    b_mean = (sync[2]["before"][name][1] + sync[3]["before"][name][1]) / 2  # B over the B-groups
    w0, shares = _tangent_changes(outs, name, 0)
    return w0, sum(shares), a_mean, b_mean


def _tangent_changes(outs, name, i):
    """Sync ``i`` of a tangent run, layer ``name``: W at the start of its phase (U·σ times Vᵀ) and each worker's
    share of the change, (A − Uσ)·Vᵀ / n_a from an A-worker and U·(B − σVᵀ) / n_b from a B-worker (2 each)."""
    return _tangent_shares(outs, name, _phase_start(outs, i), [o["syncs"][i]["before"][name] for o in outs])


def _phase_start(outs, i):
    """The step whose decomposition started the phase that sync ``i`` ends (each sync is followed by one)."""
    return T_W if i == 0 else outs[0]["syncs"][i - 1]["step"]


def _tangent_basis(outs, name, start_step):
    """U and Vᵀ of layer ``name``'s decomposition at ``start_step``: a B-worker's A and an A-worker's B."""
    start = [next(s for s in o["steps"] if s["t"] == start_step)["after"] for o in outs]
    return start[2]["A"][name], start[0]["B"][name]


def _tangent_shares(outs, name, start_step, factors):
    """Layer ``name`` of a tangent run whose phase started at ``start_step``: W then (U·σ times Vᵀ) and each
    worker's share of the change its ``factors`` (A, B) made to it since (the 2 A-workers first)."""
    start = [next(s for s in o["steps"] if s["t"] == start_step)["after"] for o in outs]
    a0, vh = start[0]["A"][name], start[0]["B"][name]  # U·σ and Vᵀ (an A-worker)
    u, b0 = start[2]["A"][name], start[2]["B"][name]  # U and σ·Vᵀ (a B-worker)
    shares = [(a - a0) @ vh / 2 if k < 2 else u @ (b - b0) / 2 for k, (a, b) in enumerate(factors)]
    return a0 @ vh, shares


def _one_model_after_each_sync(outs, syncs):
    """After each of the first ``syncs`` syncs every worker holds the same W, other parameters and buffers
    (the factors of the decomposition that follows are each group's own split)."""
    for i in range(syncs):
        ref = {k: v for k, v in _tensors(outs[0]["syncs"][i]["after"]).items() if k[0] not in ("A", "B")}
        for w in outs[1:]:
            held = _tensors(w["syncs"][i]["after"])
            assert all(torch.equal(held[k], v) for k, v in ref.items()), i


def _sync_payload(o, element_bytes, layer_numbers):
    """The sync phase's payload bytes: at every sync each factorised layer's ``layer_numbers(name, A, B)``, every
    parameter kept full rank with its SGD momentum (trained apart during the AB phase) and the float buffers, at
    ``element_bytes`` an element; and the all-reduce(MAX) of the int64 ranks at every truncation."""
    expected = 0
    for sync in o["syncs"]:
        layers = sum(layer_numbers(name, a, b) for name, (a, b) in sync["before"].items())
        rest = sum(v.numel() for v in sync["before_other"].values())
        expected += element_bytes * (layers + 2 * rest + o["float_buffers"])
    return expected + 8 * len(o["records"]) * len([r for r in o["ranks_log"] if r["step"] != T_W])


def _factors(name, a, b):
    return a.numel() + b.numel()


def _train(topo, options, optimizer="sgd", steps=STEPS, plan=False):
    comm = Communicator()
    torch.manual_seed(0)
    model = Net()
    # the paper's fp32 phases and with-stale sync, whose byte formulas these tests check, with the payload and
    # the core the tangent split had before they followed it; options over them as flags over a config file
    # (a rank rule in options replaces the paper's tau)
    base = {**PAPER, "warmup_steps": T_W, "sync_every": K, "rebound_steps": F, "lr_rebound_steps": 0,
            "sync_payload": "factors", "tangent_core": "sum", "sync_moments": True, "min_rank": 8, "init": "default"}
    options = dict(options)
    if options.pop("defaults", False):  # abtrain's defaults, with only the schedule of these tests in steps
        base = {"warmup_steps": T_W, "sync_every": K}
    cfg = ABConfig(**merge({"ab": base}, {"ab": options})["ab"])
    method = ABTraining(comm, topo, cfg)
    model = method.prepare(model)
    if plan:
        method.set_total_steps(steps)
    group = method.train_group  # only-b trains B over all workers
    out_group_ranks = dist.get_process_group_ranks(group.pg) if group.pg is not None else [topo.rank]
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    out = {"rank": topo.rank, "role": method.role, "syncs": [], "steps": [], "ledger_by_step": [],
           "group_ranks": out_group_ranks, "decomposed": {}, "decomposed_other": {}}
    sync_due: dict = {}

    def before_the_method(optimizer, args, kwargs):
        # Registered before attach(), so it runs after the update and before the method's own hook,
        # which syncs when the schedule says so for the step count it is about to reach.
        sync, decompose = method.schedule.events(method.t + 1)
        if decompose and not sync:  # the W the decomposition cuts (it releases W's storage)
            out["decomposed"][method.t + 1] = {fp.name: fp.effective_weight().clone() for fp in method.records}
            out["decomposed_other"][method.t + 1] = _snapshot(method, model)["other"]
        if sync:
            sync_due["before"] = {fp.name: (fp.A.detach().clone(), fp.B.detach().clone())
                                  for fp in method.records if fp.mode == "lowrank"}
            sync_due["before_other"] = _snapshot(method, model)["other"]  # parameters kept full rank
            sync_due["before_buffers"] = _snapshot(method, model)["buffers"]
            sync_due["moments"] = _moments(method, opt)

    opt.register_step_post_hook(before_the_method)
    sync_impl = method._sync

    def sync_and_keep_w(*args, **kwargs):
        # W as the sync formed it: a decomposition that follows in the same step releases W's storage
        sync_impl(*args, **kwargs)
        sync_due["merged"] = {fp.name: fp.weight.detach().clone() for fp in method.records}

    method._sync = sync_and_keep_w
    gen = torch.Generator().manual_seed(100 + topo.rank)  # every worker its own data
    with method.attach(opt):
        for _ in range(steps):
            x = torch.randn(16, 12, generator=gen)
            y = torch.randint(0, 5, (16,), generator=gen)
            phase = method.phase
            before = _snapshot(method, model)
            modes_before = {fp.name: fp.mode for fp in method.records}
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            after = _snapshot(method, model)
            after["W"].update(sync_due.pop("merged", {}))
            after["moments_full"] = {n: m.clone() for n, m in _full_moments(method, model, opt).items()}
            if sync_due:
                memory = method.compressor.errors if method.compressor is not None else {}  # lowrank payload
                out["syncs"].append({"step": method.t, **sync_due, "after": after,
                                     "memory": {k: v.clone() for k, v in memory.items()}})
                sync_due.clear()
            out["steps"].append({"phase": phase, "t": method.t, "before": before, "after": after,
                                 "modes_before": modes_before,
                                 "ranks": {fp.name: fp.rank for fp in method.records},
                                 "modes": {fp.name: fp.mode for fp in method.records},
                                 "state_shapes": {fp.name: [tuple(v.shape) for v in opt.state.get(fp.A, {}).values()
                                                            if torch.is_tensor(v) and v.ndim == 2]
                                                  for fp in method.records},
                                 "moments": _moments(method, opt)})
            out["ledger_by_step"].append(copy.deepcopy(comm.ledger.summary()["by_phase"]))
            if method.t == 1:  # a warm-up step: what a worker holds to train the dense model
                out["warmup_state"] = training_state_parts(model, opt, method)
                out["dense_params"] = sum(p.numel() for p in model.parameters())
    out["final"] = _snapshot(method, model)  # after attach() ended, as the run leaves the model
    out["final_modes"] = {fp.name: fp.mode for fp in method.records}
    out["ranks_log"] = method.ranks
    out["records"] = [(fp.name, fp.m, fp.n) for fp in method.records]
    out["float_buffers"] = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    out["summary"] = comm.ledger.summary()
    out["results"] = method.extra_results()
    out["planned_syncs"] = method.schedule.syncs() if plan else None
    return out


CONFIGS = {  # name: (AB options, optimizer, steps, plan the run's length)
    "with-stale": ({"rank_fraction": 0.25}, "sgd", STEPS, False),
    "ranks": ({"tau": 0.5}, "adamw", STEPS, False),
    "only-learned": ({"rank_fraction": 0.25, "sync": "only-learned"}, "sgd", T_W + K, False),
    "map": ({"tau": 0.5, "optimizer_state": "map"}, "adamw", STEPS, False),
    # σ in one factor: every group must split W the same way for the sync's Ā·B̄ to mean W
    "sigma": ({"rank_fraction": 0.25, "sync": "only-learned", "split": "sigma", "rebound_steps": 0},
              "sgd", 2 * K, False),
    # σ in the factor each group trains; the sync adds each group's change to W
    "tangent": ({"rank_fraction": 0.25, "sync": "only-learned", "split": "tangent", "rebound_steps": 0},
                "sgd", 2 * K, False),
    # the same with the part of the changes both groups can make (U·X·Vᵀ) averaged, the rest added
    "tangent-core": ({"rank_fraction": 0.25, "sync": "only-learned", "split": "tangent", "rebound_steps": 0,
                      "tangent_core": "mean"}, "sgd", 2 * K, False),
    # each worker's own A·B (the start plus its group's change) averaged: half of each change
    "tangent-full": ({"rank_fraction": 0.25, "sync": "full", "split": "tangent", "rebound_steps": 0},
                     "sgd", 2 * K, False),
    # ranks at which body and body2's factors hold more numbers than W: their sync sends W's change (bfloat16)
    "tangent-change": ({"rank_fraction": 0.75, "sync": "only-learned", "split": "tangent", "rebound_steps": 0,
                        "sync_codec": "bf16", "sync_payload": "smaller"}, "sgd", 2 * K, False),
    # the change of W sent as a rank-3 approximation with error feedback, three syncs, fp32 on the wire
    "tangent-lowrank": ({"rank_fraction": 0.75, "sync": "only-learned", "split": "tangent", "rebound_steps": 0,
                         "sync_payload": "lowrank", "sync_rank": 3, "linear_apply": "weight", "svd": "full"},
                        "sgd", 3 * K, False),
    # the same with every low-rank Linear applied as x·Bᵀ·Aᵀ, never forming A·B
    "tangent-lowrank-factors": ({"rank_fraction": 0.75, "sync": "only-learned", "split": "tangent",
                                 "rebound_steps": 0, "sync_payload": "lowrank", "sync_rank": 3,
                                 "linear_apply": "factors", "svd": "full"}, "sgd", 3 * K, False),
    # the same with the moments mapped into each new basis (the defaults' policy) and, next, each decomposition
    # after a sync finding W's SVD from the SVD before it and the rank-3 change
    "tangent-lowrank-map": ({"rank_fraction": 0.75, "sync": "only-learned", "split": "tangent",
                             "rebound_steps": 0, "sync_payload": "lowrank", "sync_rank": 3, "optimizer_state": "map",
                             "svd": "full"}, "sgd", 3 * K, False),
    "tangent-lowrank-update": ({"rank_fraction": 0.75, "sync": "only-learned", "split": "tangent",
                                "rebound_steps": 0, "sync_payload": "lowrank", "sync_rank": 3, "optimizer_state": "map",
                                "svd": "update"}, "sgd", 3 * K, False),
    # the same in bfloat16: the rounding of P and Q' goes into the error memories
    "tangent-lowrank-bf16": ({"rank_fraction": 0.75, "sync": "only-learned", "split": "tangent",
                              "rebound_steps": 0, "sync_payload": "lowrank", "sync_rank": 3, "sync_codec": "bf16"},
                             "sgd", 3 * K, False),
    # the defaults' sync: only-learned in bfloat16, the next decomposition right after it
    "bf16-sync": ({"rank_fraction": 0.25, "sync": "only-learned", "sync_codec": "bf16", "rebound_steps": 0},
                  "sgd", 3 * K, False),
    "full": ({"rank_fraction": 0.25, "sync": "full"}, "sgd", T_W + K, False),
    # with-stale as the authors' code runs it: the parameters averaged at a sync, not their moments
    "no-sync-moments": ({"rank_fraction": 0.25, "sync_moments": False}, "sgd", T_W + K, False),
    # abtrain's defaults end to end, planned, the run ending with a sync on its last step (3K)
    "defaults": ({"defaults": True}, "sgd", 3 * K, True),
    # the defaults with full-rank phases of local steps (no gradient averaged), fp32 on the wire; the run ends in
    # a rebound
    "local": ({"defaults": True, "dense_comm": "local", "rebound_steps": F, "sync_codec": "fp32"}, "sgd", STEPS,
              False),
    "only-b-world": ({"rank_fraction": 0.25, "sync": "only-b", "only_b_groups": "world"}, "sgd", T_W + K, False),
    "only-b": ({"rank_fraction": 0.25, "sync": "only-b"}, "sgd", 2 * K, False),
    # the authors' VGG16 sync: B averaged, all else from rank 0; body (40 x 48) turned tall, as their code turns it
    "only-b-rank0": ({"rank_fraction": 0.25, "sync": "only-b", "only_b_sync": "rank0", "orientation": "tall",
                      "sync_moments": False}, "sgd", 2 * K, False),
    # the defaults' tangent merge with a rank-3 change and updated SVDs, body turned tall
    "tall": ({"rank_fraction": 0.75, "sync": "only-learned", "split": "tangent", "rebound_steps": 0,
              "sync_payload": "lowrank", "sync_rank": 3, "optimizer_state": "map", "svd": "update",
              "orientation": "tall"}, "sgd", 3 * K, False),
}


def _train_all():
    topo = Topology.from_env(backend="gloo", device="cpu", group_size=2)
    out = {name: _train(topo, *args) for name, args in CONFIGS.items()}
    out["ddp-wrapped"] = _ddp_wrapped(topo)
    topo.close()
    return out


@pytest.fixture(scope="module")
def runs():
    """Each configuration's outputs, one per worker."""
    outs = run_world(_train_all, 4)
    return {name: [o[name] for o in outs] for name in outs[0]}


@pytest.fixture(scope="module")
def with_stale(runs):
    return runs["with-stale"]


def test_workers_identical_after_every_sync(with_stale):
    # three scheduled syncs at multiples of K; the run ends in a rebound, so leaving ``attach`` adds none
    assert [s["step"] for s in with_stale[0]["syncs"]] == [K, 2 * K, 3 * K]
    for i in range(3):
        ref = _tensors(with_stale[0]["syncs"][i]["after"])
        for o in with_stale[1:]:
            for k, v in _tensors(o["syncs"][i]["after"]).items():
                assert torch.equal(v, ref[k]), f"{k} differs after sync {i}"


def test_roles_train_only_their_factor(with_stale):
    for o in with_stale:
        assert o["role"] == ("A" if o["rank"] < 2 else "B")
        frozen = "B" if o["role"] == "A" else "A"
        synced_at = {sync["step"] for sync in o["syncs"]}  # those steps end with the sync's averaging
        ab_steps = [s for s in o["steps"] if s["phase"] == "ab" and s["t"] not in synced_at]
        assert len(ab_steps) > 5
        for s in ab_steps:
            before, after = s["before"], s["after"]
            for name in before["W"]:
                if before[frozen][name].shape == after[frozen][name].shape:
                    assert torch.equal(before[frozen][name], after[frozen][name]), \
                        f"{o['role']}-worker changed {frozen} of {name} at step {s['t']}"
                if s["modes"][name] == "lowrank":  # W holds no numbers while its factors train
                    assert after["W"][name].numel() == 0, f"W of {name} kept its storage during AB"
            role = o["role"]
            trained = [name for name in before[role] if before[role][name].shape == after[role][name].shape]
            assert any(not torch.equal(before[role][name], after[role][name]) for name in trained)


def test_group_collectives_stay_in_group(with_stale):
    for o in with_stale:
        g = o["rank"] // 2
        assert o["group_ranks"] == [2 * g, 2 * g + 1]
    # Inside a group the trained factor is averaged, so both members agree; the two groups differ.
    last_ab = max(i for i, s in enumerate(with_stale[0]["steps"]) if s["phase"] == "ab" and s["t"] < K)
    a0, a1, b0 = (with_stale[r]["steps"][last_ab]["after"] for r in (0, 1, 2))
    assert torch.equal(a0["A"]["body.weight"], a1["A"]["body.weight"])
    assert not torch.equal(a0["A"]["body.weight"], b0["A"]["body.weight"])


def test_bytes_per_phase_match_the_formulas(with_stale):
    o = with_stale[0]
    p, g = 4, 2
    ring = lambda n, size: 2 * (size - 1) / size * n  # noqa: E731
    by_phase = o["summary"]["by_phase"]
    first = o["steps"][0]["before"]
    full_params = sum(v.numel() for part in ("W", "other") for v in first[part].values())  # W, biases, norms
    # warm-up and rebound: every full-rank parameter's gradient over all workers, every step
    rebound_steps = sum(1 for s in o["steps"] if s["phase"] == "rebound")
    assert by_phase["warmup"]["payload_bytes"] == 4 * full_params * T_W
    assert by_phase["rebound"]["payload_bytes"] == 4 * full_params * rebound_steps
    assert by_phase["warmup"]["wire_bytes"] == pytest.approx(ring(4 * full_params * T_W, p))
    # AB: the trained factor (+ layers kept full rank, biases, norms) over the group, every step
    expected_ab = 0
    for s in o["steps"]:
        if s["phase"] != "ab":
            continue
        expected_ab += 4 * sum(v.numel() for v in s["before"]["other"].values())
        for name, W in s["before"]["W"].items():
            trained = s["before"][o["role"]][name] if s["modes_before"][name] == "lowrank" else W
            expected_ab += 4 * trained.numel()
    assert by_phase["ab"]["payload_bytes"] == expected_ab
    assert by_phase["ab"]["wire_bytes"] == pytest.approx(ring(expected_ab, g))
    assert o["summary"]["by_scope"]["group"]["payload_bytes"] == expected_ab
    # sync: r(m+n) per factorised layer + everything kept full rank (and its optimizer moments)
    # + float buffers, over all workers
    assert by_phase["sync"]["payload_bytes"] == _sync_payload(o, 4, _factors)


def test_ranks_agree_and_follow_the_rule(runs):
    outs = runs["ranks"]
    logs = [o["ranks_log"] for o in outs]
    assert all(log == logs[0] for log in logs)
    first, later = logs[0][0], logs[0][1:]
    assert all(r == min(m, n) for (name, m, n), r in zip(outs[0]["records"], first["layers"].values()))
    # the ratchet: under the tau rule (no gate) every truncation keeps every layer factorised, ranks never grow
    for before, after in zip(later, later[1:]):
        for name, r in after["layers"].items():
            assert r is not None and r <= before["layers"][name], (name, before["step"], after["step"])
    for entry in later:
        for name, m, n in outs[0]["records"]:
            # the rank was chosen on the rebound's last W
            W = outs[0]["decomposed"][entry["step"]][name]
            sigma = torch.linalg.svdvals(W.reshape(m, -1).float())
            expected = max(min(8, m, n), int((sigma > 0.5 * sigma[0]).sum()))  # the default rank floor is 8
            r = entry["layers"][name]
            if r is not None:
                assert r == expected, name
    # optimizer moments follow the rank: AdamW exp_avg / exp_avg_sq of A are m x r
    for o in outs:
        for s in o["steps"]:
            for name, m, n in o["records"]:
                if s["modes"][name] == "lowrank" and s["state_shapes"][name]:
                    assert all(shape == (m, s["ranks"][name]) for shape in s["state_shapes"][name])


def test_mapped_optimizer_state_follows_the_new_factors(runs):
    """optimizer_state="map": at each truncation the trained factor's moment becomes M·(B₀ᵀ)⁺·B'ᵀ (A) or A'ᵀ·(A₀ᵀ)⁺·M (B)."""
    outs = runs["map"]
    for i in range(3):  # one model on every worker after each sync, as with the other policies
        ref = _tensors(outs[0]["syncs"][i]["after"])
        assert all(torch.equal(v, ref[k]) for o in outs[1:] for k, v in _tensors(o["syncs"][i]["after"]).items())
    checked = 0
    for o in outs:
        for sync in o["syncs"][:2]:  # the third sync ends the run's last AB phase
            cut = next(s for s in o["steps"] if s["t"] == sync["step"] + F)  # the truncation after the rebound
            for name, (a0, b0) in sync["before"].items():
                if name not in sync["moments"]:
                    continue
                m = sync["moments"][name].double()
                a1, b1 = cut["after"]["A"][name].double(), cut["after"]["B"][name].double()
                want = (m @ torch.linalg.pinv(b0.double().T, rtol=1e-6) @ b1.T if o["role"] == "A"
                        else a1.T @ torch.linalg.pinv(a0.double().T, rtol=1e-6) @ m)
                got = cut["moments"][name].double()
                assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-3, atol=1e-6), (name, o["rank"])
                checked += 1
    assert checked >= 8


def test_bf16_sync_leaves_one_model_and_sends_two_bytes_an_element(runs):
    """The defaults' sync in bfloat16: every worker ends each sync with the same model; W is the product of the
    groups' factors to bfloat16's precision; the sync's bytes are 2 per element (the ranks' agreement: int64)."""
    outs = runs["bf16-sync"]
    assert [s["step"] for s in outs[0]["syncs"]] == [K, 2 * K, 3 * K]
    for i in range(3):
        ref = _tensors(outs[0]["syncs"][i]["after"])
        for o in outs[1:]:
            assert all(torch.equal(v, ref[k]) for k, v in _tensors(o["syncs"][i]["after"]).items()), i
        sync = [o["syncs"][i] for o in outs]
        for name in sync[0]["before"]:
            a, b = sync[0]["before"][name][0].double(), sync[2]["before"][name][1].double()  # the groups' factors
            exact = a @ b
            got = sync[0]["after"]["W"][name].double().reshape(exact.shape)
            assert torch.allclose(got, exact, rtol=0.02, atol=0.01 * float(exact.abs().max()))
    o = outs[0]  # bfloat16: 2 bytes an element
    assert o["summary"]["by_phase"]["sync"]["payload_bytes"] == _sync_payload(o, 2, _factors)


def test_sigma_split_is_one_factorisation_on_every_worker(runs):
    """split="sigma": after every decomposition all workers hold the same A = U·σ and B = Vᵀ (A- and B-groups
    alike), so the sync's product of one group's A and another group's B is W, not U·σ²·Vᵀ."""
    outs = runs["sigma"]
    decomposed = [T_W, K]  # the warm-up's end; the sync at K is followed at once by the next decomposition
    for t in decomposed:
        after = [next(s for s in o["steps"] if s["t"] == t)["after"] for o in outs]
        for name in after[0]["A"]:
            a, b = after[0]["A"][name], after[0]["B"][name]
            for other in after[1:]:
                assert torch.equal(other["A"][name], a) and torch.equal(other["B"][name], b), (t, name)
            torch.testing.assert_close(b @ b.T, torch.eye(b.shape[0]), rtol=0, atol=1e-4)  # σ is all in A
    assert all(o["syncs"][0]["step"] == K for o in outs)
    # the sync multiplies the A-group's A by the B-group's B; with one factorisation that product is the model
    for name in outs[0]["syncs"][0]["before"]:
        a, b = outs[0]["syncs"][0]["before"][name][0], outs[2]["syncs"][0]["before"][name][1]
        got = outs[0]["syncs"][0]["after"]["W"][name].reshape(a.shape[0], -1)
        torch.testing.assert_close(got, a @ b, rtol=1e-4, atol=1e-5)


def test_tangent_split_adds_each_groups_change_to_the_model(runs):
    """split="tangent": A-groups train A = U·σ against B = Vᵀ, B-groups B = σ·Vᵀ against A = U (one W on every
    worker); the sync leaves every worker with UσVᵀ + (Ā − Uσ)·Vᵀ + U·(B̄ − σVᵀ), not the product Ā·B̄."""
    outs = runs["tangent"]
    assert [o["role"] for o in outs] == ["A", "A", "B", "B"]
    for t in (T_W, K):  # the warm-up's end; the sync at K is followed at once by the next decomposition
        after = [next(s for s in o["steps"] if s["t"] == t)["after"] for o in outs]
        for name in after[0]["A"]:
            w = after[0]["A"][name] @ after[0]["B"][name]
            for o, held in zip(outs, after):
                a, b = held["A"][name], held["B"][name]
                torch.testing.assert_close(a @ b, w, rtol=1e-5, atol=1e-5)
                basis = b @ b.T if o["role"] == "A" else a.T @ a  # the factor this worker does not train
                torch.testing.assert_close(basis, torch.eye(basis.shape[0]), rtol=0, atol=1e-4)
    sync = [o["syncs"][0] for o in outs]
    assert all(s["step"] == K for s in sync)
    for name in sync[0]["before"]:
        w0, change, a_mean, b_mean = _tangent_first_sync(outs, name)
        got = sync[0]["after"]["W"][name].reshape(w0.shape)
        torch.testing.assert_close(got, w0 + change, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, a_mean @ b_mean, atol=1e-2)  # the product would scale by σ twice
        for s in sync[1:]:
            assert torch.equal(s["after"]["W"][name], sync[0]["after"]["W"][name])
    # the run ends at step 2K, a sync followed by a decomposition: every worker leaves with one W, bit for bit
    assert [s["step"] for s in outs[0]["syncs"]] == [K, 2 * K]
    last = next(s for s in outs[0]["steps"] if s["t"] == 2 * K)["after"]
    for o in outs:
        assert set(o["final_modes"].values()) == {"full"}
        for name, w in o["final"]["W"].items():
            assert torch.equal(w, outs[0]["final"]["W"][name]), name
            if name in last["A"]:  # the model of the last decomposition, U·σ times Vᵀ on an A-worker
                torch.testing.assert_close(w.reshape(-1, last["B"][name].shape[1]), last["A"][name] @ last["B"][name])


def test_tangent_core_mean_averages_the_part_both_groups_can_change(runs):
    """tangent_core="mean": the sync adds the groups' summed change C less half of its part inside the phase's
    singular vectors, UσVᵀ + C − ½·UUᵀ·C·VVᵀ (with "sum", UσVᵀ + C); one W on every worker after each sync;
    the same bytes as the tangent split's sync (the factors)."""
    outs, summed = runs["tangent-core"], runs["tangent"]
    _one_model_after_each_sync(outs, 2)
    for name in outs[0]["syncs"][0]["before"]:
        w0, change, _, _ = _tangent_first_sync(outs, name)
        u, vh = _tangent_basis(outs, name, T_W)
        core = u @ (u.T @ change @ vh.T) @ vh
        got = outs[0]["syncs"][0]["after"]["W"][name].reshape(w0.shape)
        torch.testing.assert_close(got, w0 + change - core / 2, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, w0 + change, atol=1e-3)  # not the sum of the changes
    # the same data and start: the first phase is the tangent run's, only the merge differs
    for name in outs[0]["syncs"][0]["before"]:
        for o, ref in zip(outs, summed):
            for x, y in zip(o["syncs"][0]["before"][name], ref["syncs"][0]["before"][name]):
                assert torch.equal(x, y)
    o, ref = outs[0], summed[0]
    assert o["summary"]["by_phase"]["sync"]["payload_bytes"] == ref["summary"]["by_phase"]["sync"]["payload_bytes"]
    assert o["summary"]["by_phase"]["sync"]["payload_bytes"] == _sync_payload(o, 4, _factors)


def test_tangent_split_with_the_full_sync_averages_the_groups_models(runs):
    """split="tangent", sync="full": each worker's own A·B (UσVᵀ plus its group's change) is averaged, so W
    moves by half of each group's change (only-learned adds them); every worker ends the sync with one W, and
    the sync sends W (m·n numbers a layer), not the factors."""
    outs = runs["tangent-full"]
    sync = [o["syncs"][0] for o in outs]
    assert all(s["step"] == K for s in sync)
    for name in sync[0]["before"]:
        w0, change, _, _ = _tangent_first_sync(outs, name)
        got = sync[0]["after"]["W"][name].reshape(w0.shape)
        torch.testing.assert_close(got, w0 + change / 2, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, w0 + change, atol=1e-3)  # not the sum of the changes
        for s in sync[1:]:
            assert torch.equal(s["after"]["W"][name], sync[0]["after"]["W"][name])
    o = outs[0]
    m_n = {name: m * n for name, m, n in o["records"]}
    assert o["summary"]["by_phase"]["sync"]["payload_bytes"] == _sync_payload(o, 4, lambda name, a, b: m_n[name])


def test_tangent_sync_sends_the_change_of_w_where_it_is_smaller_than_the_factors(runs):
    """sync_payload="smaller" with the tangent split: a layer whose factors hold more numbers
    than W sends the change its group made to W instead; every worker ends each sync with one model, W is the
    tangent merge to bfloat16's precision on the change, and the sync's bytes are those of the smaller payloads."""
    outs = runs["tangent-change"]
    o = outs[0]
    m_n = {name: m * n for name, m, n in o["records"]}
    # at rank 30 of 40, A and B hold 2640 numbers, W 1920: every factorised layer sends its change
    assert all(m_n[name] < a.numel() + b.numel() for s in o["syncs"] for name, (a, b) in s["before"].items())
    assert [s["step"] for s in o["syncs"]] == [K, 2 * K]
    _one_model_after_each_sync(outs, 2)
    for name in o["syncs"][0]["before"]:
        w0, change, _, _ = _tangent_first_sync(outs, name)
        got = o["syncs"][0]["after"]["W"][name].reshape(w0.shape)
        # bfloat16 rounds each worker's share of the change, then the sum: an error on the scale of the change
        torch.testing.assert_close(got, w0 + change, rtol=0, atol=0.02 * float(change.abs().max()))
    # bfloat16: 2 bytes an element
    assert o["summary"]["by_phase"]["sync"]["payload_bytes"] == _sync_payload(o, 2, lambda name, a, b: m_n[name])


def test_lowrank_sync_sends_a_rank_q_change_and_the_rest_later(runs):
    """sync_payload="lowrank": each sync adds to W the projection of the summed change (plus what earlier syncs
    left in the workers' memories) onto q directions, the same on every worker; what it leaves out is added
    to the next sync's change; the sync sends P (m×q) and Q (n×q) per layer."""
    _check_lowrank_syncs(runs["tangent-lowrank"], q=3, element_bytes=4, projected=True)


def _same_model_and_bytes(o, r, syncs):
    """Worker output ``o`` against the same worker's ``r`` of another run: W after each of the first ``syncs``
    syncs within 1e-4 relative (rounding), and the same payload bytes in every phase."""
    for i in range(syncs):
        for name, w in o["syncs"][i]["after"]["W"].items():
            rw = r["syncs"][i]["after"]["W"][name]
            assert float((w - rw).norm() / rw.norm()) < 1e-4, (i, name)
    for phase, got in o["summary"]["by_phase"].items():
        assert got["payload_bytes"] == r["summary"]["by_phase"][phase]["payload_bytes"], phase


def test_factored_linear_layers_train_the_same_model_and_send_the_same_bytes(runs):
    """linear_apply="factors": the same syncs as forming W (one model on every worker, a rank-q change with its
    memory), the same model as the W-forming run up to rounding, and the same bytes in every phase."""
    outs, ref = runs["tangent-lowrank-factors"], runs["tangent-lowrank"]
    _check_lowrank_syncs(outs, q=3, element_bytes=4, projected=True)
    for o, r in zip(outs, ref):
        # After the first two syncs W differs by rounding only (measured ~1e-6). Later the rank-3 approximation
        # of the change can pick other directions from nearly equal candidates, so the runs may part more.
        _same_model_and_bytes(o, r, syncs=2)


def test_updated_svds_give_the_same_training_and_bytes(runs):
    """svd="update": every decomposition after a sync (the first at full rank, where r + q exceeds min(m, n), then
    ranks 30 of 40) finds W's SVD from the parts the sync left; only the first decomposition, after the warm-up,
    takes the full SVD; the
    same syncs as with full SVDs (one model everywhere, a rank-q change with its memory), the same factor products and models up
    to rounding, the same bytes."""
    outs, ref = runs["tangent-lowrank-update"], runs["tangent-lowrank-map"]
    _check_lowrank_syncs(outs, q=3, element_bytes=4, projected=True)
    for o, r in zip(outs, ref):
        # two layers at each decomposition: step 3 full, steps 6, 12 and 18 (the unplanned run goes on) updated
        assert o["results"]["svd_counts"] == {"full": 2, "updated": 6}
        assert r["results"]["svd_counts"] == {"full": 8, "updated": 0}
        after = next(s["after"] for s in o["steps"] if s["t"] == 2 * K)
        ref_after = next(s["after"] for s in r["steps"] if s["t"] == 2 * K)
        for name in after["A"]:
            assert after["A"][name].shape == ref_after["A"][name].shape == (40 if name == "body.weight" else 48, 30)
            ab, ref_ab = after["A"][name] @ after["B"][name], ref_after["A"][name] @ ref_after["B"][name]
            assert float((ab - ref_ab).norm() / ref_ab.norm()) < 1e-5, name
        _same_model_and_bytes(o, r, syncs=3)  # the last sync follows a phase trained from the updated factors


def test_lowrank_sync_in_bfloat16_leaves_one_model_and_keeps_the_rounding_for_later(runs):
    """sync_payload="lowrank" with sync_codec="bf16": every worker still ends each sync with the same model; what
    arrives is no longer the exact projection of the summed change, and the memories keep the difference, rounding
    included; P and Q take 2 bytes an element."""
    _check_lowrank_syncs(runs["tangent-lowrank-bf16"], q=3, element_bytes=2, projected=False)


def _matrix(w, shape):
    """W as the factorised matrix of ``shape``: its (S[0], rest) view, or that view's transpose (turned tall)."""
    rows = w.reshape(w.shape[0], -1)
    return rows if rows.shape == shape else rows.T


def _check_lowrank_syncs(outs, q, element_bytes, projected):
    """Three lowrank syncs: one model on every worker after each, rank ≤ q added to W, the workers' memories
    averaging to what the sync left out of the summed change plus the memories before it, and the sync's bytes
    (P and Q per layer); ``projected``: what was added is the exact projection onto its q directions."""
    o = outs[0]
    assert [s["step"] for s in o["syncs"]] == [K, 2 * K, 3 * K]
    _one_model_after_each_sync(outs, 3)
    for name in o["syncs"][0]["before"]:
        left = 0  # the average of the workers' memories
        for i in range(3):
            w_start, shares = _tangent_changes(outs, name, i)
            total = sum(shares) + left
            added = _matrix(o["syncs"][i]["after"]["W"][name], w_start.shape) - w_start
            assert torch.linalg.matrix_rank(added, atol=1e-5) <= q
            basis = torch.linalg.svd(added, full_matrices=False)[0][:, :q]  # the q directions it chose
            projection = basis @ (basis.T @ total)
            tol = {"rtol": 1e-4, "atol": 1e-4 * float(total.abs().max())}  # fp32 arithmetic on the change's scale
            if projected:
                torch.testing.assert_close(added, projection, **tol)
            else:  # bfloat16's rounding of P and Q' moved it off the projection
                assert not torch.allclose(added, projection, **tol)
            assert float((total - added).norm()) > 0.05 * float(total.norm())  # rank q leaves something out
            left = torch.stack([w["syncs"][i]["memory"][name] for w in outs]).mean(0)
            torch.testing.assert_close(left, total - added, **tol)  # kept for the next sync
    m_n = {name: (m, n) for name, m, n in o["records"]}
    assert all(q * (m + n) < m * n for m, n in m_n.values())
    assert o["summary"]["by_phase"]["sync"]["payload_bytes"] == _sync_payload(
        o, element_bytes, lambda name, a, b: q * sum(m_n[name]))


@pytest.mark.parametrize("mode", ["only-learned", "full", "with-stale"])
def test_sync_modes_compute_the_spec_average(runs, mode):
    outs = runs[mode]
    sync = [o["syncs"][0] for o in outs]
    for name in sync[0]["before"]:
        As = torch.stack([s["before"][name][0] for s in sync]).double()
        Bs = torch.stack([s["before"][name][1] for s in sync]).double()
        if mode == "only-learned":
            W = As[:2].mean(0) @ Bs[2:].mean(0)
        elif mode == "with-stale":  # every worker's A and B, trained or stale, averaged: W = mean A times mean B
            W = As.mean(0) @ Bs.mean(0)
        else:
            W = (As @ Bs).mean(0)
        for s in sync:
            got = s["after"]["W"][name].double().reshape(W.shape)
            assert torch.allclose(got, W, rtol=1e-5, atol=1e-6), (mode, name)


def test_a_sync_averages_the_full_rank_moments_unless_told_not_to(runs):
    """The parameters trained apart during the AB phase (biases, norms, kept layers) leave a sync equal on every
    worker; their optimizer moments too by default, and not with sync_moments=False (the authors' code)."""
    for name, averaged in (("with-stale", True), ("no-sync-moments", False)):
        outs = runs[name]
        after = [o["syncs"][0]["after"] for o in outs]
        assert after[0]["moments_full"] and after[0]["other"]
        for a in after[1:]:
            assert all(torch.equal(a["other"][k], v) for k, v in after[0]["other"].items()), name
        other_group = after[2]  # workers 0 and 1 trained in one group, 2 and 3 in the other
        same = all(torch.equal(other_group["moments_full"][k], v) for k, v in after[0]["moments_full"].items())
        assert same == averaged, name


def test_the_defaults_run_end_to_end_and_leave_the_last_syncs_model(runs):
    """abtrain's defaults in a 4-worker world: no factors larger than W at any decomposition, the schedule's
    sync count is the syncs made, and a run whose last step ends with a sync is left with the W that sync
    merged on every worker (no cut follows it)."""
    outs = runs["defaults"]
    o = outs[0]
    assert o["planned_syncs"] == o["results"]["syncs"] == 3 and [s["step"] for s in o["syncs"]] == [K, 2 * K, 3 * K]
    for entry in o["ranks_log"]:
        for name, m, n in o["records"]:
            r = entry["layers"][name]
            assert r is None or r * (m + n) < m * n, (entry["step"], name, r)
    assert [entry["step"] for entry in o["ranks_log"]] == [T_W, K, 2 * K]  # none after the last step
    merged = o["syncs"][-1]["after"]["W"]
    for w in outs:
        assert set(w["final_modes"].values()) == {"full"}
        for name, weight in w["final"]["W"].items():
            assert torch.equal(weight, merged[name]), name


def test_local_full_rank_phases_send_nothing_and_average_the_model_before_each_decomposition(runs):
    """--ab-dense-comm local: warm-up and rebound steps average no gradient, so the workers' models drift apart;
    the decomposition that ends each such phase first averages the model over every worker and the optimizer's
    moments inside each group, and a run that ends in a rebound ends with that average too."""
    outs = runs["local"]
    o = outs[0]
    for step in o["ledger_by_step"]:
        assert "warmup" not in step and "rebound" not in step  # nothing sent in a full-rank phase
    for w in outs:  # no error memory, no warm-start Q: the warm-up holds what DDP holds, to the byte
        assert sum(w["warmup_state"].values()) == dense_training_state_bytes(w["dense_params"], 1)
    assert sum(runs["defaults"][0]["warmup_state"].values()) > dense_training_state_bytes(o["dense_params"], 1)
    # the warm-up's end: one fp32 all-reduce of the parameters and float buffers over everyone, one of SGD's
    # momentum (one per parameter element) inside the group; the first decomposition sends nothing else
    sent = o["ledger_by_step"][T_W - 1]["sync"]
    assert sent["calls"] == 2 and sent["payload_bytes"] == 4 * (2 * o["dense_params"] + o["float_buffers"])
    first = [w["steps"][0]["after"]["other"]["stem.weight"] for w in outs]
    assert not torch.equal(first[0], first[1])  # each worker stepped on its own data alone
    cuts = sorted(o["decomposed_other"])
    assert cuts == [T_W, K + F, 2 * K + F]
    for t in cuts:
        for name in o["decomposed_other"][t]:
            mean = sum(w["decomposed_other"][t][name] for w in outs) / len(outs)
            for w in outs:
                assert torch.allclose(w["steps"][t - 1]["after"]["other"][name], mean, atol=1e-6), (t, name)
        for w in outs:  # the moments of the factor each worker trains start alike inside its group
            mates = [v for v in outs if v["role"] == w["role"]]
            for name, moment in w["steps"][t - 1]["moments"].items():
                assert all(torch.equal(moment, v["steps"][t - 1]["moments"][name]) for v in mates), (t, name)
    apart = [w["steps"][-1]["after"]["other"]["stem.weight"] for w in outs]  # after the last rebound step
    assert not torch.equal(apart[0], apart[2])
    for w in outs:  # the run ends in a rebound: averaged once more
        assert set(w["final_modes"].values()) == {"full"}
        for key, value in _tensors(w["final"]).items():
            assert torch.equal(value, _tensors(o["final"])[key]), key


def test_only_b_over_the_world_trains_b_with_dp_everywhere(runs):
    outs = runs["only-b-world"]
    for o in outs:
        assert o["role"] == "B"
        assert o["group_ranks"] == [0, 1, 2, 3]  # across the 2 groups of 2
    last = _tensors(outs[0]["steps"][-1]["after"])
    for o in outs[1:]:
        for (kind, name), v in _tensors(o["steps"][-1]["after"]).items():
            if kind != "buffers":  # BatchNorm statistics are averaged at sync and eval
                assert torch.equal(v, last[kind, name]), name  # DP over all workers: no drift at all


def test_only_b_in_groups_trains_b_inside_groups_and_averages_it_at_sync(runs):
    outs = runs["only-b"]
    for o in outs:
        assert o["role"] == "B"
        assert o["group_ranks"] == [2 * (o["rank"] // 2), 2 * (o["rank"] // 2) + 1]
    # inside the first AB phase: B identical inside a group, different between groups; A frozen and equal everywhere
    ab = max(i for i, s in enumerate(outs[0]["steps"]) if s["phase"] == "ab" and s["t"] < K)
    after = [o["steps"][ab]["after"] for o in outs]
    B, A = ([a[factor]["body.weight"] for a in after] for factor in ("B", "A"))
    assert torch.equal(B[0], B[1])
    assert torch.equal(B[2], B[3])
    assert not torch.equal(B[0], B[2])
    assert all(torch.equal(a, A[0]) for a in A)
    # at the sync B is averaged over all workers and W = A B is rebuilt: one model everywhere
    sync = [o["syncs"][0] for o in outs]
    mean_b = torch.stack([s["before"]["body.weight"][1] for s in sync]).double().mean(0)
    W = sync[0]["before"]["body.weight"][0].double() @ mean_b
    for s in sync:
        got = s["after"]["W"]["body.weight"].double()
        assert torch.allclose(got, W, rtol=1e-5, atol=1e-6)
        ref = _tensors(sync[0]["after"])
        for k, v in _tensors(s["after"]).items():
            assert torch.equal(v, ref[k]), k


def test_only_b_with_rank0_averages_b_and_takes_all_else_from_rank_0(runs):
    """--ab-only-b-sync rank0, the authors' only-b sync in groups: B averaged over every worker, W = A·B̄ (body's
    matrix turned tall); the parameters trained full rank (the norm, the kept stem and head, the biases), which
    the groups trained apart, and the buffers take rank 0's copy, not their mean; every worker leaves with one
    model; the sync sends B in an all-reduce and the rest in a broadcast."""
    outs = runs["only-b-rank0"]
    o = outs[0]
    assert ("body.weight", 48, 40) in o["records"]
    sync = [w["syncs"][0] for w in outs]
    assert not torch.equal(sync[0]["before_other"]["stem.weight"], sync[2]["before_other"]["stem.weight"])
    for name in sync[0]["before"]:
        mean_b = torch.stack([s["before"][name][1] for s in sync]).double().mean(0)
        w = sync[0]["before"][name][0].double() @ mean_b
        for s in sync:
            torch.testing.assert_close(_matrix(s["after"]["W"][name].double(), w.shape), w, rtol=1e-5, atol=1e-6)
    for s in sync:
        assert all(torch.equal(s["after"]["other"][k], v) for k, v in sync[0]["before_other"].items())
        assert all(torch.equal(s["after"]["buffers"][k], v) for k, v in sync[0]["before_buffers"].items()
                   if v.is_floating_point())
        ref = _tensors(sync[0]["after"])  # the model; the moments stay each worker's (--no-ab-sync-moments)
        assert all(torch.equal(v, ref[k]) for k, v in _tensors(s["after"]).items() if k[0] != "moments_full")
    sent = {op: sum(r["payload_bytes"] for r in o["summary"]["rows"] if r["phase"] == "sync" and r["op"] == op)
            for op in ("broadcast", "all_reduce")}
    rest = sum(v.numel() for v in sync[0]["before_other"].values()) + o["float_buffers"]
    assert sent["broadcast"] == 4 * rest * len(o["syncs"])
    b_numbers = sum(s["before"][name][1].numel() for s in o["syncs"] for name in s["before"])
    truncations = len([r for r in o["ranks_log"] if r["step"] != T_W])
    assert sent["all_reduce"] == 4 * b_numbers + 8 * len(o["records"]) * truncations


def test_a_run_turned_tall_merges_in_the_turned_matrix(runs):
    """--ab-orientation tall with the defaults' sync: body's factors are A (48 x r) and B (r x 40) of Wᵀ; the
    syncs add a rank-q change of that matrix, one model on every worker, with the SVDs updated from the parts."""
    outs = runs["tall"]
    o = outs[0]
    assert [r for r in o["records"] if r[0] == "body.weight"] == [("body.weight", 48, 40)]
    after = next(s["after"] for s in o["steps"] if s["t"] == 2 * K)
    assert after["A"]["body.weight"].shape == (48, 30) and after["B"]["body.weight"].shape == (30, 40)
    _check_lowrank_syncs(outs, q=3, element_bytes=4, projected=True)
    assert o["results"]["svd_counts"] == {"full": 2, "updated": 6}


def test_single_group_is_refused():
    with pytest.raises(ValueError, match="at least 2 groups"):
        ABTraining(Communicator(), Topology(rank=0, world_size=2, local_world_size=2), ABConfig())


def _ddp_wrapped(topo):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                                nn.Linear(64, 16)))
    method = ABTraining(Communicator(), topo, ABConfig(warmup_steps=1, sync_every=3, rebound_steps=1))
    model = method.prepare(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(topo.rank)
    with method.attach(opt):
        for _ in range(7):
            loss = model(torch.randn(8, 16, generator=gen)).logsumexp(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    out = {"unwrapped": model is ddp.module, "names": [fp.name for fp in method.records], "kept": method.state.kept,
           "weights": {k: v.detach().clone() for k, v in method.export().items() if torch.is_tensor(v)}}
    del ddp
    return out


def test_a_ddp_wrapped_model_is_unwrapped_and_trains(runs):
    outs = runs["ddp-wrapped"]
    for o in outs:
        assert o["unwrapped"]
        assert o["names"] == ["0.weight", "2.weight", "4.weight"]  # no "module." prefix
        assert o["kept"] == ["4.weight"]
    # the run ends with a sync: one model everywhere (the groups' factors differ under the tangent split: A = U·σ
    # or U; the weights they make are the same)
    for k, v in outs[0]["weights"].items():
        for o in outs[1:]:
            assert torch.allclose(v, o["weights"][k], rtol=1e-5, atol=1e-6), k


def test_method_state_of_another_layout_is_refused_naming_the_abtrain_that_wrote_it():
    """The method's state in the optimizer's state_dict carries its layout and the abtrain that wrote it; a
    state of another layout (the unnumbered earlier one, or a newer one) is refused in one line."""
    cfg = ABConfig(warmup_steps=1, sync_every=3)
    method = ABTraining(Communicator(), Topology(rank=0, world_size=4, local_world_size=4, group_size=2), cfg)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method.attach(opt)
    saved = opt.state_dict()
    assert saved["abtrain"]["version"] == STATE_VERSION and saved["abtrain"]["abtrain"] == abtrain.__version__
    opt.load_state_dict(saved)  # its own layout loads
    earlier = {k: v for k, v in saved["abtrain"].items() if k not in ("version", "abtrain")}
    for state, version, writer in ((earlier, None, "an earlier one"),
                                   ({**saved["abtrain"], "version": STATE_VERSION + 1, "abtrain": "9.9.9"},
                                    STATE_VERSION + 1, "9.9.9")):
        with pytest.raises(ValueError) as err:
            opt.load_state_dict({**saved, "abtrain": state})
        assert str(err.value) == (f"the optimizer's state_dict carries abtrain's method state in layout {version!r}, "
                                  f"this abtrain ({abtrain.__version__}) reads layout {STATE_VERSION}: load it with "
                                  f"the abtrain that wrote it ({writer})")
    method.detach(finalize=False)
