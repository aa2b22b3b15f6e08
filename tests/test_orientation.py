"""AB-training's two orientations of a wide weight (--ab-orientation): W's S[0] x prod(S[1:]) view as it is, or
turned tall as the authors' code turns it. Every part that knows A is m x r and B is r x n works on the matrix the
layer factorises, so both compute the same function, decompose and recompose exactly, and merge the same W; one
process, float32 against float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from abtrain.methods.ab import lowrank as lr
from abtrain.methods.ab.config import ABConfig
from abtrain.methods.ab.prepare import factorise_layers
from abtrain.methods.ab.state import PhaseState


class Net(nn.Module):
    """A wide Linear (16 x 32), a tall one (32 x 16), a wide convolution (8 x 4*3*3) and a tall one (48 x 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.wide_conv = nn.Conv2d(4, 8, 3, padding=1)
        self.tall_conv = nn.Conv2d(8, 48, 1)
        self.wide = nn.Linear(32, 16)
        self.tall = nn.Linear(16, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.tall_conv(torch.relu(self.wide_conv(self.stem(x))))).mean((2, 3))
        return self.head(torch.relu(self.tall(torch.relu(self.wide(h[:, :32])))))

    @staticmethod
    def example() -> torch.Tensor:
        return torch.randn(3, 3, 5, 5, generator=torch.Generator().manual_seed(1))


def _prepared(orientation: str, apply: str = "weight") -> tuple[nn.Module, list[lr.FactorizedParam]]:
    torch.manual_seed(0)
    model = Net()
    return model, lr.prepare_model(model, orientation=orientation, apply=apply)


def test_tall_turns_the_wide_weights_only():
    _, records = _prepared("tall")
    for fp in records:
        rows, cols = fp.shape[0], math.prod(fp.shape[1:])
        assert fp.param.transposed == (rows < cols)
        assert (fp.m, fp.n) == (max(rows, cols), min(rows, cols))  # every factorised matrix is tall
        torch.testing.assert_close(fp.matrix(), fp.weight.detach().reshape(rows, cols).T if rows < cols
                                   else fp.weight.detach().reshape(rows, cols), rtol=0, atol=0)
    _, as_is = _prepared("as-is")
    assert [(fp.m, fp.n) for fp in as_is] == [(8, 36), (48, 8), (16, 32), (32, 16)]
    assert [(fp.m, fp.n) for fp in records] == [(36, 8), (48, 8), (32, 16), (32, 16)]
    with pytest.raises(ValueError, match="orientation must be one of"):
        lr.prepare_model(Net(), orientation="wide")


@pytest.mark.parametrize("orientation", ["as-is", "tall"])
@pytest.mark.parametrize("apply", ["weight", "factors"])
def test_full_rank_factors_compute_the_same_function_and_recompose_exactly(orientation, apply):
    model, records = _prepared(orientation, apply)
    x = Net.example()
    with torch.no_grad():
        ref = model(x)
    weights = [fp.weight.detach().clone() for fp in records]
    for fp in records:
        lr.decompose(fp)
        assert fp.B.shape == (min(fp.m, fp.n), fp.n)
        if orientation == "tall":
            assert fp.B.shape[1] == min(fp.shape[0], math.prod(fp.shape[1:]))  # B is the short factor
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)
    for fp, w in zip(records, weights):
        torch.testing.assert_close(fp.effective_weight(), w, rtol=1e-4, atol=1e-5)
        product = fp.param.weight_of(fp.A @ fp.B).detach()
        lr.recompose(fp)
        assert torch.equal(fp.weight.detach(), product)


