"""Benchmark-independent evaluation machinery shared by τ-bench and KernelBench.

``runner.BatchRunner``: concurrency, per-resource slots, per-item timeouts, serialised writes
that survive cancellation. ``claims.EvalClaim``: one live process per evaluation name.
``settings_differences``: the settings-change refusal on resume. ``Outcome``: the taxonomy.
``executor``: where an item's work runs (``local``, or ``ray`` with the extra ``closedloop[ray]``);
``flags``: its command-line flags; ``choose``: the executor a config or the flags name.

Names are imported on first use (PEP 562), so a benchmark's parser can import ``flags`` without
the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from closedloop.evals.harness.claims import EvalBusyError, EvalClaim
    from closedloop.evals.harness.executor import (Executor, ExecutorConfig, ExecutorUnavailable, ItemWork,
                                                   LocalExecutor, Resources)
    from closedloop.evals.harness.choose import executor_config_from_args, make_executor
    from closedloop.evals.harness.flags import add_executor_arguments
    from closedloop.evals.harness.runner import (OUTCOMES, BatchRunner, Outcome, ResourceSlots, plan_remaining,
                                                 settings_differences)

_WHERE = {
    "claims": ("EvalBusyError", "EvalClaim"),
    "executor": ("Executor", "ExecutorConfig", "ExecutorUnavailable", "ItemWork", "LocalExecutor", "Resources"),
    "choose": ("executor_config_from_args", "make_executor"),
    "flags": ("add_executor_arguments",),
    "runner": ("OUTCOMES", "BatchRunner", "Outcome", "ResourceSlots", "plan_remaining", "settings_differences"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = ["BatchRunner", "EvalBusyError", "EvalClaim", "Executor", "ExecutorConfig", "ExecutorUnavailable", "ItemWork",
           "LocalExecutor", "OUTCOMES", "Outcome", "ResourceSlots", "Resources", "add_executor_arguments",
           "executor_config_from_args", "make_executor", "plan_remaining", "settings_differences"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
