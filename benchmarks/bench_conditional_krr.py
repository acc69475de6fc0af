"""Conditional KRR (closedloop.tools.conditional_krr) against scikit-learn's KernelRidge.

Empty F must match KernelRidge (same estimator), so the ratio is pure solver overhead; the
'linear F' column shows the cost of the null-space method (QR of Phi plus Z^T (K + lam I) Z).

    python benchmarks/bench_conditional_krr.py [--sizes 500 1000 2000 4000] [--repeats 3]
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.kernel_ridge import KernelRidge

from closedloop.tools.conditional_krr import ConditionalKernelRidge
from _timing import best_time_and_result as best_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    parser.add_argument("--n-test", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'n':>6} {'sklearn s':>10} {'ours(F=0) s':>12} {'ratio':>6} {'max|diff|':>10} {'ours(F=lin) s':>14} {'ratio':>6}")
    for n in args.sizes:
        rng = np.random.default_rng(n)
        x, xt = rng.uniform(-1, 1, (n, 5)), rng.uniform(-1, 1, (args.n_test, 5))
        y = np.sin(3 * x[:, 0]) + x[:, 1] + 0.1 * rng.standard_normal(n)
        params = dict(kernel="rbf", gamma=0.5, alpha=0.1)
        t_ref, p_ref = best_time(lambda: KernelRidge(**params).fit(x, y).predict(xt), args.repeats)
        t_ours, p_ours = best_time(lambda: ConditionalKernelRidge(**params).fit(x, y).predict(xt), args.repeats)
        t_lin, _ = best_time(lambda: ConditionalKernelRidge(features="linear", **params).fit(x, y).predict(xt), args.repeats)
        diff = float(np.abs(p_ref - p_ours).max())
        print(f"{n:>6} {t_ref:>10.4f} {t_ours:>12.4f} {t_ours / t_ref:>6.2f} {diff:>10.1e} {t_lin:>14.4f} {t_lin / t_ref:>6.2f}")


if __name__ == "__main__":
    main()
