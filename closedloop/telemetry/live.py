"""Opt-in live export: spans leave while a graph runs, not after.

:class:`OtelRecorder` wraps the recorder a run already has (a
:class:`~closedloop.runtime.recording.StoreRecorder`, or none) and, for every step ``run_graph``
records, hands the new turns and tool calls to the SDK's ``BatchSpanProcessor`` as spans (it
exports on its own thread, off the event loop); :meth:`OtelRecorder.end` adds the run's span.
Ids are those of the stored export (:mod:`closedloop.telemetry.spans`), so a run exported live
and again from the store is one trace, not two::

    recorder = OtelRecorder(StoreRecorder(store, run_id), run_id, graph="react", model_spec=spec)
    try:
        await run_graph(graph, inputs, recorder=recorder)
    finally:
        recorder.end("completed")      # the run's span; flushes and stops the exporter
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from closedloop.messages import Turn, _Message
from closedloop.telemetry.otlp import make_exporter
from closedloop.telemetry.spans import capture_content, run_span, span_id_for, tool_span, trace_id_for, turn_span

__all__ = ["OtelRecorder"]


class OtelRecorder:
    """A :class:`~closedloop.runtime.execute.Recorder` that exports spans as steps happen, then
    passes the step on to ``inner`` (when given)."""

    def __init__(self, inner: Any, run_id: str, *, graph: str | None = None, model_spec: str | None = None,
                 kind: str = "run", endpoint: str | None = None, exporter: Any = None,
                 content: bool | None = None, parent_run_id: str | None = None, trace_run_id: str | None = None,
                 schedule_delay_ms: float = 500) -> None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.inner, self.run_id, self.graph, self.model_spec, self.kind = inner, run_id, graph, model_spec, kind
        self.content = capture_content(content)
        self.parent = span_id_for(parent_run_id) if parent_run_id else None
        self.trace_id = trace_id_for(trace_run_id or parent_run_id or run_id)
        self.processor = BatchSpanProcessor(exporter or make_exporter(endpoint), schedule_delay_millis=schedule_delay_ms)
        self.start_ns = time.time_ns()
        self.messages: list[_Message] = []
        self.turns = 0
        self.tools = 0
        self.tokens = [0, 0]
        self.ended = False

    def record(self, messages: list[_Message], turns: list[Turn], tool_records: Sequence[Any]) -> None:
        now = time.time_ns()
        for turn in turns:
            # the prompt: the messages seen before this step (the turn's own message arrives with it)
            span = turn_span(run_id=self.run_id, trace_id=self.trace_id, index=self.turns, turn=turn,
                             start=now - int((turn.latency_s or 0.0) * 1e9), end=now,
                             prompt=list(self.messages) if self.content else None, content=self.content)
            self.processor.on_end(span)
            self.turns += 1
            self.tokens[0] += turn.usage.prompt_tokens
            self.tokens[1] += turn.usage.completion_tokens
        for r in tool_records:
            span = tool_span(run_id=self.run_id, trace_id=self.trace_id, index=self.tools, name=r.name,
                             call_id=r.call_id, arguments=r.arguments, result=r.content, error=r.error,
                             error_kind=r.error_kind, start=now - int((r.latency_s or 0.0) * 1e9), end=now,
                             content=self.content)
            self.processor.on_end(span)
            self.tools += 1
        self.messages.extend(messages)
        if self.inner is not None:
            self.inner.record(messages, turns, tool_records)

    def flush(self) -> None:
        self.processor.force_flush()
        if self.inner is not None and hasattr(self.inner, "flush"):
            self.inner.flush()

    async def aflush(self) -> None:
        import asyncio

        await asyncio.to_thread(self.flush)

    def end(self, status: str = "completed", *, rewards: dict[str, Any] | None = None, error: str | None = None) -> None:
        """Export the run's own span, flush and stop the exporter. Idempotent."""
        if self.ended:
            return
        self.ended = True
        self.processor.on_end(run_span(run_id=self.run_id, trace_id=self.trace_id, parent=self.parent, kind=self.kind,
                                       graph=self.graph, model_spec=self.model_spec, status=status,
                                       start=self.start_ns, end=time.time_ns(), prompt_tokens=self.tokens[0],
                                       completion_tokens=self.tokens[1], rewards=rewards, error=error))
        self.processor.shutdown()
