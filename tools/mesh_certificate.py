"""Compatibility certificate for learned cochain operator pairs (ICML 2026, poster 65687; method
reconstructed from the abstract, see shared/research/papers.md section 8).

Learned discrete exterior derivatives D0 (vertices -> edges, shape (E, V)) and D1 (edges ->
faces, shape (F, E)) should satisfy the chain condition D1 D0 = 0. The certificate is

    delta = ||D1 D0||_F,      delta_rel = ||D1 D0||_F / (||D1|| ||D0||)

(Frobenius norms by default: then 0 <= delta_rel <= 1 and it costs one sparse product; spectral
norms on request). Frobenius-nearest compatible operators, in closed form:

* fix D0, project D1:  D1' = D1 (I - P0),  P0 = D0 D0^+  (orthogonal projector onto im D0);
* fix D1, project D0:  D0' = (I - P1) D0,  P1 = D1^+ D1  (projector onto im D1^T);
* joint (dense only): any compatible pair has im X0 in a subspace S with X1 S = 0, so the joint
  distance is min_S ||(I-P_S)D0||^2 + ||D1 P_S||^2 = ||D0||^2 + min_S tr(P_S M) with
  M = D1^T D1 - D0 D0^T. The minimiser is S = negative eigenspace of M: the exact joint optimum,
  never farther than either one-sided projection. Alternating the one-sided projections is
  pointless: after one of them the pair is compatible and the other one is the identity.

Hodge Laplacians L0 = D0^T D0 (V, V) and L1 = D0 D0^T + D1^T D1 (E, E): for exact incidence
operators dim ker L1 is the first Betti number; condition numbers are taken on the nonzero
spectrum. Sparse inputs stay sparse: the projected operator is in general dense (it involves the
Green's function of L0), so it is returned as a matrix-free ``ProjectedOperator`` whose projector
solves the least-squares problem with one sparse factorisation of A^T A (+ a tiny shift, removed
by iterative refinement) or with LSQR; certificates of matrix-free operators use Hutchinson probes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import scipy.linalg as sla
import scipy.sparse as sp
import scipy.sparse.csgraph as csgraph
import scipy.sparse.linalg as spla
from pydantic import BaseModel, Field

from closedloop.artifacts import ArrayInput, ArrayRef, ArtifactError, load_array, save_array, write_artifact
from closedloop.tool import Tool, tool

Operator = Any  # np.ndarray | scipy.sparse matrix | scipy.sparse.linalg.LinearOperator

# ---------------------------------------------------------------------------------- meshes


def incidence_matrices(faces: Any, n_vertices: int | None = None) -> tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]:
    """Exact signed incidence (D0, D1, edges) of a triangle mesh.

    Edges are oriented from the lower to the higher vertex index, so the orientation is
    consistent whatever the face order; D1[f, e] = +1 when face f traverses e in that direction.
    """
    faces = np.asarray(faces)
    if faces.ndim != 2 or faces.shape[1] != 3:
        raise ValueError(f"faces must have shape (F, 3), got {faces.shape}")
    if faces.size and (faces.dtype.kind == "f" and not np.all(faces == np.round(faces))):
        raise ValueError("faces must hold integer vertex indices")
    faces = faces.astype(np.int64)
    nv = int(faces.max()) + 1 if n_vertices is None and faces.size else int(n_vertices or 0)
    if faces.size and (faces.min() < 0 or faces.max() >= nv):
        raise ValueError(f"face indices must lie in [0, {nv}); got range [{faces.min()}, {faces.max()}]")
    if np.any((faces[:, 0] == faces[:, 1]) | (faces[:, 1] == faces[:, 2]) | (faces[:, 0] == faces[:, 2])):
        raise ValueError("degenerate face: a face repeats a vertex")
    a = faces.ravel()
    b = np.roll(faces, -1, axis=1).ravel()  # (a,b),(b,c),(c,a) per face
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    keys, inverse = np.unique(lo * nv + hi, return_inverse=True)
    edges = np.stack([keys // nv, keys % nv], axis=1)
    ne, nf = len(edges), len(faces)
    rows = np.repeat(np.arange(ne), 2)
    d0 = sp.csr_matrix((np.tile([-1.0, 1.0], ne), (rows, edges.ravel())), shape=(ne, nv))
    sign = np.where(a < b, 1.0, -1.0)
    d1 = sp.csr_matrix((sign, (np.repeat(np.arange(nf), 3), inverse.ravel())), shape=(nf, ne))
    return d0, d1, edges


def grid_mesh(n: int, holes: Any = ()) -> tuple[np.ndarray, np.ndarray]:
    """A triangulated unit square of n x n cells with the listed cells (i, j) removed.

    Each removed cell (or 4-connected block of cells) away from the border adds one hole, so the
    mesh is a disk with b1 = number of such blocks; unused vertices are dropped.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    removed = {(int(i), int(j)) for i, j in holes}
    if any(not (0 <= i < n and 0 <= j < n) for i, j in removed):
        raise ValueError(f"hole cells must lie in [0, {n})^2")
    vid = lambda i, j: i * (n + 1) + j  # noqa: E731
    ii, jj = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    keep = np.array([(i, j) not in removed for i, j in zip(ii.ravel(), jj.ravel())])
    i, j = ii.ravel()[keep], jj.ravel()[keep]
    v00, v10, v11, v01 = vid(i, j), vid(i + 1, j), vid(i + 1, j + 1), vid(i, j + 1)
    faces = np.concatenate([np.stack([v00, v10, v11], 1), np.stack([v00, v11, v01], 1)])
    gx, gy = np.meshgrid(np.linspace(0, 1, n + 1), np.linspace(0, 1, n + 1), indexing="ij")
    vertices = np.stack([gx.ravel(), gy.ravel()], 1)
    used = np.unique(faces)
    remap = np.full(len(vertices), -1)
    remap[used] = np.arange(len(used))
    return vertices[used], remap[faces]


