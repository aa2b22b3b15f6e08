"""Single-process invariants of abtrain.methods.ab.lowrank: factorisation, rank rules, optimizer state, counts."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from abtrain.methods.ab import lowrank as lr


# ---------------------------------------------------------------------------
# Small models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))

    @staticmethod
    def example() -> torch.Tensor:
        return torch.randn(5, 8)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.grouped = nn.Conv2d(8, 16, 3, padding=1, groups=2)
        self.bn = nn.BatchNorm2d(16)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.conv1d = nn.Conv1d(16, 12, 3, padding=1)
        self.conv3d = nn.Conv3d(16, 8, (1, 3, 3), padding=(0, 1, 1))
        self.head = nn.Linear(12 + 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.grouped(self.stem(x))))
        x = self.depthwise(x)
        y = self.conv1d(x.flatten(2)).mean(-1)
        z = self.conv3d(x.unsqueeze(2)).mean((2, 3, 4))
        return self.head(torch.cat([y, z], 1))

    @staticmethod
    def example() -> torch.Tensor:
        return torch.randn(2, 3, 6, 6)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.ff = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(torch.relu(self.ff(h))).mean(1)

    @staticmethod
    def example() -> torch.Tensor:
        return torch.randn(2, 5, 6)


MODELS = [MLP, CNN, Attn]


def _build(cls: type[nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls().eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------
# Preparation


@pytest.mark.parametrize("cls", MODELS)
def test_prepare_keeps_outputs_bit_identical(cls):
    model = _build(cls)
    x = cls.example()
    with torch.no_grad():
        before = model(x)
    records = lr.prepare_model(model)
    with torch.no_grad():
        after = model(x)
    assert torch.equal(before, after)
    assert records and all(fp.mode == "full" and fp.rank == 0 for fp in records)
    names = [fp.name for fp in records]
    assert not any(n.startswith(("stem.", "head.")) for n in names)
    # Placeholders are already parameters, so an optimizer built now covers the factors.
    params = {id(p) for p in model.parameters()}
    assert all(id(fp.A) in params and id(fp.B) in params for fp in records)


class Doubled(nn.Linear):
    """An nn.Linear subclass with its own forward, which preparation must leave in charge."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@pytest.mark.parametrize("apply", ["factors", "auto"])
