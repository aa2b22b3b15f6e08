"""The models trained by abtrain: an MLP, a VGG-style CNN, a small ResNet and a character GPT.

Every weight lives in a plain ``nn.Linear`` / ``nn.Conv2d`` module that the
forward pass calls, so low-rank factorisation can swap weights through
``torch.nn.utils.parametrize`` without touching model code. The layer that
first sees the input is named ``stem`` and the output layer ``head``: the
default "keep full rank" patterns match ``stem.*`` and ``head.*``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from abtrain.data import Dataset

__all__ = ["MODELS", "build_model", "count_parameters", "criterion"]

MODELS = ("mlp", "cnn", "wide", "resnet", "gpt")
# Which task each model fits; used for the "wrong dataset" message.
_MODEL_TASK = {"mlp": "classify", "cnn": "classify", "wide": "classify", "resnet": "classify", "gpt": "lm"}
_TASK_DATASETS = {"classify": "fashion-mnist, synthetic", "lm": "shakespeare"}
# Keyword options build_model passes through to each model.
_OVERRIDES = {
    "mlp": ("hidden",),
    "cnn": ("width", "dropout"),
    "wide": ("hidden", "dropout"),
    "resnet": ("blocks", "width"),
    "gpt": ("d_model", "n_layer", "n_head"),
}


# ---------------------------------------------------------------- MLP


class MLP(nn.Module):
    """Flatten -> Linear -> ReLU -> Linear -> ReLU -> head."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 256) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x.flatten(1)))
        x = F.relu(self.hidden(x))
        return self.head(x)


# ---------------------------------------------------------------- VGG-style CNN


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    # BatchNorm follows, so the conv bias would be redundant.
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)
    )


class VGG(nn.Module):
    """VGG-style CNN with BatchNorm: three conv stages with max-pooling, then two linear layers."""

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, width: float = 1.0, dropout: float = 0.25
    ) -> None:
        super().__init__()
        c, h, w = input_shape
        c1, c2, c3 = (max(1, round(k * width)) for k in (32, 64, 128))
        hidden = max(1, round(256 * width))
        self.stem = _conv_bn_relu(c, c1)
        self.features = nn.Sequential(
            nn.MaxPool2d(2),
            _conv_bn_relu(c1, c2),
            _conv_bn_relu(c2, c2),
            nn.MaxPool2d(2),
            _conv_bn_relu(c2, c3),
            nn.MaxPool2d(2),
        )
        # Floor division three times mirrors MaxPool2d's default rounding (28 -> 14 -> 7 -> 3).
        flat = c3 * (h // 8) * (w // 8)
        if flat == 0:
            raise ValueError(f"cnn needs inputs of at least 8x8 pixels, got {h}x{w}; use mlp for smaller inputs")
        self.fc = nn.Linear(flat, hidden)
        # Dropout draws from the global generator, which the caller seeds.
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.stem(x)).flatten(1)
        x = self.dropout(F.relu(self.fc(x)))
        return self.head(x)


class WideCNN(nn.Module):
    """Two small conv stages, then two wide fully connected layers: VGG16's shape on small images.

    timm's VGG16 holds 89 % of its 134 M parameters in its classifier, whose first layer takes
    25088 inputs (a 7x7 convolution from 512 to 4096 channels; on 32x32 inputs timm pools the 1x1
    feature map up to 7x7 for it); with a 512 -> 4096 -> 4096 classifier the share would be 56 %.
    This model puts its weight in two wide layers the same way on Fashion-MNIST, at a size two CPU
    cores train in minutes: 1568 -> 1024 -> 1024 (2.67 M parameters, 99.4 % of them in ``fc1``
    and ``fc2``).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 1024,
                 dropout: float = 0.25) -> None:
        super().__init__()
        c, h, w = input_shape
        if h < 4 or w < 4:
            raise ValueError(f"wide needs inputs of at least 4x4 pixels, got {h}x{w}; use mlp for smaller inputs")
        self.stem = nn.Sequential(_conv_bn_relu(c, 16), nn.MaxPool2d(2))
        self.features = nn.Sequential(_conv_bn_relu(16, 32), nn.MaxPool2d(2))
        self.fc1 = nn.Linear(32 * (h // 4) * (w // 4), hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.stem(x)).flatten(1)
        x = F.relu(self.fc1(x))
        x = self.dropout(F.relu(self.fc2(x)))
        return self.head(x)


# ---------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with a residual connection (He et al., 2016)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: 3x3 stem, three stages of BasicBlocks, global average pool, head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, blocks: int = 1, width: float = 1.0) -> None:
        super().__init__()
        if blocks < 1:
            raise ValueError(f"resnet needs blocks >= 1 per stage, got {blocks}")
        c = input_shape[0]
        widths = [max(1, round(k * width)) for k in (16, 32, 64)]
        self.stem = _conv_bn_relu(c, widths[0])
        stages: list[nn.Module] = []
        c_in = widths[0]
        for i, c_out in enumerate(widths):
            # Stages 2 and 3 halve the resolution in their first block.
            stage = [BasicBlock(c_in, c_out, stride=1 if i == 0 else 2)]
            stage += [BasicBlock(c_out, c_out, stride=1) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


# ---------------------------------------------------------------- GPT


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v, o projections."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        # Separate projections (not one fused qkv) so each can be factorised on its own.
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Character-level GPT-style decoder; returns logits [B, T, vocab]."""

    def __init__(
        self, vocab_size: int, block_size: int, d_model: int = 128, n_layer: int = 5, n_head: int = 4
    ) -> None:
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"gpt d_model ({d_model}) must be divisible by n_head ({n_head}); change one of them")
        if n_layer < 1:
            raise ValueError(f"gpt needs n_layer >= 1, got {n_layer}")
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaling of residual output projections keeps the residual
        # stream's variance from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.o.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds the model's block size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---------------------------------------------------------------- factory


def build_model(name: str, dataset: Dataset, **overrides: Any) -> nn.Module:
    """Build model ``name`` sized for ``dataset``; ``overrides`` are the model's keyword options."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    task = _MODEL_TASK[name]
    if dataset.task != task:
        raise ValueError(
            f"model {name!r} does not fit dataset {dataset.name!r} (task {dataset.task!r}); "
            f"use it with: {_TASK_DATASETS[task]}"
        )
    shape = tuple(dataset.input_shape)
    if name in ("cnn", "wide", "resnet") and len(shape) != 3:
        raise ValueError(
            f"model {name!r} needs image inputs (C, H, W) but {dataset.name!r} has input shape {shape}; "
            "use mlp for flat inputs"
        )
    allowed = _OVERRIDES[name]
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for model {name!r}; "
            f"it accepts: {', '.join(allowed) or 'none'}"
        )
    if name == "mlp":
        return MLP(math.prod(shape), dataset.num_classes, **overrides)
    if name == "cnn":
        return VGG(shape, dataset.num_classes, **overrides)
    if name == "wide":
        return WideCNN(shape, dataset.num_classes, **overrides)
    if name == "resnet":
        return ResNet(shape, dataset.num_classes, **overrides)
    return GPT(dataset.num_classes, shape[0], **overrides)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameter elements."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def criterion(task: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean cross-entropy for ``task``: logits [B, C] vs [B], or [B, T, V] vs [B, T] for "lm"."""
    if task == "classify":
        return F.cross_entropy
    if task == "lm":

        def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        return lm_loss
    raise ValueError(f"unknown task {task!r}; expected 'classify' or 'lm'")