def perturb(op: Operator, scale: float, rng: np.random.Generator) -> Operator:
    """Multiplicative noise on the stored entries: a 'learned' operator with the same sparsity."""
    if sp.issparse(op):
        out = sp.csr_matrix(op, copy=True)
        out.data = out.data * (1 + scale * rng.standard_normal(out.nnz))
        return out
    return op * (1 + scale * rng.standard_normal(op.shape))


# ---------------------------------------------------------------------------------- projectors


class ImageProjector:
    """P = A A^+, the orthogonal projector onto im A, applied without forming it.

    ``factor``: one sparse LU of A^T A + s I (s tiny) and iterative refinement on the normal
    equations; the shift keeps a rank-deficient A (exact incidence) factorisable, and since A^T b
    has no kernel component the refined solution is the least-squares one. ``lsqr``: no
    factorisation at all, one LSQR run per column (slower, least memory).
    """

    def __init__(self, a: Operator, method: Literal["factor", "lsqr"] = "factor",
                 rtol: float = 1e-14, max_refine: int = 60) -> None:
        self.method, self.rtol, self.max_refine = method, rtol, max_refine
        self.shape = a.shape
        self.a = sp.csr_matrix(a)
        self.at = self.a.T.tocsr()
        if method == "factor":
            normal = (self.at @ self.a).tocsc()
            shift = 1e-10 * max(float(normal.diagonal().max(initial=0.0)), 1e-300)
            self._lu = spla.splu((normal + shift * sp.identity(normal.shape[0], format="csc")).tocsc(),
                                 permc_spec="MMD_AT_PLUS_A")
        elif method != "lsqr":
            raise ValueError(f"unknown projector method {method!r}; use 'factor' or 'lsqr'")

    def lstsq(self, b: np.ndarray) -> np.ndarray:
        """x minimising ||A x - b|| for a vector or a block of columns."""
        if self.method == "lsqr":
            cols = b.reshape(b.shape[0], -1)
            out = np.column_stack([spla.lsqr(self.a, c, atol=1e-15, btol=1e-15, iter_lim=20 * sum(self.shape))[0]
                                   for c in cols.T])
            return out.reshape((self.shape[1],) + b.shape[1:])
        rhs = self.at @ b
        x = self._lu.solve(rhs)
        target = self.rtol * max(float(np.linalg.norm(rhs)), 1e-300)
        for _ in range(self.max_refine):
            r = rhs - self.at @ (self.a @ x)
            if np.linalg.norm(r) <= target:
                break
            x = x + self._lu.solve(r)
        return x

    def project(self, v: np.ndarray) -> np.ndarray:
        return self.a @ self.lstsq(v)

    def complement(self, v: np.ndarray) -> np.ndarray:
        return v - self.project(v)


