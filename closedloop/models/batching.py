"""Micro-batching for local backends: requests from any event loop or thread are gathered for a
few milliseconds into one batch for a single worker thread, which owns the device.

One worker thread (not an asyncio task) so that one client can serve several event loops (a
server, a test runner, a trainer's rollout loop) and the device work never blocks a loop.

Each batch runs while holding :attr:`MicroBatcher.lock` (a ``threading.RLock``). A trainer that
shares the model with the backend holds the same lock (``with batcher.paused():``) while it
changes the weights, so no batch ever decodes across an optimizer step or a weight load: a batch
already running finishes first, and requests queued meanwhile run after the context exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


def settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
           error: BaseException | None = None) -> None:
    """Complete ``future`` on its own loop from any thread (a no-op if done or the loop is closed)."""
    settle_many([(loop, future, result, error)])


def settle_many(outcomes: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, Any, BaseException | None]]) -> None:
    """:func:`settle` for several futures with one wake-up per event loop: each
    ``call_soon_threadsafe`` writes to the loop's self-pipe, and on a busy process every such
    write hands the GIL to the loop's thread, so a decode worker finishing rows pays it once."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, BaseException | None]]] = {}
    for loop, future, result, error in outcomes:
        by_loop.setdefault(loop, []).append((future, result, error))

    for loop, items in by_loop.items():
        def apply(items: list[tuple[asyncio.Future, Any, BaseException | None]] = items) -> None:
            for future, result, error in items:
                if future.done():
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

        try:
            loop.call_soon_threadsafe(apply)
        except RuntimeError:
            pass  # that loop is closed; nobody is waiting


class MicroBatcher(Generic[T]):
    """Calls ``run_batch(items)`` on a worker thread with up to ``max_batch_size`` queued items,
    waiting at most ``wait_s`` after the first for more to arrive. Items whose ``future``
    attribute was cancelled are dropped before the batch runs."""

    def __init__(self, run_batch: Callable[[list[T]], None], *, max_batch_size: int | None = None,
                 wait_s: float = 0.005, name: str = "closedloop-batcher") -> None:
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self.name = name
        self._queue: queue.Queue[T | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Held by the worker for the whole of each batch; hold it to keep batches out.
        self.lock = threading.RLock()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Keep batches from running inside the block (e.g. while a trainer steps the optimizer).

        Blocks the calling thread until the batch in progress, if any, has finished. Requests
        submitted meanwhile wait in the queue and run after the block. Re-entrant. Never await a
        generation of this batcher inside the block: it cannot run until the block exits.
        """
        with self.lock:
            yield

    def put(self, item: T) -> None:
        self._queue.put(item)
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._worker.start()

    async def close(self, timeout_s: float = 30.0) -> None:
        """Let the queued batches finish, then stop the worker."""
        worker = self._worker
        if worker is not None and worker.is_alive():
            self._queue.put(None)
            await asyncio.get_running_loop().run_in_executor(None, worker.join, timeout_s)
        self._worker = None

    def _work(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stop = [first], False
            deadline = time.perf_counter() + self.wait_s
            while self.max_batch_size is None or len(batch) < self.max_batch_size:
                remaining = deadline - time.perf_counter()
                try:
                    item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            live = [b for b in batch if not getattr(getattr(b, "future", None), "cancelled", lambda: False)()]
            if live:
                with self.lock:
                    self.run_batch(live)
            if stop:
                return
