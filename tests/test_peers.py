"""streaming-diloco and demo: their math in one process, exact byte counts, one model on a real gloo world, resume.

One spawned world of 4 workers in groups of 2 runs every multi-process case in turn.
"""

import math
import tempfile

import pytest
import torch
from torch import nn

from abtrain.comm.communicator import Communicator
from abtrain.comm.ledger import Ledger, wire_bytes
from abtrain.comm.recording import LocalWorld
from abtrain.comm.topology import Topology
from abtrain.compress.codec import E3M0Codec
from abtrain.compress.dct import ChunkedDCT, DCTTopKCodec, dct_matrix, extract, scatter_mean
from abtrain.compress.grid import chunk_length
from abtrain.methods import build_method
from abtrain.methods.demo import DeMoConfig
from abtrain.methods.fragments import equal_groups, fragments_of, parameter_layers
from abtrain.methods.streaming_diloco import StreamingDiLoCoConfig
from helpers import layered_model, run_world, stopped_and_resumed, train_snapshots


def _train(method, model, steps, seed=0, adam=False):
    optimizer = (lambda params: torch.optim.AdamW(params, lr=1e-2)) if adam else (lambda params: torch.optim.SGD(params, lr=0.01))
    return train_snapshots(method, model, steps, optimizer, seed=seed)


# -- single process: DeMo's transform and extraction ---------------------------------------------------------
@pytest.mark.parametrize("n, target, c", [(128, 64, 64), (75, 64, 25), (10, 64, 10), (97, 64, 1), (784, 64, 56)])
def test_chunks_are_the_largest_divisor_not_above_the_target(n, target, c):
    assert chunk_length(n, target) == c


def test_dct_is_orthonormal():
    for n in (1, 5, 64):
        c = dct_matrix(n)
        assert torch.allclose(c @ c.T, torch.eye(n, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("shape", [(128, 3, 5, 5), (24, 6), (130,), (5,)])
def test_compression_round_trips_what_it_keeps(shape):
    """IDCT of the kept components transforms back to exactly them; residual + sent == momentum."""
    transform = ChunkedDCT(torch.Size(shape), 64, dtype=torch.float64)
    m = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(transform.decode(transform.encode(m)), m, atol=1e-12)
    coef = transform.encode(m)
    k = min(8, transform.elements)
    values, index = extract(coef, k)
    kept = torch.zeros_like(coef).scatter_(-1, index, values)
    sent = transform.decode(kept)
    again = transform.encode(sent)
    assert torch.allclose(again, kept, atol=1e-12)  # the kept components, and nothing else
    mask = torch.zeros_like(coef, dtype=torch.bool).scatter_(-1, index, True)
    dropped = coef.masked_fill(mask, 0).abs().amax(-1)
    assert bool((dropped <= values.abs().amin(-1)).all())  # top-k by magnitude, per chunk
    assert torch.allclose((m - sent) + sent, m, atol=1e-12)
    assert torch.allclose(transform.encode(m - sent), coef.masked_fill(mask, 0), atol=1e-12)  # the residual stays


def test_scatter_mean_averages_over_the_workers_that_sent_an_entry():
    v = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])]
    i = [torch.tensor([0, 1]), torch.tensor([1, 3])]
    assert scatter_mean(v, i, 4).tolist() == [1.0, 2.5, 0.0, 5.0]


def test_demo_momentum_keeps_what_is_not_sent():
    method = build_method("demo", Communicator(), Topology(), topk=3, decay=0.9)
    model = layered_model()
    method.prepare(model)
    codec = method.codec
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        grad = torch.randn(sum(method.numels), generator=gen)
        before = 0.9 * method.momentum + grad
        update = method.exchange(grad)
        sent = before - method.momentum
        for t, k, s, u in zip(codec.transforms, codec.ks, sent.split(method.numels), update.split(method.numels)):
            assert int((t.encode(s.view(t.shape)).abs() > 1e-5).sum()) <= t.chunks * k  # k components per chunk left
            # One worker: the update is the sign of what it sent.
            clear = s.abs() > 1e-6
            assert torch.equal(u[clear], s.sign()[clear])
            assert set(u.unique().tolist()) <= {-1.0, 0.0, 1.0}