class ProjectedOperator(spla.LinearOperator):
    """D1 (I - P0) (``side='right'``) or (I - P1) D0 (``side='left'``), matrix-free."""

    def __init__(self, base: Operator, projector: ImageProjector, side: Literal["left", "right"]) -> None:
        self.base, self.projector, self.side = base, projector, side
        super().__init__(dtype=np.float64, shape=base.shape)

    def _matmat(self, x: np.ndarray) -> np.ndarray:
        if self.side == "right":
            return self.base @ self.projector.complement(x)
        return self.projector.complement(self.base @ x)

    def _rmatmat(self, y: np.ndarray) -> np.ndarray:
        if self.side == "right":
            return self.projector.complement(self.base.T @ y)
        return self.base.T @ self.projector.complement(y)

    def _rmatvec(self, y: np.ndarray) -> np.ndarray:
        return self._rmatmat(y.reshape(-1, 1)).ravel()

    def toarray(self, block: int = 512) -> np.ndarray:
        """Dense copy, column block by column block (only for small operators)."""
        n = self.shape[1]
        return np.concatenate([self._matmat(np.eye(n)[:, s:s + block]) for s in range(0, n, block)], axis=1)


# ---------------------------------------------------------------------------------- certificate


@dataclass
class Certificate:
    defect: float  # ||D1 D0||_F (a Hutchinson estimate when ``estimated``)
    relative: float  # defect / (||D1|| ||D0||)
    norm_d0: float
    norm_d1: float
    norm: str
    estimated: bool
    n_probes: int
    max_abs_entry: float | None  # largest |(D1 D0)_fv|, when the product is explicit


def _explicit(op: Operator) -> bool:
    return isinstance(op, np.ndarray) or sp.issparse(op)


def frobenius(op: Operator, n_probes: int = 16, rng: np.random.Generator | None = None) -> tuple[float, bool]:
    """||op||_F, exact for explicit matrices, Hutchinson (E||op z||^2, z Rademacher) otherwise."""
    if sp.issparse(op):
        return float(spla.norm(op)), False
    if isinstance(op, np.ndarray):
        return float(np.linalg.norm(op)), False
    rng = rng or np.random.default_rng(0)
    z = rng.choice([-1.0, 1.0], size=(op.shape[1], n_probes))
    return float(np.sqrt(np.sum((op @ z) ** 2) / n_probes)), True


def spectral_norm(op: Operator) -> float:
    if isinstance(op, np.ndarray):
        return float(np.linalg.norm(op, 2))
    if min(op.shape) < 3:
        return float(np.linalg.norm(op.toarray(), 2))
    return float(spla.svds(spla.aslinearoperator(op), k=1, tol=1e-6, return_singular_vectors=False)[0])


def certificate(d0: Operator, d1: Operator, *, norm: Literal["fro", "spectral"] = "fro",
                n_probes: int = 16, seed: int = 0) -> Certificate:
    """Distance to compatibility ||D1 D0||_F and its scale-free form."""
    check_pair(d0, d1)
    rng = np.random.default_rng(seed)
    max_abs: float | None = None
    if _explicit(d0) and _explicit(d1):
        prod = d1 @ d0
        defect, estimated = frobenius(prod)
        max_abs = float(abs(prod).max()) if prod.size and (not sp.issparse(prod) or prod.nnz) else 0.0
    else:
        defect, estimated = frobenius(spla.aslinearoperator(d1) @ spla.aslinearoperator(d0), n_probes, rng)
    if norm == "fro":
        n0, n1 = frobenius(d0, n_probes, rng)[0], frobenius(d1, n_probes, rng)[0]
    elif norm == "spectral":
        n0, n1 = spectral_norm(d0), spectral_norm(d1)
    else:
        raise ValueError(f"norm must be 'fro' or 'spectral', got {norm!r}")
    rel = defect / (n0 * n1) if n0 > 0 and n1 > 0 else 0.0
    return Certificate(defect, rel, n0, n1, norm, estimated, n_probes if estimated else 0, max_abs)


