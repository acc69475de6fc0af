"""The store's errors, each a one-line message meant to be printed as is (the CLI does, without a traceback)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from closedloop.redact import redact_text

__all__ = ["RunNotFoundError", "RunStateError", "StoreBusyError", "StoreOpenError", "LOCK_TIMEOUT_ENV"]


class RunNotFoundError(KeyError):
    """No run with that id (or id prefix)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RunStateError(RuntimeError):
    """The run is not in a state that allows the operation (e.g. logging to a finished run)."""


class StoreOpenError(ValueError):
    """The path cannot be a run store: a directory, a device, a file that is not a DuckDB database,
    a missing directory the caller did not ask to create, a lock file that cannot be created."""


class StoreBusyError(RuntimeError):
    """Another process held the store's lock for longer than ``lock_timeout_s``.

    ``pid`` and ``command`` name the holder when it is known (DuckDB's lock error, or
    ``/proc/locks`` for the store's own lock, see :mod:`closedloop.store.lock`), and ``/proc``
    shows its command line; the message is one line, meant to be printed as is (the CLI does,
    without a traceback).
    """

    def __init__(self, message: str, *, pid: int | None = None, command: str | None = None,
                 waited_s: float | None = None) -> None:
        super().__init__(message)
        self.pid, self.command, self.waited_s = pid, command, waited_s

    @classmethod
    def locked(cls, path: Any, waited_s: float, duckdb_message: str) -> "StoreBusyError":
        m = _LOCK_PID.search(duckdb_message)
        return cls.held(path, waited_s, int(m.group(1)) if m else None)

    @classmethod
    def held(cls, path: Any, waited_s: float, pid: int | None) -> "StoreBusyError":
        command = _command_line(pid) if pid is not None else None
        who = f"pid {pid}" + (f" ({command})" if command else "") if pid is not None else "another process"
        return cls(f"run store {path} is held by {who} and stayed locked for {waited_s:g} s; wait for it to "
                   f"finish, or wait longer with {LOCK_TIMEOUT_ENV}=<seconds>", pid=pid, command=command,
                   waited_s=waited_s)

    @staticmethod
    def within(error: BaseException | None) -> "StoreBusyError | None":
        """The StoreBusyError behind ``error`` (itself, a cause or context, or one in an exception group)."""
        seen: set[int] = set()
        stack = [error]
        while stack:
            e = stack.pop()
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            if isinstance(e, StoreBusyError):
                return e
            stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
        return None


LOCK_TIMEOUT_ENV = "CLOSEDLOOP_STORE_LOCK_TIMEOUT"
_LOCK_PID = re.compile(r"\(PID (\d+)\)")


def _command_line(pid: int, limit: int = 200) -> str | None:
    """The holder's command line from ``/proc`` (Linux), shortened; None where it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    text = " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)
    text = redact_text(" ".join(text.split()))  # one line, and no key typed on its command line
    return (text[:limit] + "...") if len(text) > limit else (text or None)
