"""FactGuard evaluation throughput: samples per minute at concurrency 1 and 8, in one run.

Synthetic samples (short videos, a BM25 corpus), the ``factguard`` graph on the tiny VLM (frames
shown: overview grid, ClipScout when called), greedy, short answers. Concurrency overlaps the
model calls (micro-batched by ``hf:``) with tool work (video decoding, search).

    python benchmarks/bench_factguard_eval.py --text-model /path/to/tiny [--vlm DIR] [--samples 16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vlm", help="VLM checkpoint (default: build the tiny VLM from --text-model)")
    ap.add_argument("--text-model")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    import torch

    from closedloop.evals.factguard.data import load_samples
    from closedloop.evals.factguard.evaluate import evaluate_factguard
    from closedloop.evals.factguard.synthetic import make_synthetic
    from closedloop.models import SamplingParams, make_client
    from closedloop.tools.factprobe import LocalCorpus

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    vlm = args.vlm
    if vlm is None:
        if not args.text_model:
            ap.error("give --vlm or --text-model")
        from closedloop.models.tiny_vlm import build_tiny_vlm

        vlm = str(build_tiny_vlm(tmp / "vlm", args.text_model))
    make_synthetic(tmp / "data", n=args.samples, frames=16)
    samples = load_samples(tmp / "data")
    client = make_client(f"hf:{vlm}")
    backend = LocalCorpus(tmp / "data" / "corpus.duckdb")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rates = {}
    for c in (1, 8):
        report = evaluate_factguard(samples, client, backend, vision=True, params=params, concurrency=c,
                                    max_side=56)
        rates[c] = report.samples_per_minute
        errors = sum(r.error is not None for r in report.results)
        print(f"concurrency {c}: {report.samples_per_minute:8.1f} samples/min ({errors} errors)")
    print(f"speedup 8 vs 1: {rates[8] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
