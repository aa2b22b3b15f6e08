"""ef21, onebit, hlocalsgd: the compression math in one process, exact byte counts, one model on real gloo worlds, resume.

One spawned world of 4 workers in groups of 2 runs every multi-process case
in turn, so the file stays fast.
"""

import math
import re
import tempfile

import pytest
import torch
from torch import nn

from abtrain.cli import build_parser, config_from_args
from abtrain.comm.communicator import Communicator
from abtrain.comm.ledger import Ledger, wire_bytes
from abtrain.comm.recording import LocalWorld
from abtrain.comm.topology import Topology
from abtrain.compress.sign import SignCodec, pack_signs, segment_ids, unpack_signs
from abtrain.compress.topk import TopKCodec, topk_compress, topk_count
from abtrain.config import TrainConfig
from abtrain.methods import build_method
from abtrain.methods.ef21 import EF21Config
from abtrain.methods.hlocalsgd import HLocalSGDConfig
from abtrain.methods.onebit import OneBitConfig
from helpers import run_world, stopped_and_resumed, train_snapshots


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 5))  # 144 + 24 + 120 + 5 = 293 parameters


def _train(method, model, steps, clip=None, seed=0):
    optimizer = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    return train_snapshots(method, model, steps, optimizer, seed=seed, clip=clip)


# -- single process: the compressors --------------------------------------------------------------
@pytest.mark.parametrize("numel, fraction, k", [(1000, 0.01, 10), (1001, 0.01, 11), (10, 0.01, 1), (7, 1.0, 7)])
def test_topk_keeps_exactly_k(numel, fraction, k):
    assert topk_count(numel, fraction) == k
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    values, indices = topk_compress(x, k)
    assert values.numel() == indices.numel() == k == indices.unique().numel()
    dense = torch.zeros_like(x).index_put_((indices,), values)
    assert torch.count_nonzero(dense) == k and torch.equal(dense[indices], x[indices])
    dropped = torch.ones(numel, dtype=torch.bool).index_fill_(0, indices, False)
    if dropped.any():
        assert x[dropped].abs().max() <= values.abs().min()


def test_ef21_estimate_plus_residual_is_the_gradient():
    """c_i + (grad - g_i_new) == grad - g_i_old: what the compressor drops stays in the residual."""
    method = build_method("ef21", Communicator(), Topology(), fraction=0.05, warmup_steps=0)
    model = _model()
    method.prepare(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        grad = torch.randn(sum(method.numels), generator=gen)
        old = method.local.clone()
        estimate = method.exchange(grad)
        new = method.local
        change = new - old
        assert int(torch.count_nonzero(change)) <= sum(method.ks)
        assert torch.allclose(change + (grad - new), grad - old, atol=1e-6)
        assert torch.equal(estimate, method.estimate)
        assert torch.allclose(method.estimate, method.local, atol=1e-6)  # one worker: g == g_1


def test_sign_packing_round_trips():
    x = torch.randn(64, generator=torch.Generator().manual_seed(2))
    x[3] = 0.0  # zero travels as +
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    assert pack_signs(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1])).item() == 0b10000001


def test_segments_follow_tensors_chunks_and_slices():
    # Tensors of 3 and 5 elements, two slices of 8 (the second is all padding).
    ids, m = segment_ids([0, 3, 8], 16, 2)
    assert m == 2
    assert ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1] + [2] * 8
    # A tensor straddling a slice boundary is cut there; chunks of 2 add their own starts.
    ids, m = segment_ids([0, 2, 4, 6], 8, 2)
    assert m == 2 and ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_sign_compression_scale_is_the_mean_magnitude():
    x = torch.tensor([1.0, -3.0, 2.0, 0.5, -0.5, 4.0, -4.0, 0.0])
    codec = SignCodec(8, [0, 4])
    message = codec.encode(x)
    assert message.numel() == codec.message_bytes(8) == 1 + 4 * 2
    assert message[1:].clone().view(torch.float32).tolist() == [1.625, 2.125]
    assert codec.decode(message).tolist() == [1.625, -1.625, 1.625, 1.625, -2.125, 2.125, -2.125, 2.125]


def test_sign_slices_carry_the_segments_inside_them_and_one_scale_count():
    """Cut in slices, each slice holds the buffer's segments inside it (cut at its start), with as many scales as
    the slice with the most segments; encoding slice by slice gives the bits of encoding the segments alone."""
    codec = SignCodec(32, [0, 3, 8, 20])
    slices = codec.for_slices(16, 2)
    assert [c.starts for c in slices] == [[0, 3, 8], [0, 4]] and [c.scales for c in slices] == [3, 3]
    x = torch.randn(32, generator=torch.Generator().manual_seed(5))
    first = slices[0].decode(slices[0].encode(x[:16]))
    for a, b in ((0, 3), (3, 8), (8, 16)):
        assert torch.equal(first[a:b], x[a:b].abs().mean() * torch.where(x[a:b] >= 0, 1.0, -1.0))
    second = slices[1].encode(x[16:])
    assert second[2:].clone().view(torch.float32)[2].item() == 0.0  # the padded scale