def test_linear_layers_apply_their_factors_where_chosen(apply):
    """In lowrank mode an nn.Linear with apply="factors" computes x·Bᵀ·Aᵀ + b, never forming A·B; "auto" does so
    where that needs fewer multiply-adds for the call's rows and forms W otherwise; both give W's function and
    gradients up to rounding; full mode, other modules and subclasses with their own forward are untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), Doubled(48, 40), nn.Conv1d(40, 40, 1))
    ref = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), Doubled(48, 40), nn.Conv1d(40, 40, 1))
    ref.load_state_dict(model.state_dict())
    records = lr.prepare_model(model, full_rank_patterns=(), apply=apply)
    refs = lr.prepare_model(ref, full_rank_patterns=())  # apply="weight"
    # at rank 40 the factors cost 3·40·112 < 48·40·64 + 3·48·64 multiply-adds for 3 rows, more for 500
    few, many = torch.randn(3, 64), torch.randn(500, 64)
    assert lr.factors_cheaper(48, 64, 40, 3) and not lr.factors_cheaper(48, 64, 40, 500)
    assert torch.equal(model[0](few), ref[0](few))  # full mode: nn.Linear.forward itself
    for recs in (records, refs):
        for fp in recs:
            lr.decompose(fp, 40 if fp.name == "0.weight" else 4)
        lr.set_trainable(recs, "A")
    fp = records[0]
    with torch.no_grad():
        factored = nn.functional.linear(nn.functional.linear(few, fp.B), fp.A, model[0].bias)
        formed = nn.functional.linear(few, (fp.A @ fp.B).reshape(fp.shape), model[0].bias)
        assert torch.equal(model[0](few), factored)
        if apply == "factors":
            expected = nn.functional.linear(nn.functional.linear(many, fp.B), fp.A, model[0].bias)
        else:
            expected = nn.functional.linear(many, (fp.A @ fp.B).reshape(fp.shape), model[0].bias)
        assert torch.equal(model[0](many), expected)
        torch.testing.assert_close(factored, formed, rtol=1e-5, atol=1e-6)
    # the subclass and the convolution form W: bit for bit what the W-forming model computes
    assert type(model[2]).forward is type(ref[2]).forward and "forward" not in vars(model[2])
    assert "forward" not in vars(model[3])
    with torch.no_grad():
        h, z = torch.randn(3, 48), torch.randn(3, 40, 5)
        assert torch.equal(model[2](h), ref[2](h)) and torch.equal(model[3](z), ref[3](z))
    x = torch.randn(3, 64)
    out, out_ref = model[:3](x), ref[:3](x)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    for fp, fr in zip(records, refs):
        if fp.name.startswith("3."):
            continue  # the convolution is not in this forward
        torch.testing.assert_close(fp.A.grad, fr.A.grad, rtol=1e-4, atol=1e-6)
        assert fp.B.grad is None and fp.weight.grad is None


def test_prepare_rejects_an_unknown_apply():
    with pytest.raises(ValueError, match="apply must be one of"):
        lr.prepare_model(_build(MLP), apply="fused")


def test_prepare_finds_every_kind_of_weight():
    assert [fp.name for fp in lr.prepare_model(_build(MLP))] == ["body.0.weight", "body.2.weight"]
    cnn = lr.prepare_model(_build(CNN))
    assert [fp.name for fp in cnn] == ["grouped.weight", "depthwise.weight", "conv1d.weight", "conv3d.weight"]
    assert [(fp.m, fp.n) for fp in cnn] == [(16, 36), (16, 9), (12, 48), (8, 144)]
    assert [fp.name for fp in lr.prepare_model(_build(Attn))] == [
        "attn.in_proj_weight",
        "attn.out_proj.weight",
        "ff.weight",
    ]


def test_prepare_rejects_models_with_nothing_to_factorise():
    model = nn.Module()
    model.stem = nn.Linear(4, 4)
    model.head = nn.Linear(4, 2)
    model.tok_emb = nn.Embedding(10, 4)
    with pytest.raises(ValueError, match="nothing to factorise.*stem.weight.*'stem.\\*'"):
        lr.prepare_model(model)
    # Without patterns the same model has work to do (the embedding stays excluded).
    assert [fp.name for fp in lr.prepare_model(model, full_rank_patterns=())] == ["stem.weight", "head.weight"]


def test_prepare_twice_is_refused():
    model = _build(MLP)
    lr.prepare_model(model)
    with pytest.raises(ValueError, match="already prepared"):
        lr.prepare_model(model)


# ---------------------------------------------------------------------------
# Decomposition


@pytest.mark.parametrize("cls", MODELS)
def test_full_rank_decompose_reconstructs(cls):
    model = _build(cls)
    x = cls.example()
    records = lr.prepare_model(model)
    with torch.no_grad():
        ref = model(x)
    originals = [fp.weight.detach().clone() for fp in records]
    for fp in records:
        lr.decompose(fp)
        assert fp.mode == "lowrank" and fp.rank == min(fp.m, fp.n)
    for fp, w in zip(records, originals):
        assert _rel(fp.effective_weight(), w) <= 1e-5
    with torch.no_grad():
        assert _rel(model(x), ref) <= 1e-5
    for fp in records:
        product = (fp.A @ fp.B).reshape(fp.shape).detach()
        lr.recompose(fp)
        assert fp.mode == "full"
        assert torch.equal(fp.weight, product)
        assert fp.rank == 0 and fp.A.numel() == fp.B.numel() == 0  # a full-rank layer costs W alone


def test_tangent_merge_with_the_core_halved_is_one_step_along_the_tangent_space():
    """recompose(basis, change, core=0.5): a step −lr·G·V on A = U·σ (trained against Vᵀ) and a step −lr·Uᵀ·G on
    B = σ·Vᵀ (trained against U) merge into UσVᵀ − lr·P(G), P the projection onto the tangent space of the
    rank-r matrices at UσVᵀ (UUᵀG + GVVᵀ − UUᵀGVVᵀ); added whole (core=1) the part UUᵀGVVᵀ counts twice."""
    model = _build(MLP)
    fp = lr.prepare_model(model)[0]
    r, step = 5, 0.1
    u, s, vh = lr.svd(fp)
    u, s, vh = u[:, :r], s[:r], vh[:r]
    g = torch.randn(fp.m, fp.n)
    pu, pv = u @ u.T, vh.T @ vh
    tangent = pu @ g + g @ pv - pu @ g @ pv
    change = (-step * g @ vh.T) @ vh + u @ (-step * u.T @ g)  # each group's step, seen in W
    for core, expected in ((0.5, u * s @ vh - step * tangent), (1.0, u * s @ vh - step * (tangent + pu @ g @ pv))):
        lr.decompose(fp, r, usv=(u, s, vh), split="sigma", sigma_in="A")
        lr.recompose(fp, (u, s, vh), change.clone(), core=core)
        torch.testing.assert_close(fp.weight.detach().reshape(fp.m, fp.n), expected, rtol=0, atol=1e-5)
        # the same merge from the factors themselves (no change sent): A-group's A and B-group's B
        lr.decompose(fp, r, usv=(u, s, vh), split="sigma", sigma_in="A")
        with torch.no_grad():
            fp.A.sub_(step * g @ vh.T)
            fp.B.copy_(s[:, None] * vh - step * u.T @ g)
        lr.recompose(fp, (u, s, vh), core=core)
        torch.testing.assert_close(fp.weight.detach().reshape(fp.m, fp.n), expected, rtol=0, atol=1e-5)
    assert not torch.allclose(pu @ g @ pv, torch.zeros_like(g), atol=1e-3)  # the two differ


@pytest.mark.parametrize("core", [1.0, 0.5])
def test_tangent_merge_from_parts_is_the_merge_of_the_change(core):
    """recompose(parts=tangent_parts(basis, P, Q, core)) is recompose(basis, P·Qᵀ, core) up to rounding."""
    fp = lr.prepare_model(_build(MLP))[0]
    r = 5
    u, s, vh = lr.svd(fp)
    basis = lr.SVD(u[:, :r], s[:r], vh[:r])
    p, q = torch.randn(fp.m, 3), torch.randn(fp.n, 3)
    lr.decompose(fp, r, usv=basis, split="sigma", sigma_in="A")
    lr.recompose(fp, basis, p @ q.T, core=core)
    expected = fp.weight.detach().clone()
    lr.decompose(fp, r, usv=basis, split="sigma", sigma_in="A")
    parts = lr.tangent_parts(basis, p, q, core)
    lr.recompose(fp, parts=parts)
    torch.testing.assert_close(fp.weight.detach(), expected, rtol=0, atol=1e-5)
    assert fp.mode == "full"
    lr.decompose(fp, r, usv=basis, split="sigma", sigma_in="A")
    with pytest.raises(ValueError, match="not both"):
        lr.recompose(fp, basis, parts=parts)


def test_sigma_split_puts_sigma_in_the_named_factor():
    model = _build(MLP)
    fp = lr.prepare_model(model)[0]
    u, s, vh = torch.linalg.svd(fp.weight.detach(), full_matrices=False)
    r = 5
    truncated = u[:, :r] @ torch.diag(s[:r]) @ vh[:r]
    lr.decompose(fp, r, split="sigma", sigma_in="A")
    # Columns of A carry σ (norm σ_i); rows of B are orthonormal.
    torch.testing.assert_close(fp.A.norm(dim=0), s[:r], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fp.B @ fp.B.T, torch.eye(r), rtol=0, atol=1e-5)
    torch.testing.assert_close(fp.A @ fp.B, truncated, rtol=0, atol=1e-5)
    lr.recompose(fp)
    fp.weight.data.copy_(u @ torch.diag(s) @ vh)
    lr.decompose(fp, r, split="sigma", sigma_in="B")
    torch.testing.assert_close(fp.B.norm(dim=1), s[:r], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fp.A.T @ fp.A, torch.eye(r), rtol=0, atol=1e-5)
    torch.testing.assert_close(fp.A @ fp.B, truncated, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="sigma_in"):
        lr.decompose(fp, r, split="sigma", sigma_in="C")


def test_sqrt_split_balances_the_factors():
    fp = lr.prepare_model(_build(MLP))[1]
    s = lr.svd(fp).S
    lr.decompose(fp, 4)
    torch.testing.assert_close(fp.A.norm(dim=0), s[:4].sqrt(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fp.B.norm(dim=1), s[:4].sqrt(), rtol=1e-5, atol=1e-6)


def test_decompose_keeps_parameter_identity_and_rejects_bad_ranks():
    fp = lr.prepare_model(_build(MLP))[0]
    a, b = fp.A, fp.B
    lr.decompose(fp, 3)
    assert fp.A is a and fp.B is b and a.shape == (32, 3) and b.shape == (3, 16)
    with pytest.raises(ValueError, match="rank"):
        lr.decompose(fp, 17)
    with pytest.raises(ValueError, match="rank"):
        lr.decompose(fp, 0)


def _lowrank_sum(m: int, n: int, r: int, q: int, seed: int = 0) -> lr.LowRankSum:
    """The SVD (U, σ, Vᵀ) of a random rank-r matrix, a core changed away from diag(σ), and a rank-q P·Qᵀ."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, r, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(n, r, generator=gen))[0]
    core = torch.diag(torch.linspace(2.0, 0.1, r)) + 0.01 * torch.randn(r, r, generator=gen)
    p, q_ = 0.3 * torch.randn(m, q, generator=gen), torch.randn(n, q, generator=gen)
    p[:, 0] = u[:, 0] + 1e-3 * p[:, 0]  # a direction nearly inside U: the orthogonal part must still be found
    return lr.LowRankSum(u, core, v.T, p, q_)


