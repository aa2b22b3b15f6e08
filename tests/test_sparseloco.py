"""sparseloco: its codecs' round trips, the accumulator, exact byte counts, one model on a real gloo world, resume.

One spawned world of 4 workers in groups of 2 runs every multi-process case in turn.
"""

import math
import tempfile

import pytest
import torch
from torch import nn

from abtrain.comm.communicator import Communicator
from abtrain.comm.ledger import Ledger
from abtrain.comm.recording import LocalWorld
from abtrain.comm.topology import Topology
from abtrain.compress.bits import IndexCodec, index_width, pack_bits, unpack_bits
from abtrain.compress.chunked_topk import ChunkedTopKCodec, Chunks, chunk_topk
from abtrain.compress.dct import scatter_mean
from abtrain.compress.twobit import TwoBitCodec, quantize
from abtrain.methods import build_method
from abtrain.methods.sparseloco import SparseLoCoConfig, sync_every_for
from helpers import flat, layered_model, run_world, stopped_and_resumed, train_snapshots


def _train(method, model, steps, seed=0):
    return train_snapshots(method, model, steps, lambda params: torch.optim.AdamW(params, lr=1e-2), seed=seed)


# -- single process: the codecs --------------------------------------------------------------------------------
def test_bits_round_trip_at_any_width():
    gen = torch.Generator().manual_seed(0)
    widths = torch.randint(0, 17, (999,), generator=gen)
    values = (torch.rand(999, generator=gen) * 2.0 ** widths).long()
    stream = pack_bits(values, widths)
    assert stream.dtype == torch.uint8 and stream.numel() == math.ceil(int(widths.sum()) / 8)
    assert torch.equal(unpack_bits(stream, widths), values)
    assert pack_bits(torch.tensor([5, 1]), torch.tensor([3, 2])).tolist() == [0b10101000]  # most significant first
    with pytest.raises(ValueError, match="does not fit its width"):
        pack_bits(torch.tensor([4]), torch.tensor([2]))


def test_an_index_takes_the_bits_of_its_chunk():
    assert [index_width(e) for e in (1, 2, 5, 64, 4096, 4097)] == [0, 1, 3, 6, 12, 13]
    codec = IndexCodec([3, 2], [12, 3])
    positions = torch.tensor([4095, 0, 17, 7, 5])
    message = codec.encode(positions)
    assert message.numel() == codec.message_bytes(5) == math.ceil((3 * 12 + 2 * 3) / 8)
    assert torch.equal(codec.decode(message), positions)


def test_two_bits_keep_the_mean_of_each_bin():
    v = torch.tensor([-3.0, -1.2, -1.0, 0.1, 0.2, 1.0, 1.5, 2.4])
    q, table = quantize(v)
    mu = v.mean()
    c = v - mu
    s = 6 * c.norm() / math.sqrt(7) / 4
    assert torch.equal(q, torch.clamp(torch.round(c / s) + 2, 0, 3).long())
    for b in range(4):
        assert torch.allclose(table[1 + b], c[q == b].mean() if bool((q == b).any()) else torch.tensor(0.0))
    codec = TwoBitCodec([8, 1, 3])
    x = torch.cat([v, torch.tensor([0.37]), torch.tensor([2.0, 2.0, 2.0])])
    message = codec.encode(x)
    assert message.numel() == codec.message_bytes(12) == math.ceil(2 * 12 / 8) + 20 * 3
    decoded = codec.decode(message)
    assert torch.equal(decoded[:8], table[1:][q] + table[0])
    assert decoded[8].item() == pytest.approx(0.37) and torch.allclose(decoded[9:], torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="holds 12 values"):
        codec.message_bytes(11)


@pytest.mark.parametrize("shape, chunk, c1, c2, k", [((128, 96), 64, 64, 48, 48), ((96,), 64, 1, 48, 1),
                                                       ((10, 3, 3, 3), 64, 10, 27, 4), ((), 64, 1, 1, 1),
                                                       ((64, 64), 64, 64, 64, 64), ((67, 5), 64, 1, 5, 1)])
def test_chunks_and_k_follow_the_authors_rule(shape, chunk, c1, c2, k):
    c = Chunks(torch.Size(shape), chunk)
    assert (c.c1, c.c2) == (c1, c2)
    assert chunk_topk(c.elements, chunk, 64) == k


