"""The shell and Python blocks of a Markdown file, with what the README says about running them.

A fenced block whose language is ``bash``/``sh``/``shell`` or ``python`` is run as written. An HTML
comment right above it (invisible on GitHub) can say how, one directive per comment:

- ``<!-- docs-test: skip REASON -->``: never run here (it needs a network service, a GPU, or it is
  the test suite itself); the reason is reported.
- ``<!-- docs-test: heavy REASON -->``: run only with ``CLOSEDLOOP_DOCS_HEAVY=1`` (minutes of CPU;
  the reason names the test that covers the same path in every run).
- ``<!-- docs-test: background URL|PORT -->``: a server: started, waited for until the URL answers
  (or the port accepts connections), left running for the blocks after it, stopped at the end.
- ``<!-- docs-test: stdin TEXT -->``: what a person types (``\\n`` for Enter), fed to the block.
- ``<!-- docs-test: cwd repo -->``: run from the repository root, as the README says (its own scripts).
- ``<!-- docs-test: expect TEXT -->``: the block's output must hold TEXT (what the README says it
  prints), so a block that runs but gives the wrong result fails too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DIRECTIVES = ("skip", "heavy", "background", "stdin", "cwd", "expect")
SHELL = ("bash", "sh", "shell")
PYTHON = ("python", "py")
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
_DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "python" if self.language in PYTHON else "shell"

    @property
    def where(self) -> str:
        parts = self.path.parts
        shown = "/".join(parts[-3:]) if len(parts) >= 3 and parts[-3] == "evals" else \
            "/".join(parts[-2:]) if parts[-2] in ("trainers", "tau", "kernelbench") else self.path.name
        return f"{shown}:{self.line}"

    @property
    def stdin(self) -> str | None:
        text = self.directives.get("stdin")
        return None if text is None else text.encode().decode("unicode_escape")


def blocks(path: Path) -> list[Block]:
    """The runnable blocks of ``path``, in order, each with the directives right above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    pending: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE.match(line.strip())
        fence = _FENCE.match(line)
        if directive:
            kind, arg = directive.groups()
            if kind not in DIRECTIVES:
                raise ValueError(f"{path}:{i + 1}: unknown docs-test directive {kind!r}")
            pending[kind] = arg
        elif fence:
            marker, language = fence.groups()
            start = i
            body: list[str] = []
            i += 1
            while i < len(lines) and not lines[i].startswith(marker):
                body.append(lines[i])
                i += 1
            if language in SHELL + PYTHON:
                out.append(Block(path, start + 1, language, "\n".join(body) + "\n", pending))
            elif pending:
                raise ValueError(f"{path}:{start + 1}: docs-test directive above a {language or 'plain'} block")
            pending = {}
        elif line.strip():
            if pending:
                raise ValueError(f"{path}:{i + 1}: a docs-test directive must stand right above its block")
        i += 1
    return out
