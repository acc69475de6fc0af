"""PHALAR: shift → phase rotation, a phase-equivariant head, phase-blind similarity, CQT pitch
shift → bin translation, and agreement with the official code (a verbatim copy, see
_phalar_reference.py)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from closedloop.tool import ToolRegistry
from closedloop.tools.phalar import (
    TOOLS,
    BilinearSimilarity,
    ComplexHead,
    CplxLinear,
    CplxRMSNorm,
    CQTFrontend,
    LearnedSpectralPooling,
    ModReLU,
    from_stacked,
    hermitian_inner,
    phase_invariant_similarity,
    spectral_pool,
    to_stacked,
)


def reference():
    spec = importlib.util.spec_from_file_location("_phalar_reference", Path(__file__).with_name("_phalar_reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def crandn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(*shape, generator=g, dtype=torch.float64),
                         torch.randn(*shape, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("norm", ["global", "channel_wise", "component_wise", "none"])
@pytest.mark.parametrize("shift", [1, 5, 37])
def test_circular_shift_rotates_component_k_by_exp_minus_2pi_i_k_s_over_t(norm, shift):
    t, k = 64, 8
    h = torch.randn(3, 10, t, generator=torch.Generator().manual_seed(shift), dtype=torch.float64)
    z, zs = spectral_pool(h, k, norm), spectral_pool(torch.roll(h, shift, -1), k, norm)
    rot = torch.exp(-2j * math.pi * torch.arange(1, k + 1, dtype=torch.float64) * shift / t)
    torch.testing.assert_close(zs, rot * z, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(zs.abs(), z.abs(), rtol=1e-10, atol=1e-12)
    assert float((zs - z).abs().max()) > 1e-3  # the phases really moved


def test_pooling_normalises_by_mean_magnitude_and_drops_dc():
    h = torch.randn(2, 6, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 100.0
    z = spectral_pool(h, 8, "global")
    assert z.shape == (2, 6, 8)
    torch.testing.assert_close(z.abs().mean(dim=(-2, -1)), torch.ones(2, dtype=torch.float64), rtol=1e-5, atol=0)
    # A DC offset changes nothing: component 0 is dropped.
    torch.testing.assert_close(z, spectral_pool(h - 100.0, 8, "global"))
    # Short sequences are zero-padded to 2K + 3 frames instead of failing.
    assert spectral_pool(torch.randn(1, 4, 5, dtype=torch.float64), 8).shape == (1, 4, 8)
    with pytest.raises(ValueError, match="norm"):
        spectral_pool(h, 8, "bogus")


def test_head_is_phase_equivariant():
    torch.manual_seed(0)
    head = ComplexHead(24, hidden=32, out_features=16).double()
    with torch.no_grad():
        head.act.b.fill_(-0.5)  # a bias that really zeroes some units
        z = crandn(5, 24)
        out = head(z)
        for phi in (0.3, math.pi / 2, 2.0, -3.0):
            r = torch.exp(torch.tensor(1j * phi, dtype=torch.complex128))
            torch.testing.assert_close(head(r * z), r * out, rtol=1e-9, atol=1e-12)
        # Not trivially so: a per-channel phase is not preserved.
        per = torch.exp(1j * torch.linspace(0, 3, 24, dtype=torch.float64))
        assert float((head(per * z) - out).abs().max()) > 1e-3
        # modReLU zeroes small magnitudes and keeps phases; RMSNorm gives unit mean power.
        act = ModReLU(24, bias_init=-1.0).double()
        y = act(z)
        small = z.abs() < 1.0 - 1e-3
        assert torch.all(y[small] == 0) and torch.all(y[~small].angle().sub(z[~small].angle()).abs() < 1e-9)
        power = CplxRMSNorm(24).double()(z).abs().pow(2).mean(-1)
        torch.testing.assert_close(power, torch.ones(5, dtype=torch.float64), rtol=1e-5, atol=0)


def test_similarities_are_invariant_to_a_common_phase():
    x, y = crandn(6, 20, seed=1), crandn(4, 20, seed=2)
    sim = BilinearSimilarity(20).double()
    with torch.no_grad():
        base_mag, base_bil = phase_invariant_similarity(x, y), sim(x, y)
        for phi in (0.7, -2.4):
            r = torch.exp(torch.tensor(1j * phi, dtype=torch.complex128))
            torch.testing.assert_close(hermitian_inner(r * x, r * y), hermitian_inner(x, y))
            torch.testing.assert_close(phase_invariant_similarity(r * x, r * y), base_mag)
            torch.testing.assert_close(sim(r * x, r * y), base_bil)
            # |xᴴy| ignores even separate phases; the bilinear score does not.
            torch.testing.assert_close(phase_invariant_similarity(r * x, y), base_mag)
            assert float((sim(r * x, y) - base_bil).abs().max()) > 1e-3
        assert float(base_mag.max()) <= 1 and float(phase_invariant_similarity(x, x).diagonal().min()) > 1 - 1e-6
        # The Hermitian form is symmetric.
        torch.testing.assert_close(sim(x, y), sim(y, x).T)


def test_matches_official_phalar_code():
    ref = reference()
    torch.manual_seed(0)
    b, c, f, t, d, k = 3, 4, 6, 50, 10, 8
    x = torch.randn(b, c, f, t, dtype=torch.float64)
    ours_pool = LearnedSpectralPooling(f, c, d, k, norm="global").double()
    proj = torch.nn.Sequential(torch.nn.Flatten(2), torch.nn.Linear(f * c, d, bias=False)).double()
    proj[1].weight.data.copy_(ours_pool.proj.weight.data)
    ref_pool = ref.LearnedFeaturesSpectralPooling(proj, d, k, complex_output=True, norm="global")
    with torch.no_grad():
        z = ours_pool(x)
        torch.testing.assert_close(to_stacked(z).transpose(1, 2), ref_pool(x))  # ref: (B, 2, d, K)

        # Head: copy our weights into the official CplxLinear/CplxRMSNorm/modReLU stack.
        head = ComplexHead(d * k, hidden=16, out_features=12).double()
        head.act.b.data.uniform_(-0.3, 0.1)
        head.norm.weight.data.uniform_(0.5, 1.5)
        ref_head = torch.nn.Sequential(ref.CplxLinear(d * k, 16), ref.CplxRMSNorm(16), ref.modReLU(16),
                                       ref.CplxLinear(16, 12)).double()
        for ours, theirs in ((head.inp, ref_head[0]), (head.out, ref_head[3])):
            theirs.W.weight.data.copy_(torch.cat([ours.weight_re, ours.weight_im]))
        ref_head[1].weight.data.copy_(head.norm.weight)
        ref_head[2].b.data.copy_(head.act.b)
        emb = head(z)
        ref_emb = ref_head(torch.stack([z.real, z.imag], 1).flatten(2))  # (B, 2, d·K), d-major
        torch.testing.assert_close(to_stacked(emb), ref_emb)

        # Similarity: Re(x̂ᴴ Wᴴ ŷ) as trained and its Hermitian form.
        e2 = crandn(4, 12, seed=3)
        for herm in (False, True):
            ours_sim = BilinearSimilarity(12, hermitian=herm).double()
            ref_sim = ref.CplxBilinearSimilarity(12, hermitian=herm).double()
            ref_sim.W.W.weight.data.copy_(torch.cat([ours_sim.W.weight_re, ours_sim.W.weight_im]))
            torch.testing.assert_close(ours_sim(emb, e2), ref_sim(to_stacked(emb), to_stacked(e2)))


def test_cplx_linear_init_matches_official_scale():
    ref = reference()
    torch.manual_seed(0)
    ours = CplxLinear(400, 300)
    theirs = ref.CplxLinear(400, 300)
    std_ours = float(torch.cat([ours.weight_re, ours.weight_im]).detach().std())
    assert std_ours == pytest.approx(float(theirs.W.weight.detach().std()), rel=0.02)


def sine(freq, sr=16000, seconds=2.5):
    t = np.arange(int(sr * seconds)) / sr
    return torch.tensor(0.5 * np.sin(2 * np.pi * freq * t), dtype=torch.float32)


def test_cqt_pitch_shift_is_a_translation_along_bins():
    front = CQTFrontend(n_bins=60, fmin=65.41)  # C2 … B6, kernels short enough for a quick test
    base = 65.41 * 2 ** (20 / 12)
    with torch.no_grad():
        peaks = {s: int(front(sine(base * 2 ** (s / 12)))[0].mean(-1).argmax()) for s in (0, 3, 7, 12)}
        spec0, spec7 = front(sine(base))[0].mean(-1), front(sine(base * 2 ** (7 / 12)))[0].mean(-1)
    assert peaks == {s: 20 + s for s in (0, 3, 7, 12)}
    # The whole profile translates (away from the edges), not just the peak.
    assert torch.corrcoef(torch.stack([spec0[5:40], spec7[12:47]]))[0, 1] > 0.99
    with pytest.raises(ValueError, match="Nyquist"):
        CQTFrontend(n_bins=200)


@pytest.fixture
def registry():
    return ToolRegistry().extend(TOOLS)


async def test_tools_end_to_end(registry, tmp_path):
    from scipy.io import wavfile

    wav = tmp_path / "a.wav"
    wavfile.write(wav, 22050, (sine(440.0, sr=22050).numpy() * 32767).astype(np.int16))
    out = await registry.call_json("phalar_cqt", {"audio": str(wav), "n_bins": 60, "fmin": 65.41})
    assert out.ok, out.error
    r = json.loads(out.content)
    assert r["bin_frequencies_hz"][r["peak_bin"]] == pytest.approx(440.0, rel=0.03)  # A4, resampled to 16 kHz

    h = np.random.default_rng(0).normal(size=(2, 5, 48))
    np.save(tmp_path / "h.npy", h)
    out = await registry.call_json("phalar_spectral_pool", json.dumps({"features": str(tmp_path / "h.npy"),
                                                                      "check_shift": 7}))
    assert out.ok, out.error
    r = json.loads(out.content)
    assert r["shape"] == [2, 2, 5, 8] and r["shift_max_error"] < 1e-10 and r["shift_magnitude_change"] < 1e-10
    z = np.load(r["components"]["path"])
    torch.testing.assert_close(from_stacked(np.moveaxis(z, 1, -2)), spectral_pool(torch.from_numpy(h), 8))

    e = to_stacked(crandn(3, 6, seed=4)).numpy()
    rot = to_stacked(from_stacked(e) * np.exp(1j * 1.1)).numpy()
    out = await registry.call_json("phalar_similarity", {"x": rot.tolist(), "y": e.tolist()})
    assert out.ok, out.error
    r = json.loads(out.content)
    assert r["best_match"] == [0, 1, 2] and np.allclose(np.diag(r["scores"]), 1, atol=1e-6)

    bad = [("phalar_cqt", {"audio": str(tmp_path / "missing.wav")}, "not found"),
           ("phalar_cqt", {"audio": [[0.1, 0.2]]}, "mono"),
           ("phalar_cqt", {"audio": [0.0] * 4000, "n_bins": 200}, "Nyquist"),
           ("phalar_spectral_pool", {"features": [1.0, 2.0]}, "(d, T)"),
           ("phalar_spectral_pool", {"features": [[1.0, float("nan")]]}, "NaN"),
           ("phalar_spectral_pool", {"features": h[0, :, :10].tolist(), "check_shift": 2}, "2K + 3"),
           ("phalar_similarity", {"x": [[1.0, 2.0, 3.0]]}, "(…, 2, D)"),
           ("phalar_similarity", {"x": e.tolist(), "kind": "hermitian", "weight": [[1.0]]}, "weight")]
    for name, args, msg in bad:
        out = await registry.call_json(name, args)
        assert not out.ok and msg in out.error, (name, out.error)
