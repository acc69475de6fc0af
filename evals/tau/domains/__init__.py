"""τ domains: each is a typed DB plus a toolkit; see :mod:`.registry`."""

from closedloop.evals.tau.domains.registry import Domain, available_domains, get_domain, register_domain

__all__ = ["Domain", "available_domains", "get_domain", "register_domain"]
