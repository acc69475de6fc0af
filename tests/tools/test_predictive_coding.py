"""Predictive-coding networks: equilibrium theory, local learning, convergence to BP (arXiv 2602.07697)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from closedloop.tool import ToolRegistry
from closedloop.tools.predictive_coding import (
    TOOLS,
    activity_grads,
    bp_weight_grads,
    compare_pc_bp,
    infer,
    init_network,
    layer_scalings,
    linear_equilibrium,
    pc_update,
    pc_weight_grads,
)

TOL = {torch.float64: dict(infer_tol=1e-11, rel=1e-9, act=1e-8), torch.float32: dict(infer_tol=1e-5, rel=1e-5, act=1e-3)}


def batch(d_in=8, d_out=3, b=10, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, d_in, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(b, d_out, generator=g, dtype=torch.float64).to(dtype))


def test_scalings_follow_width_and_depth():
    mupc = layer_scalings("mupc", 16, 64, 8, residual=True)
    assert mupc[0] == pytest.approx(1 / 4) and mupc[-1] == pytest.approx(1 / 64)
    assert mupc[1:-1] == pytest.approx([1 / math.sqrt(64 * 8)] * 6)
    assert layer_scalings("mupc", 16, 64, 8, residual=False)[1] == pytest.approx(1 / 8)
    assert layer_scalings("ntp", 16, 64, 8, residual=True)[-1] == pytest.approx(1 / 8)
    assert layer_scalings("sp", 16, 64, 8, residual=True) == [1.0] * 8
    with pytest.raises(ValueError, match="param_type"):
        layer_scalings("mup", 16, 64, 8, residual=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("param_type,residual,lam", [("mupc", True, 1.0), ("sp", True, 1.0), ("ntp", False, 1.0),
                                                     ("mupc", True, 2.5)])
def test_inference_reaches_closed_form_equilibrium(param_type, residual, lam, dtype):
    tol = TOL[dtype]
    net = init_network(8, 16, 4, 3, param_type=param_type, residual=residual, output_weight=lam, seed=1, dtype=dtype)
    x, y = batch(dtype=dtype)
    theory, z_star = linear_equilibrium(net, x, y)
    res = infer(net, x, y, tol=tol["infer_tol"], max_steps=50000)
    assert res.converged
    assert res.energy == pytest.approx(theory, rel=tol["rel"])
    assert max(float((a - b).abs().max()) for a, b in zip(res.hidden, z_star)) < tol["act"]
    # The equilibrium is a true minimum: the feedforward pass (all hidden errors zero) has higher energy.
    assert float(net.energy(net.forward(x)[:-1], x, y)) > theory
    # F* is a rescaled squared error: at most the BP loss, since S ⪰ I/λ.
    assert theory <= float(net.loss(x, y)) * (1 + 1e-6)


def test_closed_form_activities_zero_the_activity_gradient():
    net = init_network(8, 24, 6, 3, param_type="ntp", residual=True, seed=3)
    x, y = batch(seed=3)
    _, z_star = linear_equilibrium(net, x, y)
    _, grads = activity_grads(net, z_star, x, y)
    assert max(float(g.abs().max()) for g in grads) < 1e-12


@pytest.mark.parametrize("activation,residual", [("linear", True), ("tanh", True), ("tanh", False), ("relu", True)])
def test_activity_and_weight_gradients_match_autograd(activation, residual):
    net = init_network(8, 16, 5, 3, activation=activation, residual=residual, output_weight=1.7, seed=2)
    x, y = batch(seed=2)
    g = torch.Generator().manual_seed(5)
    hidden = [z + 0.3 * torch.randn(z.shape, generator=g, dtype=z.dtype) for z in net.forward(x)[:-1]]
    energy, grads = activity_grads(net, hidden, x, y)
    zs = [h.clone().requires_grad_(True) for h in hidden]
    auto = torch.autograd.grad(net.energy(zs, x, y) * x.shape[0], zs)
    assert float(energy) == pytest.approx(float(net.energy(hidden, x, y)), rel=1e-12)
    for a, b in zip(grads, auto):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # Local weight gradients (away from equilibrium too) equal autograd's ∂F/∂W.
    ws = [w.clone().requires_grad_(True) for w in net.weights]
    probe = type(net)(ws, net.scales, net.residual, net.activation, net.output_weight)
    auto_w = torch.autograd.grad(probe.energy(hidden, x, y), ws)
    for a, b in zip(pc_weight_grads(net, hidden, x, y), auto_w):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_pc_gradient_at_equilibrium_is_gradient_of_theoretical_energy():
    """Envelope theorem: −∂F/∂W at z* is the gradient of F*(W); checked by central differences."""
    net = init_network(6, 12, 4, 2, param_type="mupc", residual=True, seed=4)
    x, y = batch(d_in=6, d_out=2, seed=4)
    _, z_star = linear_equilibrium(net, x, y)
    grads = pc_weight_grads(net, z_star, x, y)
    g = torch.Generator().manual_seed(9)
    direction = [torch.randn(w.shape, generator=g, dtype=w.dtype) for w in net.weights]
    h = 1e-5

    def f_star(t):
        shifted = type(net)([w + t * d for w, d in zip(net.weights, direction)], net.scales, net.residual)
        return linear_equilibrium(shifted, x, y)[0]

    numeric = (f_star(h) - f_star(-h)) / (2 * h)
    analytic = float(sum((a * d).sum() for a, d in zip(grads, direction)))
    assert numeric == pytest.approx(analytic, rel=1e-6)
    # ...and it differs from BP's gradient at this small width (so the check above is not vacuous).
    bp = float(sum((a * d).sum() for a, d in zip(bp_weight_grads(net, x, y), direction)))
    assert abs(bp - analytic) > 1e-3 * abs(analytic)


def test_mupc_energy_and_gradients_approach_bp_as_width_grows():
    x, y = batch(d_in=16, d_out=4, b=32, seed=0)
    ratios, cosines = [], []
    for width in (16, 64, 256, 1024):
        al = compare_pc_bp(init_network(16, width, 8, 4, param_type="mupc", seed=0), x, y)
        ratios.append(al.ratio)
        cosines.append(al.cosine)
    assert all(a < b for a, b in zip(ratios, ratios[1:])), ratios
    assert all(a < b for a, b in zip(cosines, cosines[1:])), cosines
    assert ratios[0] < 0.8 and ratios[-1] > 0.97
    assert cosines[-1] > 0.99
    assert all(r <= 1 + 1e-12 for r in ratios)


def test_standard_parameterisation_loses_convergence_in_depth():
    x, y = batch(d_in=16, d_out=4, b=32, seed=0)
    wide_sp = compare_pc_bp(init_network(16, 1024, 8, 4, param_type="sp", seed=0), x, y)
    assert wide_sp.ratio < 0.1  # width does not rescue SP: Σ P_ℓP_ℓᵀ grows with depth
    plain = [compare_pc_bp(init_network(16, 256, d, 4, param_type="sp", residual=False, seed=0), x, y).ratio
             for d in (2, 4, 8)]
    assert plain[0] > plain[1] > plain[2]


def test_nonlinear_inference_converges_and_aligns_with_bp_at_width():
    x, y = batch(d_in=16, d_out=4, b=16, seed=1)
    narrow = compare_pc_bp(init_network(16, 16, 4, 4, activation="tanh", seed=1), x, y, tol=1e-8)
    wide = compare_pc_bp(init_network(16, 256, 4, 4, activation="tanh", seed=1), x, y, tol=1e-8)
    assert narrow.method == wide.method == "inference"
    assert narrow.inference.converged and wide.inference.converged
    assert wide.cosine > narrow.cosine and wide.cosine > 0.99
    assert abs(wide.ratio - 1) < abs(narrow.ratio - 1)


def test_local_pc_updates_reduce_the_bp_loss():
    x, y = batch(d_in=16, d_out=4, b=16, seed=2)
    net = init_network(16, 128, 4, 4, param_type="mupc", seed=2)
    losses = [float(net.loss(x, y))]
    for _ in range(3):
        pc_update(net, x, y, lr=50.0, tol=1e-8)  # μP: the 1/N output scale wants a large lr
        losses.append(float(net.loss(x, y)))
    assert losses[-1] < 0.75 * losses[0] and all(a > b for a, b in zip(losses, losses[1:]))


# ---------------------------------------------------------------------------------- tools


@pytest.fixture
def registry():
    return ToolRegistry().extend(TOOLS)


async def test_alignment_tool_reports_ratio_and_cosine(registry):
    out = await registry.call_json("pc_bp_alignment", json.dumps({"width": 256, "depth": 8, "seed": 3}))
    assert out.ok, out.error
    rep = json.loads(out.content)
    assert rep["method"] == "closed_form" and len(rep["layer_cosines"]) == 8
    assert rep["energy_loss_ratio"] == pytest.approx(rep["energy"] / rep["loss"])
    assert 0.9 < rep["energy_loss_ratio"] <= 1 and rep["grad_cosine"] > 0.95
    sim = json.loads((await registry.call_json("pc_bp_alignment", {"width": 32, "depth": 4, "method": "inference",
                                                                   "tol": 1e-10})).content)
    theory = json.loads((await registry.call_json("pc_bp_alignment", {"width": 32, "depth": 4})).content)
    assert sim["inference_converged"] and sim["energy"] == pytest.approx(theory["energy"], rel=1e-8)


async def test_alignment_tool_takes_array_artifacts(registry, tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((12, 5)))
    np.save(tmp_path / "y.npy", rng.standard_normal(12))
    out = await registry.call_json("pc_bp_alignment", {"width": 16, "depth": 3, "inputs": str(tmp_path / "x.npy"),
                                                       "targets": str(tmp_path / "y.npy"), "dtype": "float32"})
    assert out.ok, out.error
    assert 0 < json.loads(out.content)["energy_loss_ratio"] <= 1 + 1e-5


async def test_equilibrium_check_tool(registry):
    out = await registry.call_json("pc_linear_equilibrium_check", {"width": 16, "depth": 5, "param_type": "ntp"})
    rep = json.loads(out.content)
    assert rep["converged"] and rep["relative_gap"] < 1e-9 and rep["max_activity_gap"] < 1e-7


async def test_sweep_tool_rows(registry):
    out = await registry.call_json("pc_width_sweep", {"widths": [8, 128], "depths": [4, 8]})
    rows = json.loads(out.content)["rows"]
    assert [(r["depth"], r["width"]) for r in rows] == [(4, 8), (4, 128), (8, 8), (8, 128)]
    assert rows[1]["energy_loss_ratio"] > rows[0]["energy_loss_ratio"]


@pytest.mark.parametrize("args,kind,needle", [
    ({"width": 8, "depth": 1}, "invalid_arguments", "depth"),
    ({"width": 0, "depth": 3}, "invalid_arguments", "width"),
    ({"width": 8, "depth": 3, "param_type": "mup"}, "invalid_arguments", "param_type"),
    ({"width": 8, "depth": 3, "activation": "tanh", "method": "closed_form"}, "exception", "linear networks only"),
    ({"width": 8, "depth": 3, "inputs": "/nonexistent/x.npy"}, "exception", "outside the working root"),
    ({"width": 8, "depth": 3, "inputs": [[1.0, float("nan")]]}, "invalid_arguments", "NaN"),
    ({"width": 8, "depth": 3, "inputs": [[[1.0]]]}, "exception", "2-D"),
    ({"width": 8, "depth": 3, "inputs": [[1.0, 2.0]], "targets": [[1.0], [2.0]]}, "exception", "targets must have"),
    ({"width": 8, "depth": 3, "output_weight": -1.0}, "invalid_arguments", "output_weight"),
])
async def test_tool_errors_are_clear(registry, args, kind, needle):
    out = await registry.call_json("pc_bp_alignment", json.dumps(args))
    assert not out.ok and out.error_kind == kind
    assert needle in out.error
