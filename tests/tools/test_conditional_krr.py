"""Properties of conditional kernel ridge regression (saddle-system solver, features, tools)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.kernel_ridge import KernelRidge

from closedloop.tool import ToolRegistry
from closedloop.tools.conditional_krr import (
    TOOLS,
    ConditionalKernelRidge,
    MercerFeatures,
    kernel_matrix,
    residual_gram,
    solve_conditional,
)

FEATURES = ["constant", "linear", "poly:2", "mercer:4", "rff:6"]


def data(seed: int = 0, n: int = 80, d: int = 2):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, d))
    return x, np.sin(3 * x[:, 0]) + x[:, 1] ** 2 + 0.1 * rng.standard_normal(n)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("lam", [1e-3, 1.0, 100.0])
def test_target_in_f_is_reproduced_with_zero_alpha(features, lam):
    x, _ = data()
    model = ConditionalKernelRidge(gamma=1.5, alpha=lam, features=features).fit(x, np.zeros(len(x)))
    phi = model.features_.transform(x)
    beta0 = np.random.default_rng(1).standard_normal(phi.shape[1])
    model.fit(x, phi @ beta0)  # features are refitted deterministically (same seed)
    assert np.allclose(model.coef_, beta0, atol=1e-8)
    assert np.abs(model.dual_coef_).max() < 1e-8
    x_new = np.random.default_rng(2).uniform(-1, 1, (30, 2))
    assert np.allclose(model.predict(x_new), model.features_.transform(x_new) @ beta0, atol=1e-8)


@pytest.mark.parametrize("features", FEATURES)
def test_side_condition_phi_t_alpha_is_zero(features):
    x, y = data(3)
    y2 = np.stack([y, np.cos(2 * x[:, 1])], axis=1)  # multi-output too
    model = ConditionalKernelRidge(gamma=1.0, alpha=0.1, features=features).fit(x, y2)
    phi = model.features_.transform(x)
    assert np.abs(model.dual_coef_).max() > 1e-3  # a non-trivial alpha
    assert np.abs(phi.T @ model.dual_coef_).max() < 1e-10 * np.abs(phi).max() * np.abs(model.dual_coef_).sum()
    assert model.coef_.shape == (phi.shape[1], 2) and model.predict(x).shape == (len(x), 2)


def test_saddle_system_and_residual_kernel_identity():
    """The solution satisfies the full saddle system, and alpha is plain KRR on (Pi K Pi, Pi y)."""
    x, y = data(4)
    k = kernel_matrix(x, x, "rbf", 2.0)
    phi = np.column_stack([np.ones(len(x)), x])
    lam = 0.05
    alpha, beta = solve_conditional(k, phi, y, lam)
    n, p = phi.shape
    saddle = np.block([[k + lam * np.eye(n), phi], [phi.T, np.zeros((p, p))]])
    assert np.allclose(saddle @ np.concatenate([alpha, beta]), np.concatenate([y, np.zeros(p)]), atol=1e-9)
    proj = np.eye(n) - phi @ np.linalg.pinv(phi)
    assert np.allclose(np.linalg.solve(residual_gram(k, phi) + lam * np.eye(n), proj @ y), alpha, atol=1e-9)


def test_mercer_residual_kernel_is_hard_threshold_of_the_gram_spectrum():
    x, _ = data(5, n=60)
    model = ConditionalKernelRidge(gamma=1.0, features="mercer:5").fit(x, np.zeros(len(x)))
    k = kernel_matrix(x, x, "rbf", 1.0)
    mu, u = np.linalg.eigh(k)
    hard = (u[:, :-5] * mu[:-5]) @ u[:, :-5].T  # drop the top 5 eigenpairs
    assert np.allclose(model.residual_kernel(x, x), hard, atol=1e-9)
    assert np.allclose(residual_gram(k, model.features_.transform(x)), hard, atol=1e-9)


@pytest.mark.parametrize("kernel,gamma", [("rbf", None), ("rbf", 3.0), ("laplacian", 0.7), ("polynomial", 0.5)])
def test_empty_f_equals_sklearn_kernel_ridge(kernel, gamma):
    x, y = data(6)
    y2 = np.stack([y, x[:, 0] * x[:, 1]], axis=1)
    x_new = np.random.default_rng(7).uniform(-1.5, 1.5, (50, 2))
    ours = ConditionalKernelRidge(kernel=kernel, gamma=gamma, alpha=0.3, features=None).fit(x, y2)
    ref = KernelRidge(kernel=kernel, gamma=gamma, alpha=0.3).fit(x, y2)
    assert np.allclose(ours.predict(x_new), ref.predict(x_new), atol=1e-9)
    assert np.allclose(ours.dual_coef_, ref.dual_coef_, atol=1e-8)


@pytest.mark.parametrize("features", ["linear", "poly:2", "rff:6"])
def test_infinite_ridge_gives_ols_on_f(features):
    x, y = data(8)
    x_new = np.random.default_rng(9).uniform(-1, 1, (40, 2))
    model = ConditionalKernelRidge(gamma=1.0, alpha=1e12, features=features).fit(x, y)
    phi = model.features_.transform(x)
    ols = np.linalg.lstsq(phi, y, rcond=None)[0]
    assert np.allclose(model.coef_, ols, atol=1e-6)
    assert np.allclose(model.predict(x_new), model.features_.transform(x_new) @ ols, atol=1e-6)
    # at moderate ridge the kernel part is active, so the limit is not trivially reached
    assert not np.allclose(ConditionalKernelRidge(gamma=1.0, alpha=1e-2, features=features).fit(x, y).coef_, ols, atol=1e-3)


def _tuned_test_mse(x, y, xv, yv, xt, yt, features, gamma, lams=(1e-3, 1e-2, 1e-1, 1.0, 10.0)):
    def mse(lam, a, b):
        return float(np.mean((ConditionalKernelRidge(gamma=gamma, alpha=lam, features=features).fit(x, y).predict(a) - b) ** 2))

    return mse(min(lams, key=lambda lam: mse(lam, xv, yv)), xt, yt)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beats_plain_krr_when_linear_f_component_dominates(seed):
    """Paper's claim, explicit F: a strong affine trend plus a small wiggle; ridge tuned on validation for both."""
    f = lambda x: 3 + 5 * x[:, 0] - 4 * x[:, 1] + 0.3 * np.sin(3 * x[:, 0])  # noqa: E731
    rng = np.random.default_rng(seed)
    x, xv, xt = rng.uniform(-1, 1, (100, 2)), rng.uniform(-1, 1, (200, 2)), rng.uniform(-1, 1, (400, 2))
    y, yv = f(x) + 0.3 * rng.standard_normal(100), f(xv) + 0.3 * rng.standard_normal(200)
    plain = _tuned_test_mse(x, y, xv, yv, xt, f(xt), None, 1.0)
    cond = _tuned_test_mse(x, y, xv, yv, xt, f(xt), "linear", 1.0)
    assert cond < 0.75 * plain


