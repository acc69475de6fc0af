"""Bridges a running graph to the run store: what each step adds is queued as it happens.

``record`` runs on the event loop (``run_graph`` calls it per super-step), so it must not touch
the DuckDB file: it hands the step to :meth:`RunStore.log_step`, which queues it in microseconds;
the store's background thread commits queued steps in batches (gathered for at least
``flush_interval_s``, longer after an expensive batch: up to a second on a loaded machine; at
most ``max_queued_steps`` at a time), keeping the file open between batches while no other
process asks for it (see :mod:`closedloop.store.writer`). ``finish_run`` (and
:meth:`StoreRecorder.flush`) commit whatever is still queued, so a finished run is complete; a
process killed mid-run loses the steps not yet committed (see :mod:`closedloop.store.writer`).
"""

from __future__ import annotations

import asyncio

from closedloop.messages import FunctionCall, ToolCall, Turn, _Message
from closedloop.runtime.state import ToolRecord
from closedloop.store import RunStore
from closedloop.tool import ToolResult


class StoreRecorder:
    """A :class:`~closedloop.runtime.execute.Recorder` writing into one run of a :class:`RunStore`."""

    def __init__(self, store: RunStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id

    def record(self, messages: list[_Message], turns: list[Turn], tool_records: list[ToolRecord]) -> None:
        calls = []
        for r in tool_records:
            # A ToolRecord's fields are validated strings already: constructing skips validating them again.
            call = ToolCall.model_construct(id=r.call_id, type="function",
                                            function=FunctionCall.model_construct(name=r.name, arguments=r.arguments))
            calls.append((call, ToolResult(r.name, r.content, r.error, r.error_kind, r.latency_s), r.turn_idx))
        self.store.log_step(self.run_id, messages, turns, calls)

    def flush(self) -> None:
        """Commit what was recorded so far (blocking; from async code use :meth:`aflush`)."""
        self.store.flush()

    async def aflush(self) -> None:
        await asyncio.to_thread(self.store.flush)
