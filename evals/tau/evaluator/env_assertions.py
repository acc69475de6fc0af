"""ENV_ASSERTION: call toolkit functions on the predicted environment and compare with the
expected boolean (tau2 ``run_env_assertion``); the component is the product over assertions."""

from __future__ import annotations

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.environment import Environment
from closedloop.evals.tau.simulation import EnvAssertionCheck


def check_env_assertions(env: Environment | None, task: Task) -> tuple[list[EnvAssertionCheck], float]:
    """tau2's env assertions on the predicted state; ``env`` is None only for a task without any
    (check_db then may take the state's hashes from its cache instead of replaying)."""
    assertions = (task.evaluation_criteria.env_assertions if task.evaluation_criteria else None) or []
    checks: list[EnvAssertionCheck] = []
    reward = 1.0
    for assertion in assertions:
        assert env is not None, "check_db keeps the predicted state whenever the task has env assertions"
        met, error = env.run_env_assertion(assertion)
        checks.append(EnvAssertionCheck(env_assertion=assertion, met=met, reward=1.0 if met else 0.0, error=error))
        reward *= 1.0 if met else 0.0
    return checks, reward
