"""ArBG: chain rule on an enumerable grid, consistent temperature/top-p, SNIS, ESS, E-W2."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from closedloop.tool import ToolRegistry
from closedloop.tools.arbg import (
    TOOLS,
    ARModel,
    Discretizer,
    energy_w2,
    ess,
    ess_from_weights,
    filter_logits,
    grid_sample,
    log_q,
    sample,
    sequence_log_prob,
    snis_log_weights,
    snis_weights,
    toy_energy,
    wasserstein2_1d,
)

SETTINGS = [(1.0, None), (0.7, None), (1.3, 0.8), (0.8, 0.5)]


def sharp_model(dim: int, bins: int, seed: int = 0) -> ARModel:
    """A random model with peaked conditionals, so temperature and top-p really remove bins."""
    torch.manual_seed(seed)
    m = ARModel(dim, bins, d_model=16, n_heads=2).double().eval()
    with torch.no_grad():
        m.head.weight.mul_(20)
    return m


def all_sequences(dim: int, bins: int) -> torch.Tensor:
    return torch.cartesian_prod(*([torch.arange(bins)] * dim)).reshape(-1, dim)


@pytest.mark.parametrize("temperature,top_p", SETTINGS)
def test_chain_rule_on_enumerable_grid(temperature, top_p):
    dim, bins = 3, 5
    m = sharp_model(dim, bins)
    grid = all_sequences(dim, bins)
    with torch.no_grad():
        joint = sequence_log_prob(m, grid, temperature, top_p)
        per = sequence_log_prob(m, grid, temperature, top_p, per_coordinate=True)
        # The joint is a distribution over the 125 sequences.
        assert float(torch.logsumexp(joint, 0)) == pytest.approx(0.0, abs=1e-10)
        # Each conditional from the one pass equals a separate forward on the prefix alone.
        for j in range(dim):
            cond = F.log_softmax(filter_logits(m(grid[:, :j])[:, -1], temperature, top_p), -1)
            torch.testing.assert_close(per[:, j], cond.gather(-1, grid[:, j:j + 1]).squeeze(-1))
        # Marginalising the last coordinate gives the two-coordinate prefix probability.
        marg = torch.logsumexp(joint.reshape(bins * bins, bins), 1)
        torch.testing.assert_close(marg, per[::bins, :2].sum(-1))
    if top_p is not None:  # top-p zeroes some sequences: it was really applied
        assert torch.isneginf(joint).any()


@pytest.mark.parametrize("temperature,top_p", SETTINGS)
def test_sampler_log_prob_equals_one_pass_likelihood(temperature, top_p):
    m = sharp_model(4, 16, seed=1)
    bins, running = sample(m, 300, temperature, top_p, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        one_pass = sequence_log_prob(m, bins, temperature, top_p)
    assert torch.isfinite(one_pass).all()  # nothing drawn outside the nucleus
    torch.testing.assert_close(running, one_pass.double())


def test_sampling_frequencies_follow_the_likelihood():
    m = sharp_model(2, 4, seed=2)
    n, temperature, top_p = 40000, 0.8, 0.9
    bins, _ = sample(m, n, temperature, top_p, generator=torch.Generator().manual_seed(3))
    grid = all_sequences(2, 4)
    with torch.no_grad():
        p = sequence_log_prob(m, grid, temperature, top_p).exp().double()
    counts = torch.bincount(bins[:, 0] * 4 + bins[:, 1], minlength=16).double()
    sd = torch.sqrt(p * (1 - p) / n)
    assert torch.all((counts / n - p).abs() <= 5 * sd + 1e-12)
    assert torch.all(counts[p == 0] == 0)


def test_filter_logits_matches_autobg_top_p_rule():
    # AutoBG's compute_log_likelihood (danyalrehman/AutoBG, src/models/autoregressive_module.py).
    def autobg(logits, temperature, top_p):
        scaled = logits / temperature
        sorted_logits, sorted_indices = torch.sort(scaled, descending=True)
        cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        rm = cum > top_p
        rm[:, :, 1:] = rm[:, :, :-1].clone()
        rm[:, :, 0] = False
        idx = rm.scatter(2, sorted_indices, rm)
        scaled = scaled.clone()
        scaled[idx] = float("-inf")
        return scaled

    logits = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(0)) * 3
    for t, p in ((1.0, 0.9), (0.5, 0.3), (2.0, 0.99)):
        torch.testing.assert_close(filter_logits(logits, t, p), autobg(logits, t, p))
    with pytest.raises(ValueError, match="temperature"):
        filter_logits(logits, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        filter_logits(logits, 1.0, 1.5)


def test_discretizer_bins_and_within_bin_noise():
    d = Discretizer.box(-4.0, 4.0, 2, 256)
    assert float(d.width[0]) == pytest.approx(8 / 256)
    b = torch.randint(0, 256, (5000, 2), generator=torch.Generator().manual_seed(0))
    x = d.from_bins(b, generator=torch.Generator().manual_seed(1))
    assert torch.equal(d.to_bins(x), b) and torch.equal(d.to_bins(d.centres(b)), b)
    frac = ((x - d.low) / d.width - b).flatten()  # uniform on [0, 1)
    assert float(frac.min()) >= 0 and float(frac.max()) < 1 and abs(float(frac.mean()) - 0.5) < 0.02
    assert d.inside(torch.tensor([[-4.0, 3.99]])).item() and not d.inside(torch.tensor([[4.0, 0.0]])).item()
    with pytest.raises(ValueError, match="shape"):
        d.to_bins(torch.zeros(3, 3))


def test_continuous_log_q_is_a_density_on_the_box():
    m = sharp_model(1, 8, seed=4)
    d = Discretizer.box(-1.0, 3.0, 1, 8)
    # Riemann sum of q over a fine grid of the box (q is constant on each bin) is 1.
    xs = torch.linspace(-1, 3, 8 * 50 + 1, dtype=torch.float64)[:-1, None] + 4 / 800
    q = log_q(m, d, xs).exp()
    assert float(q.sum() * 4 / 400) == pytest.approx(1.0, abs=1e-9)
    assert torch.isneginf(log_q(m, d, torch.tensor([[3.0], [-1.5]], dtype=torch.float64))).all()


def test_snis_weights_invariant_to_constant_shifts():
    g = torch.Generator().manual_seed(0)
    e, lq = torch.randn(500, generator=g, dtype=torch.float64) * 3, torch.randn(500, generator=g, dtype=torch.float64)
    w = snis_weights(snis_log_weights(e, lq))
    d_log_width = 66 * math.log(8 / 256)  # −d·log(bin width) for d = 66 coordinates
    for shifted in (snis_log_weights(e + 1234.5, lq), snis_log_weights(e, lq - d_log_width),
                    snis_log_weights(e - 1e4, lq + 7.0)):
        torch.testing.assert_close(snis_weights(shifted), w, rtol=1e-9, atol=1e-15)
        assert ess(shifted) == pytest.approx(ess(snis_log_weights(e, lq)), rel=1e-9)
    assert float(w.sum()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="NaN"):
        snis_weights(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="−inf"):
        snis_weights(torch.full((3,), float("-inf")))


def test_ess_is_kish_formula():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(1000, generator=g, dtype=torch.float64) ** 4
    expected = float(w.sum() ** 2 / (w ** 2).sum())
    assert ess(w.log()) == pytest.approx(expected, rel=1e-10)
    assert ess_from_weights(w) == pytest.approx(expected, rel=1e-12)
    assert ess(torch.zeros(37, dtype=torch.float64)) == pytest.approx(37)
    assert ess(torch.tensor([0.0, -math.inf, -math.inf])) == pytest.approx(1.0)
    assert ess_from_weights(5 * w) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError):
        ess_from_weights(torch.tensor([1.0, -0.5]))


def test_w2_closed_forms_and_pot():
    rng = np.random.default_rng(0)
    a = rng.normal(size=300)
    assert wasserstein2_1d(a, a + 2.5) == pytest.approx(2.5, abs=1e-12)
    assert wasserstein2_1d(a, a[::-1]) == pytest.approx(0.0, abs=1e-12)
    # Integer weights are the same as repeating samples.
    b = rng.normal(size=50) * 2
    k = rng.integers(1, 5, size=50)
    assert wasserstein2_1d(a, b, None, k) == pytest.approx(wasserstein2_1d(a, np.repeat(b, k)), rel=1e-10)
    ot = pytest.importorskip("ot")  # AutoBG's E-W2 is sqrt(ot.emd2_1d(true, pred))
    wb = rng.random(50)
    assert wasserstein2_1d(a, b) == pytest.approx(math.sqrt(ot.emd2_1d(a, b)), rel=1e-8)
    ref = math.sqrt(ot.emd2_1d(a, b, np.full(300, 1 / 300), wb / wb.sum()))
    assert energy_w2(a, b, wb) == pytest.approx(ref, rel=1e-8)
    with pytest.raises(ValueError, match="weights"):
        wasserstein2_1d(a, b, None, np.ones(3))


def test_reweighting_recovers_double_well_energies_as_samples_grow():
    # A flat proposal on the box (log q = −log 5): SNIS alone must turn it into the double well.
    toy = toy_energy("double_well_1d")
    ref = toy.energy(grid_sample(toy, 20000, seed=99)).numpy()

    def e_w2(n: int, seed: int) -> tuple[float, float]:
        x = torch.rand(n, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 5 - 2.5
        e = toy.energy(x)
        w = snis_weights(snis_log_weights(e, torch.full_like(e, -math.log(5.0))))
        return energy_w2(ref, e.numpy(), w.numpy()), energy_w2(ref, e.numpy())

    small = np.mean([e_w2(100, s)[0] for s in range(5)])
    large = [e_w2(20000, s) for s in range(5)]
    assert np.mean([r for r, _ in large]) < small / 4
    assert all(rw < raw / 10 for rw, raw in large)


@pytest.fixture
def registry():
    return ToolRegistry().extend(TOOLS)


async def test_toy_tool_learns_the_double_well(registry):
    out = await registry.call_json("arbg_toy", json.dumps({"energy": "double_well_1d", "steps": 150,
                                                           "n_samples": 2000, "save_samples": True}))
    assert out.ok, out.error
    r = json.loads(out.content)
    # KL(p‖q) = −H(p) − E_p[log q] ≥ 0; H(p) = E_p[E] + log Z from the exact grid.
    toy = toy_energy("double_well_1d")
    xs = torch.linspace(-2.5, 2.5, 200001, dtype=torch.float64)[:, None]
    e = toy.energy(xs)
    log_z = float(torch.logsumexp(-e, 0)) + math.log(5 / 200000)
    p = torch.softmax(-e, 0)
    entropy = float((p * e).sum()) + log_z
    kl = -entropy - r["heldout_log_q"]
    assert -0.05 < kl < 0.05  # sampling noise of 2000 held-out points is ~0.02 nats
    assert r["e_w2_reweighted"] < r["e_w2_raw"]
    with np.load(r["samples"]["path"]) as z:
        assert z["x"].shape == (2000, 1) and float(z["weights"].sum()) == pytest.approx(1.0)


async def test_snis_and_ew2_tools_and_their_errors(registry, tmp_path):
    np.save(tmp_path / "e.npy", np.array([1.0, 2.0, 3.0]))
    out = await registry.call_json("arbg_snis", {"energies": str(tmp_path / "e.npy"), "log_q": [0.0, 0.0, 0.0]})
    assert out.ok, out.error
    r = json.loads(out.content)
    w = np.exp(-np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(r["weights"], w / w.sum())
    assert r["ess"] == pytest.approx(w.sum() ** 2 / (w ** 2).sum())
    out = await registry.call_json("arbg_energy_w2", {"energies_true": [0.0, 1.0], "energies_pred": [2.0, 3.0]})
    assert out.ok and json.loads(out.content)["e_w2"] == pytest.approx(2.0)
    bad = [("arbg_snis", {"energies": [1.0, 2.0], "log_q": [0.0]}, "same length"),
           ("arbg_snis", {"energies": str(tmp_path / "missing.npy"), "log_q": [0.0]}, "not found"),
           ("arbg_snis", {"energies": [1.0, float("nan")], "log_q": [0.0, 0.0]}, "NaN"),
           ("arbg_snis", {"energies": [[1.0]], "log_q": [0.0]}, "1-D"),
           ("arbg_energy_w2", {"energies_true": [1.0], "energies_pred": [1.0, 2.0], "weights_pred": [1.0]}, "entries"),
           ("arbg_toy", {"energy": "harmonic"}, "energy")]
    for name, args, msg in bad:
        out = await registry.call_json(name, args)
        assert not out.ok and msg in out.error, (name, out.error)
