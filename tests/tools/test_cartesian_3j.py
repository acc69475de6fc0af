"""Properties of the irreducible Cartesian tensor tools; each test names the property it checks.

e3nn (a test dependency) is the independent reference: its spherical harmonics and Wigner-3j
are computed by code that shares nothing with ours.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from closedloop.tool import ToolRegistry
from closedloop.tools.cartesian import (change_of_basis, decompose, multiplicities, random_rotation, raw_coupling,
                                        rotate_tensor, standard_basis, weight_projectors, wigner_d)
from closedloop.tools.cartesian_3j import (TOOLS, CartesianIrreps, CartesianTensorProduct, cartesian_3j,
                                           from_cartesian, rotate_features, standard_3j, to_cartesian)

o3 = pytest.importorskip("e3nn.o3")


def valid_triples(max_l: int) -> list[tuple[int, int, int]]:
    return [t for t in itertools.product(range(max_l + 1), repeat=3) if abs(t[0] - t[1]) <= t[2] <= t[0] + t[1]]


def as_array(value) -> np.ndarray:
    """A tool's array output: inline list, or an ArrayRef dict pointing at a .npy artifact."""
    return np.load(value["path"]) if isinstance(value, dict) else np.asarray(value)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def powers(points: np.ndarray, l: int) -> np.ndarray:
    """Rows x^{⊗l} (flattened) for each point, the tensors whose contraction gives polynomials."""
    out = np.ones((len(points), 1))
    for _ in range(l):
        out = np.einsum("pi,pj->pij", out, points).reshape(len(points), -1)
    return out


def e3nn_sh_to_cartesian(l: int, rng: np.random.Generator) -> np.ndarray:
    """A_l (2l+1 × 3**l) with e3nn's Y_l(x) = A_l x^{⊗l}, rows traceless symmetric.

    Fitted in the eigenbasis of our Casimir projector only, not our standard basis, so comparisons
    that go through A_l do not assume the two bases agree.
    """
    values, vectors = np.linalg.eigh(weight_projectors(l)[l])
    v = vectors[:, values > 0.5]
    points = rng.standard_normal((8 * (2 * l + 1), 3))
    y = o3.spherical_harmonics(l, torch.tensor(points), normalize=False, normalization="norm").numpy()
    q, *_ = np.linalg.lstsq(powers(points, l) @ v, y, rcond=None)
    return q.T @ v.T


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_weight_projectors_sum_to_identity_are_idempotent_and_mutually_orthogonal(n: int) -> None:
    projectors = weight_projectors(n)
    assert sorted(projectors) == list(range(0 if n != 1 else 1, n + 1))
    total = sum(projectors.values())
    assert np.max(np.abs(total - np.eye(3**n))) < 1e-12
    for l, p in projectors.items():
        assert np.max(np.abs(p @ p - p)) < 1e-12
        assert np.max(np.abs(p - p.T)) < 1e-14
        for l2, p2 in projectors.items():
            if l2 != l:
                assert np.max(np.abs(p @ p2)) < 1e-12


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_path_change_of_basis_is_orthonormal_complete_and_reproduces_casimir_projectors(n: int) -> None:
    copies = change_of_basis(n)
    mult = multiplicities(n)
    assert sum(m * (2 * l + 1) for l, m in mult.items()) == 3**n
    assert len(copies) == sum(mult.values())
    for c in copies:
        assert np.max(np.abs(c.matrix.T @ c.matrix - np.eye(2 * c.l + 1))) < 1e-12
    assert np.max(np.abs(sum(c.matrix @ c.matrix.T for c in copies) - np.eye(3**n))) < 1e-12
    # two independent constructions (coupling paths vs Casimir eigenspaces) must give the same P_l
    for l, p in weight_projectors(n).items():
        from_paths = sum(c.matrix @ c.matrix.T for c in copies if c.l == l)
        assert np.max(np.abs(from_paths - p)) < 1e-12
        assert round(np.trace(p)) == mult[l] * (2 * l + 1)