def check_pair(d0: Operator, d1: Operator) -> None:
    for name, op in (("D0", d0), ("D1", d1)):
        if len(op.shape) != 2:
            raise ValueError(f"{name} must be a 2-D operator, got shape {op.shape}")
    if d1.shape[1] != d0.shape[0]:
        raise ValueError(f"shape mismatch: D1 is {d1.shape} (faces x edges) but D0 is {d0.shape} "
                         f"(edges x vertices); D1 needs {d0.shape[0]} columns")


# ---------------------------------------------------------------------------------- projection


@dataclass
class Projection:
    d0: Operator
    d1: Operator
    mode: str
    distance: float  # ||(D0', D1') - (D0, D1)||_F (estimated for matrix-free results)
    distance_estimated: bool


def project_compatible(d0: Operator, d1: Operator, mode: Literal["d1", "d0", "joint"] = "d1",
                       method: Literal["auto", "factor", "lsqr", "dense"] = "auto",
                       n_probes: int = 16, seed: int = 0) -> Projection:
    """Frobenius-nearest compatible pair; ``mode`` says which operator moves (see module doc)."""
    check_pair(d0, d1)
    sparse = sp.issparse(d0) or sp.issparse(d1)
    if method == "auto":
        method = "factor" if sparse else "dense"
    if mode == "joint":
        if d0.shape[0] > 20_000:
            raise ValueError(f"the joint projection diagonalises a dense {d0.shape[0]}^2 edge matrix; use mode 'd1' or 'd0'")
        a0, a1 = _dense(d0), _dense(d1)
        m = a1.T @ a1 - a0 @ a0.T
        w, u = np.linalg.eigh(m)
        tol = max(m.shape[0], 1) * np.finfo(float).eps * max(float(np.abs(w).max(initial=0.0)), 1.0)
        q = u[:, w < -tol]
        x0 = q @ (q.T @ a0)
        x1 = a1 - (a1 @ q) @ q.T
        dist = float(np.sqrt(np.sum((x0 - a0) ** 2) + np.sum((x1 - a1) ** 2)))
        return Projection(x0, x1, mode, dist, False)
    if mode not in ("d1", "d0"):
        raise ValueError(f"mode must be 'd1', 'd0' or 'joint', got {mode!r}")
    if method == "dense":
        a0, a1 = _dense(d0), _dense(d1)
        if mode == "d1":
            q = sla.orth(a0)
            x0, x1 = a0, a1 - (a1 @ q) @ q.T
        else:
            q = sla.orth(a1.T)
            x0, x1 = a0 - q @ (q.T @ a0), a1
        dist = float(np.sqrt(np.sum((x0 - a0) ** 2) + np.sum((x1 - a1) ** 2)))
        return Projection(x0, x1, mode, dist, False)
    if mode == "d1":
        proj = ImageProjector(d0, method)
        out = ProjectedOperator(sp.csr_matrix(d1), proj, "right")
        moved = _block_operator(d1.shape, lambda x: d1 @ proj.project(x))
        dist = frobenius(moved, n_probes, np.random.default_rng(seed))[0]
        return Projection(d0, out, mode, dist, True)
    proj = ImageProjector(sp.csr_matrix(d1).T, method)
    out = ProjectedOperator(sp.csr_matrix(d0), proj, "left")
    moved = _block_operator(d0.shape, lambda x: proj.project(d0 @ x))
    dist = frobenius(moved, n_probes, np.random.default_rng(seed))[0]
    return Projection(out, d1, mode, dist, True)


def _block_operator(shape: tuple[int, int], fn: Any) -> spla.LinearOperator:
    return spla.LinearOperator(shape, matvec=lambda x: fn(x.reshape(-1, 1)).ravel(), matmat=fn, dtype=float)


def _dense(op: Operator) -> np.ndarray:
    if isinstance(op, ProjectedOperator):
        return op.toarray()
    return np.asarray(op.toarray() if sp.issparse(op) else op, dtype=float)


# ---------------------------------------------------------------------------------- Hodge spectra


def hodge_laplacians(d0: Operator, d1: Operator) -> tuple[Operator, Operator]:
    """L0 = D0^T D0 and L1 = D0 D0^T + D1^T D1 (sparse in, sparse out)."""
    check_pair(d0, d1)
    return d0.T @ d0, d0 @ d0.T + d1.T @ d1


