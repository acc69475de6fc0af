"""Tool descriptions read from a user's tau2 checkout.

The descriptions are part of the agent's prompt, so they are tau2's own docstrings. Ours are
copies of them (the fallback); when a tau2 checkout is at hand its current docstrings are used
instead, so a newer upstream wording reaches the agent without a release of ours. The source is
parsed, never imported (tau2 needs Python 3.12 and its own dependencies).

A checkout is found at ``$TAU2_SRC_DIR`` (the folder holding ``src/tau2``), or beside the data
root when the data root is a checkout's ``data`` folder.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

__all__ = ["SRC_DIR_ENV", "find_tau2_source", "read_tool_docstrings"]

SRC_DIR_ENV = "TAU2_SRC_DIR"


def find_tau2_source(data_root: Path | None) -> Path | None:
    """The ``src/tau2`` folder of a checkout, or None."""
    candidates = [os.environ.get(SRC_DIR_ENV)]
    if data_root is not None:
        candidates.append(str(Path(data_root).parent))
    for cand in candidates:
        if cand and (Path(cand) / "src" / "tau2" / "domains").is_dir():
            return Path(cand) / "src" / "tau2"
    return None


def read_tool_docstrings(src: Path, domain: str, module: str = "tools") -> dict[str, str]:
    """{tool name: raw docstring} of the methods marked ``@is_tool(...)`` in
    ``src/tau2/domains/<domain>/<module>.py``; empty when the file is absent."""
    path = src / "domains" / domain / f"{module}.py"
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text())
    out: dict[str, str] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            marked = any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "is_tool" or
                         getattr(d, "id", None) == "is_tool" for d in fn.decorator_list)
            doc = ast.get_docstring(fn, clean=False)
            if marked and doc is not None:
                out[fn.name] = doc
    return out
