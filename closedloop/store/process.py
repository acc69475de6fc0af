"""Is the process that opened a run still alive? Used to mark runs whose writer was SIGKILLed.

A pid alone is not enough: pids are reused, and an unreaped child is a zombie that still answers
``kill(pid, 0)``. On Linux we also compare the process start time from ``/proc/<pid>/stat``.
Runs are only judged on the host that wrote them; containers that share a hostname but not a pid
namespace cannot see each other's processes, so give them distinct hostnames or pass
``RunStore(detect_killed=False)``.
"""

from __future__ import annotations

import os
import socket

__all__ = ["hostname", "process_start", "pid_alive"]


def hostname() -> str:
    return socket.gethostname()


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; everything after the last ')'
    # is space-separated, starting with field 3 (state).
    return raw[raw.rfind(")") + 2:].split()


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), or None where unknown."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int | None, start: int | None = None) -> bool:
    """False only when we are sure: no such process, a zombie, or a different process on that pid."""
    if pid is None or pid <= 0:
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return True
    fields = _stat_fields(pid)
    if fields:
        if fields[0] in ("Z", "X"):
            return False
        if start is not None and process_start(pid) not in (None, start):
            return False
    return True
