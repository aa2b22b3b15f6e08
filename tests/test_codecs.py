"""The codec seam: each format's bytes and rounding, and the one compressed all-reduce over simulated workers
(exact means, one result everywhere, bytes equal to the formula, error feedback that loses nothing)."""

import pytest
import torch

from abtrain.comm.ledger import wire_bytes
from abtrain.comm.recording import LocalWorld, RecordingCommunicator
from abtrain.compress.allreduce import compressed_all_reduce, slice_length
from abtrain.compress.codec import CODECS, BF16Codec, E3M0Codec, Float32Codec, Int8Codec, build_codec
from abtrain.compress.sign import SignCodec


def _randn(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# -- single process: the formats ------------------------------------------------------------------------------
@pytest.mark.parametrize("codec, per_element", [(Float32Codec(), 4), (BF16Codec(), 2), (Int8Codec(16), 1 + 4 / 16),
                                                (E3M0Codec(16), 0.5 + 4 / 16)])
def test_message_bytes_equal_the_formula(codec, per_element):
    x = _randn(64, 0)
    message = codec.encode(x)
    assert message.dtype == torch.uint8 and message.numel() == codec.message_bytes(64) == 64 * per_element
    assert codec.decode(message).dtype == torch.float32 and codec.decode(message).numel() == 64


def test_casts_round_as_torch_does():
    x = _randn(100, 1)
    assert torch.equal(Float32Codec().decode(Float32Codec().encode(x)), x)
    assert torch.equal(BF16Codec().decode(BF16Codec().encode(x)), x.to(torch.bfloat16).float())


def test_int8_rounds_to_the_nearest_step_of_its_block_scale():
    codec = Int8Codec(4)
    x = torch.tensor([1.0, -0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0])
    s = torch.tensor(1.0) / 127
    expected = torch.tensor([127.0, -64.0, 32.0, 0.0]) * s  # -63.5 -> -64 (ties to even), 31.75 -> 32
    assert torch.equal(codec.decode(codec.encode(x)), torch.cat([expected, torch.zeros(4)]))  # zero block: zeros
    y = _randn(4096, 2)
    back = Int8Codec(256).decode(Int8Codec(256).encode(y))
    step = y.view(-1, 256).abs().amax(1, keepdim=True) / 127
    assert bool(((back - y).view(-1, 256).abs() <= step / 2 * (1 + 1e-5)).all())


def test_e3m0_encoding_its_own_values_changes_nothing():
    codec = E3M0Codec(32)
    once = codec.decode(codec.encode(_randn(256, 3)))
    assert torch.equal(codec.decode(codec.encode(once)), once)


def test_block_codecs_refuse_a_partial_block_and_bad_names():
    with pytest.raises(ValueError, match="pad to a multiple of 16"):
        Int8Codec(16).encode(torch.zeros(20))
    with pytest.raises(ValueError, match="must be even"):
        E3M0Codec(15)
    with pytest.raises(ValueError, match="choose one of: fp32, bf16, int8, e3m0"):
        build_codec("int4")
    assert [build_codec(name, 8).name for name in CODECS] == list(CODECS)


# -- the compressed all-reduce over simulated workers ----------------------------------------------------------
def _reduce(p, n, codec, errors=False, seed=0):
    """Each worker's result, ledger rows and error memories after one call; worker r holds _randn(n, seed + r)."""
    length = slice_length(n, p, codec.align)

    def worker(comm):
        flat = _randn(n, seed + comm.rank)
        worker_error = _randn(p * length, 100 + comm.rank) * 0.1 if errors else None
        server_error = _randn(length, 200 + comm.rank) * 0.1 if errors and not codec.summable else None
        before = (None if worker_error is None else worker_error.clone(),
                  None if server_error is None else server_error.clone())
        out = compressed_all_reduce(comm, comm.world.group, flat, codec, worker_error=worker_error,
                                    server_error=server_error)
        assert torch.equal(flat, _randn(n, seed + comm.rank))  # the input is left as it is
        return out, comm.ledger.summary()["rows"], before, (worker_error, server_error)

    return LocalWorld(p).run(worker)


def _reference(p, n, codec, seed=0):
    """The two roundings of the compressed all-reduce written out: each worker's slices encoded, decoded, averaged in
    rank order, the mean encoded and decoded."""
    length = slice_length(n, p, codec.align)
    padded = [torch.cat([_randn(n, seed + r), torch.zeros(p * length - n)]) for r in range(p)]
    out = []
    for j in range(p):
        total = torch.zeros(length)
        for r in range(p):
            total += codec.decode(codec.encode(padded[r][j * length:(j + 1) * length]))
        out.append(codec.decode(codec.encode(total / p)))
    return torch.cat(out)[:n]


@pytest.mark.parametrize("codec", [E3M0Codec(8), Int8Codec(8)])
@pytest.mark.parametrize("p", [3, 4])
def test_every_worker_gets_the_mean_of_the_decoded_slices(codec, p):
    n = 101
    results = _reduce(p, n, codec)
    for out, *_ in results:
        assert torch.equal(out, results[0][0])
    assert torch.equal(results[0][0], _reference(p, n, codec))
    if isinstance(codec, Int8Codec):  # two roundings of at most half a step (1/254 of a block's largest) each
        mean = torch.stack([_randn(n, r) for r in range(p)]).mean(0)
        assert torch.allclose(results[0][0], mean, atol=0.05)


@pytest.mark.parametrize("codec", [E3M0Codec(8), Int8Codec(8), SignCodec(4 * 32)])
def test_bytes_equal_the_formula(codec):
    p, n = 4, 101
    rows = {r["op"]: r for r in _reduce(p, n, codec)[0][1]}
    length = slice_length(n, p, codec.align)
    m = codec.for_slices(length, p)[0].message_bytes(length)
    assert set(rows) == {"all_to_all", "all_gather"} and {r["dtype"] for r in rows.values()} == {"uint8"}
    assert (rows["all_to_all"]["payload_bytes"], rows["all_to_all"]["wire_bytes"]) == (p * m, (p - 1) * m)
    assert (rows["all_gather"]["payload_bytes"], rows["all_gather"]["wire_bytes"]) == (m, (p - 1) * m)


@pytest.mark.parametrize("codec", [Float32Codec(), BF16Codec()])
def test_a_summable_codec_is_one_all_reduce_in_its_dtype(codec):
    p, n = 4, 101
    results = _reduce(p, n, codec)
    rows = results[0][1]
    assert [(r["op"], r["dtype"], r["payload_bytes"]) for r in rows] == [
        ("all_reduce", str(codec.wire_dtype).removeprefix("torch."), codec.message_bytes(n))]
    assert rows[0]["wire_bytes"] == wire_bytes("all_reduce", codec.message_bytes(n), p)
    flats = [_randn(n, r) for r in range(p)]
    if codec.wire_dtype == torch.float32:  # summed in rank order, then divided
        expected = flats[0].clone()
        for f in flats[1:]:
            expected += f
        expected /= p
    else:  # divided before the sum, against overflow
        expected = flats[0].to(torch.bfloat16) / p
        for f in flats[1:]:
            expected += f.to(torch.bfloat16) / p
        expected = expected.float()
    for out, *_ in results:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("p", [1, 4])
def test_error_feedback_loses_nothing(p):
    """out + mean_i e_w_i' + e_s' == mean_i (x_i + e_w_i) + e_s, the server errors of all slices concatenated."""
    n = 90
    codec = SignCodec(p * slice_length(n, p, 8), [0, 40, 70])
    results = _reduce(p, n, codec, errors=True)
    length = slice_length(n, p, 8)
    padded = [torch.cat([_randn(n, r), torch.zeros(p * length - n)]) for r in range(p)]
    sent = sum(x + before[0] for x, (_, _, before, _) in zip(padded, results)) / p
    kept = sum(after[0] for *_, after in results) / p
    server_before = torch.cat([before[1] for _, _, before, _ in results])
    server_after = torch.cat([after[1] for *_, after in results])
    out = results[0][0]
    assert torch.allclose(out + kept[:n] + server_after[:n], sent[:n] + server_before[:n], atol=1e-5)
    assert not torch.allclose(out, sent[:n], atol=1e-3)  # the codec did round


def test_a_summable_codec_keeps_its_rounding_in_the_worker_error():
    results = _reduce(2, 50, BF16Codec(), errors=True)
    for r, (_, _, before, after) in enumerate(results):
        x = _randn(50, r) + before[0][:50]
        assert torch.equal(after[0][:50], x - x.to(torch.bfloat16).float())


def test_one_worker_rounds_once_and_sends_nothing():
    codec = E3M0Codec(16)
    flat = _randn(40, 5)
    comm = RecordingCommunicator()
    out = compressed_all_reduce(comm, LocalWorld(1).group, flat, codec)
    assert torch.equal(out, codec.decode(codec.encode(torch.cat([flat, torch.zeros(8)])))[:40])
    assert comm.calls == []


def test_wrong_error_memories_are_refused():
    comm, group = RecordingCommunicator(), LocalWorld(1).group
    with pytest.raises(ValueError, match="no server error"):
        compressed_all_reduce(comm, group, torch.zeros(8), Float32Codec(), server_error=torch.zeros(8))
    with pytest.raises(ValueError, match="worker_error holds 8 elements"):
        compressed_all_reduce(comm, group, torch.zeros(8), E3M0Codec(16), worker_error=torch.zeros(8))
