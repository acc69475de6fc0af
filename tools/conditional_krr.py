"""Conditional kernel ridge regression (Takhanov & Assylbekov, ICML 2026: "Conditional kernel
ridge regression with conditionally positive definite kernels"; see shared/research/papers.md
section 15, estimator reconstructed in the standard form).

With an unpenalised class F spanned by features Phi (n, k) and a kernel K (PD, or conditionally
PD with respect to F) the estimator f(x) = phi(x)^T beta + k(x, X) alpha minimises

    ||y - Phi beta - K alpha||^2 + lam alpha^T K alpha,

whose solution is the saddle system  [[K + lam I, Phi], [Phi^T, 0]] [alpha; beta] = [y; 0].
(lam is scikit-learn's ``alpha``; the paper's (1/N)-normalised lam_paper = lam / N.)

Properties used and tested: Phi^T alpha = 0; y = Phi beta0 gives beta = beta0, alpha = 0; F empty
is plain KRR; lam -> oo gives OLS on F; and with Pi = I - Phi Phi^+, alpha = (Pi K Pi + lam I)^-1
Pi y, i.e. OLS on F followed by KRR on the residual with the residual Gram matrix Pi K Pi.
For F = top-k Mercer eigenfunctions (Nystrom on the data) that residual kernel is the hard
threshold sum_{j>k} lam_j e_j e_j^T; for F = k random Fourier features it is K - Z Z^T (soft).

Solver: for PD K + lam I = L L^T, beta = argmin ||L^-1 (Phi beta - y)|| (weighted least squares,
QR-based, rank-deficient Phi allowed) and alpha = (K + lam I)^-1 (y - Phi beta): one Cholesky. For
conditionally PD kernels (thin-plate spline, -distance), where K + lam I is indefinite, the
null-space method: Phi = Q R (pivoted, rank r), Z = Q[:, r:], alpha = Z g with
Z^T (K + lam I) Z g = Z^T y (positive definite there), then beta = Phi^+ (y - (K + lam I) alpha).
Shapes: X (n, d), y (n,) or (n, t); alpha like y; beta (k,) or (k, t). Cost O(n^3).
"""

from __future__ import annotations

import abc

from dataclasses import dataclass
from functools import partial
from itertools import combinations_with_replacement
from typing import Annotated, Any, Callable, Literal

import numpy as np
import scipy.linalg as sla
from pydantic import BaseModel, Field

from closedloop.artifacts import ArrayRef, ArtifactError, array_output, load_array
from closedloop.tool import Tool, tool

KernelName = Literal["rbf", "laplacian", "linear", "polynomial", "tps", "distance"]
CPD_ORDER = {"tps": 2, "distance": 1}  # conditionally PD w.r.t. polynomials of degree < order

# ---------------------------------------------------------------------------------- kernels


def kernel_matrix(a: np.ndarray, b: np.ndarray, kernel: str = "rbf", gamma: float | None = None,
                  degree: int = 3, coef0: float = 1.0) -> np.ndarray:
    """Gram matrix k(a_i, b_j); gamma=None means 1 / n_features, as in scikit-learn."""
    g = 1.0 / a.shape[1] if gamma is None else gamma
    if kernel in ("rbf", "tps", "distance"):
        sq = np.maximum((a**2).sum(1)[:, None] + (b**2).sum(1)[None, :] - 2 * a @ b.T, 0.0)
        if kernel == "rbf":
            return np.exp(-g * sq)
        if kernel == "distance":
            return -np.sqrt(sq)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(sq > 0, 0.5 * sq * np.log(np.where(sq > 0, sq, 1.0)), 0.0)  # r^2 log r
    if kernel == "laplacian":
        return np.exp(-g * np.abs(a[:, None, :] - b[None, :, :]).sum(-1))
    if kernel == "linear":
        return a @ b.T
    if kernel == "polynomial":
        return (g * (a @ b.T) + coef0) ** degree
    raise ValueError(f"unknown kernel {kernel!r}; use one of rbf, laplacian, linear, polynomial, tps, distance")


