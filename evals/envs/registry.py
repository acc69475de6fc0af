"""Environments by name: the plugins of the ``closedloop.environments`` entry-point group
(``[project.entry-points."closedloop.environments"] name = "module:Factory"``; the built-ins are
declared the same way in closedloop's ``pyproject.toml``), so a user's package adds environments
without touching closedloop. Code can add one in-process with
``closedloop.plugins.registry(ENV_GROUP).register(name, factory)``.

A factory is called with the options as keyword arguments and returns an object satisfying
:class:`closedloop.env.AgentEnvironment`.
"""

from __future__ import annotations

from typing import Any

from closedloop import plugins
from closedloop.env import AgentEnvironment

__all__ = ["ENV_GROUP", "available_envs", "make_env", "UnknownEnvironment"]

ENV_GROUP = "closedloop.environments"


class UnknownEnvironment(plugins.PluginNotFound):
    """No environment of that name; the message lists the available ones."""


def available_envs() -> dict[str, str]:
    """Environment names and the ``module:attr`` each resolves to (nothing imported)."""
    return {name: plugin.target for name, plugin in plugins.available(ENV_GROUP).items()}


def make_env(name: str, **options: Any) -> AgentEnvironment:
    """A fresh environment: ``make_env("calc", level=2)``; options are validated by the environment
    (unknown names raise :class:`~closedloop.evals.envs.base.EnvOptionsError`)."""
    try:
        factory = plugins.load(ENV_GROUP, name)
    except plugins.PluginNotFound as e:
        raise UnknownEnvironment(str(e)) from None
    env = factory(**options)
    if not isinstance(env, AgentEnvironment):
        raise TypeError(f"environment {name!r} ({available_envs()[name]}) does not satisfy "
                        f"closedloop.env.AgentEnvironment")
    return env
