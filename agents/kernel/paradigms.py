"""What EGG's stages explore (paper 2): algorithmic paradigms for stage-A seeds, semantics-preserving
refinements, and the ordered hardware-tuning steps of stage B with their per-backend meaning.

Seeds start from *different algorithms* for the same computation (im2col vs direct convolution,
online vs three-pass softmax) so the search does not begin with one structure and only polish
it. :func:`seed_paradigms` picks operator-specific paradigms from the problem's source by
keyword, then generic ones, so every problem gets ``k`` distinct seeds.
"""

from __future__ import annotations

import re

__all__ = ["seed_paradigms", "GENERIC_PARADIGMS", "OPERATOR_PARADIGMS", "REFINEMENTS", "TUNING_STEPS",
           "TUNING_GUIDES"]

GENERIC_PARADIGMS = (
    "direct: one loop nest that mirrors the reference computation output element by output element",
    "fused single pass: compute the whole chain for each output without materialising intermediate tensors",
    "blocked: split the iteration space into cache-sized tiles that are processed independently",
    "vectorised rows: process contiguous rows with inner loops the compiler can vectorise",
)

#: (pattern over the problem's source, paradigms), most specific first.
OPERATOR_PARADIGMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"conv", ("direct convolution: loop over output positions and accumulate over the kernel window",
               "im2col + GEMM: unfold input patches into a matrix and multiply it by the flattened weights")),
    (r"softmax|logsumexp", ("three-pass softmax: row max, sum of exponentials, then normalise",
                            "online softmax: one pass keeping a running max and a rescaled running sum")),
    (r"layer_?norm|batch_?norm|group_?norm|instance_?norm|rms_?norm|LayerNorm|BatchNorm|GroupNorm|RMSNorm",
     ("two-pass statistics: mean first, then variance, then normalise",
      "one-pass Welford statistics: running mean and M2 in a single sweep")),
    (r"matmul|\bmm\b|bmm|Linear|einsum|\s@\s", (
        "blocked GEMM: tiles of A, B and C sized for cache, accumulating a C tile in registers",
        "outer-product accumulation: for each k, add A[:, k] ⊗ B[k, :] into C rows (streams B row-wise)")),
    (r"pool", ("direct pooling: one window per output element",
               "separable pooling: reduce along one spatial axis, then the other")),
    (r"\bsum\b|mean|\bmax\b|\bmin\b|argmax|argmin|cumsum|cumprod|norm", (
        "sequential reduction: each worker reduces whole rows on its own",
        "tree reduction: partial results per worker, combined in a final pass")),
)

REFINEMENTS = (
    "operator fusion: merge consecutive elementwise and reduction steps into one pass over memory",
    "online / single-pass statistics (e.g. online softmax: running max with a rescaled sum) instead of "
    "separate passes",
    "algebraic simplification: fold constants and scalings, reorder operations to do less work, skip work "
    "whose result is discarded",
    "remove intermediate buffers and redundant passes over memory",
)

#: Stage B, in this order: where the work runs, how it is blocked, how memory is touched.
TUNING_STEPS = ("parallel_mapping", "tiling", "memory")

TUNING_GUIDES: dict[str, dict[str, str]] = {
    "cpu": {
        "parallel_mapping": "how work is split across OpenMP threads: which loop carries `#pragma omp parallel for`, "
                            "collapse(n) for short outer loops, schedule(static) for even work, no false sharing of "
                            "output cache lines between threads",
        "tiling": "cache blocking: tile sizes so a tile's working set fits L1/L2, register blocking of the inner "
                  "loop, loop order so the innermost loop walks contiguous memory",
        "memory": "memory access: contiguous (unit-stride) inner loops, `#pragma omp simd`, __restrict__ pointers, "
                  "no temporaries in the inner loop, hoisted index arithmetic, fewer passes over large tensors",
    },
    "triton": {
        "parallel_mapping": "the launch grid and program-id mapping: which output tiles each program owns, "
                            "enough programs to fill the device",
        "tiling": "BLOCK_M/BLOCK_N/BLOCK_K (or BLOCK_SIZE) choices: powers of two sized to the problem, masks "
                  "for the ragged edges",
        "memory": "num_warps and num_stages, coalesced tl.load/tl.store along the contiguous axis, fewer round "
                  "trips to global memory",
    },
    "cuda": {
        "parallel_mapping": "grid and block dimensions and the thread-to-element mapping: enough blocks per SM, "
                            "warps aligned with the contiguous axis",
        "tiling": "shared-memory tiles and register tiles: tile sizes that reuse loaded data, thread coarsening",
        "memory": "coalesced global loads, vectorised (float4) access, shared-memory bank conflicts, fewer global "
                  "round trips, occupancy vs registers",
    },
}


def seed_paradigms(problem_source: str, k: int = 3) -> list[str]:
    """``k`` distinct paradigms for this problem: operator-specific ones first, then generic ones."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    chosen: list[str] = []
    for pattern, paradigms in OPERATOR_PARADIGMS:
        if re.search(pattern, problem_source):
            chosen += [p for p in paradigms if p not in chosen]
    chosen += [p for p in GENERIC_PARADIGMS if p not in chosen]
    return chosen[:k]
