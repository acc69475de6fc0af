"""Environments by name: the built-ins plus any declared under the ``closedloop.environments``
entry-point group (``[project.entry-points."closedloop.environments"] name = "module:Factory"``),
so a user's package adds environments without touching closedloop.

A factory is called with the options as keyword arguments and returns an object satisfying
:class:`closedloop.env.AgentEnvironment`.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Callable

from closedloop.env import AgentEnvironment

__all__ = ["ENV_GROUP", "BUILTIN_ENVS", "available_envs", "make_env", "UnknownEnvironment"]

ENV_GROUP = "closedloop.environments"
# Built-ins resolve even before the package's entry points are (re)installed.
BUILTIN_ENVS: dict[str, str] = {"calc": "closedloop.evals.envs.calc:CalcEnv",
                                "clarify": "closedloop.evals.envs.clarify:ClarifyEnv",
                                "simul": "closedloop.evals.envs.simul:SimulEnv"}


class UnknownEnvironment(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def _load(target: str) -> Callable[..., Any]:
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def available_envs() -> dict[str, str]:
    """Environment names and the ``module:attr`` each resolves to (entry points override built-ins)."""
    found = dict(BUILTIN_ENVS)
    found.update({ep.name: ep.value for ep in entry_points(group=ENV_GROUP)})
    return found


def make_env(name: str, **options: Any) -> AgentEnvironment:
    """A fresh environment: ``make_env("calc", level=2)``; options are validated by the environment
    (unknown names raise :class:`~closedloop.evals.envs.base.EnvOptionsError`)."""
    envs = available_envs()
    if name not in envs:
        raise UnknownEnvironment(f"no environment named {name!r}; available: {sorted(envs)}")
    env = _load(envs[name])(**options)
    if not isinstance(env, AgentEnvironment):
        raise TypeError(f"environment {name!r} ({envs[name]}) does not satisfy closedloop.env.AgentEnvironment")
    return env
