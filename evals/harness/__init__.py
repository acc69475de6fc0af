"""Benchmark-independent evaluation machinery shared by τ-bench and KernelBench.

``runner.BatchRunner``: concurrency, per-resource slots, per-item timeouts, serialised writes
that survive cancellation. ``claims.EvalClaim``: one live process per evaluation name.
``settings_differences``: the settings-change refusal on resume. ``Outcome``: the taxonomy.
"""

from closedloop.evals.harness.claims import EvalBusyError, EvalClaim
from closedloop.evals.harness.runner import OUTCOMES, BatchRunner, Outcome, ResourceSlots, plan_remaining, settings_differences

__all__ = ["BatchRunner", "ResourceSlots", "Outcome", "OUTCOMES", "EvalClaim", "EvalBusyError", "plan_remaining",
           "settings_differences"]
