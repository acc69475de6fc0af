"""The store's file and the one way to use it: one transaction on a connection of its own, under the store's lock.

DuckDB lets one process at a time open a file for writing, so the store never holds the file
between operations: each transaction opens a connection, runs inside BEGIN/COMMIT and closes it
(DuckDB checkpoints on close) before the lock is released. Every open goes through the store's own
lock first (:mod:`closedloop.store.lock`): exclusive for a write, shared for a read (readers open
the file ``read_only`` and may read together); DuckDB 2 reads the file's header before it locks
the file, and this lock is what keeps another process from checkpointing in between. A lock held
elsewhere is waited for, with backoff, until ``lock_timeout_s`` (then :class:`StoreBusyError`,
naming the holder). A crash mid-write loses only the uncommitted transaction, never half of one.

``":memory:"`` (tests) is one in-process database; a thread lock gives it the same one
transaction at a time.
"""

from __future__ import annotations

import math
import os
import random
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import duckdb

from closedloop.config import default_store_path
from closedloop.store.errors import LOCK_TIMEOUT_ENV, StoreBusyError, StoreOpenError
from closedloop.store.location import check_store_path
from closedloop.store.lock import LockTimeout, StoreLock

__all__ = ["StoreFile", "lock_timeout_from_env", "Transaction"]

T = TypeVar("T")
Transaction = Callable[[duckdb.DuckDBPyConnection], T]
_DEFAULT_LOCK_TIMEOUT_S = 15.0


def lock_timeout_from_env() -> float:
    """``$CLOSEDLOOP_STORE_LOCK_TIMEOUT`` seconds, else 15; anything but a number >= 0 is an error."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return _DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={raw!r}: give the seconds to wait for a locked run store (a number >= 0)")
    return value


def _backoff(delay: float) -> float:
    """Sleep about ``delay`` (jittered, so waiting threads do not retry in step); the next delay."""
    time.sleep(delay * (0.5 + random.random()))
    return min(delay * 2, 0.2)


class StoreFile:
    """A run store's DuckDB file (or ``":memory:"``) and its transactions.

    ``path=None`` is the default location (:func:`closedloop.config.default_store_path`), whose
    directory is created; a path the caller names must be in an existing directory unless
    ``create_dirs`` (see :mod:`closedloop.store.location`).
    """

    def __init__(self, path: str | os.PathLike[str] | None, *, lock_timeout_s: float, create_dirs: bool) -> None:
        self.lock_timeout_s = lock_timeout_s
        self.memory: duckdb.DuckDBPyConnection | None = None
        self._memory_lock = threading.Lock()  # one transaction at a time, as the file's lock gives
        if str(path) == ":memory:":
            self.path: Path | str = ":memory:"
            self.memory = duckdb.connect(":memory:")
        else:
            self.path = check_store_path(Path(path).expanduser() if path is not None else default_store_path(),
                                         create_dirs=create_dirs or path is None)
            self._lock = StoreLock(self.path)

    @contextmanager
    def connect(self, deadline: float | None = None, *, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection for one transaction, under the store's lock: shared and ``read_only`` for
        reads, exclusive for writes; closed before the lock is released."""
        deadline = deadline if deadline is not None else time.monotonic() + self.lock_timeout_s
        if self.memory is not None:
            with self._memory_connection(deadline) as con:
                yield con
            return
        try:
            held = self._lock.hold(shared=read_only, deadline=deadline)
            held.__enter__()
        except LockTimeout as e:
            raise StoreBusyError.held(self.path, self.lock_timeout_s, e.holders[0] if e.holders else None) from None
        except OSError as e:  # the lock file beside the store cannot be created or opened
            raise StoreOpenError(f"run store {self.path}: cannot use its lock file {self._lock.path}: "
                                 f"{e.strerror or e}") from None
        try:
            con = self._open_file(deadline, read_only)
            try:
                yield con
            finally:
                con.close()
        except BaseException:
            if not held.__exit__(*sys.exc_info()):
                raise
        else:
            held.__exit__(None, None, None)

    @contextmanager
    def _memory_connection(self, deadline: float) -> Iterator[duckdb.DuckDBPyConnection]:
        assert self.memory is not None
        if not self._memory_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise StoreBusyError(f"run store {self.path}: another thread held it for {self.lock_timeout_s:g} s",
                                 waited_s=self.lock_timeout_s)
        try:
            con = self.memory.cursor()
            try:
                yield con
            finally:
                con.close()
        finally:
            self._memory_lock.release()

    def _open_file(self, deadline: float, read_only: bool) -> duckdb.DuckDBPyConnection:
        """``duckdb.connect``, waiting for a process outside the lock protocol (a ``duckdb`` shell
        on the file) that holds DuckDB's own lock."""
        delay = 0.005
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=read_only)
            except duckdb.IOException as e:
                if "lock" not in str(e).lower():
                    raise
                if time.monotonic() >= deadline:
                    raise StoreBusyError.locked(self.path, self.lock_timeout_s, str(e)) from None
                delay = _backoff(delay)

    def transaction(self, fn: Transaction[T], before: Callable[[duckdb.DuckDBPyConnection], Any] | None = None, *,
                    read_only: bool = False) -> T:
        """Run ``fn`` in one transaction; a write-write conflict with another thread is retried whole.

        ``before`` runs on the same connection outside the transaction (migrations manage their own).
        ``read_only``: a read under the shared lock (``fn`` must not write).
        """
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.005
        while True:
            try:
                with self.connect(deadline, read_only=read_only) as con:
                    if before is not None:
                        before(con)
                    con.execute("BEGIN TRANSACTION")
                    try:
                        result = fn(con)
                        con.execute("COMMIT")
                        return result
                    except BaseException:
                        try:
                            con.execute("ROLLBACK")
                        except duckdb.Error:
                            pass  # a failed COMMIT has already rolled back
                        raise
            except duckdb.TransactionException as e:
                if "conflict" not in str(e).lower():
                    raise
                if time.monotonic() >= deadline:
                    raise StoreBusyError(f"run store {self.path}: a write kept conflicting with another thread's "
                                         f"for {self.lock_timeout_s:g} s ({LOCK_TIMEOUT_ENV} waits longer)",
                                         waited_s=self.lock_timeout_s) from None
                delay = _backoff(delay)

    def close(self) -> None:
        """Close an in-memory database (a file has no connection open between transactions)."""
        if self.memory is not None:
            self.memory.close()
            self.memory = None
