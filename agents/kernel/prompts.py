"""Prompts of the kernel agents, per backend and per role.

Backends: ``cpu`` (C++ with OpenMP, compiled by ``torch.utils.cpp_extension.load_inline``),
``triton`` (``@triton.jit`` kernels; correctness under the interpreter on CPU) and ``cuda``
(``__global__`` kernels through ``load_inline``'s ``cuda_sources``). Each backend has one short
example of the submission format (our own elementwise add, in the spirit of KernelBench's
one-shot prompt) and the rules the evaluator's static policy enforces, stated up front so a
model does not spend rounds discovering them.

Roles: the single agent of the ``kernel`` graph; EGG's code agent (stage-A seeds and
refinement, stage-B tuning), debug agent and profile agent.
"""

from __future__ import annotations

from typing import Literal, get_args

from closedloop.agents.kernel.feedback import EvalResult, feedback_json
from closedloop.agents.kernel.profile import PROFILE_SCHEMA_HINT, ProfilePlan

__all__ = ["Backend", "BACKENDS", "check_backend", "backend_guide", "single_system", "single_task", "single_feedback",
           "code_system", "seed_task", "refine_task", "debug_system", "debug_task", "tune_system", "tune_task",
           "profile_system", "profile_task", "problem_block"]

Backend = Literal["cpu", "triton", "cuda"]
BACKENDS: tuple[str, ...] = get_args(Backend)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return backend


_CPU_EXAMPLE = r'''```python
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <torch/extension.h>

torch::Tensor add_forward(torch::Tensor a, torch::Tensor b) {
    auto ac = a.contiguous();
    auto bc = b.contiguous();
    auto out = torch::empty_like(ac);
    const float* pa = ac.data_ptr<float>();
    const float* pb = bc.data_ptr<float>();
    float* po = out.data_ptr<float>();
    const int64_t n = ac.numel();
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
    return out;
}
"""

ext = load_inline(name="add_ext", cpp_sources=cpp_source, functions=["add_forward"],
                  extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return ext.add_forward(a, b)
```'''

_TRITON_EXAMPLE = r'''```python
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(a_ptr + offs, mask=mask) + tl.load(b_ptr + offs, mask=mask), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty_like(a)
        n = out.numel()
        add_kernel[(triton.cdiv(n, 1024),)](a, b, out, n, BLOCK=1024)
        return out
```'''

_CUDA_EXAMPLE = r'''```python
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>

__global__ void add_kernel(const float* a, const float* b, float* out, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

torch::Tensor add_forward(torch::Tensor a, torch::Tensor b) {
    auto ac = a.contiguous();
    auto bc = b.contiguous();
    auto out = torch::empty_like(ac);
    int64_t n = ac.numel();
    int threads = 256;
    add_kernel<<<(n + threads - 1) / threads, threads>>>(ac.data_ptr<float>(), bc.data_ptr<float>(),
                                                         out.data_ptr<float>(), n);
    return out;
}
"""
cpp_source = "torch::Tensor add_forward(torch::Tensor a, torch::Tensor b);"

ext = load_inline(name="add_ext", cpp_sources=cpp_source, cuda_sources=cuda_source, functions=["add_forward"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return ext.add_forward(a, b)
```'''

_GUIDES = {
    "cpu": ("C++ CPU kernels (OpenMP)",
            "Write the kernel in C++ and build it with torch.utils.cpp_extension.load_inline (cpp_sources=..., "
            "functions=[...], extra_cflags=['-O3', '-fopenmp'], extra_ldflags=['-fopenmp']). Parallelise with "
            "OpenMP pragmas. Work on raw pointers (tensor.data_ptr<float>()) of contiguous tensors; allocate "
            "outputs with torch::empty. Do not call ATen/torch compute functions (at::matmul, torch::softmax, "
            "...) inside the C++: the computation itself must be yours.", _CPU_EXAMPLE),
    "triton": ("Triton kernels",
               "Write @triton.jit kernels using triton.language (tl.load, tl.store, tl.dot, ...) and launch them "
               "from ModelNew.forward with a grid. Correctness may be checked under Triton's interpreter on "
               "CPU, so use only portable Triton features.", _TRITON_EXAMPLE),
    "cuda": ("CUDA kernels",
             "Write __global__ CUDA kernels and build them with torch.utils.cpp_extension.load_inline "
             "(cpp_sources with the declarations, cuda_sources with the kernels and launchers, functions=[...]). "
             "Do not call cuBLAS/cuDNN or torch compute functions for the computation itself.", _CUDA_EXAMPLE),
}

RULES = """Rules (checked by the evaluator; breaking one fails the attempt):
- Define `class ModelNew(nn.Module)` taking the same constructor arguments as `Model` and the same forward
  inputs, returning an output of the same shape and dtype, numerically equal within tolerance.
- Do not subclass or call `Model`; no try/except fallback to PyTorch; no threads or processes of your own
  (OpenMP is fine on CPU); do not touch timers, torch.allclose or the reference; do not return or cache an
  input tensor; do not modify the inputs.
- Reply with the complete module (imports, kernel source, ModelNew) in one ```python block; no test code."""


