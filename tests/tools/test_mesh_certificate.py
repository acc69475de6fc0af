"""Properties of the compatibility certificate, the nearest-compatible projections and the Hodge spectra."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from closedloop.tool import ToolRegistry
from closedloop.tools.mesh_certificate import (
    TOOLS,
    DefectPenalty,
    certificate,
    grid_mesh,
    hodge_laplacians,
    incidence_matrices,
    perturb,
    project_compatible,
    spectrum_summary,
)


def annulus_mesh(n_r: int = 3, n_theta: int = 12) -> np.ndarray:
    """A polar annulus built ring by ring, independent of grid_mesh (faces only)."""
    vid = lambda r, t: r * n_theta + t % n_theta  # noqa: E731
    faces = []
    for r in range(n_r):
        for t in range(n_theta):
            faces.append([vid(r, t), vid(r + 1, t), vid(r + 1, t + 1)])
            faces.append([vid(r, t), vid(r + 1, t + 1), vid(r, t + 1)])
    return np.array(faces)


@pytest.fixture
def noisy_pair():
    _, faces = grid_mesh(6, [(2, 2)])
    d0, d1, _ = incidence_matrices(faces)
    rng = np.random.default_rng(1)
    return perturb(d0, 0.05, rng).toarray(), perturb(d1, 0.05, rng).toarray()


@pytest.mark.parametrize("holes", [(), [(1, 1)], [(1, 1), (3, 4)]])
def test_exact_incidence_operators_have_zero_defect(holes):
    _, faces = grid_mesh(5, holes)
    d0, d1, edges = incidence_matrices(faces)
    assert certificate(d0, d1).defect == 0.0
    # orientation is consistent: every edge runs from the lower to the higher vertex
    assert np.all(edges[:, 0] < edges[:, 1])
    assert np.array_equal(d0.toarray()[np.arange(len(edges)), edges[:, 1]], np.ones(len(edges)))
    # a learned (noisy) pair is certified as incompatible
    rng = np.random.default_rng(0)
    assert certificate(perturb(d0, 0.05, rng), perturb(d1, 0.05, rng)).relative > 1e-4


def test_faces_with_any_vertex_order_give_zero_defect():
    rng = np.random.default_rng(3)
    faces = annulus_mesh()
    shuffled = np.array([np.roll(f, rng.integers(3)) if rng.random() < 0.5 else f[::-1] for f in faces])
    d0, d1, _ = incidence_matrices(shuffled)
    assert certificate(d0, d1).defect == 0.0


@pytest.mark.parametrize("mode", ["d1", "d0", "joint"])
def test_projection_is_compatible_idempotent_and_identity_on_exact(noisy_pair, mode):
    d0, d1 = noisy_pair
    res = project_compatible(d0, d1, mode=mode)
    scale = np.linalg.norm(d0) * np.linalg.norm(d1)
    assert np.linalg.norm(res.d1 @ res.d0) <= 1e-10 * scale
    again = project_compatible(res.d0, res.d1, mode=mode)
    assert np.allclose(again.d0, res.d0, atol=1e-10) and np.allclose(again.d1, res.d1, atol=1e-10)
    assert again.distance < 1e-9
    _, faces = grid_mesh(4)
    e0, e1, _ = incidence_matrices(faces)
    exact = project_compatible(e0.toarray(), e1.toarray(), mode=mode)
    assert np.allclose(exact.d0, e0.toarray(), atol=1e-10) and np.allclose(exact.d1, e1.toarray(), atol=1e-10)


def test_projection_is_frobenius_nearest_against_random_compatible_operators(noisy_pair):
    d0, d1 = noisy_pair
    rng = np.random.default_rng(7)
    res = project_compatible(d0, d1, mode="d1")
    q = np.linalg.svd(d0, full_matrices=False)[0]  # d0 has full column rank once noisy
    for _ in range(50):
        # any X with X D0 = 0: X = Y (I - P0); include ones close to the projection
        y = res.d1 + rng.standard_normal(d1.shape) * rng.choice([1e-3, 1e-1, 1.0])
        x = y - (y @ q) @ q.T
        assert np.linalg.norm(x @ d0) < 1e-9 * np.linalg.norm(x)
        assert np.linalg.norm(x - d1) >= res.distance - 1e-12
    # the joint optimum is never farther than either one-sided projection, nor than random compatible pairs
    joint = project_compatible(d0, d1, mode="joint")
    assert joint.distance <= min(res.distance, project_compatible(d0, d1, mode="d0").distance) + 1e-12
    for _ in range(20):
        s = np.linalg.qr(rng.standard_normal((d0.shape[0], rng.integers(1, d0.shape[0]))))[0]
        x0, x1 = s @ (s.T @ d0), d1 - (d1 @ s) @ s.T
        assert np.hypot(np.linalg.norm(x0 - d0), np.linalg.norm(x1 - d1)) >= joint.distance - 1e-12


@pytest.mark.parametrize("holes,betti1", [((), 0), ([(2, 2)], 1), ([(1, 1), (4, 4)], 2), ([(2, 2), (2, 3), (3, 2), (3, 3)], 1)])
def test_kernel_of_l1_equals_first_betti_number(holes, betti1):
    _, faces = grid_mesh(7, holes)
    d0, d1, _ = incidence_matrices(faces)
    _, l1 = hodge_laplacians(d0, d1)
    assert spectrum_summary(l1).kernel_dim == betti1
    assert spectrum_summary(d0.T @ d0).kernel_dim == 1  # one connected component


def test_kernel_of_l1_on_polar_annulus_and_sparse_spectrum_agrees_with_dense():
    d0, d1, _ = incidence_matrices(annulus_mesh(8, 40))
    l0, l1 = hodge_laplacians(d0, d1)
    assert l1.shape[0] > 400  # takes the sparse (shift-invert) path
    sparse, dense = spectrum_summary(l1, threshold=0.05), spectrum_summary(l1.toarray(), threshold=0.05)
    assert not sparse.exact and dense.exact
    assert sparse.kernel_dim == dense.kernel_dim == 1
    assert sparse.below_threshold == dense.below_threshold
    assert sparse.lambda_min_nonzero == pytest.approx(dense.lambda_min_nonzero, rel=1e-8)
    assert sparse.condition == pytest.approx(dense.condition, rel=1e-3)


@pytest.mark.parametrize("method", ["factor", "lsqr"])
@pytest.mark.parametrize("mode", ["d1", "d0"])
def test_sparse_projection_agrees_with_dense(noisy_pair, method, mode):
    d0, d1 = noisy_pair
    dense = project_compatible(d0, d1, mode=mode, method="dense")
    sparse = project_compatible(sp.csr_matrix(d0), sp.csr_matrix(d1), mode=mode, method=method)
    moved = sparse.d1 if mode == "d1" else sparse.d0
    expected = dense.d1 if mode == "d1" else dense.d0
    assert np.allclose(moved.toarray(), expected, atol=1e-10)
    assert np.allclose(moved.T @ np.eye(moved.shape[0]), expected.T, atol=1e-10)  # rmatmat path
    assert sparse.distance == pytest.approx(dense.distance, rel=0.25)  # Hutchinson estimate
    c_sparse, c_dense = certificate(sp.csr_matrix(d0), sp.csr_matrix(d1)), certificate(d0, d1)
    assert c_sparse.defect == pytest.approx(c_dense.defect, rel=1e-12)


def test_sparse_mesh_with_1e5_edges_stays_sparse_and_fast():
    _, faces = grid_mesh(183)
    d0, d1, edges = incidence_matrices(faces)
    assert len(edges) >= 100_000
    rng = np.random.default_rng(0)
    n0, n1 = perturb(d0, 0.05, rng), perturb(d1, 0.05, rng)
    start = time.process_time()  # CPU seconds: a loaded machine stretches wall time, not the work done
    before = certificate(n0, n1)
    res = project_compatible(n0, n1, mode="d1", n_probes=4)
    after = certificate(res.d0, res.d1, n_probes=4)
    assert time.process_time() - start < 30
    assert sp.issparse(res.d0) and res.d1.base.nnz == n1.nnz
    assert before.relative > 1e-4 and after.relative < 1e-12


def test_defect_penalty_gradients_and_training_reduce_defect():
    _, faces = grid_mesh(4, [(1, 1)])
    d0, d1, _ = incidence_matrices(faces)
    rng = np.random.default_rng(2)
    n0, n1 = perturb(d0, 0.1, rng), perturb(d1, 0.1, rng)
    t0 = torch.tensor(n0.toarray(), requires_grad=True)
    t1 = torch.tensor(n1.toarray(), requires_grad=True)
    pen = DefectPenalty()(t0, t1)
    pen.backward()
    prod = n1.toarray() @ n0.toarray()
    assert pen.item() == pytest.approx(np.sum(prod**2), rel=1e-12)
    assert np.allclose(t1.grad.numpy(), 2 * prod @ n0.toarray().T)
    assert np.allclose(t0.grad.numpy(), 2 * n1.toarray().T @ prod)
    # sparse-pattern penalty: same value, gradient = dense gradient restricted to the pattern
    sparse_pen = DefectPenalty(n0, n1)
    v0 = torch.tensor(n0.data, requires_grad=True)
    v1 = torch.tensor(n1.data, requires_grad=True)
    val = sparse_pen(v0, v1)
    val.backward()
    assert val.item() == pytest.approx(pen.item(), rel=1e-12)
    r0, c0 = n0.nonzero()
    assert np.allclose(v0.grad.numpy(), t0.grad.numpy()[r0, c0])
    # defect-aware training: a data term plus mu * penalty drives the defect down
    opt = torch.optim.Adam([v0, v1], lr=1e-2)
    target0, target1 = torch.tensor(n0.data), torch.tensor(n1.data)
    for _ in range(300):
        opt.zero_grad()
        loss = (v0 - target0).pow(2).sum() + (v1 - target1).pow(2).sum() + 100.0 * sparse_pen(v0, v1)
        loss.backward()
        opt.step()
    assert sparse_pen(v0, v1).item() < 0.05 * pen.item()


def test_incidence_rejects_bad_faces():
    with pytest.raises(ValueError, match="shape"):
        incidence_matrices(np.zeros((3, 4), int))
    with pytest.raises(ValueError, match="degenerate"):
        incidence_matrices(np.array([[0, 1, 1]]))
    with pytest.raises(ValueError, match="shape mismatch"):
        certificate(np.ones((3, 2)), np.ones((1, 4)))


def test_spectral_normaliser_matches_numpy_and_bounds_hold(noisy_pair):
    d0, d1 = noisy_pair
    fro, spec = certificate(d0, d1), certificate(sp.csr_matrix(d0), sp.csr_matrix(d1), norm="spectral")
    assert spec.norm_d0 == pytest.approx(np.linalg.norm(d0, 2), rel=1e-6)
    assert spec.norm_d1 == pytest.approx(np.linalg.norm(d1, 2), rel=1e-6)
    # ||D1 D0||_F <= ||D1||_2 ||D0||_F <= ||D1||_F ||D0||_F: Frobenius-relative defect is in [0, 1]
    assert 0 < fro.relative <= 1 and fro.defect <= spec.norm_d1 * fro.norm_d0 + 1e-12
    assert spec.relative == pytest.approx(fro.defect / (spec.norm_d0 * spec.norm_d1), rel=1e-12)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path / "artifacts"))
    return ToolRegistry().extend(TOOLS)


async def test_tools_end_to_end(registry, tmp_path):
    mesh = await registry.call_json("grid_mesh_operators", json.dumps({"n": 6, "holes": [[2, 2], [4, 4]]}))
    assert mesh.ok, mesh.error
    m = json.loads(mesh.content)
    assert m["euler_characteristic"] == -1 and m["components"] == 1
    cert = json.loads((await registry.call_json("compatibility_certificate",
                                                json.dumps({"d0": m["d0"]["path"], "d1": m["d1"]["path"]}))).content)
    assert cert["defect"] == 0.0 and cert["compatible"] and cert["sparse"]
    hodge = json.loads((await registry.call_json("hodge_spectrum",
                                                 json.dumps({"d0": m["d0"]["path"], "d1": m["d1"]["path"]}))).content)
    assert hodge["l1"]["kernel_dim"] == 2 and hodge["l0"]["kernel_dim"] == 1
    # learned pair as dense .npy files -> projection saves a compatible dense D1
    d0, d1 = sp.load_npz(m["d0"]["path"]), sp.load_npz(m["d1"]["path"])
    rng = np.random.default_rng(0)
    np.save(tmp_path / "d0.npy", perturb(d0, 0.05, rng).toarray())
    np.save(tmp_path / "d1.npy", perturb(d1, 0.05, rng).toarray())
    proj = await registry.call_json("project_to_compatible", json.dumps({"d0": str(tmp_path / "d0.npy"),
                                                                        "d1": str(tmp_path / "d1.npy")}))
    assert proj.ok, proj.error
    p = json.loads(proj.content)
    assert p["before"]["relative_defect"] > 1e-4 and p["after"]["compatible"] and p["d0"] is None
    new_d1 = np.load(p["d1"]["path"])
    assert np.linalg.norm(new_d1 @ np.load(tmp_path / "d0.npy")) < 1e-10 * p["before"]["norm_d0"] * p["before"]["norm_d1"]
    assert np.linalg.norm(new_d1 - np.load(tmp_path / "d1.npy")) == pytest.approx(p["distance"], rel=1e-10)
    inc = json.loads((await registry.call_json("mesh_incidence", json.dumps({"faces": [[0, 1, 2], [1, 3, 2]]}))).content)
    assert (inc["n_vertices"], inc["n_edges"], inc["n_faces"]) == (4, 5, 2)


async def test_tools_report_clear_errors(registry, tmp_path):
    missing = await registry.call_json("compatibility_certificate", json.dumps({"d0": str(tmp_path / "nope.npy"), "d1": [[1.0]]}))
    assert not missing.ok and "not found" in missing.error
    mismatch = await registry.call_json("compatibility_certificate", json.dumps({"d0": [[1.0, 0.0]], "d1": [[1.0, 2.0]]}))
    assert not mismatch.ok and "shape mismatch" in mismatch.error
    np.save(tmp_path / "bad.npy", np.array([[np.nan, 1.0]]))
    nonfinite = await registry.call_json("hodge_spectrum", json.dumps({"d0": str(tmp_path / "bad.npy"), "d1": [[1.0]]}))
    assert not nonfinite.ok and "NaN" in nonfinite.error
    vector = await registry.call_json("compatibility_certificate", json.dumps({"d0": [1.0, 2.0], "d1": [[1.0]]}))
    assert not vector.ok and "2-D" in vector.error
    bad_faces = await registry.call_json("mesh_incidence", json.dumps({"faces": [[0, 1]]}))
    assert not bad_faces.ok and "(F, 3)" in bad_faces.error