@pytest.mark.parametrize("rank", [3, 8])
def test_a_tall_linear_applies_its_factors_as_x_a_b(rank):
    """In lowrank mode a turned Linear holds W = (A·B)ᵀ: x·Wᵀ = x·A·B, never forming W, with the gradients of the
    W-forming layer (up to rounding)."""
    model, records = _prepared("tall", apply="factors")
    ref, refs = _prepared("tall", apply="weight")
    fp, fr = next(r for r in records if r.name == "wide.weight"), next(r for r in refs if r.name == "wide.weight")
    for f in (fp, fr):
        lr.decompose(f, rank)
        lr.set_trainable([f], "both")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    out, out_ref = model.wide(x), ref.wide(x)
    torch.testing.assert_close(out, x @ fp.A.detach() @ fp.B.detach() + model.wide.bias.detach(), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(fp.A.grad, fr.A.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fp.B.grad, fr.B.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("core", [1.0, 0.5])
def test_the_tangent_merge_gives_the_same_w_in_both_orientations(core):
    """The same steps in W's space, G on A (against Vᵀ) and on B (against U), merged by the tangent merge of each
    orientation's own SVD: the same W, since the projection U(Uᵀ·Δ·V)Vᵀ of the transpose is the transpose of the
    projection; and the same again when the change arrives summed (the sync's change of W)."""
    merged = {}
    g = torch.randn(16, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    for orientation in ("as-is", "tall"):
        _, records = _prepared(orientation)
        fp = next(r for r in records if r.name == "wide.weight")
        u, s, vh = lr.svd(fp)
        basis = lr.SVD(u[:, :5], s[:5], vh[:5])
        gm = fp.param.matrix(g)  # the step in the factorised matrix's coordinates
        lr.decompose(fp, 5, usv=basis, split="sigma", sigma_in="A")
        with torch.no_grad():
            fp.A.sub_(0.1 * gm @ basis.Vh.T)
            fp.B.copy_(basis.S[:, None] * basis.Vh - 0.1 * basis.U.T @ gm)
        lr.recompose(fp, basis, core=core)
        from_factors = fp.weight.detach().clone()
        change = (-0.1 * gm @ basis.Vh.T) @ basis.Vh + basis.U @ (-0.1 * basis.U.T @ gm)
        lr.decompose(fp, 5, usv=basis, split="sigma", sigma_in="A")
        lr.recompose(fp, basis, change, core=core)
        torch.testing.assert_close(fp.weight.detach(), from_factors, rtol=0, atol=1e-5)
        merged[orientation] = from_factors
    torch.testing.assert_close(merged["tall"], merged["as-is"], rtol=0, atol=1e-5)


def test_the_svd_of_a_turned_layer_is_the_svd_of_its_matrix():
    _, records = _prepared("tall")
    for fp in records:
        u, s, vh = lr.svd(fp)
        assert u.shape == (fp.m, min(fp.m, fp.n)) and vh.shape == (min(fp.m, fp.n), fp.n)
        torch.testing.assert_close(u * s @ vh, fp.matrix(), rtol=1e-4, atol=1e-5)


def test_a_checkpoint_of_the_other_orientation_is_refused():
    model, records = _prepared("tall")
    for fp in records:
        lr.decompose(fp, 2)
    state = model.state_dict()
    again, again_records = _prepared("tall")
    again.load_state_dict(state)
    assert [fp.rank for fp in again_records] == [2] * 4
    other, _ = _prepared("as-is")
    with pytest.raises(ValueError, match="--ab-orientation the checkpoint was written with"):
        other.load_state_dict(state)


def test_ortho_sigma_over_every_matrix_or_the_factorised_ones():
    """--ab-init ortho-sigma sets every singular value to 1 of the factorised weights, or with --ab-init-scope all
    of every parameter of 2 or more dims (kept layers, embeddings; a single row to unit norm), whatever the
    orientation; 1-D parameters are left as they are."""
    def prepared(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 24), nn.LayerNorm(24), nn.Linear(24, 8),
                              nn.Linear(8, 3))
        model.register_parameter("token", nn.Parameter(torch.randn(1, 1, 6)))
        state = PhaseState(role="A")
        factorise_layers(model, ABConfig(init="ortho-sigma", min_rank=1, full_rank="4.*", **options), state)
        return model, state

    def spectrum(p):
        return torch.linalg.svdvals(p.detach().reshape(p.shape[0], -1))

    torch.manual_seed(0)
    plain = dict(nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 24), nn.LayerNorm(24), nn.Linear(24, 8),
                               nn.Linear(8, 3)).named_parameters())
    every, _ = prepared(init_scope="all")
    factorised, state = prepared()
    tall, _ = prepared(init_scope="all", orientation="tall")
    assert sorted(fp.name for fp in state.records) == ["1.weight", "3.weight"]
    for (name, p), q, t in zip(every.named_parameters(), factorised.parameters(), tall.parameters()):
        if p.ndim >= 2 and p.numel():
            torch.testing.assert_close(spectrum(p), torch.ones(min(p.shape[0], p[0].numel())), rtol=0, atol=1e-5)
            torch.testing.assert_close(t, p, rtol=0, atol=1e-6)  # the transpose's U·Vᵀ is the transpose of W's
        elif name in plain:  # biases and norms: untouched by either scope
            assert torch.equal(p, plain[name]) and torch.equal(q, plain[name])
    assert torch.equal(factorised[0].weight, plain["0.weight"]) and torch.equal(factorised[4].weight, plain["4.weight"])
    assert float(every.token.detach().norm()) == pytest.approx(1.0, abs=1e-6)
