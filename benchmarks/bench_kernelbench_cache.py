"""KernelBench harness speed: the build cache and parallel compilation.

1. Cache: evaluate one unchanged CPU candidate on P problems at scale 1/64, cold (empty cache:
   the first problem builds the extension, the others share it because the cache is keyed by
   the extension's source) and warm (every build cached). Reported per problem; the goal is
   <= 1 s per problem warm. The peer is the cold evaluation of the same problems.
   The peer for the fork server is the same warm evaluation with a fresh interpreter per
   sandbox (``fork_server=False``).
2. Compile throughput: K distinct kernels (different sources, so nothing is shared) built with
   one worker vs ``--workers`` workers (default: every core); reported as kernels per minute
   and the ratio.

    python benchmarks/bench_kernelbench_cache.py                    # P=4, K=4
    python benchmarks/bench_kernelbench_cache.py --problems 8 --kernels 8 --workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from closedloop.evals.kernelbench.evaluate import KernelEvalConfig, KernelEvaluator  # noqa: E402
from closedloop.evals.kernelbench.problems import load_problems  # noqa: E402
from closedloop.sandbox import run_sandboxed  # noqa: E402

PROBLEM = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


batch_size = {batch}
dim = 65536


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
'''

KERNEL = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
torch::Tensor relu_fwd(torch::Tensor x) {{
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const float* in = xc.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const int64_t n = xc.numel();
    const float floor_value = {floor}f;
    #pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) o[i] = in[i] > floor_value ? in[i] : floor_value;
    return out;
}}
"""
ext = load_inline(name="bench_relu_{tag}", cpp_sources=src, functions=["relu_fwd"],
                  extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.relu_fwd(x)
'''


def make_problems(root: Path, n: int) -> list:
    lvl = root / "level1"
    lvl.mkdir(parents=True)
    for i in range(1, n + 1):
        (lvl / f"{i}_ReLU_{i}.py").write_text(PROBLEM.format(batch=64 * i))
    return load_problems(root, level=1)


def cfg(cache: Path, workers: int, fork_server: bool = True) -> KernelEvalConfig:
    return KernelEvalConfig(cache_dir=str(cache), scale=1 / 64, trials=3, warmup=1, iters=10, compile_workers=workers,
                            fork_server=fork_server)


async def evaluate_all(ev: KernelEvaluator, problems, code: str) -> list:
    return [await ev.aevaluate(p, code) for p in problems]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--kernels", type=int, default=4)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-kb-"))
    try:
        problems = make_problems(tmp / "problems", args.problems)
        code = KERNEL.format(floor="0.0", tag="shared")

        cache = tmp / "cache"
        t0 = time.perf_counter()
        cold = asyncio.run(evaluate_all(KernelEvaluator(cfg(cache, 1)), problems, code))
        cold_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = asyncio.run(evaluate_all(KernelEvaluator(cfg(cache, 1)), problems, code))
        warm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        spawn = asyncio.run(evaluate_all(KernelEvaluator(cfg(cache, 1, fork_server=False)), problems, code))
        spawn_s = time.perf_counter() - t0
        statuses = {r.status for r in cold + warm + spawn}
        builds_cold = sum(not b["cached"] for r in cold for b in r.builds)
        hits = all(b["cached"] for r in warm for b in r.builds)
        print(f"cache: {args.problems} problems at scale 1/64, statuses {sorted(statuses)}")
        print(f"  cold (empty cache): {cold_s:.2f} s total, {cold_s / args.problems:.2f} s/problem, "
              f"{builds_cold} build(s) for {args.problems} problems (the kernel is shared)")
        print(f"  warm (unchanged candidate): {warm_s:.2f} s total, {warm_s / args.problems:.2f} s/problem, "
              f"all cache hits: {hits}; goal <= 1 s/problem: {'met' if warm_s / args.problems <= 1.0 else 'NOT met'}")
        print(f"  speedup warm vs cold: {cold_s / warm_s:.1f}x")
        print(f"  warm, fresh interpreter per sandbox (fork_server=False, the peer): {spawn_s:.2f} s total, "
              f"{spawn_s / args.problems:.2f} s/problem; fork server vs fresh interpreter: {spawn_s / warm_s:.2f}x")
        sb = [r.sandbox.get("wall_s", 0.0) for r in warm]
        print(f"  warm sandbox wall per problem (fork + checks + timing): "
              f"min {min(sb):.2f} s, max {max(sb):.2f} s")
        floor = []
        for _ in range(3):
            t0 = time.perf_counter()
            run_sandboxed("torch:get_num_threads")
            floor.append(time.perf_counter() - t0)
        forked = []
        for _ in range(3):
            t0 = time.perf_counter()
            run_sandboxed("torch:get_num_threads", preload=["torch"])
            forked.append(time.perf_counter() - t0)
        print(f"  floor (a sandbox that only imports torch): {min(floor):.2f} s fresh, {min(forked[1:]):.3f} s "
              f"forked from a server that preloaded torch (its start: {forked[0]:.2f} s, once)")

        codes = [KERNEL.format(floor=f"{-0.001 * (k + 1):.4f}", tag=f"k{k}") for k in range(args.kernels)]
        items = [(problems[0], c, k) for k, c in enumerate(codes)]
        rates = {}
        for workers in sorted({1, args.workers}):
            cache_w = tmp / f"cache-w{workers}"
            ev = KernelEvaluator(cfg(cache_w, workers))

            async def build_all():
                return await asyncio.gather(*(ev.acompile(*it) for it in items))

            t0 = time.perf_counter()
            built = asyncio.run(build_all())
            dt = time.perf_counter() - t0
            ok = sum(r.status == "compiled" for r in built)
            rates[workers] = args.kernels / dt * 60
            print(f"compile: {args.kernels} distinct kernels, {workers} worker(s): {dt:.1f} s "
                  f"({rates[workers]:.1f} kernels/min, {ok} built)")
        if len(rates) > 1:
            print(f"  throughput {args.workers} workers vs 1: {rates[args.workers] / rates[1]:.2f}x "
                  f"on {os.cpu_count()} cores")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
