"""The working root: the directories whose files tools may read when a model names a path.

A model (or whoever writes its prompt) chooses the strings a tool receives, so a path argument
must not reach any file on the machine: ``~/.ssh/key.npy``, ``../../secret.npz``,
``~/data.safetensors``. Every path a tool reads or writes on a caller's behalf resolves through
:func:`resolve_path`, which follows ``~``, ``..`` and symbolic links first and then requires the
result to lie inside one of :func:`working_roots`:

- the artifacts directory (what tools wrote earlier, handed back as paths),
- the current working directory,
- and any directory listed in ``$CLOSEDLOOP_WORKING_ROOTS`` (``os.pathsep``-separated), which is
  how a user widens the root.

The refusal names the argument but neither the roots' absolute paths nor where a link points, and
never says whether the file outside exists: the same message for every outside path, existing or
not, so errors cannot be used to probe the machine (or, over MCP, to learn its layout).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ROOTS_ENV", "PathOutsideRoot", "working_roots", "resolve_path", "is_inside", "allow_root"]

ROOTS_ENV = "CLOSEDLOOP_WORKING_ROOTS"
_ALLOWED: list[Path] = []  # roots a server added for this process (e.g. ``closedloop mcp serve --workdir``)


def allow_root(path: str | os.PathLike[str]) -> Path:
    """Add a working root for the rest of this process (a server's configured working directory)."""
    root = Path(path).expanduser().resolve()
    if root not in _ALLOWED:
        _ALLOWED.append(root)
    return root


class PathOutsideRoot(ValueError):
    """A path argument resolves outside every working root."""


def working_roots() -> list[Path]:
    """The artifacts directory, the current directory, roots added with :func:`allow_root` and
    ``$CLOSEDLOOP_WORKING_ROOTS``, resolved."""
    from closedloop.config import get_settings

    candidates = [get_settings().artifacts_dir, Path.cwd(), *_ALLOWED]
    candidates += [Path(p).expanduser() for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    roots: list[Path] = []
    for c in candidates:
        try:
            r = c.resolve()
        except (OSError, RuntimeError):
            continue
        if r not in roots:
            roots.append(r)
    return roots


def is_inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def resolve_path(value: str | os.PathLike[str], *, name: str = "path") -> Path:
    """``value`` as an absolute path inside a working root, or :class:`PathOutsideRoot`.

    Relative paths are taken from the current directory; ``~`` is expanded; symbolic links are
    followed (a link inside the root pointing outside it is outside).
    """
    text = os.fspath(value)
    roots = working_roots()
    if len(text) > 4096 or any(len(part) > 255 for part in text.split("/")):
        raise PathOutsideRoot(f"{name}: not a usable path (over 4096 characters, or a name over 255)")
    try:
        if "\x00" in text:
            raise ValueError("NUL byte")
        path = Path(text).expanduser()
        resolved = (path if path.is_absolute() else Path.cwd() / path).resolve()
    except (OSError, RuntimeError, ValueError):
        resolved = None
    if resolved is None or not is_inside(resolved, roots):
        shown = text if len(text) <= 200 else text[:200] + "..."
        raise PathOutsideRoot(f"{name}: path {shown!r} is outside the working root (the current directory, the "
                              f"artifacts directory, {ROOTS_ENV}); use a file inside it")
    return resolved
