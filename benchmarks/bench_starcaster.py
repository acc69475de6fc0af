"""STARCaster metrics (closedloop.tools.starcaster) against straightforward reference versions.

* sync: our vectorised SyncNet offset search vs SyncNet's own per-frame loop (syncnet_python's
  calc_pdist: torch pairwise_distance of each video frame against a window of 2*vshift+1 padded
  audio frames), on 1024-d features (SyncNet's embedding size); both must give the same distances.
* FVD: our Fréchet distance vs pytorch-fid's formula written inline (numpy cov + scipy sqrtm) on
  400-d features (I3D logits' size).

    python benchmarks/bench_starcaster.py [--frames 250 1000 4000] [--repeats 3]
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.linalg as sla
import torch
import torch.nn.functional as F

from closedloop.tools.starcaster import av_sync, frechet_distance, gaussian_fit
from _timing import best_time_and_result as best_time


def syncnet_loop(v: np.ndarray, a: np.ndarray, vshift: int) -> np.ndarray:
    vid, aud = torch.from_numpy(v), torch.from_numpy(a)
    win = vshift * 2 + 1
    aud_p = F.pad(aud, (0, 0, vshift, vshift))
    dists = [F.pairwise_distance(vid[[i], :].repeat(win, 1), aud_p[i:i + win, :], eps=0.0) for i in range(len(vid))]
    return torch.mean(torch.stack(dists, 1), 1).numpy()


def fid_reference(f1: np.ndarray, f2: np.ndarray) -> float:
    mu1, mu2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    covmean = sla.sqrtm(s1.dot(s2)).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[250, 1000, 4000])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vshift", type=int, default=15)
    parser.add_argument("--fvd-n", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"sync (D={args.dim}, vshift={args.vshift})")
    print(f"{'frames':>7} {'SyncNet loop s':>15} {'ours s':>8} {'ratio':>6} {'max|diff|':>10} {'offset':>7}")
    for t in args.frames:
        rng = np.random.default_rng(t)
        a = rng.standard_normal((t, args.dim))
        v = np.roll(a, 3, axis=0) + 0.5 * rng.standard_normal((t, args.dim))
        t_ref, ref = best_time(lambda: syncnet_loop(v, a, args.vshift), args.repeats)
        t_ours, ours = best_time(lambda: av_sync(v, a, args.vshift), args.repeats)
        diff = float(np.abs(np.asarray(ours.mean_distance) - ref).max())
        print(f"{t:>7} {t_ref:>15.4f} {t_ours:>8.4f} {t_ours / t_ref:>6.2f} {diff:>10.1e} {ours.offset:>7}")
    print("FVD (D=400)")
    print(f"{'n':>7} {'pytorch-fid formula s':>22} {'ours s':>8} {'ratio':>6} {'|diff|':>10}")
    for n in args.fvd_n:
        rng = np.random.default_rng(n)
        f1, f2 = rng.standard_normal((n, 400)), 1.1 * rng.standard_normal((n, 400)) + 0.1
        t_ref, ref = best_time(lambda: fid_reference(f1, f2), args.repeats)
        t_ours, ours = best_time(lambda: frechet_distance(*gaussian_fit(f1), *gaussian_fit(f2)), args.repeats)
        print(f"{n:>7} {t_ref:>22.4f} {t_ours:>8.4f} {t_ours / t_ref:>6.2f} {abs(ours - ref):>10.1e}")


if __name__ == "__main__":
    main()