def test_decompose_parts_and_path_coefficients_both_reconstruct_the_tensor() -> None:
    t = np.random.default_rng(4).standard_normal((3, 3, 3, 3))
    dec = decompose(t)
    assert np.max(np.abs(sum(dec.parts.values()) - t)) < 1e-12
    rebuilt = sum(c.matrix @ dec.coefficients[c.path] for c in change_of_basis(4))
    assert np.max(np.abs(rebuilt.reshape(t.shape) - t)) < 1e-12
    assert sum(v**2 for v in dec.norms().values()) == pytest.approx(np.sum(t**2))
    with pytest.raises(ValueError, match="shape"):
        decompose(np.ones((3, 9)))


def test_change_of_basis_intertwines_rotations_with_wigner_d() -> None:
    rng = np.random.default_rng(3)
    rotation = random_rotation(rng)
    for c in change_of_basis(3):
        rotated = rotate_tensor(c.matrix.reshape(3, 3, 3, -1), rotation, axes=3).reshape(27, -1)
        assert np.max(np.abs(rotated - c.matrix @ wigner_d(c.l, rotation))) < 1e-12


def test_cached_arrays_are_handed_out_as_copies() -> None:
    z = cartesian_3j(1, 1, 1)
    z[...] = 0.0
    assert np.linalg.norm(cartesian_3j(1, 1, 1)) == pytest.approx(1.0)
    p = weight_projectors(2)
    p[2][...] = 0.0
    assert np.trace(weight_projectors(2)[2]) == pytest.approx(5.0)


@pytest.mark.parametrize("l", [0, 1, 2, 3, 4])
def test_standard_basis_is_orthonormal_traceless_symmetric(l: int) -> None:
    u = standard_basis(l)
    assert np.max(np.abs(u.T @ u - np.eye(2 * l + 1))) < 1e-12
    if l >= 2:
        t = u.reshape((3,) * l + (2 * l + 1,))
        assert np.max(np.abs(t - np.swapaxes(t, 0, 1))) < 1e-12
        assert np.max(np.abs(t - np.swapaxes(t, 0, l - 1))) < 1e-12
        assert np.max(np.abs(np.einsum("ii...->...", t))) < 1e-12


@pytest.mark.parametrize("l", [0, 1, 2, 3, 4])
def test_standard_basis_equals_e3nn_real_spherical_harmonics_up_to_positive_scale(l: int) -> None:
    rng = np.random.default_rng(l)
    a = e3nn_sh_to_cartesian(l, rng)
    q = a @ standard_basis(l)  # e3nn coefficients of our basis vectors
    scale = q[0, 0]
    assert scale > 0
    assert np.max(np.abs(q / scale - np.eye(2 * l + 1))) < 1e-10


@pytest.mark.parametrize("proper", [True, False])
def test_cartesian_3j_is_rotation_invariant_with_parity_det_r(proper: bool) -> None:
    rng = np.random.default_rng(11 if proper else 12)
    for la, lb, lc in valid_triples(3) + [(4, 2, 2), (4, 3, 1), (2, 2, 4)]:
        z = cartesian_3j(la, lb, lc)
        rotation = random_rotation(rng, proper=proper)
        total = la + lb + lc
        rotated = rotate_tensor(z.reshape((3,) * total), rotation).reshape(z.shape)
        sign = np.linalg.det(rotation) ** (total % 2)
        assert np.max(np.abs(rotated - sign * z)) < 1e-12, (la, lb, lc)
        assert np.linalg.norm(z) == pytest.approx(1.0, abs=1e-12)


def test_standard_3j_is_invariant_under_wigner_d_for_all_triples_up_to_l4() -> None:
    rng = np.random.default_rng(5)
    rotation = random_rotation(rng)
    for la, lb, lc in valid_triples(4):
        w = standard_3j(la, lb, lc)
        rotated = np.einsum("ABC,aA,bB,cC->abc", w, wigner_d(la, rotation), wigner_d(lb, rotation), wigner_d(lc, rotation))
        assert np.max(np.abs(rotated - w)) < 1e-12, (la, lb, lc)