def test_beats_plain_krr_when_top_mercer_component_dominates():
    """Paper's claim, F = top-3 Nystrom eigenfunctions; target mostly in the top population eigenfunctions."""
    reference = MercerFeatures(6).fit(np.linspace(-1, 1, 400)[:, None], ConditionalKernelRidge(gamma=4.0))
    coef = np.array([3.0, 2.0, -2.0, 0.3, 0.3, 0.0])
    f = lambda x: reference.transform(x) @ coef  # noqa: E731
    fixed, tuned = [], []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        x, xv, xt = rng.uniform(-1, 1, (100, 1)), rng.uniform(-1, 1, (200, 1)), rng.uniform(-1, 1, (400, 1))
        y, yv = f(x) + 0.5 * rng.standard_normal(100), f(xv) + 0.5 * rng.standard_normal(200)
        fixed_ridge = [np.mean((ConditionalKernelRidge(gamma=4.0, alpha=10.0, features=feats).fit(x, y).predict(xt) - f(xt)) ** 2)
                       for feats in ("mercer:3", None)]
        fixed.append(fixed_ridge[0] / fixed_ridge[1])
        tuned_ridge = [_tuned_test_mse(x, y, xv, yv, xt, f(xt), feats, 4.0) for feats in ("mercer:3", None)]
        tuned.append(tuned_ridge[0] / tuned_ridge[1])
    assert max(fixed) < 0.5  # same strong ridge: KRR shrinks the dominant part, conditional KRR does not
    assert np.mean(tuned) < 1.0 and max(tuned) < 1.05


