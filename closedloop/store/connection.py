"""The store's file and the one way to use it: one transaction on a connection of its own, under the store's lock.

DuckDB lets one process at a time open a file for writing, so by default the store does not hold
the file between operations: a transaction opens a connection, runs inside BEGIN/COMMIT and closes
it (DuckDB checkpoints on close) before the lock is released. Every open goes through the store's own
lock first (:mod:`closedloop.store.lock`): exclusive for a write, shared for a read (readers open
the file ``read_only`` and may read together); DuckDB 2 reads the file's header before it locks
the file, and this lock is what keeps another process from checkpointing in between. A lock held
elsewhere is waited for, with backoff, until ``lock_timeout_s`` (then :class:`StoreBusyError`,
naming the holder). A crash mid-write loses only the uncommitted transaction, never half of one.

Opening and closing is most of what a small transaction costs (creating DuckDB's database
instance, the checkpoint on close: some 20-40 ms of CPU). So while the store's background writer
streams batches (:mod:`closedloop.store.writer`), :meth:`StoreFile.keep_open` keeps the write
connection and its exclusive lock between transactions, shared by every thread of the process
(one at a time, as before; reads of this process use it too, since DuckDB allows one instance of
a file per process). Other processes are not shut out: one that waits for the lock says so
(the *want* byte of :mod:`closedloop.store.lock`), and the writer closes the file at its next
check (:meth:`StoreFile.release_if_wanted`, every :data:`~closedloop.store.writer.POLL_S` while
it waits and after each batch) or once it has been idle for a while
(:data:`~closedloop.store.writer.LINGER_S`). Closing checkpoints, so the waiter opens exactly
the state of the last commit, as when every transaction closed the file. A transaction with a
``before`` step (migrations, bulk settings that change the connection's checkpointing) always
runs on a connection of its own. A SIGKILL while the file is kept loses nothing committed: the
commits are in DuckDB's WAL, which the next opener replays (a ``read_only`` one in memory,
leaving the file as it is; the next writer checkpoints it).

``":memory:"`` (tests) is one in-process database; a thread lock gives it the same one
transaction at a time.
"""

from __future__ import annotations

import math
import os
import random
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


class _Kept:
    """A write connection kept open between transactions, and the lock descriptor that holds the file."""

    def __init__(self, con: duckdb.DuckDBPyConnection, fd: int) -> None:
        self.con, self.fd = con, fd


# Kept connections by lock file (one per file and process, shared by every StoreFile of that
# file); read and changed only under the file's StoreLock.local.
_kept: dict[str, _Kept] = {}
_inherited: list[_Kept] = []  # a forked child's copies: never closed there (closing would checkpoint)


def _forget_kept_in_child() -> None:
    _inherited.extend(_kept.values())
    _kept.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_kept_in_child)

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
        self._keeper: int | None = None  # the thread whose write connections are kept (keep_open)
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
    def connect(self, deadline: float | None = None, *, read_only: bool = False,
                own: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection for one transaction, under the store's lock: shared and ``read_only`` for
        reads, exclusive for writes; closed before the lock is released, unless :meth:`keep_open`
        keeps it (then a kept connection serves reads and writes alike). ``own``: a connection
        of its own, never kept (a kept one is closed first)."""
        deadline = deadline if deadline is not None else time.monotonic() + self.lock_timeout_s
        if self.memory is not None:
            with self._memory_connection(deadline) as con:
                yield con
            return
        try:
            with self._lock.local(deadline):
                kept = _kept.get(self._lock.key)
                if kept is not None and (own or self._keeper is None or self._lock.wanted(kept.fd)):
                    self._close_kept()
                    kept = None
                if kept is not None:
                    try:
                        yield kept.con
                    except BaseException:
                        self._close_kept()  # a fresh connection for the next try, whatever state this one is in
                        raise
                    if self._keeper is None:  # keeping ended meanwhile (its release waited for this transaction)
                        self._close_kept()
                    return
                fd = self._acquire(deadline, read_only)
                try:
                    con = self._open_file(deadline, read_only)
                except BaseException:
                    self._lock.release(fd)
                    raise
                try:
                    yield con
                finally:
                    if (self._keeper == threading.get_ident() and not (own or read_only)
                            and not self._lock.wanted(fd)):
                        _kept[self._lock.key] = _Kept(con, fd)
                    else:
                        try:
                            con.close()
                        finally:
                            self._lock.release(fd)
        except LockTimeout as e:
            raise StoreBusyError.held(self.path, self.lock_timeout_s, e.holders[0] if e.holders else None) from None

    def _acquire(self, deadline: float, read_only: bool) -> int:
        try:
            return self._lock.acquire(shared=read_only, deadline=deadline)
        except LockTimeout:  # a TimeoutError, hence an OSError: the caller names the holder
            raise
        except OSError as e:  # the lock file beside the store cannot be created or opened
            raise StoreOpenError(f"run store {self.path}: cannot use its lock file {self._lock.path}: "
                                 f"{e.strerror or e}") from None

    def keep_open(self, keep: bool) -> None:
        """Keep the write connection between transactions (``True``: a connection that the calling
        thread opens, a background writer that checks :meth:`release_if_wanted` while it runs;
        other threads use it meanwhile), or close it now and no longer (``False``)."""
        self._keeper = threading.get_ident() if keep else None
        if not keep:
            self.release_if_wanted(always=True)

    def holding(self) -> bool:
        """Whether this process keeps the file open now."""
        return self.memory is None and self._lock.key in _kept

    def release_if_wanted(self, *, always: bool = False) -> None:
        """Close a kept connection (and let the lock go) if another process waits for it, or ``always``."""
        if self.memory is not None or self._lock.key not in _kept:
            return
        try:
            with self._lock.local(time.monotonic() + (self.lock_timeout_s if always else 0.0)):
                kept = _kept.get(self._lock.key)
                if kept is not None and (always or self._lock.wanted(kept.fd)):
                    self._close_kept()
        except LockTimeout:
            pass  # a transaction of another thread has the file: it closes it when done (always), or the next check

    def _close_kept(self) -> None:
        kept = _kept.pop(self._lock.key)
        try:
            kept.con.close()  # checkpoints: the next opener sees every commit in the file itself
        finally:
            self._lock.release(kept.fd)

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
                with self.connect(deadline, read_only=read_only, own=before is not None) as con:
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
        """Close an in-memory database, or a kept connection to the file."""
        if self.memory is None:
            self.keep_open(False)
        if self.memory is not None:
            self.memory.close()
            self.memory = None