class Spectrum(BaseModel):
    size: int
    lambda_max: float
    lambda_min_nonzero: float | None
    condition: float | None  # lambda_max / lambda_min_nonzero
    kernel_dim: int  # eigenvalues <= rtol * lambda_max
    below_threshold: int  # eigenvalues < threshold, kernel included
    exact: bool  # full dense spectrum; otherwise the smallest ``computed`` eigenvalues by shift-invert
    computed: int


def spectrum_summary(lap: Operator, threshold: float = 1e-3, rtol: float = 1e-8, k: int = 8) -> Spectrum:
    """Condition number on the nonzero spectrum and low-frequency counts of a symmetric PSD matrix.

    Sparse: Lanczos for lambda_max, shift-invert at a small negative shift for the low end, with k
    doubled until a nonzero eigenvalue above the threshold shows up (counts are then exact).
    """
    n = lap.shape[0]
    if n == 0:
        raise ValueError("empty Laplacian")
    if not sp.issparse(lap) or n <= 400:
        w = np.linalg.eigvalsh(_dense(lap))
        lmax = float(w[-1])
        return _spectrum_from(w, n, n, lmax, threshold, rtol, exact=True)
    lap = sp.csc_matrix(lap)
    lmax = lanczos_max(lap)
    shift = -1e-6 * max(lmax, 1e-300)
    lu = spla.splu((lap - shift * sp.identity(n, format="csc")).tocsc(), permc_spec="MMD_AT_PLUS_A")
    opinv = spla.LinearOperator((n, n), matvec=lu.solve, dtype=float)
    kk = min(k, n - 2)
    while True:
        w = np.sort(spla.eigsh(lap, k=kk, sigma=shift, OPinv=opinv, which="LM", ncv=min(n - 1, max(2 * kk + 1, 24)),
                               tol=1e-10, return_eigenvectors=False))
        nz = w[w > rtol * lmax]
        if (len(nz) and nz.max() >= threshold) or kk >= min(n - 2, 512):
            return _spectrum_from(w, n, kk, lmax, threshold, rtol, exact=False)
        kk = min(2 * kk, n - 2)


def lanczos_max(a: Operator, steps: int = 60, seed: int = 0) -> float:
    """Largest eigenvalue of a symmetric operator by fully reorthogonalised Lanczos.

    The Ritz value is a lower bound that reaches the top of a clustered mesh spectrum to about
    1e-4 relative in a few dozen steps, where ARPACK spends seconds resolving the cluster.
    """
    n = a.shape[0]
    steps = min(steps, n)
    q = np.random.default_rng(seed).standard_normal(n)
    q /= np.linalg.norm(q)
    basis = np.zeros((n, steps))
    alphas: list[float] = []
    betas: list[float] = []
    for j in range(steps):
        basis[:, j] = q
        w = a @ q
        alphas.append(float(q @ w))
        w -= basis[:, : j + 1] @ (basis[:, : j + 1].T @ w)
        w -= basis[:, : j + 1] @ (basis[:, : j + 1].T @ w)
        b = float(np.linalg.norm(w))
        if j == steps - 1 or b <= 1e-12 * max(abs(alphas[-1]), 1e-300):
            break
        betas.append(b)
        q = w / b
    return float(sla.eigh_tridiagonal(np.array(alphas), np.array(betas[: len(alphas) - 1]), eigvals_only=True)[-1])


def _spectrum_from(w: np.ndarray, n: int, computed: int, lmax: float, threshold: float, rtol: float, exact: bool) -> Spectrum:
    zero = w <= rtol * max(lmax, 0.0)
    nz = w[~zero]
    lmin = float(nz.min()) if len(nz) else None
    cond = lmax / lmin if lmin else None
    return Spectrum(size=n, lambda_max=lmax, lambda_min_nonzero=lmin, condition=cond, kernel_dim=int(zero.sum()),
                    below_threshold=int((w < threshold).sum()), exact=exact, computed=computed)


# ---------------------------------------------------------------------------------- torch penalty


