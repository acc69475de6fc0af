"""Kernel-writing agents (KernelBench-style problems): what the ``kernel`` and ``egg`` graphs wire up.

- :mod:`.prompts`: backend-specific instructions (``cpu``: C++/OpenMP through ``load_inline``;
  ``triton``; ``cuda``) and the prompt of every agent role (code, debug, refine, tune, profile).
- :mod:`.extract`: the candidate's code from a model reply (a fenced ``python`` block that
  defines ``ModelNew``), with an error message written for the model.
- :mod:`.feedback`: the evaluator's JSON result (``evaluate_kernel``) as a typed value, which
  results count as correct, how two results rank, and the structured feedback the model reads.
- :mod:`.profile`: the profile agent's ``{bottleneck, modification_plan}`` JSON, validated, with a
  re-ask message when it is not valid.
- :mod:`.paradigms`: algorithmic paradigms for stage-A seeds, semantics-preserving refinements,
  and the ordered hardware-tuning steps of stage B (EGG, paper 2).
- :mod:`.evaluate`: calling the injected ``evaluate_kernel``/``profile_kernel`` tools and recording
  the calls as :class:`~closedloop.runtime.ToolRecord`\\ s.

The evaluator itself lives in ``closedloop.evals.kernelbench`` and reaches the graphs only as
injected tools (``make_kernel_tools(problem, backend, ...)``), so agents never import evals.
"""

from closedloop.agents.kernel.evaluate import EVALUATE_TOOL, PROFILE_TOOL, evaluate_code, profile_code, require_evaluator
from closedloop.agents.kernel.extract import CodeExtractionError, extract_code, extract_problem
from closedloop.agents.kernel.feedback import EvalResult, feedback_json, parse_eval_result
from closedloop.agents.kernel.paradigms import REFINEMENTS, TUNING_STEPS, seed_paradigms
from closedloop.agents.kernel.profile import ProfileParseError, ProfilePlan, parse_profile_plan
from closedloop.agents.kernel.prompts import BACKENDS, Backend, check_backend

__all__ = ["EVALUATE_TOOL", "PROFILE_TOOL", "evaluate_code", "profile_code", "require_evaluator", "CodeExtractionError", "extract_code",
           "extract_problem", "EvalResult", "feedback_json", "parse_eval_result", "REFINEMENTS", "TUNING_STEPS",
           "seed_paradigms", "ProfileParseError", "ProfilePlan", "parse_profile_plan", "BACKENDS", "Backend",
           "check_backend"]
