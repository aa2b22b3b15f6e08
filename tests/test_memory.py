"""Training state: every storage once, and DDP's figure equal to its formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from abtrain.methods.memory import (dense_training_state_bytes, moments_per_element, scalar_state_bytes,
    storage_bytes, training_state_bytes, training_state_parts)


def _step(model, opt):
    opt.zero_grad()
    model(torch.randn(4, 10)).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("make_opt, moments", [
    (lambda p: torch.optim.SGD(p, lr=0.1), 0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), 2),
])
def test_a_dense_model_holds_what_the_formula_says(make_opt, moments):
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    opt = make_opt(model.parameters())
    params = sum(p.numel() for p in model.parameters())
    assert training_state_bytes(model, opt) == 4 * params  # before a step: no gradients, no state
    assert moments_per_element(opt) == moments  # read from the settings before the first step
    _step(model, opt)
    assert moments_per_element(opt) == moments
    # Adam's step counts are scalars of 4 bytes each (one per parameter tensor), not per-element state;
    # DDP's figure counts them per tensor of the dense model
    tensors = len(list(model.parameters()))
    assert scalar_state_bytes(opt) == (4 if moments == 2 else 0)
    scalars = 4 * tensors if moments == 2 else 0
    assert training_state_bytes(model, opt) == dense_training_state_bytes(params, moments) + scalars
    assert training_state_bytes(model, opt) == dense_training_state_bytes(
        params, moments, tensors=tensors, scalar_bytes=scalar_state_bytes(opt))


def test_views_of_one_storage_count_once_and_a_methods_tensors_count():
    base = torch.zeros(100)
    assert storage_bytes([base, base[:10], base.view(10, 10)]) == 400
    assert storage_bytes([torch.zeros(0), torch.zeros(3, dtype=torch.float64)]) == 24

    class Holder:  # a method's own state, found through containers and attributes
        def __init__(self, model):
            self.module = model  # the model: counted as parameters, not again
            self.memory = {"a": torch.zeros(50), "view": base}
            self.inner = type("Inner", (), {})()
            self.inner.copies = [torch.zeros(25), base[5:]]

        def held_state(self):
            return vars(self)

    model = nn.Linear(10, 10)
    parts = training_state_parts(model, None, Holder(model))
    assert parts == {"parameters": 440, "gradients": 0, "optimizer": 0, "method.memory": 600, "method.inner": 100}


def test_multiply_adds_of_a_step_by_hand():
    """Forward: B·Σ in·out; backward: every weight's gradient (B·Σ in·out) and every layer's input gradient
    but the first's (the data needs none); counted once per phase."""
    from abtrain.run.results import count_multiply_adds

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    counts: dict[str, int] = {}
    with count_multiply_adds(counts, "train"):
        model(torch.randn(32, 64)).sum().backward()
    assert counts == {"train": 32 * (3 * (64 * 128 + 128 * 10) - 64 * 128)}
    with count_multiply_adds(counts, "train"):  # the phase was counted: nothing changes
        model(torch.randn(999, 64)).sum().backward()
    assert counts == {"train": 32 * (3 * (64 * 128 + 128 * 10) - 64 * 128)}
