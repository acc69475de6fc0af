"""FoG-A cost: hook-based layer skipping vs rebuilding the stack by hand, and vs one forward.

FoG-A needs L + 1 forward passes per probe batch. This times ``fog_deltas`` (a forward hook turns
block ℓ into the identity) against a straightforward reference that reruns the blocks in a Python
loop leaving block ℓ out, on a residual MLP stack, and prints the ratio, the agreement of the two
Δ vectors, and the cost relative to a single forward (ideally ≈ L + 1).

    python benchmarks/bench_fog_attribution.py [--layers 12 24] [--width 256] [--tokens 512]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

from closedloop.tools.fog_attribution import fog_deltas
from _timing import best_time


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 80)  # a mel-sized velocity head

    def forward(self, x, skip: int | None = None):
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = b(x)
        return self.head(x)


@torch.no_grad()
def reference(model: Stack, batches) -> np.ndarray:
    out = np.zeros(len(model.blocks))
    for x in batches:
        v = model(x)
        for i in range(len(model.blocks)):
            out[i] += float((model(x, skip=i) - v).pow(2).mean().sqrt() / v.pow(2).mean().sqrt())
    return out / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"== FoG-A over one probe batch ({args.tokens} tokens × {args.width}), {torch.get_num_threads()} threads ==")
    print(f"{'layers':>6} {'forward ms':>11} {'ref ms':>9} {'FoG-A ms':>9} {'FoG/ref':>8} {'FoG/forward':>12} {'max |ΔΔ|':>9}")
    for n in args.layers:
        torch.manual_seed(0)
        model = Stack(n, args.width).eval()
        batches = [torch.randn(args.tokens, args.width)]
        with torch.no_grad():
            t_fwd = best_time(lambda: model(batches[0]), args.repeats)
        t_ref = best_time(lambda: reference(model, batches), args.repeats)
        t_fog = best_time(lambda: fog_deltas(model, model.blocks, batches), args.repeats)
        diff = float(np.abs(fog_deltas(model, model.blocks, batches) - reference(model, batches)).max())
        print(f"{n:>6} {1e3 * t_fwd:>11.2f} {1e3 * t_ref:>9.2f} {1e3 * t_fog:>9.2f} {t_fog / t_ref:>8.2f} "
              f"{t_fog / t_fwd:>12.1f} {diff:>9.1e}")


if __name__ == "__main__":
    main()