# ---------------------------------------------------------------------------------- features


class Features(abc.ABC):
    """The unpenalised class F as a feature map; ``fit`` sees the training inputs and kernel."""

    def fit(self, x: np.ndarray, model: "ConditionalKernelRidge") -> "Features":
        return self

    @abc.abstractmethod
    def transform(self, x: np.ndarray) -> np.ndarray:
        """Φ(x): one row of feature values per input."""

    def residual_kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        raise ValueError(f"{type(self).__name__} defines no population residual kernel; use residual_gram")


@dataclass
class NoFeatures(Features):
    def transform(self, x: np.ndarray) -> np.ndarray:
        return np.zeros((len(x), 0))


@dataclass
class PolynomialFeatures(Features):
    """All monomials of degree <= ``degree`` (degree 0: constants; 1: affine functions)."""

    degree: int = 1

    def transform(self, x: np.ndarray) -> np.ndarray:
        cols = [np.ones(len(x))]
        for d in range(1, self.degree + 1):
            cols += [np.prod(x[:, list(c)], axis=1) for c in combinations_with_replacement(range(x.shape[1]), d)]
        return np.stack(cols, axis=1)


@dataclass
class CallableFeatures(Features):
    fn: Callable[[np.ndarray], np.ndarray]

    def transform(self, x: np.ndarray) -> np.ndarray:
        out = np.asarray(self.fn(x), dtype=float)
        if out.ndim != 2 or out.shape[0] != len(x):
            raise ValueError(f"feature function must return shape ({len(x)}, k), got {out.shape}")
        return out


@dataclass
class MercerFeatures(Features):
    """Top-k empirical Mercer eigenfunctions by Nystrom on (a subset of) the training inputs:
    e_j(x) = sqrt(m) k(x, L) u_j / mu_j, so that (1/m) sum_i e_j(l_i)^2 = 1 on the landmarks."""

    k: int
    n_landmarks: int | None = None
    seed: int = 0

    def fit(self, x: np.ndarray, model: "ConditionalKernelRidge") -> "MercerFeatures":
        if model.kernel in CPD_ORDER:
            raise ValueError("Mercer features need a positive definite kernel")
        m = len(x) if self.n_landmarks is None else min(self.n_landmarks, len(x))
        idx = np.sort(np.random.default_rng(self.seed).choice(len(x), m, replace=False)) if m < len(x) else np.arange(m)
        if not 1 <= self.k <= m:
            raise ValueError(f"mercer:k needs 1 <= k <= {m} landmarks, got k={self.k}")
        self.landmarks_ = x[idx]
        self._kern = model._kernel
        mu, u = np.linalg.eigh(self._kern(self.landmarks_, self.landmarks_))
        mu, u = mu[::-1][: self.k], u[:, ::-1][:, : self.k]
        if mu[-1] <= 1e-12 * mu[0]:
            raise ValueError(f"the kernel has fewer than k={self.k} nonzero eigenvalues on the landmarks")
        self.eigenvalues_ = mu / m  # operator eigenvalues
        self._proj = np.sqrt(m) * u / mu
        return self

    def transform(self, x: np.ndarray) -> np.ndarray:
        return self._kern(x, self.landmarks_) @ self._proj

    def residual_kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Hard thresholding: k(a, b) - sum_{j<=k} lam_j e_j(a) e_j(b)."""
        return self._kern(a, b) - (self.transform(a) * self.eigenvalues_) @ self.transform(b).T


@dataclass
class RandomFourierFeatures(Features):
    """k random Fourier features of a shift-invariant kernel: z(x) = sqrt(2/k) cos(x W + c)."""

    k: int
    seed: int = 0

    def fit(self, x: np.ndarray, model: "ConditionalKernelRidge") -> "RandomFourierFeatures":
        if model.kernel not in ("rbf", "laplacian"):
            raise ValueError(f"random Fourier features need the rbf or laplacian kernel, not {model.kernel!r}")
        if self.k < 1:
            raise ValueError("rff:k needs k >= 1")
        g = 1.0 / x.shape[1] if model.gamma is None else model.gamma
        rng = np.random.default_rng(self.seed)
        if model.kernel == "rbf":
            self.w_ = rng.normal(scale=np.sqrt(2 * g), size=(x.shape[1], self.k))
        else:
            self.w_ = g * rng.standard_cauchy(size=(x.shape[1], self.k))
        self.c_ = rng.uniform(0, 2 * np.pi, self.k)
        self._kern = model._kernel
        return self

    def transform(self, x: np.ndarray) -> np.ndarray:
        return np.sqrt(2.0 / self.k) * np.cos(x @ self.w_ + self.c_)

    def residual_kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Soft thresholding: k(a, b) - z(a) z(b)^T."""
        return self._kern(a, b) - self.transform(a) @ self.transform(b).T


