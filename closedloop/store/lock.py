"""Who may open the store file when: a reader/writer lock beside it, taken before DuckDB opens it.

Why DuckDB's own lock is not enough: DuckDB 2 reads the file's header (the pointer to the
current catalog and free list) while it detects the file type, with the file *not yet locked*,
and only then opens and locks it, serving the first reads from those prefetched bytes (traced
with strace: ``open O_RDONLY; pread 12288 @ 0; close; open O_RDWR; fcntl F_SETLK``). When
another process checkpoints in between, the opener works from a header that no longer
describes the file: a reader fails with ``IO Error: Could not read enough bytes`` (the block it
looks for was truncated away) or reads blocks that now hold other data, and a *writer* would
write its checkpoint from a stale free list over blocks the other process just committed, which
loses that process's rows.

The protocol: every closedloop process takes this lock before ``duckdb.connect`` and releases it
only after the connection (and with it DuckDB's checkpoint-on-close) is closed. Writers hold it
exclusively, readers shared (and open the file ``read_only``, so a reader can never write).
Hence no process reads the file, header included, while another one has it open for writing:
each opener sees exactly the state the last writer checkpointed, and readers that overlap only
overlap each other. Processes that open the file with plain DuckDB (a ``duckdb`` shell) are
outside the protocol; DuckDB's own lock still keeps them from writing at the same time, and the
store waits for them as before.

The lock is two one-byte POSIX record locks (``lockf``) in ``<store>.lock``: a *gate* and the
*data* lock. A writer takes the gate exclusively, then the data lock, then lets the gate go; a
reader passes the gate shared. A waiting writer therefore holds the gate, so new readers queue
behind it instead of starving it (readers that keep overlapping would otherwise never leave the
data lock free). POSIX locks belong to a process, not a thread, and closing any descriptor of the
file drops them all, so within a process one threading lock per file serialises access first
(threads of one process take turns anyway: DuckDB allows one instance of a file per process).
The kernel releases everything when a process dies, SIGKILL included. Waits poll with backoff
until a deadline, so a caller always gets an answer (:class:`LockTimeout`) instead of hanging.

A third byte, *want*, lets a holder that keeps the file open between transactions (the store's
background writer, :mod:`closedloop.store.connection`) learn that another process is waiting:
a process whose first try at the gate or the data lock fails holds *want* shared until it gets
the lock (or gives up), and :meth:`StoreLock.wanted` asks whether some other process holds it.
The holder then closes the file and lets the lock go at its next check (at most
:data:`closedloop.store.writer.POLL_S` later, or after the batch it is writing), so the waiter
gets its turn as it did when the file was released after every transaction.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["StoreLock", "LockTimeout", "lock_path"]

_GATE, _DATA, _WANT = 0, 1, 2  # byte offsets of the locks in the lock file
_BUSY = (errno.EAGAIN, errno.EACCES)  # what F_SETLK answers for a conflicting lock


class LockTimeout(TimeoutError):
    """The lock stayed held by other processes (``holders``: their pids, where the OS says) past the deadline."""

    def __init__(self, path: Path, holders: list[int]) -> None:
        super().__init__(f"{path} stayed locked")
        self.path, self.holders = path, holders


def lock_path(store_path: Path) -> Path:
    return store_path.with_name(store_path.name + ".lock")


_registry_lock = threading.Lock()
_thread_locks: dict[str, threading.Lock] = {}
_owners: dict[str, int] = {}  # lock file -> the thread holding it in this process


def _thread_lock(key: str) -> threading.Lock:
    with _registry_lock:
        lock = _thread_locks.get(key)
        if lock is None:
            lock = _thread_locks[key] = threading.Lock()
        return lock


def _reset_after_fork() -> None:
    """A forked child starts with fresh locks: one held by another thread at fork time would never be released."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _thread_locks.clear()
    _owners.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class StoreLock:
    """The lock of one store file (see the module docstring). ``hold`` is not re-entrant: a thread
    that already holds it and asks again gets a ``RuntimeError`` (a nested open would drop the
    outer hold when it closed).

    ``hold`` is ``local`` (this process's turn) then ``acquire`` (the other processes'); a caller
    that keeps the file open between its turns (see :mod:`closedloop.store.connection`) keeps the
    descriptor ``acquire`` returned and gives it to ``release`` when it closes the file.
    """

    def __init__(self, store_path: Path) -> None:
        self.path = lock_path(store_path)
        self.key = os.path.realpath(self.path)

    @contextmanager
    def hold(self, *, shared: bool, deadline: float) -> Iterator[None]:
        with self.local(deadline):
            fd = self.acquire(shared=shared, deadline=deadline)
            try:
                yield
            finally:
                self.release(fd)

    @contextmanager
    def local(self, deadline: float) -> Iterator[None]:
        """This process's turn at the file: one thread at a time (POSIX locks are per process)."""
        me = threading.get_ident()
        if _owners.get(self.key) == me:
            raise RuntimeError(f"{self.path}: nested store access from one thread (a bug in the caller)")
        local = _thread_lock(self.key)
        if not local.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise LockTimeout(self.path, [])
        _owners[self.key] = me
        try:
            yield
        finally:
            del _owners[self.key]
            local.release()

    def acquire(self, *, shared: bool, deadline: float) -> int:
        """The data lock against other processes (call within :meth:`local`); the descriptor that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            self._acquire(fd, mode, _GATE, deadline)
            try:
                self._acquire(fd, mode, _DATA, deadline)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, _GATE)
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, _WANT)  # no longer waiting
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # releases the data lock (and any lock this process has on the file)

    @staticmethod
    def wanted(fd: int) -> bool:
        """Whether another process waits for this lock (holds the *want* byte); one non-blocking syscall."""
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _WANT)
        except OSError as e:
            if e.errno not in _BUSY:
                raise
            return True
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, _WANT)
        return False

    def _acquire(self, fd: int, mode: int, offset: int, deadline: float) -> None:
        delay = 0.001
        wanting = False
        while True:
            try:
                fcntl.lockf(fd, mode | fcntl.LOCK_NB, 1, offset)
                return
            except OSError as e:
                if e.errno not in _BUSY:
                    raise
            if not wanting:  # tell a holder that keeps the file open to let it go (module docstring)
                try:
                    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, _WANT)
                    wanting = True
                except OSError as e:
                    if e.errno not in _BUSY:  # the holder is checking right now: try again next round
                        raise
            if time.monotonic() >= deadline:
                raise LockTimeout(self.path, holders(self.path))
            time.sleep(min(delay * (0.5 + random.random()), max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)


def holders(path: Path) -> list[int]:
    """Pids holding POSIX locks on ``path``, from ``/proc/locks`` (Linux); empty where unknown."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        parts = line.split()
        # "1: POSIX  ADVISORY  WRITE 4242 08:01:1234567 0 0" (blocked waiters are marked "->")
        if len(parts) >= 6 and parts[1] == "POSIX" and parts[5] == inode and parts[4].isdigit():
            pid = int(parts[4])
            if pid != os.getpid() and pid not in pids:
                pids.append(pid)
    return pids
