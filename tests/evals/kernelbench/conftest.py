"""Shared, session-scoped KernelBench fixtures: one build cache for the whole session, so every
candidate that uses the shared ReLU kernel (the correct one and most hostile ones) compiles once."""

from __future__ import annotations

from pathlib import Path

import pytest

from closedloop.sandbox import SandboxLimits
from closedloop.evals.kernelbench.evaluate import KernelEvalConfig, KernelEvaluator
from closedloop.evals.kernelbench.problems import load_problems

HERE = Path(__file__).parent
PROBLEMS = HERE / "problems"
RELU_OK = (HERE / "candidates" / "relu_ok.py").read_text()
# The kernel every shared candidate uses, verbatim from relu_ok.py (same source, same cache key).
KERNEL = RELU_OK.split("class ModelNew")[0]


def config(cache: Path, **kw) -> KernelEvalConfig:
    base = dict(cache_dir=str(cache), scale=0.25, trials=3, warmup=1, iters=5, compile_workers=2,
                limits=SandboxLimits(wall_s=120, cpu_s=60, memory_mb=4096, processes=128, file_size_mb=256,
                                     open_files=512))
    base.update(kw)
    return KernelEvalConfig(**base)


@pytest.fixture(scope="session")
def kb_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def problems() -> dict[int, object]:
    return {p.problem_id: p for p in load_problems(PROBLEMS, level=1)}


@pytest.fixture(scope="session")
def relu_result(kb_cache, problems):
    """The correct CPU kernel, evaluated once (this is the one build of the session)."""
    return KernelEvaluator(config(kb_cache)).evaluate(problems[1], RELU_OK)
