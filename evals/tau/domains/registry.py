"""Domains by name: a DB model, a toolkit factory and where their files live.

Adding a domain edits nothing here: define a :class:`Domain` and either call
:func:`register_domain` (in-process) or publish it as an entry point of the group
``closedloop.domains`` whose target is the :class:`Domain` (or a zero-argument function returning
it). Built-in domains are imported lazily, on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from closedloop.evals.tau.domains.base import TauDB, Toolkit

__all__ = ["Domain", "register_domain", "get_domain", "available_domains", "UnknownDomainError"]

ENTRY_POINT_GROUP = "closedloop.domains"
_BUILTINS = {"retail": "closedloop.evals.tau.domains.retail", "airline": "closedloop.evals.tau.domains.airline",
             "telecom": "closedloop.evals.tau.domains.telecom"}
_REGISTRY: dict[str, "Domain"] = {}


class UnknownDomainError(KeyError, ValueError):
    """No domain of that name; a ValueError too, so front ends report it as bad input (one line)."""

    def __str__(self) -> str:
        return str(self.args[0])


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


def register_domain(domain: Domain, *, replace: bool = False) -> Domain:
    existing = _REGISTRY.get(domain.name)
    if existing is not None and existing is not domain and not replace:
        raise ValueError(f"a τ domain named {domain.name!r} is already registered")
    _REGISTRY[domain.name] = domain
    return domain


def _entry_points() -> dict:
    from closedloop.plugins import available

    return available(ENTRY_POINT_GROUP)


def get_domain(name: str) -> Domain:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTINS:
        importlib.import_module(_BUILTINS[name])  # registers itself on import
        if name in _REGISTRY:
            return _REGISTRY[name]
    eps = _entry_points()
    if name in eps:
        target = eps[name].load()
        domain = target if isinstance(target, Domain) else target()
        if not isinstance(domain, Domain):
            raise TypeError(f"entry point {name!r} of {ENTRY_POINT_GROUP} must give a Domain, got {type(domain).__name__}")
        return register_domain(domain)
    raise UnknownDomainError(f"no τ domain named {name!r}; available: {available_domains()}")


def available_domains() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTINS) | set(_entry_points()))