def test_projected_3j_lies_in_irreducible_subspaces_while_raw_pairing_does_not() -> None:
    top = {l: weight_projectors(l)[l] if l else np.ones((1, 1)) for l in range(4)}

    def project(t: np.ndarray, la: int, lb: int, lc: int) -> np.ndarray:
        return np.einsum("ia,jb,kc,abc->ijk", top[la], top[lb], top[lc], t, optimize=True)

    leaks = {}
    for la, lb, lc in valid_triples(3):
        z = cartesian_3j(la, lb, lc)
        assert np.max(np.abs(project(z, la, lb, lc) - z)) < 1e-12
        raw = raw_coupling(la, lb, lc)
        raw_projected = project(raw, la, lb, lc)
        leaks[(la, lb, lc)] = np.linalg.norm(raw_projected) ** 2 / np.linalg.norm(raw) ** 2
        # the raw pairing is invariant and its projection is the 3j symbol up to scale
        assert abs(cosine(raw_projected, z)) == pytest.approx(1.0, abs=1e-12)
    # the caveat of the paper: for these triples most of the raw norm is outside the subspaces
    for triple in [(2, 1, 1), (2, 2, 2), (3, 2, 1)]:
        assert leaks[triple] < 0.9, (triple, leaks[triple])
    assert leaks[(1, 1, 1)] == pytest.approx(1.0)


@pytest.mark.parametrize("triple", valid_triples(3), ids=lambda t: "".join(map(str, t)))
def test_cartesian_3j_matches_e3nn_wigner_3j_after_change_of_basis(triple: tuple[int, int, int]) -> None:
    la, lb, lc = triple
    rng = np.random.default_rng(sum(triple))
    a_a, a_b, a_c = (e3nn_sh_to_cartesian(l, rng) for l in triple)
    w3j = o3.wigner_3j(la, lb, lc, dtype=torch.float64).numpy()
    # e3nn's symbol written in Cartesian slots, through a change of basis fitted from its own SH
    z_e3nn = np.einsum("ABC,Ai,Bj,Ck->ijk", w3j, a_a, a_b, a_c)
    assert abs(cosine(cartesian_3j(la, lb, lc), z_e3nn)) == pytest.approx(1.0, abs=1e-10)
    # and in the standard basis the symbols coincide outright (sign +1)
    assert cosine(standard_3j(la, lb, lc), w3j) == pytest.approx(1.0, abs=1e-10)


IRREPS_1 = "2x0e + 2x1o + 1x2e + 1x1e"
IRREPS_2 = "1x0e + 2x1o + 1x2e + 1x3o"
IRREPS_OUT = "2x0e + 2x1o + 2x1e + 2x2e + 1x2o + 1x3o + 1x3e"


def random_features(irreps: str, batch: int, gen: torch.Generator) -> torch.Tensor:
    parsed = CartesianIrreps.parse(irreps)
    return to_cartesian(parsed, torch.randn(batch, parsed.standard_dim, dtype=torch.float64, generator=gen))


