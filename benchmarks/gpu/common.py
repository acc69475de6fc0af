"""What every part of the GPU check shares: its record, its clock, its arguments.

A part is a script run by ``check.py`` in a process of its own, with a hard deadline: the
orchestrator kills it when the deadline passes. So a part writes its record (``part.json``)
atomically after every result, never only at the end: a part killed mid-way still returns
everything it measured, and the report says where it stopped.

Parts import only the standard library at module level, so that ``--help`` and the
orchestrator stay cheap; torch and the project come in inside each part's ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHIPPED = HERE / "shipped"


class Recorder:
    """A part's record, rewritten atomically (temp file + rename) after every change."""

    def __init__(self, path: Path, name: str, *, dry_run: bool, deadline_s: float):
        self.path = path
        self.end = time.monotonic() + deadline_s
        self.data: dict[str, Any] = {"part": name, "status": "running", "dry_run": dry_run,
                                     "deadline_s": deadline_s, "results": {}, "skipped": {}, "notes": []}
        self.flush()

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def set(self, key: str, value: Any) -> None:
        self.data["results"][key] = value
        self.flush()

    def skip(self, key: str, reason: str) -> None:
        """A step that did not run here, and why (the report lists every one)."""
        self.data["skipped"][key] = reason
        self.flush()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.flush()

    def summary(self, lines: list[str]) -> None:
        """Markdown lines for the report (a table of the figures that matter)."""
        self.data["summary"] = lines
        self.flush()

    def finish(self, status: str, **extra: Any) -> None:
        self.data.update(status=status, **extra)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def imported_distributions() -> dict[str, list[str]]:
    """Every top-level module this process imported from an installed distribution, with the
    distributions that provide it (normalised names; a namespace such as ``google`` has several):
    what the device machine must have, from its image or the carried wheels (``wheels.py``)."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    found: dict[str, list[str]] = {}
    for name in list(sys.modules):
        top = name.partition(".")[0]
        if top in owners and top not in found:
            found[top] = sorted({normalise(d) for d in owners[top]})
    return dict(sorted(found.items()))


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def part_main(name: str, run: Callable[[Recorder, argparse.Namespace], str | None],
              add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Parse the common arguments, run ``run(recorder, args)`` and close the record: status
    ``ok`` (or what ``run`` returns), ``error`` with the traceback's tail if it raised."""
    p = argparse.ArgumentParser(description=f"GPU check, part {name}")
    p.add_argument("--out", type=Path, required=True, help="this part's folder (part.json goes there)")
    p.add_argument("--work", type=Path, required=True, help="the run's shared scratch folder")
    p.add_argument("--deadline-s", type=float, required=True, help="the orchestrator kills the part after this")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, on whatever device is here")
    if add_args is not None:
        add_args(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out / "part.json", name, dry_run=args.dry_run, deadline_s=args.deadline_s)
    try:
        status = run(rec, args) or "ok"
    except BaseException as exc:  # noqa: BLE001 - the record says what failed, the orchestrator goes on
        rec.data["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        rec.data["traceback_tail"] = traceback.format_exc()[-4000:]
        status = "error"
    sandbox = sys.modules.get("closedloop.sandbox")
    if sandbox is not None:  # its fork servers, so their CPU is counted as this part's
        sandbox.shutdown_fork_servers()
    rec.finish(status, imported_distributions=imported_distributions())
    sys.stdout.flush()
    # leave at once: threads a library left running (servers' clients, compile workers) must not
    # keep a finished part alive until its deadline
    os._exit(0 if status in ("ok", "skipped") else 1)


def cuda_ready() -> tuple[bool, str]:
    """Whether a CUDA device is usable here, and if not, why (the reason the report gives)."""
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device here (dry run, or a machine without a GPU)"
    return True, ""
