"""One live process per evaluation name: an OS lock beside the run store, holding the owner's PID.

Why a lock file and not a row: the claim must disappear when its holder dies however it dies
(SIGKILL included), and ``flock`` locks are released by the kernel with the process. A claim
left by a dead process is therefore simply free: the next run takes it over. Taking it is
atomic (``LOCK_EX | LOCK_NB``), so two processes starting the same name cannot both win.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path


class EvalBusyError(RuntimeError):
    """Another live process is running this evaluation."""


class EvalClaim:
    """``with EvalClaim(store_path, name):`` — refuse if another live process holds ``name``."""

    def __init__(self, store_path: str | Path, name: str):
        self.name = name
        if str(store_path) == ":memory:":
            self.path = None  # an in-memory store is private to this process
        else:
            p = Path(store_path).expanduser()
            digest = hashlib.sha256(name.encode()).hexdigest()[:24]
            self.path = p.parent / f".{p.name}.claims" / f"{digest}.lock"
        self._fd: int | None = None

    def holder(self) -> dict | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            return json.loads(self.path.read_text() or "null")
        except (OSError, ValueError):
            return None

    def acquire(self) -> "EvalClaim":
        if self.path is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            who = self.holder() or {}
            raise EvalBusyError(f"evaluation {self.name!r} is still running (claimed by pid {who.get('pid', '?')} "
                                f"on {who.get('host', '?')} since {who.get('since', '?')}); wait for it or use "
                                "another --name") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"name": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "EvalClaim":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