@pytest.mark.parametrize("proper", [True, False])
def test_tensor_product_layer_is_o3_equivariant(proper: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    tp = CartesianTensorProduct(IRREPS_1, IRREPS_2, IRREPS_OUT, dtype=torch.float64, generator=gen)
    x1, x2 = random_features(IRREPS_1, 6, gen), random_features(IRREPS_2, 6, gen)
    rng = np.random.default_rng(21)
    for _ in range(3):
        rotation = random_rotation(rng, proper=proper)
        lhs = tp(rotate_features(IRREPS_1, x1, rotation), rotate_features(IRREPS_2, x2, rotation))
        rhs = rotate_features(IRREPS_OUT, tp(x1, x2), rotation)
        assert torch.max(torch.abs(lhs - rhs)).item() < 1e-10
        assert torch.max(torch.abs(rhs)).item() > 1e-2  # not trivially zero


def test_tensor_product_layer_equals_e3nn_fully_connected_tensor_product_after_change_of_basis() -> None:
    gen = torch.Generator().manual_seed(1)
    tp = CartesianTensorProduct(IRREPS_1, IRREPS_2, IRREPS_OUT, dtype=torch.float64, generator=gen)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # e3nn builds its 3j buffers in the default dtype
    try:
        ref = o3.FullyConnectedTensorProduct(IRREPS_1, IRREPS_2, IRREPS_OUT)
    finally:
        torch.set_default_dtype(previous)
    assert ref.weight_numel == tp.weight_numel
    with torch.no_grad():
        ref.weight.copy_(tp.weight)
    s1 = torch.randn(5, o3.Irreps(IRREPS_1).dim, dtype=torch.float64, generator=gen)
    s2 = torch.randn(5, o3.Irreps(IRREPS_2).dim, dtype=torch.float64, generator=gen)
    ours = from_cartesian(IRREPS_OUT, tp(to_cartesian(IRREPS_1, s1), to_cartesian(IRREPS_2, s2)))
    assert torch.max(torch.abs(ours - ref(s1, s2))).item() < 1e-10


def test_tensor_product_layer_rejects_wrong_shapes_and_zero_fills_unreachable_outputs() -> None:
    tp = CartesianTensorProduct("1x1o", "1x1o", "1x0e + 1x1o", dtype=torch.float64)
    assert tp.unreachable_outputs == ["1o"]  # 1o ⊗ 1o has even parity at l = 1
    x = torch.randn(2, 3, dtype=torch.float64)
    out = tp(x, x)
    assert torch.all(out[:, 1:] == 0)
    with pytest.raises(ValueError, match="expected last dims"):
        tp(torch.randn(2, 4, dtype=torch.float64), x)
    with pytest.raises(ValueError, match="cannot parse"):
        CartesianIrreps.parse("2y1o")
    out.sum().backward()
    assert tp.weight.grad is not None and torch.any(tp.weight.grad != 0)


# ---------------------------------------------------------------- tools through JSON


@pytest.fixture()
def registry(tmp_path, monkeypatch) -> ToolRegistry:
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path / "artifacts"))
    return ToolRegistry().extend(TOOLS)


async def test_decompose_tool_splits_rank2_into_trace_antisymmetric_and_traceless_parts(registry) -> None:
    rng = np.random.default_rng(7)
    t = rng.standard_normal((3, 3))
    res = await registry.call_json("cartesian_decompose", json.dumps({"tensor": t.tolist()}))
    assert res.ok, res.error
    out = json.loads(res.content)
    parts = np.asarray(out["parts"]).reshape(3, 3, 3)
    assert out["parts_l"] == [0, 1, 2]
    assert np.allclose(parts[0], np.trace(t) / 3 * np.eye(3), atol=1e-12)
    assert np.allclose(parts[1], (t - t.T) / 2, atol=1e-12)
    assert np.allclose(parts[2], (t + t.T) / 2 - np.trace(t) / 3 * np.eye(3), atol=1e-12)
    assert sum(w["fraction"] for w in out["weights"]) == pytest.approx(1.0)


async def test_decompose_tool_reads_npy_and_saves_large_parts_as_artifact(registry, tmp_path) -> None:
    rng = np.random.default_rng(8)
    t = rng.standard_normal((3, 3, 3))
    np.save(tmp_path / "t.npy", t)
    res = await registry.call_json("cartesian_decompose", json.dumps({"tensor": str(tmp_path / "t.npy")}))
    assert res.ok, res.error
    out = json.loads(res.content)
    parts = np.load(out["parts"]["path"])
    assert parts.shape == (4, 3, 3, 3)
    assert np.max(np.abs(parts.sum(axis=0) - t)) < 1e-12
    # a fully symmetric traceless part has no lower weights: its decomposition is weight 3 only
    top = parts[3]
    res2 = await registry.call_json("cartesian_decompose", {"tensor": top.tolist()})
    norms = {w["l"]: w["norm"] for w in json.loads(res2.content)["weights"]}
    assert norms[3] == pytest.approx(np.linalg.norm(top)) and max(norms[0], norms[1], norms[2]) < 1e-12


