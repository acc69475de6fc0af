"""CGP probe vs the official BAT head: forward time on identical inputs, and the agreement.

Times our ``CGPProbe`` (einsum mixing, optional mask) against the verbatim official ``CGP`` head
(tests/tools/_cgp_reference.py, conv1x1 prototypes) with the same weights, on ViT-sized layer
features (L layers, B clips, D dims, T×F patches, P prototypes), and prints the ratio and the
largest difference of their logits.

    python benchmarks/bench_cgp_probe.py [--sizes 12x8x768x8x8x1000 12x8x768x32x8x10000]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from closedloop.tools.cgp_probe import CGPProbe
from _timing import best_time


def official_class():
    path = Path(__file__).resolve().parents[1] / "tests" / "tools" / "_cgp_reference.py"
    spec = importlib.util.spec_from_file_location("_cgp_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.OfficialCGP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["12x8x768x8x8x1000", "12x8x768x32x8x10000"],
                    help="L x B x D x T x F x P")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--classes", type=int, default=527)
    args = ap.parse_args()
    official_cls = official_class()
    print(f"== CGP forward (eval, float32, {torch.get_num_threads()} threads, best of {args.repeats}) ==")
    print(f"{'L x B x D x T x F x P':>24} {'official ms':>12} {'ours ms':>9} {'ours/off':>9} {'max |Δlogit|':>13}")
    with torch.no_grad():
        for size in args.sizes:
            L, B, D, T, Fq, P = (int(v) for v in size.lower().split("x"))
            torch.manual_seed(0)
            ours = CGPProbe(args.classes, D, L, P).eval()
            official = official_cls(args.classes, D, P, L).eval()
            official.load_state_dict(ours.state_dict())
            patch, cls = torch.randn(L, B, D, T, Fq), torch.randn(L, B, D)
            t_off = best_time(lambda: official({"patch_tokens": patch, "cls_tokens": cls}), args.repeats)
            t_ours = best_time(lambda: ours(patch, cls), args.repeats)
            diff = float((ours(patch, cls) - official({"patch_tokens": patch, "cls_tokens": cls})).abs().max())
            print(f"{size:>24} {1e3 * t_off:>12.2f} {1e3 * t_ours:>9.2f} {t_ours / t_off:>9.2f} {diff:>13.2e}")


if __name__ == "__main__":
    main()
