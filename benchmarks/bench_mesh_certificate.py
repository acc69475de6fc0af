"""Compatibility certificate and nearest-compatible projection: sparse path against dense numpy.

For grid meshes with exact incidence operators plus 5% multiplicative noise (a 'learned' pair):

* certificate ||D1 D0||_F: sparse matmul vs dense numpy matmul;
* projection D1' = D1 (I - D0 D0^+): dense (SVD orthonormal basis of im D0, then D1 - (D1 Q) Q^T)
  vs sparse (one sparse LU of D0^T D0 + shift, matrix-free D1'); the sparse column times
  materialising the whole D1' (same output as dense) and, separately, the at-scale use: setting
  up the projector and certifying the projected pair with Hutchinson probes.
* sparse only, large meshes (--large): 1e5 and 1e6 edges.

    python benchmarks/bench_mesh_certificate.py [--sizes 10 20 40] [--large]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.linalg as sla

from closedloop.tools.mesh_certificate import certificate, grid_mesh, incidence_matrices, perturb, project_compatible


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def noisy_pair(n: int):
    _, faces = grid_mesh(n)
    d0, d1, edges = incidence_matrices(faces)
    rng = np.random.default_rng(n)
    return perturb(d0, 0.05, rng), perturb(d1, 0.05, rng), len(edges)


def dense_rows(sizes: list[int]) -> None:
    print(f"{'edges':>7} | {'cert dense s':>12} {'cert sparse s':>13} {'ratio':>7} | {'proj dense s':>12} "
          f"{'proj sparse(full) s':>19} {'ratio':>6} {'max|diff|':>9} | {'sparse setup+cert s':>19} {'defect after':>12}")
    for n in sizes:
        s0, s1, ne = noisy_pair(n)
        a0, a1 = s0.toarray(), s1.toarray()
        t_cd, c_dense = timed(lambda: (np.linalg.norm(a1 @ a0), np.linalg.norm(a0), np.linalg.norm(a1)))
        t_cs, c_sparse = timed(lambda: certificate(s0, s1))
        assert abs(c_dense[0] - c_sparse.defect) <= 1e-10 * c_dense[0]

        def dense_projection():
            q = sla.orth(a0)
            return a1 - (a1 @ q) @ q.T

        t_pd, x_dense = timed(dense_projection)
        t_ps, x_sparse = timed(lambda: project_compatible(s0, s1, mode="d1", n_probes=4).d1.toarray())
        t_at, after = timed(lambda: certificate(s0, project_compatible(s0, s1, mode="d1", n_probes=4).d1, n_probes=4))
        diff = float(np.abs(x_dense - x_sparse).max())
        print(f"{ne:>7} | {t_cd:>12.4f} {t_cs:>13.4f} {t_cd / t_cs:>7.1f} | {t_pd:>12.4f} {t_ps:>19.4f} "
              f"{t_pd / t_ps:>6.2f} {diff:>9.1e} | {t_at:>19.4f} {after.relative:>12.1e}")


def large_rows(sizes: list[int]) -> None:
    print(f"\nsparse only (dense D1 would need F x E doubles)\n{'edges':>8} {'dense GB':>9} | {'cert s':>7} "
          f"{'defect rel':>10} | {'proj setup+cert s':>17} {'defect rel after':>16} {'dist (est.)':>11}")
    for n in sizes:
        s0, s1, ne = noisy_pair(n)
        t_c, before = timed(lambda: certificate(s0, s1))
        t_p, (res, after) = timed(lambda: (lambda r: (r, certificate(r.d0, r.d1, n_probes=4)))(
            project_compatible(s0, s1, mode="d1", n_probes=4)))
        gb = s1.shape[0] * s1.shape[1] * 8 / 1e9
        print(f"{ne:>8} {gb:>9.0f} | {t_c:>7.3f} {before.relative:>10.1e} | {t_p:>17.2f} {after.relative:>16.1e} "
              f"{res.distance:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 20, 40])
    parser.add_argument("--large", action="store_true", help="also 1e5 and 1e6 edges, sparse only")
    args = parser.parse_args()
    dense_rows(args.sizes)
    if args.large:
        large_rows([183, 577])


if __name__ == "__main__":
    main()
