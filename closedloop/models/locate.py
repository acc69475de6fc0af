"""Where the model of an ``hf:`` or ``vllm:`` spec lives: a local directory, or a hub id.

transformers takes any string it cannot find on disk for a hub id, so a mistyped or not yet built
local path (``hf:out/tinyy``) used to cost 30-90 s of retries against huggingface.co and end in a
traceback blaming the network, never saying "no such directory". :func:`locate_checkpoint`
decides first, from the string and the filesystem alone:

- a path that exists must be a checkpoint directory (``config.json`` inside);
- a string that could only be a path (it starts with ``/``, ``~`` or ``.``, has more than one
  ``/``, is not a valid hub id, or its first component is an existing local directory, as
  ``out`` in ``out/tiny``) and does not exist is "no such directory", at once;
- anything else is a hub id; offline (``HF_HUB_OFFLINE``) it must already be in the local cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from closedloop.models.base import ModelError

__all__ = ["CheckpointNotFoundError", "hub_offline", "locate_checkpoint", "looks_like_hub_id"]


class CheckpointNotFoundError(ModelError, ValueError):
    """The spec names no checkpoint this process can load (the caller's to fix, never retried)."""


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off for this process (``HF_HUB_OFFLINE``, or
    transformers' older ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_like_hub_id(name: str) -> bool:
    """``name`` or ``org/name`` as the hub spells ids, and nothing that reads as a local path: no
    leading ``/``, ``~`` or ``.``, at most one ``/``, and no existing local directory as its first
    component (``out/tiny`` beside an ``out/`` folder is a path, whatever the hub accepts)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or name.startswith(("/", "~", ".")) or "\\" in name or name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    first = name.split("/", 1)[0]
    return "/" not in name or not Path(first).is_dir()


def locate_checkpoint(name: str, *, what: str = "model") -> str:
    """The directory (as given, ``~`` expanded) or hub id that ``name`` names, or
    :class:`CheckpointNotFoundError` with one line saying what is wrong.

    Never contacts the hub: a hub id is returned for the loader to fetch (offline: only when the
    local cache holds its ``config.json``)."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointNotFoundError(f"{what} {name!r} is a file, not a checkpoint directory")
        if not (path / "config.json").is_file():
            raise CheckpointNotFoundError(f"{what} {name!r} has no config.json: not a Hugging Face model directory")
        return str(path)
    if not looks_like_hub_id(name):
        raise CheckpointNotFoundError(f"{what} {name!r}: no such directory{_nearest_hint(path)}")
    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise CheckpointNotFoundError(f"{what} {name!r}: no such directory, and not a hub model in the local "
                                          "cache (HF_HUB_OFFLINE is set, so the hub is not asked)")
    return name


def _nearest_hint(path: Path) -> str:
    """Where the path stops existing, so a typo is easy to see: ``(out/ exists; it holds: a, b)``."""
    parent = path.parent
    while parent != parent.parent and not parent.is_dir():
        parent = parent.parent
    if not parent.is_dir() or parent == path:
        return ""
    try:
        entries = sorted(p.name for p in parent.iterdir() if p.is_dir())[:8]
    except OSError:
        return ""
    shown = "the current directory" if str(parent) == "." else str(parent).rstrip("/") + "/"
    return f" ({shown} holds: {', '.join(entries)})" if entries else f" ({shown} holds no directories)"