def test_updated_svd_equals_the_svd_of_the_sum():
    fp = lr.prepare_model(_build(MLP))[0]  # 32x16
    parts = _lowrank_sum(fp.m, fp.n, r=8, q=3)
    w = parts.U @ parts.core @ parts.Vh + parts.P @ parts.Q.T
    fp.weight.data.copy_(w)
    u, s, vh = lr.svd_update(fp, parts)
    assert u.shape == (32, 11) and vh.shape == (11, 16) and s.shape == (16,)
    assert torch.equal(s[11:], torch.zeros(5))  # W's other singular values: zero, as the rank rules expect
    torch.testing.assert_close(s, torch.linalg.svdvals(w), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close((u * s[:11]) @ vh, w, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(u.T @ u, torch.eye(11), atol=2e-6, rtol=0)
    torch.testing.assert_close(vh @ vh.T, torch.eye(11), atol=2e-6, rtol=0)
    lr.decompose(fp, 11, usv=(u, s, vh))  # cut from the updated SVD
    torch.testing.assert_close(fp.A @ fp.B, w, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="holds 11 singular vectors"):
        lr.decompose(fp, 12, usv=(u, s, vh))


def test_updated_svd_is_refused_where_it_does_not_hold():
    fp = lr.prepare_model(_build(MLP))[0]
    parts = _lowrank_sum(fp.m, fp.n, r=8, q=3)
    w = parts.U @ parts.core @ parts.Vh + parts.P @ parts.Q.T
    fp.weight.data.copy_(w + 1e-3 * torch.randn(w.shape))  # W moved since the parts were taken
    assert lr.svd_update(fp, parts) is None
    fp.weight.data.copy_(w)
    assert lr.svd_update(fp, parts._replace(P=1.01 * parts.P)) is None  # parts that are not W


@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_updated_svd_leaves_it_to_the_full_svd_where_a_small_svd_does_not_converge(failing_call, monkeypatch):
    """The update takes three small SVDs (the parts of P and Q outside the bases, the middle matrix); LAPACK
    failing to converge on any of them gives None, so the caller takes W's full SVD, never an exception."""
    fp = lr.prepare_model(_build(MLP))[0]
    parts = _lowrank_sum(fp.m, fp.n, r=8, q=3)
    fp.weight.data.copy_(parts.U @ parts.core @ parts.Vh + parts.P @ parts.Q.T)
    svd, calls = torch.linalg.svd, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == failing_call:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return svd(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", fails_once)
    assert lr.svd_update(fp, parts) is None and len(calls) == failing_call


@pytest.mark.parametrize("r, q", [(14, 3), (16, 4), (10, 20)])
def test_updated_svd_holds_where_r_plus_q_reaches_the_short_side(r, q):
    """r + q >= min(m, n) = 16: the part of P outside U has fewer directions than q; the update still gives
    W's SVD, with orthonormal singular vectors (none of rounding noise inside U)."""
    fp = lr.prepare_model(_build(MLP))[0]  # 32x16
    parts = _lowrank_sum(fp.m, fp.n, r=min(r, 16), q=q)
    w = parts.U @ parts.core @ parts.Vh + parts.P @ parts.Q.T
    fp.weight.data.copy_(w)
    u, s, vh = lr.svd_update(fp, parts)
    k = u.shape[1]
    assert k <= 16 and vh.shape == (k, 16) and s.shape == (16,)
    torch.testing.assert_close(s, torch.linalg.svdvals(w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((u * s[:k]) @ vh, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(u.T @ u, torch.eye(k), atol=1e-5, rtol=0)
    torch.testing.assert_close(vh @ vh.T, torch.eye(k), atol=1e-5, rtol=0)


def test_svd_of_a_wide_weight_is_its_svd():
    """A wide W is decomposed as its transpose: the same factorisation, singular vectors contiguous."""
    fp = lr.prepare_model(_build(MLP))[0]
    wide = lr.prepare_model(nn.Sequential(nn.Linear(48, 12)))[0]  # 12x48
    for layer in (fp, wide):
        u, s, vh = lr.svd(layer)
        w = layer.weight.detach().reshape(layer.m, layer.n)
        assert u.is_contiguous() and vh.is_contiguous() and u.shape == (layer.m, min(layer.m, layer.n))
        torch.testing.assert_close((u * s) @ vh, w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, torch.linalg.svdvals(w), atol=1e-5, rtol=1e-5)


def test_svd_of_non_finite_weight_names_the_layer():
    fp = lr.prepare_model(_build(MLP))[0]
    fp.weight.data[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="body.0.weight"):
        lr.svd(fp)


def test_decompose_all_cuts_each_layer_at_its_rank():
    model = _build(MLP)
    records = lr.prepare_model(model)
    svds = [lr.svd(fp) for fp in records]
    # 32x16 at rank 11: r(m+n) = 528 numbers, more than W's 512; the rank given is the rank kept.
    lr.decompose_all(records, [10, 11], svds)
    assert [(fp.mode, fp.rank) for fp in records] == [("lowrank", 10), ("lowrank", 11)]
    lr.decompose_all(records, [None, None])  # full rank: the untruncated first decomposition
    assert [fp.rank for fp in records] == [min(fp.m, fp.n) for fp in records]
    with pytest.raises(ValueError, match="same length"):
        lr.decompose_all(records, [2])


def test_state_dict_round_trip_restores_factors_and_mode():
    model = _build(CNN)
    records = lr.prepare_model(model)
    for fp in records:
        lr.decompose(fp, 2)
    sd = model.state_dict()
    assert "grouped.parametrizations.weight.original" in sd
    assert sd["grouped.parametrizations.weight.0.A"].shape == (16, 2)
    x = CNN.example()
    fresh = _build(CNN, seed=1)
    fresh_records = lr.prepare_model(fresh)
    fresh.load_state_dict(sd)
    assert [fp.mode for fp in fresh_records] == ["lowrank"] * 4
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_a_low_rank_layer_holds_no_w_and_a_checkpoint_loads_either_way():
    """W's storage is released while the factors train and allocated again, whole, by the recomposition;
    a checkpoint written in either mode loads into a model in the other."""
    model = _build(CNN)
    records = lr.prepare_model(model)
    whole = copy.deepcopy(model.state_dict())
    x = CNN.example()
    for fp in records:
        lr.decompose(fp)  # full rank: the same function
        assert fp.weight.numel() == 0 and fp.weight.grad is None
    low = copy.deepcopy(model.state_dict())
    assert low["grouped.parametrizations.weight.original"].numel() == 0
    with torch.no_grad():
        out_low = model(x)
    model.load_state_dict(whole)  # the checkpoint of the full-rank model into released layers
    assert [fp.mode for fp in records] == ["full"] * len(records)
    assert all(fp.weight.shape == fp.shape for fp in records)
    model.load_state_dict(low)
    assert all(fp.weight.numel() == 0 for fp in records)
    with torch.no_grad():
        assert torch.equal(model(x), out_low)
    for fp in records:
        lr.recompose(fp)
        torch.testing.assert_close(fp.weight.detach(), whole[f"{fp.name.rpartition('.')[0]}.parametrizations.weight"
                                                            ".original"], rtol=1e-5, atol=1e-5)


def test_paying_rank_is_the_largest_rank_whose_factors_are_smaller_than_w():
    for m, n in [(64, 288), (256, 1152), (1024, 1024), (3, 32), (8, 8), (1, 5)]:
        r = lr.paying_rank(m, n)
        assert r * (m + n) < m * n <= (r + 1) * (m + n), (m, n, r)
        assert not lr.factors_compress(m, n, r + 1)


@pytest.mark.parametrize("memory", [0.0, 0.5, 1.0])
def test_state_rank_is_the_largest_rank_within_ddps_state_for_w(memory):
    """A worker training the longer factor holds (3 + moments) copies of it, the frozen factor and ``memory``
    times W's numbers of error memory (0.5: kept in bfloat16); DDP holds (2 + moments) copies of W."""
    for m, n, moments, extra in [(64, 288, 1, 0), (256, 1152, 2, 64 * 1152), (128, 128, 2, 31 * 128), (512, 128, 1, 0)]:
        r = lr.state_rank(m, n, moments, memory=memory, extra=extra)

        def held(rank):
            return (3 + moments) * rank * max(m, n) + rank * min(m, n) + memory * m * n + extra

        assert held(r) <= (2 + moments) * m * n < held(r + 1), (m, n, moments, memory, r)
    assert lr.state_rank(256, 1152, 1, memory=0.5) > lr.state_rank(256, 1152, 1, memory=1.0)


# ---------------------------------------------------------------------------
# Rank rules


def test_rank_rules():
    sigma = torch.tensor([10.0, 5.0, 2.0, 1.5, 1.0, 0.1])
    # τ = 0.15: σ_i > 1.5 -> 10, 5, 2 (1.5 is not strictly greater).
    assert lr.RankRule(tau=0.15).choose(sigma) == 3
    assert lr.RankRule(tau=0.99).choose(sigma) == 1
    assert lr.RankRule(rank=4).choose(sigma) == 4
    assert lr.RankRule(rank=100).choose(sigma) == 6
    assert lr.RankRule(fraction=0.5).choose(sigma) == 3
    assert lr.RankRule(fraction=0.01).choose(sigma) == 1
    assert lr.RankRule(fraction=1.0).choose(sigma) == 6
    assert lr.RankRule(tau=0.05, max_rank=2).choose(sigma) == 2
    assert lr.RankRule(tau=0.15).choose(torch.zeros(4)) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one"),
        ({"tau": 0.1, "rank": 2}, "exactly one"),
        ({"tau": 0.0}, "tau"),
        ({"tau": 1.0}, "tau"),
        ({"fraction": 0.0}, "fraction"),
        ({"fraction": 1.5}, "fraction"),
        ({"rank": 0}, "rank"),
        ({"tau": 0.1, "max_rank": 0}, "max_rank"),
    ],
)
def test_rank_rules_reject_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lr.RankRule(**kwargs).choose(torch.ones(3))


def test_factors_compress_boundaries():
    assert not lr.factors_compress(4, 4, 2)  # 16 numbers in factors vs 16 in W
    assert lr.factors_compress(4, 4, 1)
    assert not lr.factors_compress(1, 100, 1)  # a row vector never pays
    assert not lr.factors_compress(8, 8, 8)  # full rank never pays


# ---------------------------------------------------------------------------
# Gradients and roles


@pytest.mark.parametrize("role", ["A", "B", "both"])
def test_lowrank_gradients_follow_the_role(role):
    model = _build(Attn).train()
    records = lr.prepare_model(model)
    for fp in records:
        lr.decompose(fp, 3)
    lr.set_trainable(records, role)
    model(Attn.example()).sum().backward()
    for fp in records:
        assert fp.weight.grad is None
        assert (fp.A.grad is not None) == (role in ("A", "both"))
        assert (fp.B.grad is not None) == (role in ("B", "both"))


def test_full_mode_gradients_reach_only_w():
    model = _build(CNN).train()
    records = lr.prepare_model(model)
    for fp in records:
        lr.decompose(fp, 2)
        lr.recompose(fp)
    lr.set_trainable(records, "full")
    model(CNN.example()).sum().backward()
    for fp in records:
        assert fp.weight.grad is not None and fp.A.grad is None and fp.B.grad is None


def test_role_full_needs_recomposed_layers():
    records = lr.prepare_model(_build(MLP))
    lr.decompose(records[0], 2)
    with pytest.raises(ValueError, match="recompose"):
        lr.set_trainable(records, "full")
    with pytest.raises(ValueError, match="decompose"):
        lr.set_mode(records, "lowrank")


# ---------------------------------------------------------------------------
# Optimizer state


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(MLP.example()).square().mean().backward()
    opt.step()


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    ],
)
def test_resize_state_slices_and_pads_and_optimizer_keeps_working(make_opt):
    torch.manual_seed(0)
    model = MLP()
    records = lr.prepare_model(model)
    opt = make_opt(model.parameters())  # built once, never rebuilt
    _step(model, opt)  # full-rank step: W gets state
    for fp in records:
        lr.decompose(fp, 6, optimizer=opt)
    _step(model, opt)
    fp = records[0]
    before_a = {k: v.clone() for k, v in opt.state[fp.A].items() if torch.is_tensor(v) and v.ndim == 2}
    before_b = {k: v.clone() for k, v in opt.state[fp.B].items() if torch.is_tensor(v) and v.ndim == 2}
    assert before_a and all(v.shape == (32, 6) for v in before_a.values())
    step_before = opt.state[fp.A].get("step")

    # Shrink: first 4 columns of A-state, first 4 rows of B-state.
    for rec in records:
        lr.recompose(rec)
        lr.decompose(rec, 4, optimizer=opt)
    for k, v in before_a.items():
        assert torch.equal(opt.state[fp.A][k], v[:, :4])
    for k, v in before_b.items():
        assert torch.equal(opt.state[fp.B][k], v[:4])
    if step_before is not None:
        assert torch.equal(torch.as_tensor(opt.state[fp.A]["step"]), torch.as_tensor(step_before))
    _step(model, opt)

    # Grow: kept part unchanged, new part zero.
    kept_a = {k: opt.state[fp.A][k].clone() for k in before_a}
    for rec in records:
        lr.recompose(rec)
        lr.decompose(rec, 7, optimizer=opt)
    for k, v in kept_a.items():
        new = opt.state[fp.A][k]
        assert new.shape == (32, 7)
        assert torch.equal(new[:, :4], v) and not new[:, 4:].any()
    for k in before_b:
        assert opt.state[fp.B][k].shape == (7, 16)
    _step(model, opt)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_resize_state_pads_state_of_a_zero_size_placeholder():
    model = MLP()
    records = lr.prepare_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fp = records[0]
    # A step on the empty placeholder leaves 0-size moments behind.
    fp.A.requires_grad_(True)
    fp.A.grad = torch.zeros_like(fp.A)
    opt.step()
    assert opt.state[fp.A]["exp_avg"].shape == (32, 0)
    lr.decompose(fp, 3, optimizer=opt)
    assert opt.state[fp.A]["exp_avg"].shape == (32, 3) and not opt.state[fp.A]["exp_avg"].any()
    opt.zero_grad()
    model(MLP.example()).sum().backward()
    opt.step()


@pytest.mark.parametrize("trained", ["A", "B"])
def test_map_state_carries_momentum_into_the_new_basis(trained):
    """After steps on one factor, the mapped momentum is W's momentum seen through the new factors."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 32)
    (fp,) = lr.prepare_model(nn.Sequential(layer), full_rank_patterns=())
    lr.decompose(fp, 6)
    lr.set_trainable([fp], trained)
    opt = torch.optim.SGD([fp.A, fp.B, layer.bias], lr=0.05, momentum=0.9)
    frozen = (fp.B if trained == "A" else fp.A).detach().clone()
    w_momentum = torch.zeros(32, 16)
    for _ in range(3):
        x, target = torch.randn(8, 16), torch.randn(8, 32)
        y = layer(x)
        w_momentum = 0.9 * w_momentum + (y - target).detach().T @ x  # dL/dW of 0.5 * ||y - target||^2
        opt.zero_grad()
        (0.5 * (y - target).pow(2).sum()).backward()
        opt.step()
    lr.recompose(fp)
    lr.decompose(fp, 4, optimizer=opt, moments_against=(trained, frozen))  # a new basis, and a smaller rank
    got = opt.state[fp.A if trained == "A" else fp.B]["momentum_buffer"]
    want = w_momentum @ fp.B.detach().T if trained == "A" else fp.A.detach().T @ w_momentum
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # keep (resize) instead would keep the old basis' columns: not the same momentum
    assert not torch.allclose(got, (w_momentum @ frozen.T)[:, :4] if trained == "A" else (frozen.T @ w_momentum)[:4],
                              atol=1e-2)


def _mapped_moments(trained, split="sqrt", orthonormal=False):
    """(optimizer, layer, ``trained``'s state) after 3 AdamW steps on factor ``trained`` and a new decomposition at
    a smaller rank, its moments mapped against the frozen factor (``orthonormal``: map_state's argument)."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 32)
    (fp,) = lr.prepare_model(nn.Sequential(layer), full_rank_patterns=())
    lr.decompose(fp, 6, split=split, sigma_in=trained)
    lr.set_trainable([fp], trained)
    opt = torch.optim.AdamW([fp.A, fp.B, layer.bias], lr=0.01)
    frozen = (fp.B if trained == "A" else fp.A).detach().clone()
    for _ in range(3):
        opt.zero_grad()
        layer(torch.randn(8, 16)).pow(2).sum().backward()
        opt.step()
    lr.recompose(fp)
    lr.decompose(fp, 4, split=split, sigma_in=trained, optimizer=opt, moments_against=(trained, frozen),
                  frozen_orthonormal=orthonormal)
    return opt, fp, opt.state.get(fp.A if trained == "A" else fp.B, {})


@pytest.mark.parametrize("trained", ["A", "B"])
@pytest.mark.parametrize("split", ["sigma", "sqrt"])
def test_map_state_through_an_orthonormal_frozen_factor_needs_no_pseudo_inverse(trained, split, monkeypatch):
    """σ in the trained factor leaves the frozen one U or Vᵀ: its transpose is its pseudo-inverse, so both
    ways map the moments alike; with √σ in both factors the check fails and the pseudo-inverse is taken."""
    _, _, state = _mapped_moments(trained, split, orthonormal=False)
    m0, v0 = state["exp_avg"], state["exp_avg_sq"]
    if split == "sigma":  # the transpose must serve: a pseudo-inverse would fail the test
        monkeypatch.setattr(torch.linalg, "pinv", lambda *a, **k: pytest.fail("pinv of an orthonormal factor"))
    _, _, state = _mapped_moments(trained, split, orthonormal=True)
    m1, v1 = state["exp_avg"], state["exp_avg_sq"]
    if split == "sqrt":
        assert torch.equal(m0, m1) and torch.equal(v0, v1)
    else:
        torch.testing.assert_close(m1, m0, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("trained", ["A", "B"])
def test_map_state_takes_the_pseudo_inverse_in_float64_where_float32_does_not_converge(trained, monkeypatch):
    """LAPACK's SVD can fail to converge in float32 on a nearly orthonormal factor (clustered singular values):
    the mapping then takes the pseudo-inverse in float64, and moves the moments as float32 would have."""
    _, _, want = _mapped_moments(trained)
    pinv, dtypes = torch.linalg.pinv, []

    def float32_fails(m, **kw):
        dtypes.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return pinv(m, **kw)

    monkeypatch.setattr(torch.linalg, "pinv", float32_fails)
    _, _, got = _mapped_moments(trained)
    assert dtypes == [torch.float32, torch.float64]
    assert got["exp_avg"].dtype == want["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(got["exp_avg"], want["exp_avg"], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-4, atol=1e-10)


def test_map_state_restarts_a_factors_state_where_no_pseudo_inverse_converges(monkeypatch, caplog):
    """No pseudo-inverse in either precision: the trained factor's state starts again (one warning), training
    goes on; never an exception out of a decomposition."""
    def fails(m, **kw):
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "pinv", fails)
    with caplog.at_level("WARNING"):
        opt, fp, state = _mapped_moments("A")
    assert not state and fp.A not in opt.state
    assert "could not be carried into the new basis" in caplog.text and "starts again" in caplog.text
    fp.A.grad = torch.ones_like(fp.A)
    opt.step()
    assert opt.state[fp.A]["exp_avg"].shape == fp.A.shape and torch.isfinite(fp.A).all()


def test_map_state_of_a_mere_reparametrisation_changes_adam_moments_only_by_sign():
    torch.manual_seed(1)
    layer = nn.Linear(16, 32)
    (fp,) = lr.prepare_model(nn.Sequential(layer), full_rank_patterns=())
    lr.decompose(fp, 5)
    lr.set_trainable([fp], "A")
    opt = torch.optim.AdamW([fp.A], lr=0.0)  # moments without a move: W stays A·B
    layer(torch.randn(4, 16)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[fp.A].items()}
    frozen = fp.B.detach().clone()
    lr.recompose(fp)
    lr.decompose(fp, 5, optimizer=opt, moments_against=("A", frozen))  # W = A·B again: the same factors up to signs
    after = opt.state[fp.A]
    assert torch.allclose(after["exp_avg_sq"], before["exp_avg_sq"], rtol=1e-3, atol=1e-9)
    assert torch.allclose(after["exp_avg"].abs(), before["exp_avg"].abs(), rtol=1e-3, atol=1e-7)
    assert torch.equal(torch.as_tensor(after["step"]), torch.as_tensor(before["step"]))


def test_a_new_rank_trains_while_the_last_steps_graph_is_still_alive():
    """A loop's ``loss`` keeps the last step's graph; a truncation right after it (no rebound) must not break backward."""
    torch.manual_seed(0)
    model = MLP()
    records = lr.prepare_model(model)
    for fp in records:
        lr.decompose(fp, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = model(MLP.example()).square().mean()
    loss.backward()
    opt.step()
    for fp in records:  # `loss` and its graph are still alive here, as in a user's loop
        lr.recompose(fp)
        lr.decompose(fp, 4, optimizer=opt)
    opt.zero_grad()
    loss = model(MLP.example()).square().mean()
    loss.backward()
    assert all(fp.A.grad.shape == fp.A.shape == (fp.m, 4) for fp in records)
    opt.step()


def test_reset_state_drops_factor_state():
    model = MLP()
    records = lr.prepare_model(model)
    opt = torch.optim.AdamW(model.parameters())
    for fp in records:
        lr.decompose(fp, 2)
    _step(model, opt)
    assert records[0].A in opt.state
    lr.reset_state(opt, [p for fp in records for p in (fp.A, fp.B)])
    assert all(fp.A not in opt.state and fp.B not in opt.state for fp in records)
    _step(model, opt)


# ---------------------------------------------------------------------------
# Counting, initialisation, reporting


def test_compression_ratio_by_hand():
    model = MLP()
    records = lr.prepare_model(model)
    # stem 8*16+16, body.0 16*32+32, body.2 32*16+16, head 16*4+4
    full = 144 + 544 + 528 + 68
    assert lr.full_param_count(model, records) == full
    assert lr.ab_param_count(model, records) == full  # nothing decomposed yet
    lr.decompose(records[0], 2)  # 32x16 -> 2*(32+16) = 96
    lr.decompose(records[1], 3)  # 16x32 -> 3*(16+32) = 144
    ab = 144 + (96 + 32) + (144 + 16) + 68
    assert lr.ab_param_count(model, records) == ab
    assert lr.full_param_count(model, records) == full
    assert lr.compression_ratio(model, records) == pytest.approx(full / ab)
    assert lr.format_ratio(full / ab) == f"{full / ab:.1f}:1"
    assert lr.format_ratio(44.14) == "44.1:1"


def test_ortho_sigma_init_keeps_singular_vectors_with_unit_singular_values():
    model = _build(CNN)
    records = lr.prepare_model(model)
    before = [fp.weight.detach().clone().reshape(fp.m, fp.n) for fp in records]
    lr.ortho_sigma_init(records)
    for fp, w0 in zip(records, before):
        w = fp.weight.detach().reshape(fp.m, fp.n)
        torch.testing.assert_close(torch.linalg.svdvals(w), torch.ones(min(fp.m, fp.n)), rtol=0, atol=1e-5)
        u, _, vh = torch.linalg.svd(w0, full_matrices=False)
        torch.testing.assert_close(w, u @ vh, rtol=0, atol=1e-6)  # the initial singular vectors, sigma = 1
    # the same starting weights give the same result (workers agree)
    again = _build(CNN)
    lr.ortho_sigma_init(again_records := lr.prepare_model(again))
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(records, again_records))


def test_output_weights_follow_the_graph_not_the_name():
    class Proto(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proto = nn.Linear(32, 4)  # the output layer, defined first and not called head
            self.stem = nn.Linear(8, 16)
            self.depthwise = nn.Conv1d(16, 16, 3, padding=1, groups=16)
            self.body = nn.Linear(16, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.body(self.depthwise(self.stem(x).unsqueeze(-1)).squeeze(-1)))
            return self.proto(h) / 0.5

    model = _build(Proto)
    records = lr.prepare_model(model)
    assert [fp.name for fp in lr.output_weights(model.train()(torch.randn(3, 8)), records)] == ["proto.weight"]
    # a model whose nearest weight is kept by name (head) has no output record
    mlp = _build(MLP)
    assert lr.output_weights(mlp.train()(MLP.example()), lr.prepare_model(mlp)) == []
    # the rank floor keeps matrices too small to gain full rank: 16x3 factors at rank 8 are larger than W
    names = [fp.name for fp in lr.prepare_model(_build(Proto), min_rank=8)]
    assert "depthwise.weight" not in names and "body.weight" in names


def test_describe_and_log_decisions(caplog):
    records = lr.prepare_model(_build(MLP))
    lr.decompose(records[0], 2)  # the second stays as prepare_model left it
    rows = lr.describe(records)
    assert rows[0] == {
        "name": "body.0.weight",
        "shape": (32, 16),
        "matrix": (32, 16),
        "mode": "lowrank",
        "rank": 2,
        "params_full": 512,
        "params_lowrank": 96,
        "note": "rank 2 of 16",
    }
    assert rows[1]["mode"] == "full" and rows[1]["rank"] is None
    with caplog.at_level(logging.INFO, logger="abtrain.methods.ab.lowrank"):
        lr.log_decisions(records)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "rank 2" in lines[0] and "full rank: not decomposed yet" in lines[1]
