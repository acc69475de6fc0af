"""Spike Dice Attention: set-similarity scores, the division-free variant, surrogate gradients."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from closedloop.tool import ToolRegistry
from closedloop.tools.spike_dice_attention import (
    TOOLS,
    LIFNeuron,
    SpikingAttention,
    density_correlation,
    dot_product_scores,
    lin_dice_scores,
    random_spikes,
    relevance_auc,
    spike,
    spike_dice_scores,
)

DTYPES = {torch.float64: 1e-12, torch.float32: 1e-6}


def binary(shape, rate=0.3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < rate).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dice_scores_are_bounded_symmetric_and_one_on_the_diagonal(dtype):
    atol = DTYPES[dtype]
    # Rates from very sparse to dense, so the diagonal covers many densities.
    q = torch.cat([binary((2, 3, 8, 32), r, seed=i, dtype=dtype) for i, r in enumerate((0.03, 0.2, 0.6, 0.95))], 2)
    k = torch.cat([binary((2, 3, 5, 32), r, seed=9 + i, dtype=dtype) for i, r in enumerate((0.1, 0.5, 0.9))], 2)
    s = spike_dice_scores(q, k)
    assert s.shape == (2, 3, 32, 15) and s.dtype == dtype
    assert float(s.min()) >= 0 and float(s.max()) <= 1
    torch.testing.assert_close(s, spike_dice_scores(k, q).transpose(-1, -2), rtol=0, atol=atol)
    self_s = torch.diagonal(spike_dice_scores(q, q), dim1=-2, dim2=-1)
    alive = q.sum(-1) > 0
    assert alive.sum() > 0 and float((self_s[alive] - 1).abs().max()) < 1e-5
    assert torch.all(self_s[~alive] == 0)  # a silent token matches nothing, and no NaN
    # The dot product instead returns the firing count on the diagonal: density, not identity.
    dot_self = torch.diagonal(dot_product_scores(q, q), dim1=-2, dim2=-1)
    torch.testing.assert_close(dot_self, q.sum(-1))
    assert float(dot_self.max() - dot_self.min()) > 10


def test_dice_matches_set_definition():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.random(40) < rng.random(), rng.random(40) < rng.random()
        if not (a.any() or b.any()):
            continue
        expected = 2 * np.sum(a & b) / (a.sum() + b.sum())
        got = float(spike_dice_scores(torch.tensor(a, dtype=torch.float64)[None], torch.tensor(b, dtype=torch.float64)[None]))
        assert got == pytest.approx(expected, abs=1e-6)


class NoDivision(TorchFunctionMode):
    """Fails on any division-like torch call, including Tensor.__truediv__ and reciprocal."""

    BANNED = ("div", "reciprocal", "rsqrt", "remainder", "fmod")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if any(b in name for b in self.BANNED):
            raise RuntimeError(f"division op called: {name}")
        return func(*args, **(kwargs or {}))


def test_lin_sda_uses_no_division_and_sda_does():
    q, k, v = binary((2, 2, 16, 32), seed=1), binary((2, 2, 16, 32), seed=2), binary((2, 2, 16, 8), seed=3)
    lin = SpikingAttention("lin_sda")
    sda = SpikingAttention("sda")
    with NoDivision():
        out = lin(q, k, v)
        lin_dice_scores(q, k, 0.3)
    assert out.shape == (2, 2, 16, 8)
    with pytest.raises(RuntimeError, match="division op"), NoDivision():  # the guard does catch division
        sda(q, k, v)
    with pytest.raises(RuntimeError, match="division op"), NoDivision():
        q / 2.0


def test_lin_sda_with_half_threshold_selects_the_same_pairs_as_sda():
    theta = 0.5
    q, k = binary((3, 2, 24, 48), 0.25, seed=4), binary((3, 2, 24, 48), 0.4, seed=5)
    sda = spike(spike_dice_scores(q, k) - theta)
    lin_raw = lin_dice_scores(q, k, theta / 2)
    lin = spike(lin_raw)
    ties = lin_raw == 0  # 2I = θ(C(q)+C(k)) exactly: SDA's ε tips them below θ
    assert torch.equal(sda[~ties], lin[~ties])
    assert 0 < float(sda.mean()) < 1  # both outcomes occur


@pytest.mark.parametrize("structure", ["independent", "prototype"])
def test_dice_is_less_density_biased_than_dot_product(structure):
    pair = random_spikes(2, 4, 64, 64, rate_low=0.05, rate_high=0.5, structure=structure, seed=0)
    r_dot = density_correlation(dot_product_scores(pair.q, pair.k), pair.q, pair.k)
    r_sda = density_correlation(spike_dice_scores(pair.q, pair.k), pair.q, pair.k)
    r_lin = density_correlation(lin_dice_scores(pair.q, pair.k, 0.25), pair.q, pair.k)
    assert r_dot > 0.6
    if structure == "independent":
        # Content-free spikes: Dice still follows density through chance overlap
        # (E[SDS] ≈ 2 p_q p_k / (p_q + p_k)), only less than the dot product does.
        assert r_sda < r_dot - 0.1
    else:
        assert r_sda < 0.6 * r_dot
        auc_sda = relevance_auc(spike_dice_scores(pair.q, pair.k), pair.q_group, pair.k_group)
        auc_dot = relevance_auc(dot_product_scores(pair.q, pair.k), pair.q_group, pair.k_group)
        assert auc_sda > 0.97 and auc_sda > auc_dot + 0.05
    assert r_lin < r_sda


def test_relevance_auc_is_exact_on_a_small_case():
    scores = torch.tensor([[0.9, 0.1], [0.4, 0.4]])
    groups = torch.tensor([0, 1])
    # positives: 0.9, 0.4 ; negatives: 0.1, 0.4 -> wins 0.9>0.1, 0.9>0.4, 0.4>0.1, tie 0.4=0.4 -> 3.5/4
    assert relevance_auc(scores, groups, groups) == pytest.approx(3.5 / 4)


@pytest.mark.parametrize("surrogate,alpha", [("sigmoid", 4.0), ("atan", 2.0)])
def test_surrogate_spike_forward_is_heaviside_and_backward_is_smooth(surrogate, alpha):
    x = torch.tensor([-2.0, -0.1, 0.0, 0.1, 3.0], dtype=torch.float64, requires_grad=True)
    s = spike(x, surrogate, alpha)
    assert s.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    (g,) = torch.autograd.grad(s.sum(), x)
    peak = alpha / 4 if surrogate == "sigmoid" else alpha / 2
    assert float(g[2]) == pytest.approx(peak)
    assert torch.all(g > 0) and float(g[0]) < float(g[1]) < float(g[2])
    # The surrogate is the derivative of a smooth step, checked against autograd of that step.
    smooth = torch.sigmoid(alpha * x) if surrogate == "sigmoid" else torch.atan(math.pi / 2 * alpha * x) / math.pi
    (g_smooth,) = torch.autograd.grad(smooth.sum(), x)
    torch.testing.assert_close(g, g_smooth)


def test_lif_integrates_fires_and_resets():
    lif = LIFNeuron(tau=2.0, v_threshold=1.0)
    out = lif(torch.full((6, 1), 1.5, dtype=torch.float64))
    # h1 = 0.75 (silent), h2 = 0.75 + (1.5 - 0.75)/2 = 1.125 (fires, resets to 0), and so on.
    assert out.flatten().tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert lif(torch.full((6, 1), 0.9)).sum() == 0  # below threshold at steady state
    with pytest.raises(ValueError, match="tau"):
        LIFNeuron(tau=1.0)


@pytest.mark.parametrize("kind", ["sda", "lin_sda", "dot"])
def test_gradients_flow_through_the_surrogate_to_membrane_inputs(kind):
    g = torch.Generator().manual_seed(0)
    T, shape = 4, (2, 2, 12, 16)
    membrane = [(1.5 * torch.rand((T, *shape), generator=g, dtype=torch.float64)).requires_grad_(True)
                for _ in range(3)]
    plif = LIFNeuron(tau=2.0, learnable_tau=True)
    q, k, v = (plif(m) for m in membrane)
    assert set(torch.unique(q).tolist()) <= {0.0, 1.0} and 0 < float(q.detach().mean()) < 1
    attn = SpikingAttention(kind, binarize=True, threshold={"sda": 0.3, "lin_sda": 0.0, "dot": 0.25}[kind],
                            lam=0.15)
    out = attn(q, k, v)
    assert out.shape == (T, *shape)
    out.sum().backward()
    for m in membrane:
        assert m.grad is not None and float(m.grad.abs().sum()) > 0
    assert plif.w.grad is not None and float(plif.w.grad.abs()) > 0
    if kind == "lin_sda":
        assert attn.lam.grad is not None and float(attn.lam.grad.abs()) > 0


# ---------------------------------------------------------------------------------- tools


@pytest.fixture
def registry():
    return ToolRegistry().extend(TOOLS)


async def test_density_bias_tool_compares_all_three(registry):
    out = await registry.call_json("spike_attention_density_bias", json.dumps({"structure": "prototype", "seed": 1}))
    assert out.ok, out.error
    rep = json.loads(out.content)
    assert rep["shape_q"] == [2, 4, 64, 64]
    assert rep["sda"]["density_correlation"] < rep["dot"]["density_correlation"]
    assert rep["sda"]["self_score_spread"] < 1e-5 < rep["dot"]["self_score_spread"]
    assert rep["sda"]["relevance_auc"] > rep["dot"]["relevance_auc"]


async def test_tools_take_spike_artifacts(registry, tmp_path):
    q = binary((1, 2, 10, 16), 0.3, seed=7).numpy()
    np.save(tmp_path / "q.npy", q)
    np.savez(tmp_path / "k.npz", k=binary((1, 2, 6, 16), 0.5, seed=8).numpy())
    out = await registry.call_json("spike_attention_density_bias", {"queries": str(tmp_path / "q.npy"),
                                                                    "keys": str(tmp_path / "k.npz")})
    assert out.ok, out.error
    assert json.loads(out.content)["shape_k"] == [1, 2, 6, 16]
    big = await registry.call_json("spike_attention_scores", {"queries": str(tmp_path / "q.npy")})
    rep = json.loads(big.content)
    assert rep["shape"] == [1, 2, 10, 10] and np.load(rep["scores"]["path"]).shape == (1, 2, 10, 10)
    small = json.loads((await registry.call_json("spike_attention_scores", {"queries": [[1, 1, 0], [0, 1, 0]],
                                                                            "kind": "lin_sda", "lin_lambda": 0.5})).content)
    assert small["scores"] == [[[[0.0, -0.5], [-0.5, 0.0]]]]


@pytest.mark.parametrize("tool,args,kind,needle", [
    ("spike_attention_density_bias", {"queries": [[0, 2, 1]]}, "exception", "binary"),
    ("spike_attention_density_bias", {"queries": [1, 0, 1]}, "exception", "shape"),
    ("spike_attention_density_bias", {"keys": [[1, 0]]}, "exception", "without queries"),
    ("spike_attention_density_bias", {"queries": "/nonexistent/q.npy"}, "exception", "outside the working root"),
    ("spike_attention_density_bias", {"queries": [[1, 0]], "keys": [[1, 0, 1]]}, "exception", "share"),
    ("spike_attention_density_bias", {"rate_low": 0.6, "rate_high": 0.2}, "exception", "rate_low"),
    ("spike_attention_density_bias", {"rate_high": 1.5}, "invalid_arguments", "rate_high"),
    ("spike_attention_density_bias", {"lin_lambda": -0.1}, "invalid_arguments", "lin_lambda"),
    ("spike_attention_scores", {"queries": [[1.0, float("nan")]]}, "invalid_arguments", "NaN"),
    ("spike_attention_scores", {"queries": [[1, 0]], "kind": "cosine"}, "invalid_arguments", "kind"),
])
async def test_tool_errors_are_clear(registry, tool, args, kind, needle):
    out = await registry.call_json(tool, json.dumps(args))
    assert not out.ok and out.error_kind == kind, out.content
    assert needle in out.error