def make_features(spec: Any, seed: int = 0, n_landmarks: int | None = None) -> Features:
    """None/'none', 'constant', 'linear', 'poly:d', 'mercer:k', 'rff:k', a callable or a Features."""
    if isinstance(spec, Features):
        return spec
    if spec is None or spec == "none":
        return NoFeatures()
    if callable(spec):
        return CallableFeatures(spec)
    if spec == "constant":
        return PolynomialFeatures(0)
    if spec == "linear":
        return PolynomialFeatures(1)
    name, _, arg = str(spec).partition(":")
    try:
        n = int(arg) if len(arg) <= 9 else -1
    except ValueError:
        n = -1
    limit = _FEATURE_LIMITS.get(name)
    if limit is not None and n > limit:  # features are allocated per sample: bound them before any work
        raise ValueError(f"features {spec!r}: {name}:k takes k <= {limit}")
    if name == "poly" and n >= 0:
        return PolynomialFeatures(n)
    if name == "mercer" and n >= 1:
        return MercerFeatures(n, n_landmarks, seed)
    if name == "rff" and n >= 1:
        return RandomFourierFeatures(n, seed)
    raise ValueError(f"unknown features {spec!r}; use none, constant, linear, poly:d, mercer:k or rff:k")


# ---------------------------------------------------------------------------------- solver