async def test_3j_tool_returns_e3nn_symbol_in_spherical_basis_and_cross_product_in_cartesian(registry) -> None:
    res = await registry.call_json("cartesian_3j_tensor", '{"l_a": 2, "l_b": 1, "l_c": 2, "basis": "spherical"}')
    assert res.ok, res.error
    out = json.loads(res.content)
    assert out["parity"] == "odd" and out["shape"] == [5, 3, 5]
    ref = o3.wigner_3j(2, 1, 2, dtype=torch.float64).numpy()
    assert np.max(np.abs(as_array(out["tensor"]) - ref)) < 1e-10
    couple = await registry.call_json("cartesian_couple", '{"a": [1, 0, 0], "b": [0, 1, 0], "l_c": 1}')
    assert json.loads(couple.content)["result"] == pytest.approx([0.0, 0.0, 2**-0.5])
    big = await registry.call_json("cartesian_3j_tensor", '{"l_a": 2, "l_b": 2, "l_c": 2}')
    ref_path = json.loads(big.content)["tensor"]["path"]
    assert np.max(np.abs(np.load(ref_path) - cartesian_3j(2, 2, 2))) == 0.0


async def test_change_of_basis_tool_returns_orthonormal_copies(registry) -> None:
    res = await registry.call_json("cartesian_change_of_basis", '{"rank": 3, "l": 1}')
    out = json.loads(res.content)
    assert out["multiplicity"] == 3 and out["shape"] == [3, 27, 3]
    mats = np.load(out["matrices"]["path"])
    gram = np.einsum("pia,qib->pqab", mats, mats)
    assert np.max(np.abs(gram - np.einsum("pq,ab->pqab", np.eye(3), np.eye(3)))) < 1e-12


@pytest.mark.parametrize(("name", "arguments", "kind", "fragment"), [
    ("cartesian_decompose", {"tensor": [1, 2, 3, 4]}, "exception", "shape (3,)*n"),
    ("cartesian_decompose", {"tensor": [[1, 2, 3], [4, 5, 6]]}, "exception", "shape (3,)*n"),
    ("cartesian_decompose", {"tensor": "/nonexistent/t.npy"}, "exception", "outside the working root"),
    ("cartesian_3j_tensor", {"l_a": 1, "l_b": 1, "l_c": 3}, "exception", "triangle rule"),
    ("cartesian_3j_tensor", {"l_a": 7, "l_b": 1, "l_c": 1}, "invalid_arguments", "less than or equal"),
    ("cartesian_3j_tensor", {"l_a": 1, "l_b": 1}, "invalid_arguments", "l_c"),
    ("cartesian_change_of_basis", {"rank": 1, "l": 0}, "exception", "no weight-0 part"),
    ("cartesian_couple", {"a": [1, 0, 0], "b": [[1, 0, 0], [0, 1, 0], [0, 0, -2]], "l_c": 0}, "exception", "triangle"),
])
async def test_tools_report_clear_errors(registry, name, arguments, kind, fragment) -> None:
    res = await registry.call_json(name, json.dumps(arguments))
    assert not res.ok
    assert res.error_kind == kind
    assert fragment in res.error


async def test_tools_reject_non_finite_tensors(registry, tmp_path) -> None:
    bad = np.ones((3, 3))
    bad[1, 2] = np.nan
    np.save(tmp_path / "bad.npy", bad)
    res = await registry.call_json("cartesian_decompose", json.dumps({"tensor": str(tmp_path / "bad.npy")}))
    assert res.error_kind == "exception" and "NaN" in res.error
    res = await registry.call_json("cartesian_decompose", '{"tensor": "not json')
    assert res.error_kind == "malformed_json"
