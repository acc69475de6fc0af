"""A batch of evaluation items run concurrently, each result written as soon as it exists.

Why it is shaped this way (the τ runner's design, now shared):

* **Concurrency**: ``concurrency`` asyncio workers pull items in plan order. Model calls overlap.
* **Per-resource slots**: ``resources={"gpu0": 1}`` and ``resource_of(item)`` hold an item's
  run to that many at once (one timing slot per device), whatever the concurrency.
* **Per-item timeouts**: ``item_timeout_s`` cancels a stuck item; ``on_timeout(item, exc)``
  turns it into a result (outcome ``timeout``), so it is written and counted like any other.
* **Crash safety**: ``write`` (blocking, run in a thread) is serialised and shielded from
  cancellation: Ctrl-C never abandons a finished item, and each worker has at most one write
  outstanding, so a slow store holds the workers back instead of piling results up.
* **Resume**: items already stored are left out of the plan by the caller
  (:func:`plan_remaining`); an item in flight at a crash has no row and runs again.
* **Where items run**: ``executor`` (:mod:`closedloop.evals.harness.executor`): this process by
  default, or Ray tasks for an :class:`ItemWork` that can leave the process. Everything above stays
  here in the driver, whatever the executor: a remote item is awaited like a local one and its
  result written by the same serialised writer. A remote scheduler places items by their
  resource requests, so the in-process ``slots`` apply to local runs only.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Awaitable, Callable, Generic, Hashable, Iterable, Literal, TypeVar

from closedloop.evals.harness.executor import Executor, ItemWork, LocalExecutor

__all__ = ["Outcome", "OUTCOMES", "BatchRunner", "ResourceSlots", "plan_remaining", "settings_differences"]

#: graded: the agent's work was judged; agent_error: the agent failed to produce gradable work;
#: infra_error: the harness failed (not the agent's fault; run again on resume); timeout.
Outcome = Literal["graded", "agent_error", "infra_error", "timeout"]
OUTCOMES: tuple[str, ...] = ("graded", "agent_error", "infra_error", "timeout")

T = TypeVar("T")
R = TypeVar("R")


class ResourceSlots:
    """Named semaphores: at most ``n`` holders of each resource (e.g. one per GPU)."""

    def __init__(self, limits: dict[str, int] | None = None):
        self.limits = dict(limits or {})
        self._sems: dict[str, asyncio.Semaphore] = {}

    @contextlib.asynccontextmanager
    async def hold(self, name: str | None):
        if name is None or name not in self.limits:
            yield
            return
        sem = self._sems.get(name)
        if sem is None:
            sem = self._sems[name] = asyncio.Semaphore(max(1, self.limits[name]))
        async with sem:
            yield


def settings_differences(stored: dict[str, Any], mine: dict[str, Any], keys: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """The settings (among ``keys``) whose stored value differs from this run's: a resume with any
    of them would mix two different evaluations, so callers refuse it."""
    return {k: (stored.get(k), mine.get(k)) for k in keys if stored.get(k) != mine.get(k)}


def plan_remaining(plan: list[T], done: set[Hashable], key: Callable[[T], Hashable]) -> list[T]:
    """The items of ``plan`` not yet done, in plan order (no loss, no repeats)."""
    return [it for it in plan if key(it) not in done]


class BatchRunner(Generic[T, R]):
    """Runs ``run_item`` over items with ``concurrency`` workers and writes each result once.

    ``run_item`` is a coroutine function (local only) or an :class:`ItemWork` (any executor)."""

    def __init__(self, run_item: Callable[[T], Awaitable[R]] | ItemWork[T, R], write: Callable[[R], Any], *,
                 concurrency: int = 1, item_timeout_s: float | None = None,
                 on_timeout: Callable[[T, BaseException], R] | None = None,
                 on_error: Callable[[T, BaseException], R] | None = None, slots: ResourceSlots | None = None,
                 resource_of: Callable[[T], str | None] | None = None,
                 after_write: Callable[[R], None] | None = None, executor: Executor | None = None):
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.executor = executor or LocalExecutor()
        work = run_item if isinstance(run_item, ItemWork) else ItemWork(local=run_item)
        self.run_item, self.write, self.concurrency = self.executor.bind(work), write, concurrency
        self._resources_of = work.resources
        self.item_timeout_s, self.on_timeout, self.on_error = item_timeout_s, on_timeout, on_error
        self.slots, self.after_write = slots or ResourceSlots(), after_write
        self.resource_of = resource_of if self.executor.in_process else None  # the cluster places them
        self._write_lock = asyncio.Lock()
        self._writes: set[asyncio.Task] = set()
        self.written = 0

    async def _one(self, item: T) -> R:
        resource = self.resource_of(item) if self.resource_of else None
        try:
            async with self.slots.hold(resource):
                return await asyncio.wait_for(self.run_item(item), self.item_timeout_s)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            if self.on_timeout is None:
                raise
            return self.on_timeout(item, exc)
        except Exception as exc:  # noqa: BLE001 - a harness failure becomes an infra_error result
            if self.on_error is None:
                raise
            return self.on_error(item, exc)

    async def _write(self, result: R) -> None:
        async with self._write_lock:
            await asyncio.to_thread(self.write, result)
        self.written += 1
        if self.after_write is not None:
            self.after_write(result)

    async def _worker(self, queue: list[T]) -> None:
        pending: asyncio.Task | None = None
        while queue:
            item = queue.pop(0)
            result = await self._one(item)
            if pending is not None:
                await asyncio.shield(pending)  # a cancelled worker still lets its finished item land
            pending = asyncio.ensure_future(self._write(result))
            self._writes.add(pending)
            pending.add_done_callback(self._writes.discard)
        if pending is not None:
            await asyncio.shield(pending)

    async def run(self, items: list[T]) -> int:
        """Run every item; returns how many results were written. On cancellation or an error,
        the workers stop, finished results still land, and the exception propagates. A resource
        request the executor can never satisfy raises
        :class:`~closedloop.evals.harness.executor.ExecutorUnavailable` before any item starts."""
        queue = list(items)
        if self._resources_of is not None and not self.executor.in_process:  # a request no node can hold fails now, not after a silent wait
            asked = {r.model_dump_json(): r for r in map(self._resources_of, queue)}
            for resources in asked.values():
                self.executor.check(resources)
        workers = [asyncio.ensure_future(self._worker(queue)) for _ in range(min(self.concurrency, len(queue)))]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await asyncio.gather(*list(self._writes), return_exceptions=True)
            raise
        return self.written
