"""Spike Dice Attention vs dot-product spiking attention: CPU time and density bias.

Times the attention forward pass (scores, spiking binarisation, product with V) of SDA and
Lin-SDA against Spikformer-style dot-product attention at a few sizes, then prints how strongly
each score follows firing density (Pearson r with C(q)+C(k)) and, for spikes built from shared
prototypes, how well it separates relevant pairs (AUC), over several firing-rate ranges.

    python benchmarks/bench_spike_dice_attention.py [--sizes 1x8x64x64 4x8x256x64 4x8x1024x64]
"""

from __future__ import annotations

import argparse
import time

import torch

from closedloop.tools.spike_dice_attention import (
    SpikingAttention,
    density_correlation,
    dot_product_scores,
    lin_dice_scores,
    random_spikes,
    relevance_auc,
    spike_dice_scores,
)


def best_time(fn, repeats: int) -> float:
    for _ in range(3):  # warm-up: first calls pay for allocation and thread start-up
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["1x8x64x64", "4x8x256x64", "4x8x1024x64"],
                    help="B x H x N x D")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    print(f"== forward time, {args.dtype}, {torch.get_num_threads()} threads (best of {args.repeats}) ==")
    print(f"{'B x H x N x D':>16} {'dot ms':>8} {'SDA ms':>8} {'SDA/dot':>8} {'Lin ms':>8} {'Lin/dot':>8}")
    mods = {k: SpikingAttention(k, binarize=True) for k in ("dot", "sda", "lin_sda")}
    with torch.no_grad():
        for size in args.sizes:
            b, h, n, d = (int(v) for v in size.lower().split("x"))
            pair = random_spikes(b, h, n, d, seed=0, dtype=dtype)
            v = random_spikes(b, h, n, d, seed=1, dtype=dtype).q
            t = {k: best_time(lambda m=m: m(pair.q, pair.k, v), args.repeats) for k, m in mods.items()}
            print(f"{size:>16} {1e3 * t['dot']:>8.2f} {1e3 * t['sda']:>8.2f} {t['sda'] / t['dot']:>8.2f} "
                  f"{1e3 * t['lin_sda']:>8.2f} {t['lin_sda'] / t['dot']:>8.2f}")

    print("\n== density bias: Pearson r(score, C(q)+C(k)); AUC same-vs-different prototype (B=4, H=4, N=D=64) ==")
    print(f"{'structure':>11} {'rates':>11} {'r dot':>7} {'r SDA':>7} {'r Lin':>7} {'AUC dot':>8} {'AUC SDA':>8} {'AUC Lin':>8}")
    for structure in ("independent", "prototype"):
        for lo, hi in ((0.02, 0.2), (0.05, 0.5), (0.1, 0.9)):
            pair = random_spikes(4, 4, 64, 64, rate_low=lo, rate_high=hi, structure=structure, seed=0)
            scores = {"dot": dot_product_scores(pair.q, pair.k), "sda": spike_dice_scores(pair.q, pair.k),
                      "lin": lin_dice_scores(pair.q, pair.k, 0.25)}
            r = {k: density_correlation(s, pair.q, pair.k) for k, s in scores.items()}
            if pair.q_group is not None:
                auc = {k: f"{relevance_auc(s, pair.q_group, pair.k_group):8.3f}" for k, s in scores.items()}
            else:
                auc = {k: f"{'-':>8}" for k in scores}
            print(f"{structure:>11} {f'{lo}-{hi}':>11} {r['dot']:>7.3f} {r['sda']:>7.3f} {r['lin']:>7.3f} "
                  f"{auc['dot']} {auc['sda']} {auc['lin']}")


if __name__ == "__main__":
    main()