def _demo_steps(rule, lrs):
    """The parameters after each step of DeMo in one process with ``momentum_rule=rule`` and the learning rates
    ``lrs`` (one per step), and the momentum at the end."""
    method = build_method("demo", Communicator(), Topology(), topk=3, chunk=8, momentum_rule=rule)
    model = layered_model()
    forward = method.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=lrs[0])
    gen = torch.Generator().manual_seed(3)
    snapshots = []
    with method.attach(opt):
        for lr in lrs:
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(forward(x), y).backward()
            opt.step()
            snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return snapshots, method.momentum.clone()


def test_demo_momentum_rules_agree_at_a_constant_lr_and_differ_under_a_schedule():
    """The reference code's m = beta m + lr g is lr times the paper's m = beta m + g while lr stays (a power of two
    here, so that the scaling is exact): the same components, the same signs, the same steps. Under an lr that
    changes every step the momentum weighs past gradients differently, and the steps part."""
    lr = 2.0 ** -7
    paper, m_paper = _demo_steps("paper", [lr] * 6)
    reference, m_reference = _demo_steps("reference", [lr] * 6)
    assert all(torch.equal(a, b) for a, b in zip(paper, reference))
    assert torch.equal(m_reference, lr * m_paper)
    decaying = [2.0 ** -(7 + k) for k in range(6)]
    paper, _ = _demo_steps("paper", decaying)
    reference, _ = _demo_steps("reference", decaying)
    assert torch.equal(paper[0], reference[0])  # the first step: one gradient, whatever its scale
    assert not torch.equal(paper[-1], reference[-1])


def test_dct_topk_message_holds_what_the_extraction_keeps():
    """The message's entries are each chunk's top-k coefficients; decode is their inverse DCT."""
    shapes = [torch.Size([16, 24]), torch.Size([10])]
    codec = DCTTopKCodec(shapes, 8, 3)
    x = torch.randn(16 * 24 + 10, generator=torch.Generator().manual_seed(4))
    message = codec.encode(x)
    assert message.dtype == torch.uint8 and message.numel() == codec.message_bytes(x.numel()) == 6 * codec.k
    values, indices = codec.entries(message)
    coef = torch.cat([t.encode(piece.view(t.shape)).reshape(-1) for t, piece in zip(codec.transforms, x.split([384, 10]))])
    assert torch.equal(values, coef[indices])
    kept = torch.zeros_like(coef).index_put_((indices,), values)
    assert torch.allclose(codec.decode(message), codec.synthesize(kept))
    assert torch.allclose(codec.synthesize(coef), x, atol=1e-5)  # the transform itself loses nothing


def test_demo_refuses_an_optimizer_with_momentum():
    method = build_method("demo", Communicator(), Topology())
    model = method.prepare(layered_model())
    with pytest.raises(ValueError, match="--optimizer sgd --momentum 0"):
        method.attach(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


# -- single process: Streaming DiLoCo's pieces -----------------------------------------------------------------
def test_e3m0_holds_powers_of_two_of_the_block_scale():
    x = torch.tensor([1.0, -0.5, 0.25, -2 ** -6, 0.0, 2 ** -8, 0.7, -0.3])
    codec = E3M0Codec(8)
    message = codec.encode(x)
    assert message.dtype == torch.uint8 and message.numel() == codec.message_bytes(8) == 4 + 4
    assert message[4:].clone().view(torch.float32).tolist() == [1.0]  # the block's scale
    assert codec.decode(message).tolist() == [1.0, -0.5, 0.25, -2 ** -6, 0.0, 0.0, 0.5, -0.25]
    # rounded to the nearest power of two in log2, not in value: 0.72 lies nearer 0.5 but above 2 ** -0.5
    between = torch.tensor([1.0, 0.72, 0.74, 0.706, 0.36, 0.353, 0.0, 0.0])
    assert codec.decode(codec.encode(between)).tolist() == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.0, 0.0]
    y = torch.randn(512, generator=torch.Generator().manual_seed(3))
    codec = E3M0Codec(256)
    back = codec.decode(codec.encode(y))
    scales = y.view(2, 256).abs().amax(1)
    big = y.abs() > scales.repeat_interleave(256) / 64
    assert torch.equal(back.sign()[big], y.sign()[big])
    assert bool(((back[big] / y[big]).log2().abs() <= 0.5 + 1e-6).all())  # rounded in log2