def solve_conditional(k: np.ndarray, phi: np.ndarray, y: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta) solving [[K + lam I, Phi], [Phi^T, 0]] [alpha; beta] = [y; 0] (see the module doc)."""
    a = k.copy()
    a.flat[:: len(k) + 1] += lam
    no_beta = np.zeros((0,) + y.shape[1:])
    if phi.shape[1] == 0:  # plain KRR
        return _cholesky_solve(a, y, overwrite=True), no_beta
    try:  # PD kernel: Schur complement, beta = weighted least squares with weight (K + lam I)^-1
        chol = sla.cholesky(a, lower=True)
    except np.linalg.LinAlgError:
        chol = None
    if chol is not None:
        w = sla.solve_triangular(chol, phi, lower=True)
        zy = sla.solve_triangular(chol, y, lower=True)
        beta = np.linalg.lstsq(w, zy, rcond=None)[0]
        return sla.solve_triangular(chol, zy - w @ beta, lower=True, trans="T"), beta
    # CPD kernel: K + lam I is indefinite, Z^T (K + lam I) Z is not
    q, r, _ = sla.qr(phi, pivoting=True)
    diag = np.abs(np.diag(r))
    rank = int((diag > diag[0] * max(phi.shape) * np.finfo(float).eps).sum()) if diag.size and diag[0] > 0 else 0
    z = q[:, rank:]
    alpha = z @ _cholesky_solve(z.T @ a @ z, z.T @ y) if z.shape[1] else np.zeros_like(y)
    return alpha, np.linalg.lstsq(phi, y - a @ alpha, rcond=None)[0]


def _cholesky_solve(m: np.ndarray, b: np.ndarray, overwrite: bool = False) -> np.ndarray:
    try:
        return sla.cho_solve(sla.cho_factor(m, lower=True, overwrite_a=overwrite), b)
    except np.linalg.LinAlgError:
        raise ValueError("K + lam I is not positive definite on the complement of F: the kernel is not "
                         "(conditionally) positive definite w.r.t. these features, or lam is 0 with a "
                         "singular kernel; raise alpha or enlarge F (tps needs 'linear', distance 'constant')") from None


def residual_gram(k: np.ndarray, phi: np.ndarray) -> np.ndarray:
    """Pi K Pi with Pi = I - Phi Phi^+: conditional KRR's alpha is plain KRR's with this Gram on Pi y."""
    if phi.shape[1] == 0:
        return k.copy()
    q = sla.orth(phi)
    pk = k - q @ (q.T @ k)
    return pk - (pk @ q) @ q.T


class ConditionalKernelRidge:
    """scikit-learn-style conditional KRR: ``fit(X, y)``, ``predict(X)``; ``alpha`` is the ridge lam."""

    def __init__(self, kernel: str = "rbf", gamma: float | None = None, alpha: float = 1.0, degree: int = 3,
                 coef0: float = 1.0, features: Any = None, n_landmarks: int | None = None,
                 random_state: int = 0) -> None:
        self.kernel, self.gamma, self.alpha, self.degree, self.coef0 = kernel, gamma, alpha, degree, coef0
        self.features, self.n_landmarks, self.random_state = features, n_landmarks, random_state

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("kernel", "gamma", "alpha", "degree", "coef0", "features",
                                             "n_landmarks", "random_state")}

    def set_params(self, **params: Any) -> "ConditionalKernelRidge":
        for k, v in params.items():
            if k not in self.get_params():
                raise ValueError(f"unknown parameter {k!r}")
            setattr(self, k, v)
        return self

    def _kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return kernel_matrix(a, b, self.kernel, self.gamma, self.degree, self.coef0)

    def fit(self, x: Any, y: Any) -> "ConditionalKernelRidge":
        x, y = _check_xy(x, y)
        if not np.isfinite(self.alpha) or self.alpha < 0:
            raise ValueError(f"alpha (the ridge lam) must be finite and >= 0, got {self.alpha}")
        kernel_matrix(x[:1], x[:1], self.kernel)  # validates the kernel name early
        self.features_ = make_features(self.features, self.random_state, self.n_landmarks).fit(x, self)
        phi = self.features_.transform(x)
        self.X_fit_, self.n_features_in_ = x, x.shape[1]
        self.dual_coef_, self.coef_ = solve_conditional(self._kernel(x, x), phi, y, float(self.alpha))
        self.side_condition_ = float(np.abs(phi.T @ self.dual_coef_).max(initial=0.0))
        return self

    def decompose(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """(F part phi(x)^T beta, kernel part k(x, X) alpha) of the prediction."""
        if not hasattr(self, "dual_coef_"):
            raise ValueError("call fit before predict")
        x = _check_x(x, self.n_features_in_)
        phi = self.features_.transform(x)
        return phi @ self.coef_, self._kernel(x, self.X_fit_) @ self.dual_coef_

    def predict(self, x: Any) -> np.ndarray:
        f_part, k_part = self.decompose(x)
        return f_part + k_part

    def residual_kernel(self, a: Any, b: Any) -> np.ndarray:
        """Population residual kernel of Mercer (hard) or random-feature (soft) F."""
        return self.features_.residual_kernel(_check_x(a, self.n_features_in_), _check_x(b, self.n_features_in_))


def _check_x(x: Any, d: int | None = None) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    if x.ndim == 1 and d is not None and d == 1:
        x = x[:, None]
    if x.ndim != 2:
        raise ValueError(f"X must have shape (n, d), got {x.shape}")
    if d is not None and x.shape[1] != d:
        raise ValueError(f"X has {x.shape[1]} features but the model was fitted on {d}")
    if not np.all(np.isfinite(x)):
        raise ValueError("X contains NaN or infinite values")
    return x


def _check_xy(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    x = _check_x(x)
    y = np.asarray(y, dtype=float)
    if y.ndim not in (1, 2) or len(y) != len(x):
        raise ValueError(f"y must have shape ({len(x)},) or ({len(x)}, t), got {y.shape}")
    if not np.all(np.isfinite(y)):
        raise ValueError("y contains NaN or infinite values")
    if len(x) < 1:
        raise ValueError("need at least one sample")
    return x, y


# ---------------------------------------------------------------------------------- tools

MAX_SAMPLES = 10_000
# The largest k of each feature family: a degree-d polynomial has O(dim^d) columns, Mercer and
# random Fourier features one column per k.
_FEATURE_LIMITS = {"poly": 8, "mercer": MAX_SAMPLES, "rff": 100_000}
Gamma = Annotated[float, Field(gt=0.0)]


def load_dataset(path: str, x_key: str, y_key: str, test: bool) -> tuple[np.ndarray, np.ndarray] | None:
    if not path.endswith(".npz"):
        raise ArtifactError(f"dataset must be an .npz file holding {x_key} and {y_key}, got {path!r}")
    if test:
        from closedloop.artifacts import resolve_array_path

        resolved = resolve_array_path(path, "dataset")  # inside the working root, or refused
        if not resolved.is_file():
            raise ArtifactError(f"dataset: file not found: {path}")
        with np.load(resolved, allow_pickle=False) as z:
            present = [k for k in (x_key, y_key) if k in z]
        if not present:
            return None
        if len(present) == 1:
            raise ArtifactError(f"dataset holds {present[0]} but not its partner ({x_key}, {y_key})")
    x, y = load_array(path, key=x_key, name=x_key), load_array(path, key=y_key, name=y_key)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or y.ndim not in (1, 2) or len(y) != len(x):
        raise ArtifactError(f"{x_key} must be (n, d) and {y_key} (n,) or (n, t); got {list(x.shape)} and {list(y.shape)}")
    return x.astype(float), y.astype(float)


class FitReport(BaseModel):
    n_train: int
    n_test: int
    n_features: int
    train_mse: float
    test_mse: float | None
    plain_krr_train_mse: float | None
    plain_krr_test_mse: float | None
    improvement_over_krr: float | None  # plain test MSE / conditional test MSE
    coef: list[Any] | ArrayRef
    dual_coef_norm: float
    side_condition: float  # max |Phi^T alpha|, zero up to rounding
    f_share_of_prediction: float  # ||F part||^2 / (||F part||^2 + ||kernel part||^2) on the training inputs
    test_predictions: list[Any] | ArrayRef | None


@tool(timeout_s=300, isolation="process")
def conditional_krr_fit(dataset: str, features: str = "linear", kernel: KernelName = "rbf", gamma: Gamma | None = None,
                        alpha: Annotated[float, Field(gt=0.0)] = 1.0, degree: Annotated[int, Field(ge=1, le=20)] = 3,
                        coef0: float = 1.0, n_landmarks: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None,
                        seed: int = 0, compare_plain: bool = True, x_key: str = "X", y_key: str = "y",
                        x_test_key: str = "X_test", y_test_key: str = "y_test") -> FitReport:
    """Fit conditional kernel ridge regression (unpenalised class F + kernel ridge on the rest) on an .npz dataset
    and evaluate it, optionally against plain KRR with the same kernel and ridge.

    Args:
        dataset: .npz with X (n, d) and y (n,) or (n, t), optionally X_test and y_test.
        features: the unpenalised class F: none, constant, linear, poly:d, mercer:k (top-k Nystrom
            eigenfunctions) or rff:k (random Fourier features).
        kernel: rbf, laplacian, linear, polynomial, or the conditionally PD tps (needs linear F)
            and distance (needs constant F).
        gamma: kernel scale (default 1 / n_features).
        alpha: ridge strength lam in ||y - Phi beta - K a||^2 + lam a^T K a.
        degree: polynomial kernel degree.
        coef0: polynomial kernel offset.
        n_landmarks: Nystrom landmarks for mercer:k (default: all training points).
        seed: seed for landmarks and random features.
        compare_plain: also fit plain KRR (F empty) and report its errors.
    """
    train = load_dataset(dataset, x_key, y_key, test=False)
    if train is None:  # unreachable: a missing training key raises in load_dataset
        raise ArtifactError(f"dataset lacks {x_key}/{y_key}")
    x, y = train
    if len(x) > MAX_SAMPLES:
        raise ValueError(f"{len(x)} training samples; the exact solver is O(n^3), limit {MAX_SAMPLES}")
    test = load_dataset(dataset, x_test_key, y_test_key, test=True)
    make = partial(ConditionalKernelRidge, kernel=kernel, gamma=gamma, alpha=alpha, degree=degree, coef0=coef0,
                   n_landmarks=n_landmarks, random_state=seed)
    model = make(features=features).fit(x, y)
    f_part, k_part = model.decompose(x)
    mse = lambda m, a, b: float(np.mean((m.predict(a) - b) ** 2))  # noqa: E731
    plain = make(features=None).fit(x, y) if compare_plain and kernel not in CPD_ORDER else None
    test_mse = mse(model, *test) if test else None
    plain_test = mse(plain, *test) if plain is not None and test else None
    fs, ks = float(np.sum(f_part**2)), float(np.sum(k_part**2))
    return FitReport(
        n_train=len(x), n_test=len(test[0]) if test else 0, n_features=int(model.coef_.shape[0]),
        train_mse=mse(model, x, y), test_mse=test_mse,
        plain_krr_train_mse=mse(plain, x, y) if plain is not None else None, plain_krr_test_mse=plain_test,
        improvement_over_krr=plain_test / test_mse if plain_test is not None and test_mse else None,
        coef=array_output(model.coef_, prefix="ckrr-coef"), dual_coef_norm=float(np.linalg.norm(model.dual_coef_)),
        side_condition=model.side_condition_, f_share_of_prediction=fs / (fs + ks) if fs + ks > 0 else 0.0,
        test_predictions=array_output(model.predict(test[0]), prefix="ckrr-pred") if test else None)


class ResidualSpectrumReport(BaseModel):
    n: int
    n_features: int
    kernel_top_eigenvalues: list[float]
    residual_top_eigenvalues: list[float]
    trace_fraction_removed: float  # 1 - tr(Pi K Pi) / tr(K)


@tool(isolation="process")
def residual_kernel_spectrum(dataset: str, features: str = "mercer:5", kernel: KernelName = "rbf",
                             gamma: Gamma | None = None, top: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 10,
                             seed: int = 0, x_key: str = "X") -> ResidualSpectrumReport:
    """Spectrum of the Gram matrix K and of the residual Gram Pi K Pi left after removing F: how much of the kernel
    the unpenalised class takes over (use it to choose k in mercer:k or rff:k).

    Args:
        dataset: .npz with X (n, d) (y not needed).
        features: none, constant, linear, poly:d, mercer:k or rff:k.
        kernel: rbf, laplacian, linear or polynomial.
        gamma: kernel scale (default 1 / n_features).
        top: how many leading eigenvalues to report (1..100).
        seed: seed for random features.
    """
    if not 1 <= top <= 100:
        raise ValueError("top must be in [1, 100]")
    x = load_array(dataset, key=x_key, name=x_key)
    x = _check_x(x[:, None] if x.ndim == 1 else x)
    if len(x) > MAX_SAMPLES:
        raise ValueError(f"{len(x)} samples exceed the limit {MAX_SAMPLES}")
    model = ConditionalKernelRidge(kernel=kernel, gamma=gamma, features=features, random_state=seed)
    feats = make_features(features, seed).fit(x, model)
    k = model._kernel(x, x)
    res = residual_gram(k, feats.transform(x))
    ev = lambda m: np.sort(np.linalg.eigvalsh(m))[::-1][:top].tolist()  # noqa: E731
    return ResidualSpectrumReport(n=len(x), n_features=feats.transform(x[:1]).shape[1], kernel_top_eigenvalues=ev(k),
                                  residual_top_eigenvalues=ev(res),
                                  trace_fraction_removed=float(1 - np.trace(res) / np.trace(k)) if np.trace(k) else 0.0)


TOOLS: list[Tool] = [conditional_krr_fit, residual_kernel_spectrum]