def backend_guide(backend: str) -> str:
    """What to write for ``backend``, with the example of the submission format."""
    name, how, example = _GUIDES[check_backend(backend)]
    return f"Target: {name}.\n{how}\n\nExample of the format (an elementwise add):\n{example}\n\n{RULES}"


def problem_block(problem: str) -> str:
    return f"Reference architecture to replace:\n```python\n{problem.strip()}\n```"


def _verdict(result: EvalResult) -> str:
    return f"```json\n{feedback_json(result)}\n```"


# ---------------------------------------------------------------- the single agent (graph ``kernel``)

def single_system(backend: str) -> str:
    return ("You are an expert performance engineer. You write custom "
            f"{_GUIDES[check_backend(backend)][0]} that replace the PyTorch operators of a reference architecture "
            "to make it faster while computing the same result. You may fuse operators or change the algorithm "
            "(e.g. online softmax). After each attempt the evaluator replies with a JSON verdict (status, "
            "message, compiler log, differences, speedup); fix what it reports, then make the kernel faster.\n\n"
            + backend_guide(backend))


def single_task(problem: str) -> str:
    return problem_block(problem) + "\n\nWrite ModelNew."


def single_feedback(result: EvalResult, round_: int, rounds: int) -> str:
    left = rounds - round_
    ask = ("It is correct: make it faster without changing what it computes." if result.correct else
           "Fix the problem it reports.")
    return (f"Evaluator verdict for attempt {round_} of {rounds}:\n{_verdict(result)}\n{ask} "
            f"{left} attempt{'s' if left != 1 else ''} left. Reply with the complete module.")


# ---------------------------------------------------------------- EGG: code, debug, profile agents

def code_system(backend: str) -> str:
    return ("You are the code agent of a kernel-engineering team, in stage A (algorithm design). You write "
            f"{_GUIDES[check_backend(backend)][0]} that replace a PyTorch reference and compute the same result. "
            "In this stage the algorithmic structure matters most: the paradigm, fusion, the number of passes over "
            "memory; hardware tuning comes later.\n\n" + backend_guide(backend))


def seed_task(problem: str, paradigm: str) -> str:
    return (problem_block(problem) + f"\n\nAlgorithmic paradigm for this design: {paradigm}.\n"
            "Write ModelNew with a kernel built around this paradigm (if it cannot apply to this problem, use the "
            "closest structure that does and say which in a comment).")


def refine_task(problem: str, code: str, result: EvalResult, refinements: tuple[str, ...] | list[str]) -> str:
    options = "\n".join(f"- {r}" for r in refinements)
    return (problem_block(problem) + f"\n\nCurrent kernel (correct):\n```python\n{code.strip()}\n```\n"
            f"Its verdict: {_verdict(result)}\n"
            "Refine the algorithm with semantics-preserving transformations that apply here, such as:\n"
            f"{options}\nThe result must stay numerically equal to the reference. Reply with the complete module.")


def debug_system(backend: str) -> str:
    return ("You are the debug agent of a kernel-engineering team. A kernel failed the evaluator (compile, load, "
            "runtime or numerical error, a policy violation, or a speedup flagged as suspicious). Find the cause from the verdict and fix it "
            "with the smallest change that keeps the kernel's design.\n\n" + backend_guide(backend))


def debug_task(problem: str, code: str, result: EvalResult, goal: str) -> str:
    return (problem_block(problem) + f"\n\nThis kernel was written to {goal}:\n```python\n{code.strip()}\n```\n"
            f"The evaluator's verdict:\n{_verdict(result)}\nFix it. Reply with the complete module.")


def tune_system(backend: str) -> str:
    return ("You are the code agent of a kernel-engineering team, in stage B (hardware tuning). You receive a "
            "correct kernel whose algorithm is decided. Tune only the aspect you are asked to tune, for the target "
            "hardware; never change what it computes beyond floating-point reassociation.\n\n"
            + backend_guide(backend))


def tune_task(problem: str, decision: str, code: str, result: EvalResult, step: str, guide: str,
              plan: ProfilePlan | None) -> str:
    planned = ("\nThe profile agent's analysis:\n" + plan.render()) if plan else ""
    return (problem_block(problem) + f"\n\nAlgorithm decision (from stage A): {decision}\n"
            f"Current kernel:\n```python\n{code.strip()}\n```\nIts verdict: {_verdict(result)}\n"
            f"Tuning step: {step.replace('_', ' ')} - {guide}.{planned}\n"
            "Apply this step. Reply with the complete module.")


def profile_system(backend: str) -> str:
    return ("You are the profile agent of a kernel-engineering team. From a profiler report of a correct "
            f"kernel ({_GUIDES[check_backend(backend)][0]}) and the current tuning step, name the one "
            "bottleneck that matters most and a concrete modification plan for the code agent. Answer with only "
            f"a JSON object of this form:\n{PROFILE_SCHEMA_HINT}")


def profile_task(code: str, report: str, step: str, guide: str, *, limit: int = 8000) -> str:
    report = report.strip()
    if len(report) > limit:  # the profiler lists the heaviest operators first: keep the head
        report = report[:limit] + f"\n… ({len(report) - limit} more characters)"
    return (f"Kernel:\n```python\n{code.strip()}\n```\nProfiler report:\n```\n{report}\n```\n"
            f"Current tuning step: {step.replace('_', ' ')} - {guide}.\nAnswer with the JSON object only.")