@pytest.mark.parametrize("values", ["fp32", "2bit"])
def test_chunked_topk_sends_each_chunks_largest_entries(values):
    shapes = [torch.Size([16, 24]), torch.Size([10]), torch.Size([4, 2, 3])]
    codec = ChunkedTopKCodec(shapes, 8, 16, values)
    n = 16 * 24 + 10 + 24
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    message = codec.encode(x)
    assert message.dtype == torch.uint8 and message.numel() == codec.message_bytes(n)
    vals, index = codec.entries(message)
    assert index.numel() == len(set(index.tolist())) == codec.k
    if values == "fp32":
        assert torch.equal(vals, x[index])  # the entries themselves, at their places in the flat buffer
    else:  # the same entries, each tensor's in 2 bits
        assert torch.equal(vals, codec.values.decode(codec.values.encode(x[index])))
    # per chunk, nothing left out is larger than what was kept
    kept = torch.zeros(n, dtype=torch.bool)
    kept[index] = True
    offset = 0
    for shape, layout, k in zip(shapes, codec.layout, codec.ks):
        piece = slice(offset, offset + layout.numel)
        chunks_x, chunks_kept = layout.split(x[piece].abs()), layout.split(kept[piece])
        assert bool((chunks_kept.sum(1) == k).all())
        assert bool((chunks_x.masked_fill(chunks_kept, 0).amax(1) <= chunks_x.masked_fill(~chunks_kept, math.inf)
                     .amin(1)).all())
        offset += layout.numel
    assert torch.equal(codec.decode(message), torch.zeros(n).index_put_((index,), vals))


# -- single process: the method's arithmetic -------------------------------------------------------------------
@pytest.mark.parametrize("quantize_values", ["fp32", "2bit"])
def test_the_accumulator_holds_exactly_what_was_not_sent(quantize_values):
    method = build_method("sparseloco", Communicator(), Topology(), sync_every=3, decay=0.9, outer_lr=0.5,
                          chunk=8, topk=16, quantize=quantize_values)
    model = layered_model()
    method.prepare(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        before = method.accumulator.clone()
        theta = flat(method.global_params)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen), alpha=0.01)
        pseudo = theta - flat(model.parameters())
        expected = before.clone().mul_(0.9).add_(pseudo)  # e = beta * e + (global - local)
        message = method.codec.encode(expected)
        sent = method.codec.decode(message)
        method.synchronize()
        assert torch.equal(method.accumulator, expected - sent)
        values, index = method.codec.entries(message)
        if quantize_values == "fp32":  # what was sent is gone, the rest is untouched
            assert bool((method.accumulator[index] == 0).all())
            rest = torch.ones_like(expected, dtype=torch.bool).index_fill_(0, index, False)
            assert torch.equal(method.accumulator[rest], expected[rest])
        # one worker: the outer step is theta - alpha * its own decoded message, and every worker loads it
        assert torch.equal(flat(method.global_params), theta.add(sent, alpha=-0.5))
        assert torch.equal(flat(model.parameters()), flat(method.global_params))


def test_mean_over_senders_or_over_all_workers():
    v = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])]
    i = [torch.tensor([0, 1]), torch.tensor([1, 3])]
    assert scatter_mean(v, i, 4).tolist() == [1.0, 2.5, 0.0, 5.0]
    method = build_method("sparseloco", Communicator(), Topology(), mean="workers", chunk=2, topk=4)
    method.prepare(nn.Linear(2, 2, bias=False))
    messages = [method.codec.encode(torch.tensor(x)) for x in ([1.0, 2.0, 0.0, 0.0], [0.0, 3.0, 0.0, 5.0])]
    assert method.combine(messages).tolist() == [0.5, 2.5, 0.0, 2.5]


def test_the_period_keeps_the_papers_outer_steps_in_a_shorter_run():
    assert [sync_every_for(t) for t in (None, 8, 702, 2000, 2445, 100_000)] == [15, 1, 4, 12, 15, 15]
    method = build_method("sparseloco", Communicator(), Topology())
    assert method.sync_every == 15
    method.set_total_steps(702)
    assert method.sync_every == 4 and method.due(4) and not method.due(3)
    fixed = build_method("sparseloco", Communicator(), Topology(), sync_every=7)
    fixed.set_total_steps(702)
    assert fixed.sync_every == 7


@pytest.mark.parametrize("options, message", [({"topk": 0}, "--sparseloco-topk must be in"),
                                              ({"chunk": 2, "topk": 5}, r"chunk\*\*2 = 4"),
                                              ({"sync_every": 0}, "--sparseloco-sync-every must be a positive"),
                                              ({"decay": 1.5}, "--sparseloco-decay must be in"),
                                              ({"quantize": "int8"}, "--sparseloco-quantize")])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        SparseLoCoConfig(**options)


# -- exact counts: a world of 4 simulated workers whose collectives meet in memory -------------------------------
#: The test model at chunk 8, topk 16 (16 of 64 entries of a full chunk, the same share of smaller ones):
#: (chunks, entries per chunk, bits per position) of each tensor.
LAYOUT = [(2, 12, 6),   # Linear(6,16).weight 16x6: chunks 8x6 (48 elements, 12 kept), 6-bit positions
          (2, 2, 3),    # its bias, 16: chunks of 8, 2 kept
          (4, 10, 6),   # Linear(16,10).weight 10x16: chunks 5x8 (40 elements, 10 kept)
          (2, 1, 3),    # its bias, 10: chunks of 5, round(1.25) = 1 kept
          (2, 1, 3),    # LayerNorm weight
          (2, 1, 3),    # LayerNorm bias
          (2, 6, 5),    # Linear(10,5).weight 5x10: chunks 5x5 (25 elements, round(6.25) = 6 kept)
          (1, 1, 3)]    # its bias, 5: one chunk of 5


