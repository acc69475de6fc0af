"""Shared pieces of the kernel-graph tests: a tiny problem in KernelBench's format, candidate
modules written for it (real C++/OpenMP through ``load_inline``), and a stand-in evaluator with
the harness's tool names and result shape for the control-flow tests.

The stand-in reads the verdict a test wants from a ``# VERDICT: {...}`` comment in the candidate,
so a scripted reply fully determines what the evaluator answers. The end-to-end tests run the same
graphs on the real harness (``closedloop.evals.kernelbench``) instead.
"""

from __future__ import annotations

import json
import re
from typing import Any

from closedloop.messages import AssistantMessage
from closedloop.tool import ToolRegistry, tool

PROBLEM = '''import torch
import torch.nn as nn

N = 4096


class Model(nn.Module):
    """relu(x + y) * scale, elementwise."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x, y):
        return torch.relu(x + y) * self.scale


def get_inputs():
    return [torch.rand(N) - 0.5, torch.rand(N) - 0.5]


def get_init_inputs():
    return [2.0]
'''

_KERNEL = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# {tag}
cpp_source = r"""
#include <torch/extension.h>

torch::Tensor relu_add_scale(torch::Tensor x, torch::Tensor y, double scale) {{
    auto xc = x.contiguous();
    auto yc = y.contiguous();
    auto out = torch::empty_like(xc);
    const float* px = xc.data_ptr<float>();
    const float* py = yc.data_ptr<float>();
    float* po = out.data_ptr<float>();
    const int64_t n = xc.numel();
    const float s = (float)scale;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {{
        float v = px[i] + py[i];
        po[i] = {expr};
    }}
    return out;
}}
"""

ext = load_inline(name="relu_add_scale_ext", cpp_sources=cpp_source, functions=["relu_add_scale"],
                  extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


class ModelNew(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x, y):
        return {ret}
'''

CORRECT_EXPR = "(v > 0.0f ? v : 0.0f) * s"
WRONG_EXPR = "(v > 0.0f ? v : 0.0f)"  # forgets the scale: wrong by a factor of 2 on positive outputs


def kernel(tag: str, *, verdict: dict[str, Any] | None = None, expr: str = CORRECT_EXPR,
           ret: str = "ext.relu_add_scale(x, y, self.scale)") -> str:
    """A candidate module; ``tag`` is a unique comment so tests can trace where its text went."""
    src = _KERNEL.format(tag=tag, expr=expr, ret=ret)
    if verdict is not None:
        src = src.replace(f"# {tag}\n", f"# {tag}\n# VERDICT: {json.dumps(verdict)}\n")
    return src


def reply(code: str, note: str = "Here is the kernel.") -> AssistantMessage:
    return AssistantMessage(content=f"{note}\n```python\n{code}```\n")


def fake_kernel_tools(*, profile: bool = True, fail: bool = False) -> tuple[ToolRegistry, list[str]]:
    """``evaluate_kernel``/``profile_kernel`` with the harness's names and JSON shape; the verdict
    comes from the candidate's ``# VERDICT:`` comment (default: correct, speedup 1.0). Returns the
    registry and the list of evaluated sources (in call order)."""
    seen: list[str] = []
    registry = ToolRegistry()

    @tool(registry=registry)
    def evaluate_kernel(code: str) -> str:
        """Compile, check and time a candidate ModelNew against the reference.

        Args:
            code: the candidate module's source.
        """
        seen.append(code)
        if fail:
            raise RuntimeError("sandbox crashed")
        m = re.search(r"^# VERDICT: (.*)$", code, re.M)
        verdict = json.loads(m.group(1)) if m else {"status": "correct", "speedup": 1.0}
        return json.dumps({"message": "", "speedup": None, **verdict})

    if profile:
        @tool(registry=registry)
        def profile_kernel(code: str) -> str:
            """Profile a candidate: top operators and a timing breakdown.

            Args:
                code: the candidate module's source.
            """
            tag = re.search(r"^# (\S+)$", code, re.M)
            return json.dumps({"top_ops": [{"name": "relu_add_scale", "self_cpu_time_us": 41.0}],
                               "kernel": tag.group(1) if tag else None, "timings": {"total_us": 50.0}})

    return registry, seen
