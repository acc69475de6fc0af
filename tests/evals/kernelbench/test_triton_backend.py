"""The triton backend: correctness under Triton's CPU interpreter (TRITON_INTERPRET=1) in the
sandbox, "not timed" without a GPU, and a policy that wants a real, launched @triton.jit kernel.
The problem and the kernels are our own (KernelBench's format)."""

from __future__ import annotations

import pytest

from closedloop.evals.kernelbench.evaluate import KernelEvaluator
from closedloop.evals.kernelbench.policy import check_policy
from closedloop.evals.kernelbench.problems import Problem

from .conftest import config

pytest.importorskip("triton", reason="the triton extra is not installed (pip install closedloop[triton])")

PROBLEM = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """Swish (x * sigmoid(x)) plus a per-column bias."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x) + b


N = 128
M = 256


def get_inputs():
    return [torch.randn(N, M), torch.randn(M)]


def get_init_inputs():
    return []
'''

KERNEL = '''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def swish_bias_kernel(x_ptr, b_ptr, out_ptr, n, m, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs % m, mask=mask)
    tl.store(out_ptr + offs, {expr}, mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x, b):
        x = x.contiguous()
        b = b.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        swish_bias_kernel[(triton.cdiv(n, 4096),)](x, b, out, n, x.shape[-1], BLOCK=4096)
        return out
'''

CORRECT = KERNEL.format(expr="x * tl.sigmoid(x) + b")
WRONG = KERNEL.format(expr="x * tl.sigmoid(x)")  # forgets the bias


@pytest.fixture(scope="module")
def problem() -> Problem:
    return Problem(level=1, problem_id=91, name="91_Swish_Bias.py", code=PROBLEM)


def evaluate(tmp_path, problem: Problem, code: str):
    return KernelEvaluator(config(tmp_path, backend="triton", scale=1.0, trials=2)).evaluate(problem, code)


def test_correct_triton_kernel_passes_under_the_interpreter(tmp_path, problem):
    r = evaluate(tmp_path, problem, CORRECT)
    assert r.status == "correct", (r.message, r.traceback_tail)
    assert r.max_diff is not None and r.max_diff < 1e-4
    assert not r.timed and r.speedup is None and r.timings == {}
    assert "not timed" in r.not_timed_reason


def test_wrong_triton_kernel_is_incorrect(tmp_path, problem):
    r = evaluate(tmp_path, problem, WRONG)
    assert r.status == "incorrect", (r.message, r.traceback_tail)
    assert "differs from the reference" in r.message


def test_policy_wants_a_real_launched_triton_kernel(tmp_path, problem):
    assert check_policy(CORRECT, "triton", "strict").ok
    torch_only = KERNEL.split("@triton.jit")[0] + (
        "class ModelNew(nn.Module):\n    def forward(self, x, b):\n        return x * torch.sigmoid(x) + b\n")
    look_alike = CORRECT.replace("import triton\n", "import triton\n\n\ndef jit(f):\n    return f\n\n", 1) \
        .replace("@triton.jit", "@jit")
    never_launched = CORRECT.replace("swish_bias_kernel[(triton.cdiv(n, 4096),)](x, b, out, n, x.shape[-1], "
                                     "BLOCK=4096)", "out.copy_(x)")
    for code, why in ((torch_only, "no Triton kernel"), (look_alike, "no Triton kernel"),
                      (never_launched, "never launched")):
        rep = check_policy(code, "triton", "strict")
        assert not rep.ok and why in rep.summary(), rep.summary()
        assert check_policy(code, "triton", "lenient").ok  # lenient judges it like any other candidate
    r = evaluate(tmp_path, problem, torch_only)
    assert r.status == "policy_violation"