def _message_bytes(quantize_values):
    entries = sum(c * k for c, k, _ in LAYOUT)
    index = math.ceil(sum(c * k * w for c, k, w in LAYOUT) / 8)
    values = math.ceil(2 * entries / 8) + 20 * len(LAYOUT) if quantize_values == "2bit" else 4 * entries
    return entries, index + values


@pytest.mark.parametrize("quantize_values", ["2bit", "fp32"])
def test_bytes_equal_the_formula(quantize_values):
    p, steps = 4, 9

    def worker(comm):
        method = build_method("sparseloco", comm, Topology(rank=comm.rank, world_size=p, group_size=2),
                              sync_every=4, chunk=8, topk=16, quantize=quantize_values)
        _train(method, layered_model(), steps, seed=comm.rank)
        return comm.ledger.summary()["rows"], method.extra_results()["sparseloco"]

    out = LocalWorld(p).run(worker)
    assert all(rows == out[0][0] for rows, _ in out)  # every worker sends the same bytes
    rows, extra = out[0]
    entries, m = _message_bytes(quantize_values)
    assert (entries, m) == (87, 242 if quantize_values == "2bit" else 408)
    assert (extra["entries"], extra["message_bytes"], extra["syncs"], extra["sync_every"]) == (entries, m, 3, 4)
    outer = [r for r in rows if r["phase"] == "outer"]
    # outer steps at steps 4 and 8; leaving attach() takes one more at step 9
    assert [(r["op"], r["scope"], r["dtype"], r["calls"]) for r in outer] == [("all_gather", "global", "uint8", 3)]
    assert outer[0]["payload_bytes"] == 3 * m and outer[0]["wire_bytes"] == 3 * (p - 1) * m


# -- real gloo worlds -----------------------------------------------------------------------------------------
STEPS = 9


def _world(fashion_dir, root):
    topo = Topology.from_env(backend="gloo", device="cpu", group_size=2)
    out = {}
    for case, options in {"senders": {"sync_every": 3, "chunk": 8, "topk": 16},
                          "workers": {"sync_every": 3, "chunk": 8, "topk": 16, "mean": "workers"}}.items():
        method = build_method("sparseloco", Communicator(Ledger(), topo.device), topo, **options)
        snapshots = _train(method, layered_model(), STEPS, seed=10 + topo.rank)
        out[case] = {"snapshots": snapshots, "global": flat(method.global_params), "accumulator": method.accumulator}
    out["resume"] = stopped_and_resumed(topo, root, fashion_dir, "sparseloco", 4,
                                        keep=lambda trainer: {"accumulator": trainer.method.accumulator.clone()},
                                        optimizer="adamw", lr=1e-3,
                                        sparseloco=SparseLoCoConfig(sync_every=3, chunk=16, topk=32))
    topo.close()
    return out


@pytest.fixture(scope="module")
def world(fashion_dir):
    with tempfile.TemporaryDirectory() as root:
        return run_world(_world, 4, fashion_dir, root)


@pytest.mark.parametrize("case", ["senders", "workers"])
def test_every_worker_ends_an_outer_step_with_one_model(world, case):
    snaps = [w[case]["snapshots"] for w in world]
    for step in range(1, STEPS + 1):
        same = all(torch.equal(snaps[r][step - 1], snaps[0][step - 1]) for r in range(1, 4))
        assert same == (step % 3 == 0), f"step {step}"  # equal after each outer step, apart in between
    for rank in range(1, 4):
        assert torch.equal(world[rank][case]["global"], world[0][case]["global"])
    assert torch.equal(snaps[0][-1], world[0][case]["global"])
    # each worker keeps its own residual
    assert not torch.equal(world[0][case]["accumulator"], world[1][case]["accumulator"])
    assert not torch.equal(world[0]["senders"]["global"], world[0]["workers"]["global"])


def test_stopped_and_resumed_runs_equal_the_uninterrupted_run(world):
    for rank_out in world:
        result = rank_out["resume"]
        assert result["stopped_at"] == 4 and result["resumed"]["step"] == result["ref"]["step"] == 10
        for key, value in result["ref"]["state"].items():
            assert torch.equal(result["resumed"]["state"][key], value), f"{key} differs after the resume"
        assert torch.equal(result["resumed"]["accumulator"], result["ref"]["accumulator"])
        assert result["resumed"]["history"] == result["ref"]["history"]
        assert result["resumed"]["ledger"] == result["ref"]["ledger"]


def test_available_from_setup_in_a_users_loop(monkeypatch):
    import abtrain

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    method = abtrain.setup("sparseloco", device="cpu", total_steps=702, topk=32)
    assert method.name == "sparseloco" and method.cfg == SparseLoCoConfig(topk=32) and method.sync_every == 4
    _train(method, layered_model(), 5)
    with method.consensus():
        assert method.in_consensus()
    assert method.syncs == 2  # step 4, and the consensus at step 5
    method.close()
