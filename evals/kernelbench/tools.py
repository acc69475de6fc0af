"""Tools an agent graph uses to test kernels for one problem: ``evaluate_kernel`` and ``profile_kernel``.

Both run the candidate in the sandbox (see ``evaluate.py``) and return the structured verdict
as JSON (status, message, compiler log tail, max/mean difference, traceback tail, speedup,
timings), which is what a model needs to fix its code. The tool timeout is the sandbox's wall
clock twice over (build, then run): the sandbox stops the work itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from closedloop.evals.harness.runner import ResourceSlots
from closedloop.sandbox import SandboxLimits
from closedloop.tool import Tool, ToolRegistry
from closedloop.evals.kernelbench.evaluate import KernelEvalConfig, KernelEvaluator
from closedloop.evals.kernelbench.problems import Problem, extract_code, load_problems


def _as_problem(problem: Problem | str | Path) -> Problem:
    if isinstance(problem, Problem):
        return problem
    return load_problems(problem)[0]


def make_kernel_tools(problem: Problem | str | Path, backend: str = "cpu", *, scale: float = 1.0,
                      limits: SandboxLimits | None = None, config: KernelEvalConfig | None = None,
                      slots: ResourceSlots | None = None) -> ToolRegistry:
    """A registry with ``evaluate_kernel(code)`` and ``profile_kernel(code)`` bound to ``problem``.

    ``config`` overrides everything else (trials, tolerances, cache dir, policy mode). ``slots``
    shares the device's timing slot with other evaluators (a batch of concurrent agents), so
    timings never overlap.
    """
    prob = _as_problem(problem)
    cfg = config.model_copy(deep=True) if config is not None else KernelEvalConfig(backend=backend, scale=scale)
    if config is None and limits is not None:
        cfg.limits = limits
    evaluator = KernelEvaluator(cfg, slots=slots)
    timeout = 2 * cfg.limits.wall_s + 30

    async def evaluate_kernel(code: str) -> str:
        """Compile, check and time a candidate ModelNew for the current problem.

        Args:
            code: Python source defining class ModelNew (a fenced ```python block is accepted).

        Returns JSON: status (correct | suspicious | compile_error | load_error | policy_violation |
        runtime_error | shape_mismatch | dtype_mismatch | incorrect | invalid_output | timeout),
        message, compiler_log, traceback_tail, max_diff, mean_diff, speedup over eager torch (median
        ratio; speedup_mean, speedup_ci, timing_unstable beside it), timings in ms per call.
        """
        res = await evaluator.aevaluate(prob, extract_code(code))
        return json.dumps(res.feedback(), default=str)

    async def profile_kernel(code: str) -> str:
        """Profile a candidate ModelNew against the reference (torch profiler top ops, timing breakdown).

        Args:
            code: Python source defining class ModelNew.

        Returns JSON: the evaluate_kernel fields plus profile.candidate / profile.reference, each the
        top operators by self CPU time (op, calls, self_cpu_ms, cpu_total_ms per forward).
        """
        res = await evaluator.aevaluate(prob, extract_code(code), profile=True)
        return json.dumps(res.feedback(), default=str)

    registry = ToolRegistry()
    registry.register(Tool(evaluate_kernel, timeout_s=timeout))
    registry.register(Tool(profile_kernel, timeout_s=timeout))
    return registry
