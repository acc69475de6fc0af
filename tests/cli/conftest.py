"""A real installed distribution for plugin tests: a ``*.dist-info`` folder with ``METADATA`` and
``entry_points.txt`` beside the package's modules, put on ``PYTHONPATH`` of a child process, which
``importlib.metadata`` discovers exactly as it discovers a pip-installed package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


class Site:
    """A folder of installed distributions and the child processes that see them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def install(self, dist: str, entry_points: dict[str, dict[str, str]], files: dict[str, str] | None = None) -> None:
        info = self.root / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items()) + "\n"
            for group, eps in entry_points.items()))
        for path, text in (files or {}).items():
            (self.root / path).parent.mkdir(parents=True, exist_ok=True)
            (self.root / path).write_text(textwrap.dedent(text))

    def run(self, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
        """``python -m closedloop ARGS`` (or ``python -c CODE``) in a child that sees this site."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.root), os.environ.get("PYTHONPATH", "")])}
        argv = [sys.executable, "-c", code, *args] if code is not None else [sys.executable, "-m", "closedloop", *args]
        return subprocess.run(argv, cwd=self.root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path / "site")
