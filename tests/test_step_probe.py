"""benchmarks/ab_step_probe.py: the part of a gradient AB-training's short factor reaches, and the two probe
methods' gradients (what the all-reduce of every worker's hooked gradient averages to)."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch

from abtrain.methods import registry

ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("ab_step_probe", os.path.join(ROOT, "benchmarks", "ab_step_probe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for name in ("ddp-half-grad", "ddp-half-outside"):
        registry.unregister(name)


@pytest.mark.parametrize("shape", [(6, 20), (20, 6)])
def test_the_inside_part_is_the_projection_on_w_s_short_side_span(probe, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g, dtype=torch.float64)
    grad = torch.randn(*shape, generator=g, dtype=torch.float64)
    wide = shape[0] < shape[1]
    inside = probe.inside_short_span(w, grad, wide)
    outside = grad - inside
    # what is left is orthogonal to W's rows (wide) or columns (tall): no change of the short factor makes it
    torch.testing.assert_close(outside @ w.T if wide else w.T @ outside, torch.zeros(shape[0] if wide else shape[1],
                               shape[0] if wide else shape[1], dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(probe.inside_short_span(w, inside, wide), inside)  # a projection
    # the inside is what a change of the short factor can make: a wide W's rows span it (X·W for some X)
    x = torch.linalg.lstsq(w.T, inside.T).solution.T if wide else torch.linalg.lstsq(w, inside).solution
    torch.testing.assert_close(x @ w if wide else w @ x, inside)
    square = torch.randn(6, 6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(probe.inside_short_span(square, grad[:6, :6], True), grad[:6, :6])  # all inside


@pytest.mark.parametrize("outside_only", [False, True])
def test_the_hooked_gradients_average_to_the_probes_step(probe, outside_only):
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(4, 3, 3, 3, generator=g))  # a convolution: the 4 x 27 matrix is wide
    grads = [torch.randn(4, 3, 3, 3, generator=g) for _ in range(4)]
    method = types.SimpleNamespace(outside_only=outside_only)
    hooked = [probe.HalfGradDDP._hook(method, w, 2.0 if rank < 2 else 0.0, True)(gr) for rank, gr in enumerate(grads)]
    averaged = torch.stack(hooked).mean(0)  # what DDP's all-reduce leaves in .grad
    first_half = (grads[0] + grads[1]) / 2
    if not outside_only:
        torch.testing.assert_close(averaged, first_half)
        return
    every = torch.stack(grads).mean(0)

    def inside(t: torch.Tensor) -> torch.Tensor:
        return probe.inside_short_span(w.detach().reshape(4, -1), t.reshape(4, -1), True).reshape(t.shape)

    torch.testing.assert_close(averaged, inside(every) + first_half - inside(first_half), atol=1e-5, rtol=1e-5)
    # the first half's part outside differs from everyone's, so the probe is not DDP
    assert (first_half - inside(first_half) - (every - inside(every))).abs().max() > 1e-3


def test_the_probes_are_registered_as_methods(probe):
    assert registry.get("ddp-half-grad").build is probe.HalfGradDDP
    assert registry.get("ddp-half-outside").build is probe.HalfOutsideDDP