class DefectPenalty:
    """Differentiable ||D1 D0||_F^2 for defect-aware training (mu * penalty added to the loss).

    Dense torch tensors: ``penalty(d0, d1)``. Learned sparse operators with fixed sparsity
    patterns: build once from the patterns (scipy), then call with the two value vectors in
    canonical CSR order (``csr.data`` after ``sum_duplicates()``). The product's entries are sums
    over (face, edge, vertex) paths gathered with index_add: O(nnz) memory, plain autograd.
    """

    def __init__(self, pattern0: Operator | None = None, pattern1: Operator | None = None) -> None:
        self.paths = None
        if pattern0 is not None and pattern1 is not None:
            p0, p1 = sp.csr_matrix(pattern0, copy=True), sp.csr_matrix(pattern1, copy=True)
            check_pair(p0, p1)
            p0.sum_duplicates()  # canonical CSR: the order the value vectors must follow
            p1.sum_duplicates()
            e = p1.indices  # edge of every D1 entry
            counts = np.diff(p0.indptr)[e]
            k1 = np.repeat(np.arange(p1.nnz), counts)
            starts = np.repeat(p0.indptr[e], counts)
            k0 = starts + np.arange(len(k1)) - np.repeat(np.cumsum(counts) - counts, counts)
            face = np.repeat(np.repeat(np.arange(p1.shape[0]), np.diff(p1.indptr)), counts)
            key = face * p0.shape[1] + p0.indices[k0]
            _, out = np.unique(key, return_inverse=True)
            self.paths = (k0, k1, out.ravel(), int(out.max()) + 1 if len(out) else 0)

    def __call__(self, d0: Any, d1: Any, normalized: bool = False) -> Any:
        import torch

        if self.paths is None:
            val = (d1 @ d0).pow(2).sum()
        else:
            k0, k1, out = (torch.as_tensor(a, device=d0.device) for a in self.paths[:3])
            n_out = self.paths[3]
            val = torch.zeros(n_out, dtype=d0.dtype, device=d0.device).index_add(0, out, d0[k0] * d1[k1]).pow(2).sum()
        return val / (d0.pow(2).sum() * d1.pow(2).sum()) if normalized else val


# ---------------------------------------------------------------------------------- tools

MAX_DENSE_ENTRIES = 4_000_000
MAX_MESH_VERTICES = 10_000_000


def load_operator(value: ArrayInput, name: str) -> Operator:
    """A dense array (.npy/.npz/.safetensors/inline) or a scipy.sparse .npz (``save_npz``)."""
    if isinstance(value, str) and value.endswith(".npz"):
        from closedloop.artifacts import check_array_file, resolve_array_path

        path = resolve_array_path(value, name)  # inside the working root, or refused
        if not path.is_file():
            raise ArtifactError(f"{name}: file not found: {value}")
        try:
            check_array_file(path, name=name)  # sizes from the headers, before unpacking
            with np.load(path, allow_pickle=False) as z:
                is_sparse = {"format", "shape", "data"} <= set(z.keys())
        except ArtifactError:
            raise
        except Exception as e:
            raise ArtifactError(f"{name}: cannot read {value}: {e}") from None
        if is_sparse:
            op = sp.csr_matrix(sp.load_npz(path), dtype=float)
            if not np.all(np.isfinite(op.data)):
                raise ArtifactError(f"{name}: contains NaN or infinite values")
            return op
    arr = load_array(value, name=name)
    if arr.ndim != 2:
        raise ArtifactError(f"{name}: expected a 2-D operator, got shape {list(arr.shape)}")
    return arr.astype(float)


