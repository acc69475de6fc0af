"""τ-bench (tau2-compatible) evaluation: domains, environment, orchestrator, evaluator, metrics.

See ``README.md`` beside this file.
"""

from closedloop.evals.tau.data import DATA_DIR_ENV, DomainData, TaskSet, TauDataError, load_domain, resolve_data_root
from closedloop.evals.tau.data_model import RewardType, Task
from closedloop.evals.tau.environment import Environment
from closedloop.evals.tau.evaluator import evaluate
from closedloop.evals.tau.gym import TauGymEnv
from closedloop.evals.tau.orchestrator import Orchestrator, UserSimulator, model_agent, run_episode
from closedloop.evals.tau.simulation import RewardInfo, SimulationRun, TerminationReason

__all__ = ["DATA_DIR_ENV", "DomainData", "TaskSet", "TauDataError", "load_domain", "resolve_data_root", "RewardType",
           "Task", "Environment", "evaluate", "TauGymEnv", "Orchestrator", "UserSimulator", "model_agent", "run_episode",
           "RewardInfo", "SimulationRun", "TerminationReason"]
