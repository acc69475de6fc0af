"""Convex Gated Probing: simplex gates, frozen backbone, 3P features, the official head's forward."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from closedloop.tool import ToolRegistry
from closedloop.tools.cgp_probe import TOOLS, CGPProbe, fit_cgp, hf_layer_features



def _official():
    """The official head (verbatim copy in _cgp_reference.py; tests run with --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location("_cgp_reference", Path(__file__).with_name("_cgp_reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.OfficialCGP


OfficialCGP = _official()


def feats(L=4, B=6, D=8, T=5, Fq=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, B, D, T, Fq, generator=g, dtype=torch.float64), torch.randn(L, B, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("use_cls", [True, False])
def test_forward_matches_the_official_head_on_identical_inputs(use_cls):
    torch.manual_seed(0)
    ours = CGPProbe(5, 8, 4, num_prototypes=7, use_cls=use_cls).double().eval()
    official = OfficialCGP(5, 8, 7, 4, use_cls=use_cls).double().eval()
    official.load_state_dict(ours.state_dict())  # same parameter names and shapes
    with torch.no_grad():
        ours.block_attention.copy_(torch.randn(4))  # non-uniform gates exercise the mixing
        official.block_attention.copy_(ours.block_attention)
    patch, cls = feats()
    expect = official({"patch_tokens": patch, "cls_tokens": cls})
    torch.testing.assert_close(ours(patch, cls if use_cls else None), expect, rtol=1e-10, atol=1e-12)
    # An all-true mask is the official forward too.
    mask = torch.ones(6, 5, 3, dtype=torch.bool)
    torch.testing.assert_close(ours(patch, cls if use_cls else None, mask), expect, rtol=1e-10, atol=1e-12)


def test_gates_uniform_at_init_and_on_the_simplex_after_training():
    probe = CGPProbe(3, 8, 5, num_prototypes=4)
    torch.testing.assert_close(probe.gates, torch.full((5,), 0.2))
    patch, cls = feats(L=5)
    fit = fit_cgp(patch.float(), cls.float(), torch.tensor([0, 1, 2, 0, 1, 2]), num_prototypes=4, steps=30, lr=5e-2)
    assert np.all(fit.gates >= 0) and fit.gates.sum() == pytest.approx(1.0, abs=1e-6)
    assert np.ptp(fit.gates) > 1e-4  # training moved them


def test_feature_size_is_3p_and_mask_excludes_padding():
    probe = CGPProbe(2, 8, 4, num_prototypes=11).double()
    patch, cls = feats()
    assert probe.features(patch, cls).shape == (6, 33)
    assert probe.fc.in_features == 33
    # A huge masked-out token must not change the features.
    mask = torch.ones(6, 5, 3, dtype=torch.bool)
    mask[:, -1] = False
    spiked = patch.clone()
    spiked[:, :, :, -1] = 1e6 * torch.randn(4, 6, 8, 1, dtype=torch.float64)
    torch.testing.assert_close(probe.features(spiked, cls, mask), probe.features(patch[..., :-1, :], cls))


def test_only_gates_prototypes_and_head_get_gradients():
    torch.manual_seed(0)
    backbone = nn.Linear(8, 8)
    for prm in backbone.parameters():
        prm.requires_grad_(False)
    probe = CGPProbe(3, 8, 2, num_prototypes=4)
    x = torch.randn(2, 6, 5, 8)
    hidden = torch.stack([backbone(x[0]), backbone(backbone(x[1]))])  # L, B, T, D
    patch = hidden.permute(0, 1, 3, 2).unsqueeze(-1)
    F.cross_entropy(probe(patch, hidden[:, :, 0]), torch.tensor([0, 1, 2, 0, 1, 2])).backward()
    assert all(p.grad is None for p in backbone.parameters())
    grads = {n: p.grad for n, p in probe.named_parameters()}
    assert set(grads) == {"block_attention", "prototype_vectors", "fc.weight", "fc.bias"}
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads.values())


def test_gate_argmax_finds_the_informative_layer():
    # Four layers of noise; only layer 2 carries the class, as a shared direction in every token.
    g = torch.Generator().manual_seed(0)
    L, B, D, T = 4, 60, 16, 6
    y = torch.arange(B) % 3
    patch = torch.randn(L, B, D, T, 1, generator=g)
    dirs = torch.randn(3, D, generator=g) * 3
    patch[2] += dirs[y][:, :, None, None]
    cls = patch.mean((3, 4))
    fit = fit_cgp(patch, cls, y, num_prototypes=16, steps=150, lr=2e-2, dropout=0.0)
    assert fit.best_layer == 2
    assert fit.train_accuracy > 0.9


def test_hf_features_and_tool_on_tiny_model(tiny_model_path):
    torch.set_num_threads(1)
    from transformers import AutoModel, AutoTokenizer

    enc = AutoModel.from_pretrained(tiny_model_path).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    texts = ["hello", "what is the weather in paris today", "add 2 and 3"]
    patch, cls, mask = hf_layer_features(enc, tok, texts)
    n_layers, d = enc.config.num_hidden_layers, enc.config.hidden_size
    assert patch.shape[:3] == (n_layers, 3, d) and patch.shape[-1] == 1 and cls.shape == (n_layers, 3, d)
    lengths = mask[:, :, 0].sum(1)
    # The "last" CLS is the last real token, not padding.
    torch.testing.assert_close(cls[:, 0], patch[:, 0, :, int(lengths[0]) - 1, 0])
    reg = ToolRegistry().extend(TOOLS)
    res = asyncio.run(reg.get("cgp_probe_hf").run({"model": f"hf:{tiny_model_path}", "texts": texts,
                                                    "labels": [0, 1, 0], "num_prototypes": 5, "steps": 5}))
    assert res.ok, res.error
    out = json.loads(res.content)
    assert out["n_layers"] == n_layers and out["feature_dim"] == 15 and 0 <= out["best_layer"] < n_layers


def test_feature_tool_and_clear_errors(tmp_path):
    reg = ToolRegistry().extend(TOOLS)
    patch = np.random.default_rng(0).standard_normal((3, 6, 4, 5))  # L, N, T, D
    np.save(tmp_path / "p.npy", patch)
    run = lambda args: asyncio.run(reg.get("cgp_probe_features").run(args))  # noqa: E731
    res = run({"patch_tokens": str(tmp_path / "p.npy"), "labels": [0, 1, 0, 1, 0, 1], "num_prototypes": 3, "steps": 3})
    assert res.ok, res.error
    assert json.loads(res.content)["feature_dim"] == 9
    assert "not found" in run({"patch_tokens": str(tmp_path / "missing.npy"), "labels": [0]}).error
    bad = patch.copy()
    bad[0, 0, 0, 0] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    assert "NaN" in run({"patch_tokens": str(tmp_path / "nan.npy"), "labels": [0, 1, 0, 1, 0, 1]}).error
    assert "labels must be" in run({"patch_tokens": str(tmp_path / "p.npy"), "labels": [0, 1]}).error
    assert "must be (L, N, T, D)" in run({"patch_tokens": [[1.0, 2.0]], "labels": [0]}).error
