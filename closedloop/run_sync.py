"""Run a coroutine from synchronous code, whether or not the calling thread already runs an event loop.

LangChain calls a chat model's or a tool's sync methods (``invoke``, a ``StructuredTool``'s
``func``) from plain code and from code running inside a loop (a notebook, a sync node of an async
graph); ``asyncio.run`` refuses the second case, so the coroutine then runs on a worker thread with
a loop of its own while the caller waits.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """The result of the coroutine ``make()`` makes, run to completion; its exception re-raised here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=work, name="closedloop-run-sync")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


__all__ = ["run_sync"]
