"""A persistent event loop on its own thread, where a trainer's rollouts run.

Why a thread: with the rollouts off the trainer's thread, the next batch's episodes can start (reset
their environments, run their graphs up to the first model call) while the optimizer step runs;
the live policy's client holds their generation until the update is done
(:meth:`closedloop.models.hf.HFClient.paused`), so every token is still sampled from the updated
weights and the results equal those of a sequential loop. One loop for the whole run also keeps
the client's futures on one loop instead of a new loop per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class RolloutThread:
    """``submit(coro)`` runs ``coro`` on the thread's loop and returns a concurrent future."""

    def __init__(self, name: str = "closedloop-rollouts") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` there and wait for its result (its exception is raised here)."""
        return self.submit(coro).result()

    def cancel_all(self, timeout: float = 60.0) -> None:
        """Cancel whatever runs on the loop and wait until it has unwound (a pending rollout's
        queued requests are dropped with it)."""
        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if not self.loop.is_closed():
            self.submit(cancel()).result(timeout=timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.cancel_all()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> "RolloutThread":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["RolloutThread"]
