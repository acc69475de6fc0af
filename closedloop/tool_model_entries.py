"""The models the operator allowed tools to name, as given: ``$CLOSEDLOOP_TOOL_MODELS`` and the
``--allow-model`` entries of this process.

A leaf, so the tool sandbox hands the entries to its child without importing model-spec parsing
(which reaches the plugin registry, which builds tool registries). The child checks every entry
when it uses them (:func:`closedloop.tool_models.allowed_models`); ``--allow-model`` entries are
checked when added.
"""

from __future__ import annotations

import os

__all__ = ["MODELS_ENV", "ADDED", "given_entries"]

MODELS_ENV = "CLOSEDLOOP_TOOL_MODELS"
ADDED: list[str] = []  # entries given on a command line for this process (``--allow-model``), checked


def given_entries() -> list[str]:
    """``$CLOSEDLOOP_TOOL_MODELS``'s entries, then those added for this process, each once, unchecked."""
    entries = [e.strip() for e in os.environ.get(MODELS_ENV, "").split(",") if e.strip()]
    return list(dict.fromkeys([*entries, *ADDED]))
