"""Built-in environments (offline, seeded, gym-style) satisfying :class:`closedloop.env.AgentEnvironment`.

- ``calc`` (:mod:`.calc`): arithmetic word problems solved with calculator tools.
- ``clarify`` (:mod:`.clarify`): find a hidden goal by asking questions; exact information gain.
- ``simul`` (:mod:`.simul`): simultaneous translation of a synthetic language pair; BLEU-by-deadline minus lag.

``make_env(name, **options)`` builds one (entry-point group ``closedloop.environments``);
``expert_trajectories(name, seeds, level)`` plays the scripted expert for SFT data.
"""

from closedloop.evals.envs.base import EnvOptionsError, last_number
from closedloop.evals.envs.calc import CalcEnv, CalcOptions
from closedloop.evals.envs.clarify import ClarifyEnv, ClarifyOptions, expected_information_gain, information_gain
from closedloop.evals.envs.experts import (aexpert_trajectories, arollout, expert_action, expert_policy,
                                           expert_trajectories)
from closedloop.evals.envs.registry import ENV_GROUP, available_envs, make_env

__all__ = ["EnvOptionsError", "last_number", "CalcEnv", "CalcOptions", "ClarifyEnv", "ClarifyOptions",
           "expected_information_gain", "information_gain", "aexpert_trajectories", "arollout", "expert_action",
           "expert_policy", "expert_trajectories", "ENV_GROUP", "available_envs", "make_env"]