def test_the_modules_pattern_deals_modules_out_in_turn():
    assert fragments_of(layered_model(), 2, "modules") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # modules 0, 2 | 1, 3
    with pytest.raises(ValueError, match="--streaming-diloco-fragments 5: the model has 4 modules"):
        fragments_of(layered_model(), 5, "modules")


def test_layers_take_the_norms_after_them():
    # Linear(6,16) | Linear(16,10) + LayerNorm(10) | Linear(10,5); a leading norm joins the first layer
    assert parameter_layers(layered_model()) == [[0, 1], [2, 3, 4, 5], [6, 7]]
    leading = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 4), nn.LayerNorm(4))
    assert parameter_layers(leading) == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("sizes, count, expected", [
    ([5] * 12, 4, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]),
    ([1, 1, 100, 1, 1, 1], 3, [[0, 1], [2], [3, 4, 5]]),  # the large item alone, the others share the rest
    ([3, 9, 2, 7, 7, 1, 4], 5, [[0], [1], [2, 3], [4], [5, 6]]),
    ([10, 1, 1, 1], 4, [[0], [1], [2], [3]]),  # no group left empty
    ([4], 1, [[0]]),
])
def test_equal_groups_are_contiguous_non_empty_and_near_the_mean(sizes, count, expected):
    groups = equal_groups(sizes, count)
    assert [i for g in groups for i in g] == list(range(len(sizes))) and all(groups) and len(groups) == count
    assert groups == expected
    with pytest.raises(ValueError, match="non-empty groups"):
        equal_groups(sizes, len(sizes) + 1)


def test_the_strided_pattern_cuts_the_depth_into_equal_groups_dealt_out_in_turn():
    # 12 equal blocks, 3 fragments, 2 groups each: groups of 2 blocks, fragment f holds groups f and f + 3
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    blocks = [[2 * b, 2 * b + 1] for b in range(12)]
    assert fragments_of(model, 3) == [blocks[0] + blocks[1] + blocks[6] + blocks[7],
                                      blocks[2] + blocks[3] + blocks[8] + blocks[9],
                                      blocks[4] + blocks[5] + blocks[10] + blocks[11]]
    # one group per fragment: the paper's sequential pattern
    assert fragments_of(model, 3, per_fragment=1) == [sum(blocks[4 * f:4 * f + 4], []) for f in range(3)]
    # a model of 3 layers has room for one group per fragment of 2: the first layer, then the other two
    assert fragments_of(layered_model(), 2) == [[0, 1], [2, 3, 4, 5, 6, 7]]
    with pytest.raises(ValueError, match="--streaming-diloco-fragments 4: the model has 3 layers"):
        fragments_of(layered_model(), 4)


# -- exact counts: a world of 4 simulated workers whose collectives meet in memory -------------------------------
def _recorded(p, name, steps, adam=False, **options):
    """Every worker's ledger rows of a short run of ``name`` in a :class:`LocalWorld` of ``p``, and rank 0's method."""
    def worker(comm):
        method = build_method(name, comm, Topology(rank=comm.rank, world_size=p, group_size=2), **options)
        _train(method, layered_model(), steps, seed=comm.rank, adam=adam)
        return comm.ledger.summary()["rows"], method

    out = LocalWorld(p).run(worker)
    assert all(rows == out[0][0] for rows, _ in out)  # every worker sends the same bytes
    return out[0]


def _rows(rows, phase):
    return {r["op"]: r for r in rows if r["phase"] == phase}


