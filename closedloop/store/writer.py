"""A background thread that turns many small writes into one transaction per batch.

Writes are queued (a list append under a lock: microseconds, so an asyncio event loop is never
blocked by the store) and this thread commits everything queued so far in one transaction after
a gathering wait. The thread's Python work (serialising and redacting what was queued) shares
the GIL with the caller's thread, so an event loop can wait up to one switch interval (5 ms) now
and then; the thread is woken only when the queue goes from empty to non-empty, not per write,
to keep such hand-offs rare. Forked children drop the queue they inherited (the parent writes it).

The file stays open while the thread works (a ``holder``, the store's
:class:`~closedloop.store.connection.StoreFile`, keeps its write connection between batches):
opening it and closing it again (creating DuckDB's database instance, the checkpoint on close)
cost some 20-40 ms of CPU per batch, far more than the rows of a batch of steps. It does not shut
other processes out (``closedloop runs list`` next to a running eval, a trainer reading
rollouts): one that waits for the file says so through the store's lock, and this thread closes
the file at its next check, every :data:`POLL_S` while it waits and after each batch, so such a
process waits about one batch, as when the file was closed after every batch. After
:data:`LINGER_S` without work, and when the thread stops, the file is closed as well.

What a batch still costs is mostly fixed (a handful of statements, whether the batch holds one
step or a thousand), so the gathering adapts: after a batch that cost ``c`` seconds of this
thread's CPU, the next gathering lasts ``c / CPU_SHARE``, at least ``interval_s`` and at most
:data:`MAX_GATHER_S` (or ``interval_s`` where that is longer), which keeps the writer's steady
share of a core near ``CPU_SHARE`` however fast steps arrive; a full queue (``max_pending``) and
``flush()`` still write at once. So ``interval_s`` is the shortest gathering, not the usual one:
on a loaded machine a gathering can last up to a second. The cyclic garbage collector is paused
while a batch is written (:func:`~closedloop.store.batch.gc_paused`): preparing a batch
allocates thousands of short-lived objects, and the collections they would trigger walk every
object of the process (the queued steps included).

The price is a window: a process that is SIGKILLed (or dies on SIGTERM without running
``atexit``) loses what it queued since the last commit. Its run still shows as ``killed`` (the
run row is written synchronously by ``start_run``) with everything committed before. How long
that window is in time is NOT bounded: the gathering wait (up to :data:`MAX_GATHER_S`), then
the batch must be prepared and written (CPU work that a loaded machine stretches many times),
and the file may be held by another process (up to its lock timeout). What is bounded is its
size: at most ``max_pending`` queued ops plus the batch being written (a submit beyond that
waits for the writer). And ``flush()`` is the ack point: when it returns, everything submitted
before it is committed (``finish_run``, ``close``, every synchronous write and read of the same
store and interpreter exit call it), so a finished run never lacks a step it logged, and a
caller that must not lose a step (a tool call with side effects) flushes.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable, Protocol, Sequence

from closedloop.store.batch import gc_paused

__all__ = ["BackgroundWriter", "Holder", "PartialBatch", "CPU_SHARE", "MAX_GATHER_S", "POLL_S", "LINGER_S"]

#: The share of one core the background thread aims to spend on commits while steps stream in.
CPU_SHARE = 0.05
#: The longest a gathering is stretched to keep to :data:`CPU_SHARE` (``interval_s`` may be longer).
MAX_GATHER_S = 1.0
#: How often a thread that keeps the file open checks whether another process waits for it.
POLL_S = 0.05
#: How long the file stays open with nothing queued before the thread closes it.
LINGER_S = 1.0


class Holder(Protocol):
    """What keeps the file open between batches (the store's ``StoreFile``)."""

    def keep_open(self, keep: bool) -> None: ...

    def holding(self) -> bool: ...

    def release_if_wanted(self, *, always: bool = False) -> None: ...


class PartialBatch(Exception):
    """Raised by ``write`` when part of a batch was committed and the rest met a retryable error
    (``cause``): only ``remaining`` goes back to the queue, so nothing is written twice."""

    def __init__(self, remaining: list[Any], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.remaining, self.cause = remaining, cause


class BackgroundWriter:
    """Runs ``write(ops)`` on a daemon thread for batches of submitted ops, in submission order.

    ``write`` must be all-or-nothing. When it raises one of ``retryable`` (the file stayed locked
    by another process) the batch goes back to the front of the queue and is tried again on the
    next flush; any other exception drops the batch and is kept in :attr:`errors` (and warned).
    """

    def __init__(self, write: Callable[[list[Any]], None], *, interval_s: float, name: str,
                 retryable: tuple[type[BaseException], ...] = (), max_pending: int | None = None,
                 holder: Holder | None = None) -> None:
        if interval_s < 0:
            raise ValueError("interval_s must be >= 0")
        if max_pending is not None and max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.max_pending = max_pending
        self._write = write
        self.interval_s = interval_s
        self._name = name
        self._retryable = retryable
        self._holder = holder
        self._pending: list[Any] = []
        self._cond = threading.Condition()
        self._flush_lock = threading.Lock()  # one batch at a time, so batches commit in order
        self._thread: threading.Thread | None = None
        self._closing = False
        self._gather_s = interval_s  # how long the next gathering lasts (see the module docstring)
        self.errors: list[BaseException] = []

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, op: Any) -> None:
        """Queue one op; never blocks on the store."""
        self.submit_many((op,))

    def submit_many(self, ops: Sequence[Any]) -> None:
        """Queue ops; waits only while ``max_pending`` ops are already queued (the writer is far
        behind, or the file is held by another process), until the writer takes them."""
        with self._cond:
            while (self.max_pending is not None and len(self._pending) >= self.max_pending
                   and self._thread is not None and self._thread.is_alive()
                   and self._thread is not threading.current_thread()):
                self._cond.notify_all()  # the writer may be in its gathering wait: write now
                self._cond.wait()
            was_empty = not self._pending
            self._pending.extend(ops)
            if self._thread is None or not self._thread.is_alive():
                self._closing = False
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            elif was_empty:
                # Wake the thread only from its idle wait: a notify during the gathering window
                # would wake it for nothing, and every wake-up is a GIL hand-off the caller's
                # thread (an event loop) then waits for.
                self._cond.notify()

    def flush(self) -> None:
        """Commit everything submitted so far, in the calling thread; raises what the write raised."""
        with self._flush_lock:
            with self._cond:
                ops, self._pending = self._pending, []
                self._cond.notify_all()  # submitters waiting for room
            if not ops:
                return
            try:
                with gc_paused():
                    self._write(ops)
            except PartialBatch as e:
                with self._cond:
                    self._pending[:0] = e.remaining
                raise e.cause from None
            except self._retryable:
                with self._cond:
                    self._pending[:0] = ops
                raise

    def _full(self) -> bool:
        return self.max_pending is not None and len(self._pending) >= self.max_pending

    def close(self, timeout: float | None = None) -> None:
        """Flush and stop the thread (a later ``submit`` starts a new one)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.flush()

    def _loop(self) -> None:
        if self._holder is not None:
            self._holder.keep_open(True)
        try:
            while self._gather():
                cpu = time.thread_time()
                try:
                    self.flush()
                    cost = time.thread_time() - cpu
                    self._gather_s = max(self.interval_s, min(cost / CPU_SHARE, MAX_GATHER_S))
                except BaseException as e:  # noqa: BLE001 - the thread must outlive any one failed batch
                    if not isinstance(e, self._retryable):
                        self.errors.append(e)
                    warnings.warn(f"run store background write failed: {e}", RuntimeWarning, stacklevel=1)
                    if isinstance(e, self._retryable):
                        time.sleep(self.interval_s)
                self._check_holder()
        finally:
            if self._holder is not None:
                self._holder.keep_open(False)

    def _gather(self) -> bool:
        """Wait for work, then gather what arrives for ``_gather_s``; False when closing with nothing queued.
        While the file is kept open, the waits are cut into :data:`POLL_S` slices to check for a
        process that waits for it (outside the condition's lock, so submitters never wait on it)."""
        idle_since = time.monotonic()
        while True:
            with self._cond:
                if self._pending or self._closing:
                    break
                self._cond.wait(POLL_S if self._holding() else None)
            self._check_holder(idle_since)
        deadline = time.monotonic() + self._gather_s
        while True:
            with self._cond:
                if self._closing or self._full() or (left := deadline - time.monotonic()) <= 0:
                    return bool(self._pending) or not self._closing
                self._cond.wait(min(left, POLL_S) if self._holding() else left)
            self._check_holder()

    def _holding(self) -> bool:
        return self._holder is not None and self._holder.holding()

    def _check_holder(self, idle_since: float | None = None) -> None:
        """Close a kept file for a process waiting for it, or after :data:`LINGER_S` idle."""
        if self._holder is None or not self._holder.holding():
            return
        idle = idle_since is not None and time.monotonic() - idle_since >= LINGER_S
        self._holder.release_if_wanted(always=idle)
