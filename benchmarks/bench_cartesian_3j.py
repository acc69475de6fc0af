"""Cartesian-3j symbols and the Cartesian tensor product against e3nn, in one run.

Three comparisons, each with the ratio ours / e3nn (above 1: we are slower):

1. 3j symbols for every valid (l_a, l_b, l_c) with l ≤ ``--lmax``: ours cold (caches cleared,
   built from δ/ε and the ladder basis), ours warm (cached copy) and ``o3.wigner_3j``.
2. Tensor product forward (and forward+backward) of ``--mul`` copies of 0e+1o+2e(+3o...) with
   itself, batch ``--batch``: ``CartesianTensorProduct`` (3**l components per copy) vs
   ``o3.FullyConnectedTensorProduct`` (2l+1), the same paths and weights; the output difference
   after the change of basis is printed as a correctness check.

    python benchmarks/bench_cartesian_3j.py --lmax 2 --mul 16 --batch 1024 --repeats 20 --threads 1
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Callable

import torch
from e3nn import o3
from rich.console import Console
from rich.table import Table

from closedloop.tools.cartesian import cartesian_3j, clear_caches
from closedloop.tools.cartesian.layer import CartesianTensorProduct, from_cartesian, to_cartesian


def timed(fn: Callable[[], object], repeats: int, warmup: int = 2, sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time in seconds over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def triples(lmax: int) -> list[tuple[int, int, int]]:
    return [t for t in itertools.product(range(lmax + 1), repeat=3) if abs(t[0] - t[1]) <= t[2] <= t[0] + t[1]]


def bench_3j(lmax: int, repeats: int) -> list[tuple[str, float, float]]:
    ts = triples(lmax)

    def ours_cold() -> None:
        clear_caches()
        for t in ts:
            cartesian_3j(*t)

    def ours_warm() -> None:
        for t in ts:
            cartesian_3j(*t)

    def e3nn_3j() -> None:
        for t in ts:
            o3.wigner_3j(*t, dtype=torch.float64)

    ref = timed(e3nn_3j, repeats)
    return [(f"3j cold, {len(ts)} triples l<={lmax}", timed(ours_cold, max(3, repeats // 5), warmup=0), ref),
            (f"3j warm, {len(ts)} triples l<={lmax}", timed(ours_warm, repeats), ref)]


def bench_tp(lmax: int, mul: int, batch: int, repeats: int, dtype: torch.dtype, device: str) -> tuple[list[tuple[str, float, float]], float]:
    irreps = " + ".join(f"{mul}x{l}{'e' if l % 2 == 0 else 'o'}" for l in range(lmax + 1))
    gen = torch.Generator().manual_seed(0)
    ours = CartesianTensorProduct(irreps, irreps, irreps, dtype=dtype, generator=gen).to(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        ref = o3.FullyConnectedTensorProduct(irreps, irreps, irreps).to(device)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
    s1 = torch.randn(batch, o3.Irreps(irreps).dim, dtype=dtype, generator=gen).to(device)
    s2 = torch.randn(batch, o3.Irreps(irreps).dim, dtype=dtype, generator=gen).to(device)
    c1, c2 = to_cartesian(irreps, s1), to_cartesian(irreps, s2)
    with torch.no_grad():
        diff = float((from_cartesian(irreps, ours(c1, c2)) - ref(s1, s2)).abs().max())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def fwd(module, a, b):
        def run() -> None:
            with torch.no_grad():
                module(a, b)
        return run

    def fwd_bwd(module, a, b):
        def run() -> None:
            module.zero_grad(set_to_none=True)
            module(a, b).pow(2).sum().backward()
        return run

    label = f"TP {irreps} x same, batch {batch}, {str(dtype).replace('torch.', '')}, {device}"
    rows = [(f"{label} fwd", timed(fwd(ours, c1, c2), repeats, sync=sync), timed(fwd(ref, s1, s2), repeats, sync=sync)),
            (f"{label} fwd+bwd", timed(fwd_bwd(ours, c1, c2), repeats, sync=sync),
             timed(fwd_bwd(ref, s1, s2), repeats, sync=sync))]
    return rows, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lmax", type=int, default=2, help="largest l in the tensor-product irreps")
    parser.add_argument("--lmax-3j", type=int, default=3, help="largest l of the 3j triples")
    parser.add_argument("--mul", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 for a stable ratio)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--float64", action="store_true", help="tensor products in float64 (default float32)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = bench_3j(args.lmax_3j, args.repeats)
    tp_rows, diff = bench_tp(args.lmax, args.mul, args.batch, args.repeats,
                             torch.float64 if args.float64 else torch.float32, args.device)
    rows += tp_rows
    import e3nn

    table = Table(title=f"Cartesian-3j vs e3nn {e3nn.__version__} (median of {args.repeats}, {args.threads} thread(s))")
    for col in ("case", "ours [ms]", "e3nn [ms]", "ours / e3nn"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for name, ours, ref in rows:
        table.add_row(name, f"{ours * 1e3:.3f}", f"{ref * 1e3:.3f}", f"{ours / ref:.2f}")
    console = Console()
    console.print(table)
    console.print(f"max |ours - e3nn| on TP outputs after change of basis: {diff:.2e}")


if __name__ == "__main__":
    main()
