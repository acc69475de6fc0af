"""Named settings of the tiny model build (:mod:`closedloop.models.tiny`).

Apart from the build code, so that changing a preset's numbers changes only the builds of that
preset: a build is identified by its settings and the build code (``tiny.build_key``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_PRESET", "TINY_PRESETS", "preset_settings"]

#: Named build settings. ``agent`` is what ``closedloop model tiny``, ``scripts/serve_react.sh`` and
#: the demo build: trained long enough, on enough distinct conversations and on the exact prompt
#: form of ``closedloop run react --tools arithmetic``, that greedy decoding copies the numbers of
#: "What is 3 plus 4?" into the tool call and the result into the answer (checked by
#: ``tests/newcomer/test_tiny_preset.py``). ``test`` is the model the test suite builds: shorter,
#: and kept as it was so the tests' expectations hold.
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "agent": {"train_steps": 1500, "agent_format": 0.5, "n_conversations": 4000},
    "test": {"train_steps": 500},
}
DEFAULT_PRESET = "agent"


def preset_settings(name: str) -> dict[str, Any]:
    """A preset's settings (``train_steps`` and :class:`~closedloop.models.tiny.TinyConfig` fields)."""
    if name not in TINY_PRESETS:
        raise ValueError(f"unknown tiny-model preset {name!r}; presets: {', '.join(TINY_PRESETS)}")
    return dict(TINY_PRESETS[name])
