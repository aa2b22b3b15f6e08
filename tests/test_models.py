"""Models: shapes, parameter names the low-rank patterns rely on, sizes, determinism, causality."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from abtrain.data import Dataset, Split
from abtrain.models import MODELS, build_model, count_parameters, criterion


def image_dataset(n: int = 6, shape: tuple[int, ...] = (1, 28, 28), classes: int = 10) -> Dataset:
    split = Split(x=torch.randn(n, *shape), y=torch.randint(0, classes, (n,)))
    return Dataset("fake-images", "classify", split, split, shape, classes)


def flat_dataset(n: int = 6, dim: int = 32, classes: int = 4) -> Dataset:
    split = Split(x=torch.randn(n, dim), y=torch.randint(0, classes, (n,)))
    return Dataset("fake-flat", "classify", split, split, (dim,), classes)


def text_dataset(n: int = 3, block: int = 64, vocab: int = 65) -> Dataset:
    ids = torch.randint(0, vocab, (n, block + 1))
    split = Split(x=ids[:, :-1], y=ids[:, 1:])
    itos = "".join(chr(32 + i) for i in range(vocab))
    return Dataset("fake-text", "lm", split, split, (block,), vocab, itos)


CLASSIFY_CASES = [
    ("mlp", image_dataset()),
    ("mlp", flat_dataset()),
    ("cnn", image_dataset()),
    ("wide", image_dataset()),
    ("resnet", image_dataset()),
    ("resnet", image_dataset(shape=(3, 16, 16), classes=5)),
]


@pytest.mark.parametrize("name, ds", CLASSIFY_CASES)
def test_classifier_output_shape_and_loss(name: str, ds: Dataset) -> None:
    torch.manual_seed(0)
    model = build_model(name, ds)
    out = model(ds.train.x)
    assert out.shape == (len(ds.train), ds.num_classes)
    loss = criterion("classify")(out, ds.train.y)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_gpt_output_shape_and_loss() -> None:
    ds = text_dataset()
    torch.manual_seed(0)
    model = build_model("gpt", ds)
    out = model(ds.train.x)
    assert out.shape == (3, 64, 65)
    loss = criterion("lm")(out, ds.train.y)
    # Small initial weights: the prediction starts close to uniform.
    assert abs(loss.item() - torch.log(torch.tensor(65.0)).item()) < 0.2
    # Shorter sequences than the block size work too.
    assert model(ds.train.x[:, :10]).shape == (3, 10, 65)


@pytest.mark.parametrize("name, ds", [*CLASSIFY_CASES, ("gpt", text_dataset())])
def test_stem_and_head_names(name: str, ds: Dataset) -> None:
    model = build_model(name, ds)
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" in names
    modules = dict(model.named_modules())
    assert isinstance(modules["head"], nn.Linear)
    if name == "gpt":
        # The GPT's input layer is its token embedding.
        assert names[0] == "tok_emb.weight"
    else:
        # The first weight is the stem's, and it belongs to a layer that can be factorised.
        assert names[0].startswith("stem.") and names[0].endswith("weight")
        assert isinstance(modules[names[0].rsplit(".", 1)[0]], (nn.Linear, nn.Conv2d))


def test_wide_holds_its_parameters_in_two_wide_layers() -> None:
    model = build_model("wide", image_dataset(shape=(1, 28, 28), classes=10))
    total = count_parameters(model)
    fc = model.fc1.weight.numel() + model.fc2.weight.numel()
    assert model.fc1.weight.shape == (1024, 1568) and model.fc2.weight.shape == (1024, 1024)
    assert fc / total > 0.98 and total == 2_671_354


def test_gpt_layer_names() -> None:
    names = {n for n, _ in build_model("gpt", text_dataset()).named_parameters()}
    for part in ("q", "k", "v", "o"):
        assert f"blocks.0.attn.{part}.weight" in names
    assert {"tok_emb.weight", "pos_emb.weight"} <= names
    assert "head.bias" not in names


def test_gpt_size() -> None:
    n = count_parameters(build_model("gpt", text_dataset(vocab=65, block=64)))
    assert 700_000 < n < 1_500_000


def test_overrides() -> None:
    small = build_model("gpt", text_dataset(), d_model=32, n_layer=1, n_head=2)
    assert count_parameters(small) < 50_000
    assert count_parameters(build_model("cnn", image_dataset(), width=0.5)) < count_parameters(
        build_model("cnn", image_dataset())
    )
    deep = build_model("resnet", image_dataset(), blocks=2)
    assert count_parameters(deep) > count_parameters(build_model("resnet", image_dataset()))
    with pytest.raises(ValueError, match="unknown option.*depth.*width"):
        build_model("cnn", image_dataset(), depth=3)
    with pytest.raises(ValueError, match="divisible"):
        build_model("gpt", text_dataset(), d_model=30, n_head=4)


def test_wrong_task_and_unknown_model() -> None:
    with pytest.raises(ValueError, match="shakespeare"):
        build_model("gpt", image_dataset())
    with pytest.raises(ValueError, match="fashion-mnist"):
        build_model("cnn", text_dataset())
    with pytest.raises(ValueError, match="mlp"):
        build_model("cnn", flat_dataset())
    with pytest.raises(ValueError, match=", ".join(MODELS)):
        build_model("transformer", image_dataset())
    with pytest.raises(ValueError, match="task"):
        criterion("regression")


@pytest.mark.parametrize("name, ds", [*CLASSIFY_CASES[1:4], ("gpt", text_dataset())])
def test_deterministic_under_manual_seed(name: str, ds: Dataset) -> None:
    outputs = []
    for _ in range(2):
        torch.manual_seed(123)
        model = build_model(name, ds)
        model.train()  # includes dropout, which must follow the same seed
        outputs.append(model(ds.train.x))
    assert torch.equal(outputs[0], outputs[1])


def test_gpt_is_causal() -> None:
    ds = text_dataset(n=2)
    torch.manual_seed(0)
    model = build_model("gpt", ds).eval()
    x = ds.train.x.clone()
    before = model(x)
    x[:, 40] = (x[:, 40] + 1) % ds.num_classes
    after = model(x)
    assert torch.allclose(before[:, :40], after[:, :40], atol=1e-6)
    assert not torch.allclose(before[:, 40:], after[:, 40:])
