"""One retry helper, for the cases the ``openai`` package's own retries do not cover.

The SDK already retries what a model server does transiently (429, 408/409, 5xx, timeouts,
dropped connections), honouring ``Retry-After`` in seconds, milliseconds or as an HTTP date, so
closedloop does not repeat that. What the SDK gets wrong for us is a *refused* connection: it
backs off through its whole retry budget, while a dead or mistyped address will not come back
within a retry chain and the user should hear so at once. :func:`retry_async` is the one loop for
such cases: bounded by attempts *and* by a deadline, with jittered exponential backoff.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: ``base_s * 2**(attempt-1)`` capped at ``max_s``, then scaled by a random
    factor in ``[1 - jitter, 1 + jitter]`` so that many clients retrying at once spread out."""

    base_s: float = 0.5
    max_s: float = 8.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.max_s < 0 or not 0 <= self.jitter < 1:
            raise ValueError("Backoff needs base_s >= 0, max_s >= 0 and 0 <= jitter < 1")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1 for the first retry)."""
        plain = min(self.max_s, self.base_s * 2 ** max(attempt - 1, 0))
        return plain * (1 - self.jitter + 2 * self.jitter * random.random())


async def retry_async(call: Callable[[], Awaitable[T]], *, retry_on: Callable[[Exception], bool],
                      max_attempts: int, backoff: Backoff = Backoff(), deadline_s: float | None = None) -> T:
    """Await ``call()`` until it succeeds; an exception ``retry_on`` accepts is retried after a
    backoff, at most ``max_attempts`` calls in all and, with ``deadline_s``, never sleeping past that
    many seconds from the first call. The last exception is re-raised unchanged."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except Exception as e:  # noqa: BLE001 - re-raised unless the caller's predicate accepts it
            if not retry_on(e) or attempt >= max_attempts:
                raise
            delay = backoff.delay(attempt)
            if deadline_s is not None and time.monotonic() - start + delay > deadline_s:
                raise
            await asyncio.sleep(delay)
