"""``closedloop serve``: any :class:`~closedloop.models.base.ModelClient` behind OpenAI's HTTP API."""

from closedloop.server.app import APIError, create_app

__all__ = ["create_app", "APIError"]