def test_topk_codec_message_is_values_then_int32_indices():
    x = torch.randn(30, generator=torch.Generator().manual_seed(6))
    codec = TopKCodec([10, 20], 0.2)
    message = codec.encode(x)
    assert codec.ks == [2, 4] and message.numel() == codec.message_bytes(30) == 8 * 6
    values, indices = codec.entries(message)
    assert torch.equal(values, x[indices]) and indices.dtype == torch.int64
    assert set(indices[:2].tolist()) <= set(range(10)) and set(indices[2:].tolist()) <= set(range(10, 30))
    assert torch.equal(codec.decode(message), torch.zeros(30).index_put_((indices,), values))


def test_onebit_error_feedback_carries_the_residual():
    """Both compressions keep what they drop: output + e_worker' + e_server' == grad + e_worker + e_server."""
    method = build_method("onebit", Communicator(), Topology(), warmup_steps=0, scale_block=16)
    model = _model()
    method.prepare(model)
    n = sum(method.numels)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        grad = torch.randn(n, generator=gen)
        before = method.worker_error[:n] + method.server_error[:n]
        out = method.exchange(grad)
        after = method.worker_error[:n] + method.server_error[:n]
        assert torch.allclose(out + after, grad + before, atol=1e-5)
        assert torch.count_nonzero(method.worker_error[n:]) == 0  # the padding never leaks


# -- exact counts: a world of 4 simulated workers whose collectives meet in memory -------------------------------
def _recorded(p, name, steps, **options):
    """Every worker's ledger rows of a short run of ``name`` in a :class:`LocalWorld` of ``p``, and rank 0's method."""
    def worker(comm):
        method = build_method(name, comm, Topology(rank=comm.rank, world_size=p, group_size=2), **options)
        _train(method, _model(), steps, seed=comm.rank)
        return comm.ledger.summary()["rows"], method

    out = LocalWorld(p).run(worker)
    assert all(rows == out[0][0] for rows, _ in out)  # every worker sends the same bytes
    return out[0]


def _rows(rows, phase):
    return {r["op"]: r for r in rows if r["phase"] == phase}


@pytest.mark.parametrize("name, options", [("ef21", {"fraction": 0.03, "warmup_steps": 2}),
                                           ("onebit", {"warmup_steps": 2}),
                                           ("onebit", {"warmup_steps": 2, "scale_block": 7})])
