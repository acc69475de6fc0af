"""Termination gating: only episodes that ended by a stop are graded (tau2 ``evaluate_simulation``).

Max steps, too many errors, timeouts, protocol errors and a context window overflow score 0
whatever the DB looks like (tau2: ``reward 0.0``, ``reward_basis null``, a note). An
infrastructure error (a model server failed) is not the agent's doing: here it is not graded at
all, and metrics list it apart (tau2 drops such simulations from its metrics as well).
"""

from __future__ import annotations

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.simulation import GRADED_TERMINATIONS, RewardInfo, SimulationRun, TerminationReason


def termination_gate(simulation: SimulationRun, task: Task) -> RewardInfo | None:
    """The final RewardInfo when the ending alone decides the grade, else None (grade it)."""
    reason = simulation.termination_reason
    if reason == TerminationReason.INFRASTRUCTURE_ERROR:
        basis = task.reward_basis
        return RewardInfo(reward=None, partial_reward=0.0, reward_basis=None, reward_breakdown=None,
                          not_graded={b: "infrastructure error" for b in basis},
                          info={"note": f"infrastructure error: {simulation.error or 'unknown'}"})
    if reason not in GRADED_TERMINATIONS:
        return RewardInfo(reward=0.0, partial_reward=0.0, reward_basis=None, reward_breakdown=None,
                          info={"note": f"Simulation terminated prematurely. Termination reason: {reason.value}"})
    return None