def save_sparse(op: sp.spmatrix, prefix: str) -> ArrayRef:
    m = sp.csr_matrix(op)
    raw = m.data.nbytes + m.indices.nbytes + m.indptr.nbytes
    # compressed .npz: at most the raw arrays, deflate's worst case (+0.1%) and the zip's own records
    path = write_artifact(prefix, ".npz", lambda f: sp.save_npz(f, m), reserve_bytes=raw + raw // 100 + 2**16)
    return ArrayRef(path=str(path), shape=list(op.shape), dtype=str(op.dtype))


class CertificateReport(BaseModel):
    defect: float
    relative_defect: float
    compatible: bool
    norm: str
    norm_d0: float
    norm_d1: float
    max_abs_entry: float | None
    estimated: bool
    shapes: dict[str, list[int]]
    sparse: bool


def _report(c: Certificate, d0: Operator, d1: Operator, tol: float) -> CertificateReport:
    return CertificateReport(defect=c.defect, relative_defect=c.relative, compatible=c.relative <= tol, norm=c.norm,
                             norm_d0=c.norm_d0, norm_d1=c.norm_d1, max_abs_entry=c.max_abs_entry,
                             estimated=c.estimated, shapes={"d0": list(d0.shape), "d1": list(d1.shape)},
                             sparse=sp.issparse(d0) or sp.issparse(d1))


@tool
def compatibility_certificate(d0: ArrayInput, d1: ArrayInput, norm: Literal["fro", "spectral"] = "fro",
                              tol: Annotated[float, Field(ge=0.0)] = 1e-10) -> CertificateReport:
    """Distance of a learned operator pair to chain compatibility: ||D1 D0||_F and ||D1 D0||_F/(||D1|| ||D0||).

    Args:
        d0: D0 (edges x vertices): .npy/.npz/.safetensors path, scipy.sparse .npz, or inline list.
        d1: D1 (faces x edges), same formats.
        norm: 'fro' (cheap, relative defect in [0, 1]) or 'spectral' for the normaliser.
        tol: relative defect at or below which the pair counts as compatible.
    """
    a0, a1 = load_operator(d0, "d0"), load_operator(d1, "d1")
    return _report(certificate(a0, a1, norm=norm), a0, a1, tol)


class ProjectionReport(BaseModel):
    mode: str
    method: str
    distance: float
    distance_estimated: bool
    before: CertificateReport
    after: CertificateReport
    d0: ArrayRef | None
    d1: ArrayRef | None
    note: str


@tool(isolation="process")
def project_to_compatible(d0: ArrayInput, d1: ArrayInput, mode: Literal["d1", "d0", "joint"] = "d1",
                          method: Literal["auto", "factor", "lsqr", "dense"] = "auto") -> ProjectionReport:
    """Frobenius-nearest chain-compatible operator pair, with certificates before and after.

    Args:
        d0: D0 (edges x vertices): dense array path, scipy.sparse .npz, or inline list.
        d1: D1 (faces x edges), same formats.
        mode: 'd1' keeps D0 and projects D1 = D1(I - D0 D0^+); 'd0' keeps D1 and projects
            D0 = (I - D1^+ D1) D0; 'joint' moves both to the exact joint optimum (dense only).
        method: 'auto' (dense for dense input, sparse factorisation for sparse input), 'factor',
            'lsqr' or 'dense'.
    """
    a0, a1 = load_operator(d0, "d0"), load_operator(d1, "d1")
    check_pair(a0, a1)
    sparse = sp.issparse(a0) or sp.issparse(a1)
    if (mode == "joint" or method == "dense") and a1.shape[1] ** 2 + a0.size + a1.size > 3 * MAX_DENSE_ENTRIES:
        raise ValueError(f"mode={mode!r}/method={method!r} needs dense matrices of about {a1.shape[1]}^2 entries; "
                         "use mode 'd1' or 'd0' with method 'factor' for large sparse operators")
    res = project_compatible(a0, a1, mode=mode, method=method)
    before = _report(certificate(a0, a1), a0, a1, 1e-10)
    after = _report(certificate(res.d0, res.d1), res.d0, res.d1, 1e-10)
    refs: dict[str, ArrayRef | None] = {"d0": None, "d1": None}
    note = "projected operator saved as a dense .npy"
    for key, new in (("d0", res.d0), ("d1", res.d1)):
        if key == "d0" and mode == "d1" or key == "d1" and mode == "d0":
            continue
        if isinstance(new, np.ndarray):
            refs[key] = save_array(new, prefix=f"projected-{key}")
        elif new.shape[0] * new.shape[1] <= MAX_DENSE_ENTRIES:
            refs[key] = save_array(new.toarray(), prefix=f"projected-{key}")
        else:
            note = ("the projected operator is dense in general and too large to save; apply it matrix-free with "
                    "closedloop.tools.mesh_certificate.project_compatible (a ProjectedOperator)")
    used = method if method != "auto" else ("factor" if sparse and mode != "joint" else "dense")
    return ProjectionReport(mode=mode, method=used, distance=res.distance, distance_estimated=res.distance_estimated,
                            before=before, after=after, d0=refs["d0"], d1=refs["d1"], note=note)


class HodgeReport(BaseModel):
    l0: Spectrum
    l1: Spectrum
    betti1_if_exact: int
    threshold: float


@tool(isolation="process")
def hodge_spectrum(d0: ArrayInput, d1: ArrayInput, threshold: Annotated[float, Field(gt=0.0)] = 1e-3,
                   rtol: Annotated[float, Field(gt=0.0, lt=1.0)] = 1e-8) -> HodgeReport:
    """Learned Hodge Laplacians L0 = D0^T D0, L1 = D0 D0^T + D1^T D1: condition numbers on the nonzero spectrum,
    kernel dimensions and low-frequency counts (eigenvalues below threshold).

    Args:
        d0: D0 (edges x vertices): dense array path, scipy.sparse .npz, or inline list.
        d1: D1 (faces x edges), same formats.
        threshold: count eigenvalues below this value (kernel included).
        rtol: eigenvalues <= rtol * lambda_max count as zero.
    """
    if threshold <= 0 or rtol <= 0:
        raise ValueError("threshold and rtol must be positive")
    a0, a1 = load_operator(d0, "d0"), load_operator(d1, "d1")
    l0, l1 = hodge_laplacians(a0, a1)
    s0, s1 = spectrum_summary(l0, threshold, rtol), spectrum_summary(l1, threshold, rtol)
    return HodgeReport(l0=s0, l1=s1, betti1_if_exact=s1.kernel_dim, threshold=threshold)


class MeshReport(BaseModel):
    n_vertices: int
    n_edges: int
    n_faces: int
    euler_characteristic: int
    components: int
    d0: ArrayRef
    d1: ArrayRef
    vertices: ArrayRef | None = None
    faces: ArrayRef | None = None


def _mesh_report(faces: np.ndarray, nv: int, vertices: np.ndarray | None = None) -> MeshReport:
    d0, d1, edges = incidence_matrices(faces, nv)
    comps = csgraph.connected_components(abs(d0.T @ d0), directed=False)[0]
    return MeshReport(n_vertices=nv, n_edges=len(edges), n_faces=len(faces), euler_characteristic=nv - len(edges) + len(faces),
                      components=int(comps), d0=save_sparse(d0, "d0"), d1=save_sparse(d1, "d1"),
                      vertices=save_array(vertices, prefix="vertices") if vertices is not None else None,
                      faces=save_array(faces, prefix="faces") if vertices is not None else None)


@tool
def mesh_incidence(faces: ArrayInput, n_vertices: Annotated[int, Field(ge=1, le=MAX_MESH_VERTICES)] | None = None
                   ) -> MeshReport:
    """Exact signed incidence operators D0 (edges x vertices) and D1 (faces x edges) of a triangle mesh,
    saved as scipy.sparse .npz; edges are oriented from lower to higher vertex index.

    Args:
        faces: (F, 3) integer vertex indices: .npy/.npz path or inline list.
        n_vertices: number of vertices (default: max index + 1; isolated vertices count as components).
    """
    f = load_array(faces, name="faces")
    nv = int(np.max(f)) + 1 if n_vertices is None and f.size else int(n_vertices or 0)
    if nv > MAX_MESH_VERTICES:  # operators and components are sized by the vertex count
        raise ValueError(f"faces name vertex {nv - 1}; at most {MAX_MESH_VERTICES} vertices are supported")
    return _mesh_report(np.asarray(f), nv)


def _grid_bytes(n: int, **_: Any) -> float:
    """Vertices, faces, the edge list and both sparse operators: about 400 bytes per cell."""
    return 400.0 * (n + 1) ** 2


@tool(isolation="process", estimate_bytes=_grid_bytes)
def grid_mesh_operators(n: Annotated[int, Field(ge=1, le=2000)],
                        holes: Annotated[list[list[int]], Field(max_length=100_000)] | None = None) -> MeshReport:
    """Triangulated n x n grid (a disk) with optional removed cells (each interior 4-connected block = one hole),
    and its exact incidence operators; a test bed for certificates and Hodge spectra.

    Args:
        n: cells per side (1..2000).
        holes: cells [i, j] to remove, e.g. [[2, 2], [5, 5]] for two holes.
    """
    if not 1 <= n <= 2000:
        raise ValueError("n must be in [1, 2000]")
    if holes and any(len(h) != 2 for h in holes):
        raise ValueError("each hole is a cell [i, j]")
    vertices, faces = grid_mesh(n, holes or ())
    return _mesh_report(faces, len(vertices), vertices)


TOOLS: list[Tool] = [compatibility_certificate, project_to_compatible, hodge_spectrum, mesh_incidence,
                     grid_mesh_operators]
