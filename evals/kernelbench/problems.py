"""KernelBench problems: ``level<N>/<id>_<Name>.py`` files or ``(code, level, name, problem_id)`` rows.

Scaling: KernelBench's level-1 inputs are GiB-sized (GPU-sized). ``scale_source`` rewrites the
module-level integer constants that look like sizes (>= ``min_size``) before the problem runs,
so ``get_inputs``/``get_init_inputs`` (which read module globals at call time) and constants
derived at module level (``shape = (N, M)``) both shrink. The scale is recorded with every result.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel

_FILE = re.compile(r"^(\d+)_(.+)\.py$")
_LEVEL = re.compile(r"^level(\d+)$")


class Problem(BaseModel):
    """One reference problem (``Model``, ``get_inputs``, ``get_init_inputs``)."""

    level: int
    problem_id: int
    name: str  # file name as KernelBench names it, e.g. "19_ReLU.py"
    code: str
    path: str | None = None

    @property
    def key(self) -> str:
        return f"level{self.level}/{self.name}"

    @property
    def hash(self) -> str:
        """Comment- and whitespace-insensitive hash (as KernelBench's ``Problem.hash``)."""
        lines = [ln.split("#", 1)[0].strip() for ln in self.code.splitlines()]
        return hashlib.md5("".join(ln for ln in lines if ln).encode()).hexdigest()


def _problem_from_file(path: Path, level: int) -> Problem | None:
    m = _FILE.match(path.name)
    if not m:
        return None
    return Problem(level=level, problem_id=int(m.group(1)), name=path.name, code=path.read_text(), path=str(path))


def load_problems(root: str | Path, *, level: int | None = None, ids: Iterable[int] | None = None) -> list[Problem]:
    """Problems under ``root`` (a ``level<N>/`` tree, one ``level<N>`` folder, or one file).

    Files not named ``<id>_<Name>.py`` are skipped; nothing assumes KernelBench's counts.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no problems at {root}")
    found: list[Problem] = []
    if root.is_file():
        lm = _LEVEL.match(root.parent.name)
        p = _problem_from_file(root, int(lm.group(1)) if lm else (level or 1))
        if p is None:
            raise ValueError(f"{root.name} is not named <id>_<Name>.py")
        found.append(p)
    else:
        lm = _LEVEL.match(root.name)
        level_dirs = [(int(lm.group(1)), root)] if lm else sorted(
            (int(m.group(1)), d) for d in root.iterdir() if d.is_dir() and (m := _LEVEL.match(d.name)))
        for lvl, d in level_dirs:
            if level is not None and lvl != level:
                continue
            for f in sorted(d.iterdir()):
                if f.is_file() and (p := _problem_from_file(f, lvl)) is not None:
                    found.append(p)
    wanted = set(ids) if ids is not None else None
    found = [p for p in found if wanted is None or p.problem_id in wanted]
    if not found:
        raise ValueError(f"no problems found under {root}" + (f" for level {level}" if level else ""))
    return sorted(found, key=lambda p: (p.level, p.problem_id))


def problems_from_rows(rows: Iterable[dict[str, Any]]) -> list[Problem]:
    """Dataset rows with KernelBench's fields ``code, level, name, problem_id``."""
    out = []
    for row in rows:
        missing = {"code", "level", "name", "problem_id"} - set(row)
        if missing:
            raise ValueError(f"dataset row lacks {sorted(missing)}")
        name = str(row["name"])
        if not name.startswith(f"{row['problem_id']}_"):
            name = f"{row['problem_id']}_{name}"
        name = name if name.endswith(".py") else name + ".py"
        out.append(Problem(level=int(row["level"]), problem_id=int(row["problem_id"]), name=name, code=row["code"]))
    return out


class _Scaler(ast.NodeTransformer):
    def __init__(self, scale: float, min_size: int):
        self.scale, self.min_size = scale, min_size
        self.changed: dict[str, Any] = {}
        self._target = ""

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        v = node.value
        if type(v) is int and v >= self.min_size:
            new = max(1, int(round(v * self.scale)))
            self.changed.setdefault(self._target, []).append([v, new])
            return ast.copy_location(ast.Constant(new), node)
        return node


def scale_source(code: str, scale: float, *, min_size: int = 16) -> tuple[str, dict[str, Any]]:
    """Rewrite module-level integer constants ``>= min_size`` (sizes) by ``scale``.

    Returns the new source and ``{name: [[old, new], ...]}``. Only top-level assignments are
    touched (``N = 4096``, ``shape = (32768, 64)``, ``batch_size = 16``); function bodies,
    small integers (dims, kernel sizes) and floats (eps, probabilities) are left alone.
    """
    if scale == 1.0:
        return code, {}
    if not 0 < scale:
        raise ValueError(f"scale must be positive, got {scale}")
    tree = ast.parse(code)
    scaler = _Scaler(scale, min_size)
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            scaler._target = ",".join(ast.unparse(t) for t in targets)
            stmt.value = scaler.visit(stmt.value)
    return ast.unparse(tree) + "\n", scaler.changed


def extract_code(text: str, *, which: str = "first") -> str:
    """The first (or last) fenced ```python block of a model answer; the text itself if none."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", text, flags=re.S)
    if not blocks:
        return text
    return blocks[0] if which == "first" else blocks[-1]
