"""Named things that live outside the core (graphs, tool modules, benchmark domains) are found
through Python entry points, so the core never imports a paper, agent, graph or benchmark.

A package (ours or a user's) declares ``[project.entry-points."closedloop.graphs"] name = "mod:fn"``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Callable

GROUPS = ("closedloop.graphs", "closedloop.tools", "closedloop.domains")


class PluginNotFound(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


def available(group: str) -> dict[str, Any]:
    """Entry points of a group by name (not loaded)."""
    return {ep.name: ep for ep in entry_points(group=group)}


def load(group: str, name: str) -> Callable[..., Any]:
    eps = available(group)
    if name not in eps:
        kind = {"closedloop.tools": "tool module", "closedloop.environments": "environment"}.get(
            group, group.split('.')[-1][:-1])
        raise PluginNotFound(f"no {kind} named {name!r}; available: {sorted(eps)}")
    return eps[name].load()


def tool_registry(modules: list[str] | None = None):
    """A :class:`~closedloop.tool.ToolRegistry` holding the tools of the named tool modules
    (entry points of ``closedloop.tools``; all of them when ``modules`` is None).

    Each entry point names a list of :class:`~closedloop.tool.Tool` objects.
    """
    from closedloop.tool import ToolRegistry

    registry = ToolRegistry()
    names = modules if modules is not None else sorted(available("closedloop.tools"))
    for name in names:
        registry.extend(list(load("closedloop.tools", name)))
    return registry
