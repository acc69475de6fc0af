"""Lint and type checks run with the tests, so CI (which runs the README's test command) fails on
them: ruff (syntax errors and pyflakes: undefined names, unused imports and variables, broken
``__all__``) over the whole repository, and mypy (with the pydantic plugin) over the whole library
exactly as ``python -m mypy`` runs it from ``pyproject.toml``: the ``closedloop`` package, whose
top-level folders are linked in, so ``closedloop.trainers`` and the rest are checked like the core."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str) -> list[str]:
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (pip install -e .[test])")
    return [exe]


def test_ruff():
    proc = subprocess.run(_tool("ruff") + ["check", "--quiet", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_mypy_library():
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_namespace_is_visible_to_static_tools(tmp_path):
    """``closedloop.<folder>`` resolves by path alone (no import hook), so mypy types a trainer's
    function instead of reading it as ``Any``."""
    for folder in ("agents", "tools", "graphs", "trainers", "memory", "evals"):
        link = REPO / "closedloop" / folder
        assert link.is_dir() and link.resolve() == (REPO / folder).resolve(), folder
    probe = tmp_path / "probe.py"
    probe.write_text("from closedloop.trainers.losses import grpo_loss\nreveal_type(grpo_loss)\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                           "--config-file", str(REPO / "pyproject.toml"), str(probe)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    revealed = [line for line in proc.stdout.splitlines() if "Revealed type" in line]
    assert revealed and "def (" in revealed[0], proc.stdout[-2000:]


# Sizes (issue 27, point 7): a library file holds at most MAX_FILE_LINES lines and a function at most
# MAX_FUNCTION_LINES (decorators aside), so each module is small enough to read as one concern.
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 120
LIBRARY_FOLDERS = ("closedloop", "agents", "tools", "graphs", "trainers", "memory", "evals")
# Ported from tau2-bench as they are there (fidelity: the reference's layout line for line).
PORTED_FILES = {
    "evals/tau/domains/airline/tools.py",
    "evals/tau/domains/retail/tools.py",
    "evals/tau/domains/telecom/tools.py",
    "evals/tau/domains/telecom/user_tools.py",
}
# Over the limits today and being split by their owners; the set may only shrink (an entry that
# fits fails the test until it is deleted here).
KNOWN_OVERSIZED = {
    "evals/kernelbench/judge.py",
}


def _library_files() -> list[Path]:
    files = []
    for folder in LIBRARY_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            top = REPO / path.relative_to(REPO).parts[0] / path.relative_to(REPO).parts[1]
            if not top.is_symlink():  # closedloop/<folder> links to a top-level folder, walked as itself
                files.append(path)
    return files


def oversized(files: list[Path], root: Path = REPO) -> dict[str, int]:
    """``{"file": lines}`` and ``{"file:function": lines}`` for what is over the limits."""
    import ast

    found: dict[str, int] = {}
    for path in files:
        name = path.relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8")
        if (lines := len(source.splitlines())) > MAX_FILE_LINES:
            found[name] = lines
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                if (lines := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    found[f"{name}:{node.name}"] = lines
    return found


def test_library_files_and_functions_are_small():
    files = _library_files()
    names = {f.relative_to(REPO).as_posix() for f in files}
    assert "closedloop/models/base.py" in names and "trainers/config.py" in names  # the walk sees the library
    assert not any(n.startswith(("closedloop/trainers/", "closedloop/evals/")) for n in names)  # each file once
    found = oversized([f for f in files if f.relative_to(REPO).as_posix() not in PORTED_FILES])
    new = {k: v for k, v in found.items() if k not in KNOWN_OVERSIZED}
    assert not new, (f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function; split by concern: "
                     f"{new}")
    stale = sorted(KNOWN_OVERSIZED - set(found))
    assert not stale, f"within the limits now, delete from KNOWN_OVERSIZED: {stale}"


def test_the_size_check_reports_what_is_over(tmp_path):
    """The checker itself: a long function and a long file are reported, a short function is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n")
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    (tmp_path / "fits.py").write_text("x = 1\n" * MAX_FILE_LINES)
    found = oversized(sorted(tmp_path.glob("*.py")), root=tmp_path)
    assert found == {"long.py:long": MAX_FUNCTION_LINES + 1, "big.py": MAX_FILE_LINES + 1}