def test_demo_bytes_equal_the_formula():
    p, steps = 4, 5
    rows, method = _recorded(p, "demo", steps, topk=4, chunk=8)
    # Linear(6,16): 16x6, chunks 8x6, 2 chunks; bias 16: 2 chunks of 8; Linear(16,10): 10x16, 5x8 chunks, 4;
    # bias 10: 2 of 5; LayerNorm 10 + 10: 2 + 2 of 5; Linear(10,5): 5x10, 5x5 chunks, 2; bias 5: 1 of 5.
    k = 2 * 4 + 2 * 4 + 4 * 4 + 2 * 4 + 4 * 4 + 2 * 4 + 1 * 4
    assert method.components == k
    row = _rows(rows, "train")["all_gather"]
    assert (row["calls"], row["payload_bytes"], row["dtype"]) == (steps, steps * 6 * k, "uint8")
    assert row["wire_bytes"] == steps * (p - 1) * 6 * k
    assert method.extra_results()["demo"]["message_bytes"] == 6 * k


@pytest.mark.parametrize("quantize", ["e3m0", "fp32"])
def test_streaming_diloco_bytes_equal_the_formula(quantize):
    p, h, steps = 4, 4, 9
    rows, method = _recorded(p, "streaming-diloco", steps, adam=True, sync_every=h, fragments=2, overlap=1, quantize=quantize,
                             scale_block=16)
    sizes = method.fragment_numels
    assert method.offsets == [0, 2] and sizes == [6 * 16 + 16, 16 * 10 + 10 + 10 + 10 + 10 * 5 + 5]
    # Fragment 1 meets at steps 2, 6; fragment 0 at 4, 8; leaving attach() exchanges both at once (step 9).
    assert method.fragment_syncs == [3, 3]
    sends = [sizes[1], sizes[0], sizes[1], sizes[0], sizes[0] + sizes[1]]
    rows = _rows(rows, "outer")
    if quantize == "fp32":
        assert set(rows) == {"all_reduce"}
        assert rows["all_reduce"]["payload_bytes"] == 4 * sum(sends)
        assert rows["all_reduce"]["wire_bytes"] == pytest.approx(sum(wire_bytes("all_reduce", 4 * n, p) for n in sends))
        return
    messages = []
    for n in sends:
        length = math.ceil(n / (p * 16)) * 16
        messages.append(length // 2 + 4 * length // 16)
    assert set(rows) == {"all_to_all", "all_gather"} and {r["dtype"] for r in rows.values()} == {"uint8"}
    assert rows["all_to_all"]["calls"] == rows["all_gather"]["calls"] == len(sends)
    assert rows["all_to_all"]["payload_bytes"] == sum(p * m for m in messages)
    assert rows["all_to_all"]["wire_bytes"] == pytest.approx(sum((p - 1) * m for m in messages))
    assert rows["all_gather"]["payload_bytes"] == sum(messages)
    assert rows["all_gather"]["wire_bytes"] == sum((p - 1) * m for m in messages)


# -- real gloo worlds -----------------------------------------------------------------------------------------
STEPS = 9
RESUME = {"demo": ({"demo": DeMoConfig(topk=4, chunk=16)}, {"optimizer": "sgd", "momentum": 0.0, "lr": 3e-3}, 5),
          # stopped at step 4: fragment 0's exchange there is merged at step 5, after the restart
          "streaming-diloco": ({"streaming_diloco": StreamingDiLoCoConfig(sync_every=4, fragments=2, overlap=1, scale_block=64)},
                               {"optimizer": "adamw", "lr": 1e-3}, 4)}


def _world(fashion_dir, root):
    topo = Topology.from_env(backend="gloo", device="cpu", group_size=2)
    out = {}
    cases = {"demo": ("demo", {"topk": 4, "chunk": 8}, False),
             "streaming": ("streaming-diloco", {"sync_every": 4, "fragments": 2, "overlap": 0, "scale_block": 16}, True),
             "streaming-overlap": ("streaming-diloco", {"sync_every": 4, "fragments": 2, "overlap": 1, "scale_block": 16}, True),
             "diloco": ("diloco", {"sync_every": 3}, True),
             "streaming-as-diloco": ("streaming-diloco", {"sync_every": 3, "fragments": 1, "overlap": 0, "quantize": "fp32"},
                                     True)}
    for case, (name, options, adam) in cases.items():
        comm = Communicator(Ledger(), topo.device)
        method = build_method(name, comm, topo, **options)
        snapshots = _train(method, layered_model(), STEPS, seed=10 + topo.rank, adam=adam)
        out[case] = {"snapshots": snapshots, "extra": method.extra_results(),
                     "global": torch.cat([g.reshape(-1) for g in getattr(method, "global_params", [torch.zeros(0)])]),
                     "final": torch.cat([p.detach().reshape(-1) for p in method.module.parameters()])}
    for name, (options, extra, stop) in RESUME.items():
        out[f"resume-{name}"] = stopped_and_resumed(topo, root, fashion_dir, name, stop, **options, **extra)
    topo.close()
    return out


@pytest.fixture(scope="module")
def world(fashion_dir):
    with tempfile.TemporaryDirectory() as root:
        return run_world(_world, 4, fashion_dir, root)


def _fragment(snapshot, model, ids):
    params = list(model.parameters())
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    return torch.cat([snapshot[offsets[i]:offsets[i + 1]] for i in ids])


def test_demo_keeps_one_model_after_every_step(world):
    for step in range(STEPS):
        for rank in range(1, 4):
            assert torch.equal(world[rank]["demo"]["snapshots"][step], world[0]["demo"]["snapshots"][step])
    assert not torch.equal(world[0]["demo"]["snapshots"][0], world[0]["demo"]["snapshots"][-1])


def test_streaming_diloco_workers_hold_one_fragment_after_its_outer_step(world):
    model = layered_model()
    frags = fragments_of(model, 2)
    snaps = [w["streaming"]["snapshots"] for w in world]
    for step, fragment in ((2, 1), (4, 0), (6, 1), (8, 0)):
        ids = frags[fragment]
        other = frags[1 - fragment]
        for rank in range(1, 4):
            assert torch.equal(_fragment(snaps[rank][step - 1], model, ids), _fragment(snaps[0][step - 1], model, ids))
        assert not torch.equal(_fragment(snaps[2][step - 1], model, other), _fragment(snaps[0][step - 1], model, other))
    for case in ("streaming", "streaming-overlap"):  # one global model everywhere; one model after detach
        for rank in range(1, 4):
            assert torch.equal(world[rank][case]["global"], world[0][case]["global"])
            assert torch.equal(world[rank][case]["final"], world[0][case]["final"])
        assert torch.equal(world[0][case]["final"], world[0][case]["global"])


def test_streaming_diloco_overlap_merges_half_of_the_local_progress(world):
    """With tau = 1 the fragment exchanged at step 2 differs between workers until merged at step 3, and stays so."""
    model = layered_model()
    ids = fragments_of(model, 2)[1]
    snaps = [w["streaming-overlap"]["snapshots"] for w in world]
    assert not torch.equal(_fragment(snaps[0][1], model, ids), _fragment(snaps[2][1], model, ids))
    assert not torch.equal(_fragment(snaps[0][2], model, ids), _fragment(snaps[2][2], model, ids))


def test_one_fragment_without_overlap_or_quantisation_is_diloco(world):
    for rank_out in world:
        for a, b in zip(rank_out["diloco"]["snapshots"], rank_out["streaming-as-diloco"]["snapshots"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(RESUME))
def test_stopped_and_resumed_runs_equal_the_uninterrupted_run(world, name):
    for rank_out in world:
        result = rank_out[f"resume-{name}"]
        assert result["stopped_at"] == RESUME[name][2] and result["resumed"]["step"] == result["ref"]["step"] == 10
        for key, value in result["ref"]["state"].items():
            assert torch.equal(result["resumed"]["state"][key], value), f"{name}: {key} differs after the resume"
        assert result["resumed"]["history"] == result["ref"]["history"]
        assert result["resumed"]["ledger"] == result["ref"]["ledger"]


def test_available_from_setup_in_a_users_loop(monkeypatch):
    import abtrain

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for name, options in (("demo", {"topk": 8}), ("streaming-diloco", {"sync_every": 2, "fragments": 2})):
        method = abtrain.setup(name, device="cpu", **options)
        assert method.name == name and method.cfg == type(method.cfg)(**options)
        _train(method, layered_model(), 3)
        with method.consensus():
            assert method.in_consensus()
        method.close()