def test_conditionally_pd_kernels_need_their_polynomial_class():
    x, y = data(10, n=50)
    tps = ConditionalKernelRidge(kernel="tps", alpha=0.0, features="linear").fit(x, y)
    assert np.allclose(tps.predict(x), y, atol=1e-8)  # interpolation is well posed for a CPD kernel of order 2
    affine = 1 + 2 * x[:, 0] - x[:, 1]
    assert np.abs(ConditionalKernelRidge(kernel="tps", alpha=0.0, features="linear").fit(x, affine).dual_coef_).max() < 1e-8
    with pytest.raises(ValueError, match="not positive definite"):
        ConditionalKernelRidge(kernel="tps", alpha=0.0, features=None).fit(x, y)
    dist = ConditionalKernelRidge(kernel="distance", alpha=1e-3, features="constant").fit(x, y)
    assert np.mean((dist.predict(x) - y) ** 2) < 1e-3


def test_estimator_rejects_bad_input():
    x, y = data()
    with pytest.raises(ValueError, match="shape"):
        ConditionalKernelRidge().fit(x, y[:-1])
    with pytest.raises(ValueError, match="NaN"):
        ConditionalKernelRidge().fit(x, np.where(np.arange(len(y)) == 3, np.nan, y))
    with pytest.raises(ValueError, match="unknown features"):
        ConditionalKernelRidge(features="splines").fit(x, y)
    with pytest.raises(ValueError, match="random Fourier"):
        ConditionalKernelRidge(kernel="polynomial", features="rff:3").fit(x, y)
    with pytest.raises(ValueError, match="fitted on 2"):
        ConditionalKernelRidge().fit(x, y).predict(np.ones((3, 3)))


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path / "artifacts"))
    return ToolRegistry().extend(TOOLS)


async def test_fit_tool_reports_errors_and_beats_krr(registry, tmp_path):
    rng = np.random.default_rng(0)
    f = lambda x: 2 + 6 * x[:, 0] - 3 * x[:, 1] + 0.2 * np.cos(4 * x[:, 1])  # noqa: E731
    x, xt = rng.uniform(-1, 1, (120, 2)), rng.uniform(-1, 1, (200, 2))
    path = tmp_path / "data.npz"
    np.savez(path, X=x, y=f(x) + 0.1 * rng.standard_normal(120), X_test=xt, y_test=f(xt))
    res = await registry.call_json("conditional_krr_fit", json.dumps({"dataset": str(path), "features": "linear",
                                                                      "gamma": 1.0, "alpha": 1.0}))
    assert res.ok, res.error
    rep = json.loads(res.content)
    assert rep["n_train"] == 120 and rep["n_test"] == 200 and rep["n_features"] == 3
    assert rep["test_mse"] < rep["plain_krr_test_mse"] and rep["improvement_over_krr"] > 1.5
    assert np.allclose(rep["coef"], [2, 6, -3], atol=0.3) and rep["side_condition"] < 1e-10
    assert len(np.load(rep["test_predictions"]["path"])) == 200  # 200 predictions go to an artifact
    spec = json.loads((await registry.call_json("residual_kernel_spectrum", json.dumps(
        {"dataset": str(path), "features": "mercer:3", "gamma": 1.0, "top": 5}))).content)
    assert np.allclose(spec["residual_top_eigenvalues"][:2], spec["kernel_top_eigenvalues"][3:5], rtol=1e-8)
    # errors come back as tool errors with a clear message
    missing = await registry.call_json("conditional_krr_fit", json.dumps({"dataset": str(tmp_path / "none.npz")}))
    assert not missing.ok and "not found" in missing.error
    np.savez(tmp_path / "bad.npz", X=x, y=np.full(120, np.inf))
    bad = await registry.call_json("conditional_krr_fit", json.dumps({"dataset": str(tmp_path / "bad.npz")}))
    assert not bad.ok and "NaN or infinite" in bad.error
    np.savez(tmp_path / "short.npz", X=x, y=np.zeros(7))
    short = await registry.call_json("conditional_krr_fit", json.dumps({"dataset": str(tmp_path / "short.npz")}))
    assert not short.ok and "(n,)" in short.error
    np.savez(tmp_path / "half.npz", X=x, y=np.zeros(120), X_test=xt)
    half = await registry.call_json("conditional_krr_fit", json.dumps({"dataset": str(tmp_path / "half.npz")}))
    assert not half.ok and "partner" in half.error
    kernel = await registry.call_json("conditional_krr_fit", json.dumps({"dataset": str(path), "kernel": "cosine"}))
    assert not kernel.ok and kernel.error_kind == "invalid_arguments"
