"""Domains by name: a DB model, a toolkit factory and where their files live.

Domains are plugins of the ``closedloop.domains`` entry-point group (:mod:`closedloop.plugins`):
the built-ins (``retail``, ``airline``, ``telecom``) are declared in closedloop's ``pyproject.toml``
and imported on first use. Adding a domain edits nothing here: define a :class:`Domain` and either
publish it as an entry point of ``closedloop.domains`` whose target is the :class:`Domain` (or a
zero-argument function returning it), or call :func:`register_domain` (in-process).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from closedloop import plugins
from closedloop.evals.tau.domains.base import TauDB, Toolkit

__all__ = ["Domain", "register_domain", "get_domain", "available_domains", "UnknownDomainError"]

ENTRY_POINT_GROUP = "closedloop.domains"


class UnknownDomainError(plugins.PluginNotFound, ValueError):
    """No domain of that name; a ValueError too, so front ends report it as bad input (one line)."""


@dataclass(frozen=True)
class Domain:
    """What code a domain contributes; its data (DB, policy, tasks) is found by convention under
    ``<data_root>/tau2/domains/<name>/``: ``db.json`` or ``db.toml``, optional ``user_db.*``,
    ``policy.md``, ``tasks.json`` with ``split_tasks.json``."""

    name: str
    db_model: type[TauDB]
    toolkit: Callable[..., Toolkit]  # (db, *, descriptions=..., **options), a Toolkit class as a rule
    user_db_model: type[TauDB] | None = None
    user_toolkit: Callable[..., Toolkit] | None = None
    policy_file: str = "policy.md"
    policy_text: Callable[[Path], str] | None = None  # composes the policy from the domain folder (telecom)
    sync_tools: Callable[[Any], None] | None = None  # reconciles agent and user DBs after each step (tau2)
    # A data root shipped with the domain's code (holding tau2/domains/<name>/), used when neither
    # --data-dir nor $TAU2_DATA_DIR names one: an offline domain works with no setup (helpdesk).
    bundled_data: Path | None = None


def register_domain(domain: Domain, *, replace: bool = False) -> Domain:
    """Register a domain in this process under its name; a name already taken (by an entry point
    or another registration) is a ``ValueError`` unless ``replace``."""
    registered: Domain = plugins.registry(ENTRY_POINT_GROUP).register(domain.name, domain, replace=replace)
    return registered


def get_domain(name: str) -> Domain:
    try:
        target = plugins.load(ENTRY_POINT_GROUP, name)
    except plugins.PluginNotFound as e:
        raise UnknownDomainError(str(e)) from None
    domain = target if isinstance(target, Domain) else _built(target)
    if not isinstance(domain, Domain):
        raise TypeError(f"entry point {name!r} of {ENTRY_POINT_GROUP} must give a Domain, got {type(domain).__name__}")
    return domain


@functools.cache
def _built(factory: Callable[[], Any]) -> Any:
    """A domain factory's result, made once (the same Domain for every lookup)."""
    return factory()


def available_domains() -> list[str]:
    return plugins.registry(ENTRY_POINT_GROUP).names()