def test_counted_bytes_equal_the_formula(name, options):
    p, steps = 4, 6
    rows, method = _recorded(p, name, steps, **options)
    n = 293
    warm = _rows(rows, "warmup")["all_reduce"]
    assert (warm["calls"], warm["payload_bytes"]) == (2, 2 * 4 * n)
    assert warm["wire_bytes"] == pytest.approx(2 * wire_bytes("all_reduce", 4 * n, p))
    train = _rows(rows, "train")
    if name == "ef21":
        k = sum(math.ceil(0.03 * t) for t in (144, 24, 120, 5))
        assert set(train) == {"all_gather"}
        assert (train["all_gather"]["calls"], train["all_gather"]["payload_bytes"]) == (4, 4 * 8 * k)
        assert train["all_gather"]["wire_bytes"] == 4 * (p - 1) * 8 * k
        assert method.extra_results()["ef21"]["message_bytes"] == 8 * k
    else:
        length = math.ceil(n / (8 * p)) * 8  # elements per slice: 80
        m = method.segments
        if "scale_block" not in options:
            # Tensors [0,144) [144,168) [168,288) [288,293), padding [293,320); the slice [240,320) holds
            # the end of the third tensor, the fourth and the padding: 3 scales.
            assert length == 80 and m == 3
        message = length // 8 + 4 * m
        assert set(train) == {"all_to_all", "all_gather"}
        assert train["all_to_all"]["payload_bytes"] == 4 * p * message
        assert train["all_to_all"]["wire_bytes"] == pytest.approx(4 * (p - 1) * message)
        assert train["all_gather"]["payload_bytes"] == 4 * message
        assert train["all_gather"]["wire_bytes"] == 4 * (p - 1) * message
        assert {r["dtype"] for r in train.values()} == {"uint8"}
        # The signs alone: 1/32 of a ring all-reduce of the (padded) float32 gradient; the scales come on top.
        assert 2 * (p - 1) * (length // 8) == wire_bytes("all_reduce", 4 * p * length, p) / 32


# -- real gloo worlds -------------------------------------------------------------------------------
STEPS = 6
CASES = {
    "ef21": ("ef21", {"fraction": 0.05}, None),
    "ef21-clip": ("ef21", {"fraction": 0.05}, 0.05),
    "onebit": ("onebit", {"warmup_steps": 2}, None),
    "onebit-chunks-clip": ("onebit", {"warmup_steps": 1, "scale_block": 16}, 0.05),
    "hlocalsgd": ("hlocalsgd", {"sync_every": 4}, None),
    "hlocalsgd-clip": ("hlocalsgd", {"sync_every": 4}, 0.05),
}
RESUME = {"ef21": ({"ef21": EF21Config(fraction=0.05)}, 5),
          "onebit": ({"onebit": OneBitConfig(warmup_steps=2)}, 5),
          "hlocalsgd": ({"hlocalsgd": HLocalSGDConfig(sync_every=4)}, 6)}  # hlocalsgd: stop while the groups differ


def _world(fashion_dir, root):
    topo = Topology.from_env(backend="gloo", device="cpu", group_size=2)
    out = {}
    for case, (name, options, clip) in CASES.items():
        comm = Communicator(Ledger(), topo.device)
        method = build_method(name, comm, topo, **options)
        snapshots = _train(method, _model(), STEPS, clip=clip, seed=10 + topo.rank)  # each worker its own data
        out[case] = {"snapshots": snapshots, "summary": comm.ledger.summary(), "extra": method.extra_results()}
    # Lossless settings (every element its own scale; k = every element) must give the exact mean.
    for name, options in (("onebit", {"scale_block": 1, "warmup_steps": 0}), ("ef21", {"fraction": 1.0, "warmup_steps": 0})):
        comm = Communicator(Ledger(), topo.device)
        method = build_method(name, comm, topo, **options)
        method.prepare(_model())
        errors = []
        for step in range(3):
            grad = torch.randn(sum(method.numels), generator=torch.Generator().manual_seed(100 * step + topo.rank))
            mean = comm.all_reduce(grad.clone(), topo.world, average=True)
            errors.append((method.exchange(grad) - mean).abs().max().item())
        out[f"lossless-{name}"] = errors
    for name, (options, stop) in RESUME.items():
        out[f"resume-{name}"] = stopped_and_resumed(topo, root, fashion_dir, name, stop, lr=0.05, **options)
    topo.close()
    return out


@pytest.fixture(scope="module")
def world(fashion_dir):
    with tempfile.TemporaryDirectory() as root:
        return run_world(_world, 4, fashion_dir, root)


@pytest.mark.parametrize("case", ["ef21", "ef21-clip", "onebit", "onebit-chunks-clip"])
def test_compressed_methods_keep_one_model_after_every_step(world, case):
    for step in range(STEPS):
        for rank in range(1, 4):
            assert torch.equal(world[rank][case]["snapshots"][step], world[0][case]["snapshots"][step]), \
                f"{case}: worker {rank} differs after step {step + 1}"
    assert not torch.equal(world[0][case]["snapshots"][0], world[0][case]["snapshots"][-1])  # it trained


@pytest.mark.parametrize("name", ["onebit", "ef21"])
def test_lossless_settings_give_the_exact_mean(world, name):
    """onebit with one scale per element and ef21 with k = numel send everything: the routing must add up."""
    for rank_out in world:
        assert max(rank_out[f"lossless-{name}"]) < 1e-6


@pytest.mark.parametrize("case", ["hlocalsgd", "hlocalsgd-clip"])
def test_hlocalsgd_groups_agree_every_step_and_everyone_every_h_steps(world, case):
    snaps = [w[case]["snapshots"] for w in world]
    for step in range(STEPS):
        assert torch.equal(snaps[0][step], snaps[1][step]) and torch.equal(snaps[2][step], snaps[3][step])
    assert torch.equal(snaps[0][3], snaps[2][3])  # step 4: the average over all
    assert not torch.equal(snaps[0][2], snaps[2][2])  # the groups drift apart in between
    # Leaving attach() averaged steps 5-6 (finalize): one model at the end.
    s = world[0][case]["summary"]
    assert s["by_phase"]["average"]["calls"] == 2 and world[0][case]["extra"]["hlocalsgd"]["syncs"] == 2


def test_hlocalsgd_counts(world):
    s = world[0]["hlocalsgd-clip"]["summary"]
    n, p = 293, 4
    local = s["by_phase"]["local"]
    # Clipping asked for the average first: still one group all-reduce per step.
    assert local["calls"] == STEPS and local["payload_bytes"] == STEPS * 4 * n
    assert local["wire_bytes"] == pytest.approx(STEPS * wire_bytes("all_reduce", 4 * n, 2))
    assert s["by_scope"]["group"]["wire_bytes"] == pytest.approx(local["wire_bytes"])
    # Each meeting: parameters and SGD's momentum.
    assert s["by_phase"]["average"]["payload_bytes"] == 2 * 2 * 4 * n
    assert s["by_phase"]["average"]["wire_bytes"] == pytest.approx(2 * wire_bytes("all_reduce", 2 * 4 * n, p))


def test_real_world_counts_equal_the_formula(world):
    n, p = 293, 4
    ef = world[0]["ef21-clip"]["summary"]["by_phase"]
    k = sum(math.ceil(0.05 * t) for t in (144, 24, 120, 5))
    assert ef["warmup"]["payload_bytes"] == 4 * n and ef["warmup"]["calls"] == 1  # the default warm-up, once
    assert ef["train"]["calls"] == STEPS - 1 and ef["train"]["payload_bytes"] == (STEPS - 1) * 8 * k
    ob = world[0]["onebit"]
    message = ob["extra"]["onebit"]["message_bytes"]
    rows = [r for r in ob["summary"]["rows"] if r["phase"] == "train"]
    assert {r["op"]: r["payload_bytes"] for r in rows} == {"all_to_all": (STEPS - 2) * p * message,
                                                           "all_gather": (STEPS - 2) * message}


@pytest.mark.parametrize("name", list(RESUME))
def test_stopped_and_resumed_runs_equal_the_uninterrupted_run(world, name):
    for rank_out in world:
        result = rank_out[f"resume-{name}"]
        assert result["stopped_at"] == RESUME[name][1] and result["resumed"]["step"] == result["ref"]["step"] == 10
        for key, value in result["ref"]["state"].items():
            assert torch.equal(result["resumed"]["state"][key], value), f"{name}: {key} differs after the resume"
        assert result["resumed"]["history"] == result["ref"]["history"]
        assert result["resumed"]["ledger"] == result["ref"]["ledger"]


# -- options ----------------------------------------------------------------------------------------------
def test_options_from_flags():
    ns = build_parser().parse_args(["train", "--method", "onebit", "--ef21-fraction", "0.05", "--onebit-scale-block",
                                    "256", "--onebit-warmup-steps", "0", "--hlocalsgd-sync-every", "3"])
    cfg = config_from_args(ns)
    assert cfg.ef21 == EF21Config(fraction=0.05)
    assert cfg.onebit == OneBitConfig(warmup_steps=0, scale_block=256)
    assert cfg.hlocalsgd == HLocalSGDConfig(sync_every=3)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("args, message", [
    (["--ef21-fraction", "0"], "--ef21-fraction must be in (0, 1]"),
    (["--ef21-fraction", "1.5"], "--ef21-fraction must be in (0, 1]"),
    (["--ef21-warmup-steps", "-1"], "--ef21-warmup-steps must be an integer >= 0"),
    (["--onebit-scale-block", "-8"], "--onebit-scale-block must be >= 0"),
    (["--onebit-warmup-steps", "-1"], "--onebit-warmup-steps must be an integer >= 0"),
    (["--hlocalsgd-sync-every", "0"], "--hlocalsgd-sync-every must be a positive integer"),
])
def test_bad_options_say_how_to_fix_them(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_args(build_parser().parse_args(["train", *args]))


# -- the bench ---------------------------------------------------------------------------------------------
def test_bench_reports_the_all_to_all_of_onebit(tmp_path):
    """The report and its projection read all_to_all rows (ef21 and hlocalsgd use collectives they knew)."""
    from abtrain.sidebyside import BenchConfig, run_bench
    from abtrain.sidebyside.alphabeta import group_size_of

    assert group_size_of("all_to_all", 1000, wire_bytes("all_to_all", 1000, 4)) == 4
    report = run_bench(BenchConfig(workload="tiny", methods=["ddp", "onebit"], out=str(tmp_path / "bench")))
    rows = {r["method"]: r for r in report["methods"]}
    assert rows["ddp"]["status"] == rows["onebit"]["status"] == "complete"
    assert rows["onebit"]["global_reduction_vs_ddp"] > 1
    assert set(report["projection"]["epoch_seconds"]) == {"ddp", "onebit"}


def test_available_from_setup_in_a_users_loop(monkeypatch):
    import abtrain

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for name, options in (("ef21", {"fraction": 0.02}), ("onebit", {"scale_block": 64}), ("hlocalsgd", {"sync_every": 2})):
        method = abtrain.setup(name, device="cpu", **options)
        assert method.name == name and method.cfg == type(method.cfg)(**options)
        _train(method, _model(), 3)
        method.close()
