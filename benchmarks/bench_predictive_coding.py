"""Width/depth sweep of predictive-coding networks against backprop (arXiv 2602.07697).

For linear residual nets (closed-form equilibrium) under SP, NTP and μPC: the equilibrium
energy over the BP loss, F*/ℒ, and the cosine between PC and BP weight gradients, over a grid
of widths and depths; then the same for tanh nets, where the equilibrium comes from running
the inference dynamics. Prints tables and saves a figure (PNG).

    python benchmarks/bench_predictive_coding.py [--widths 8 16 ... 1024] [--depths 4 8 16 31]
        [--nonlinear-widths 16 64 256] [--out pc_width_depth_sweep.png]
"""

from __future__ import annotations

import argparse
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from closedloop.tools.predictive_coding import compare_pc_bp, init_network  # noqa: E402

PARAMS = ("sp", "ntp", "mupc")


def data(d_in: int, d_out: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, d_in, generator=g, dtype=torch.float64),
            torch.randn(batch, d_out, generator=g, dtype=torch.float64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 31])
    ap.add_argument("--nonlinear-widths", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--nonlinear-depth", type=int, default=8)
    ap.add_argument("--input-dim", type=int, default=16)
    ap.add_argument("--output-dim", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3, help="results are averaged over this many seeds")
    ap.add_argument("--out", default="pc_width_depth_sweep.png")
    args = ap.parse_args()

    results: dict[tuple[str, int, int], tuple[float, float]] = {}
    start = time.perf_counter()
    for pt in PARAMS:
        print(f"\n== {pt} (linear, residual, closed-form equilibrium; mean of {args.seeds} seeds) ==")
        print(f"{'depth':>5} {'width':>6} {'F*/L':>8} {'cos(PC,BP)':>11}")
        for depth in args.depths:
            for width in args.widths:
                ratio = cos = 0.0
                for seed in range(args.seeds):
                    x, y = data(args.input_dim, args.output_dim, args.batch, seed)
                    al = compare_pc_bp(init_network(args.input_dim, width, depth, args.output_dim, param_type=pt,
                                                    seed=seed), x, y, "closed_form")
                    ratio += al.ratio / args.seeds
                    cos += al.cosine / args.seeds
                results[(pt, depth, width)] = (ratio, cos)
                print(f"{depth:>5} {width:>6} {ratio:>8.4f} {cos:>11.4f}")
    print(f"\nclosed-form sweep: {time.perf_counter() - start:.1f} s")

    print(f"\n== mupc, tanh, depth {args.nonlinear_depth}: equilibrium by inference (gradient descent on activities) ==")
    print(f"{'width':>6} {'F/L':>8} {'cos(PC,BP)':>11} {'steps':>6} {'converged':>9} {'seconds':>8}")
    nonlinear = []
    x, y = data(args.input_dim, args.output_dim, args.batch, 0)
    for width in args.nonlinear_widths:
        t0 = time.perf_counter()
        net = init_network(args.input_dim, width, args.nonlinear_depth, args.output_dim, param_type="mupc",
                           activation="tanh", seed=0)
        al = compare_pc_bp(net, x, y, "inference", tol=1e-8, max_steps=50000)
        nonlinear.append((width, al.ratio, al.cosine))
        print(f"{width:>6} {al.ratio:>8.4f} {al.cosine:>11.4f} {al.inference.steps:>6} "
              f"{str(al.inference.converged):>9} {time.perf_counter() - t0:>8.2f}")

    fig, axes = plt.subplots(2, len(PARAMS), figsize=(4.2 * len(PARAMS), 7), sharex=True, sharey="row")
    for col, pt in enumerate(PARAMS):
        for depth in args.depths:
            for row in (0, 1):
                axes[row, col].plot(args.widths, [results[(pt, depth, w)][row] for w in args.widths],
                                    marker="o", ms=3, label=f"L={depth} (linear)")
        if pt == "mupc" and nonlinear:
            for row in (0, 1):
                axes[row, col].plot([w for w, *_ in nonlinear], [r[1 + row] for r in nonlinear], "k--", marker="x",
                                    label=f"L={args.nonlinear_depth} (tanh, inference)")
        axes[0, col].set_title(pt)
        axes[1, col].set_xlabel("width N")
        for row in (0, 1):
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].axhline(1.0, color="grey", lw=0.8)
            axes[row, col].grid(alpha=0.3)
    axes[0, 0].set_ylabel("F* / BP loss")
    axes[1, 0].set_ylabel("cos(PC grad, BP grad)")
    axes[0, -1].legend(fontsize=7)
    fig.suptitle("Predictive coding at equilibrium vs backprop (residual nets)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
