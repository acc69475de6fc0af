"""Stored runs exported over OTLP/HTTP: ``closedloop runs export --format otlp [--endpoint URL]``.

Each selected run becomes its span (with its turns and tool calls, see
:mod:`closedloop.telemetry.spans`), its child runs nested under it, all in the trace of its
top-level ancestor. Spans go through the OpenTelemetry SDK's own OTLP/HTTP exporter (protobuf),
so any OTLP receiver takes them: an OpenTelemetry Collector, Jaeger, Phoenix, Langfuse.

The endpoint is ``--endpoint`` (a full traces URL, or a base URL to which ``/v1/traces`` is
added), else the exporter's standard environment (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_HEADERS``), else ``http://localhost:4318``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable, Iterator
from urllib.parse import urlparse

from opentelemetry.sdk.trace import ReadableSpan

from closedloop.store import RunRecord, RunStore
from closedloop.telemetry.spans import capture_content, run_span, to_ns, tool_span, trace_id_for, turn_span

__all__ = ["record_spans", "run_tree_spans", "export_runs", "make_exporter", "traces_url", "export_otlp_command"]

BATCH = 512  # spans per OTLP request


def traces_url(endpoint: str) -> str:
    """A base URL (``http://host:4318``) gets OTLP/HTTP's ``/v1/traces``; a URL with a path is kept."""
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"OTLP endpoint {endpoint!r} must be an http(s) URL such as http://127.0.0.1:4318")
    return endpoint if parsed.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def make_exporter(endpoint: str | None = None, timeout_s: float | None = None) -> Any:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None, timeout=timeout_s)


def record_spans(run: RunRecord, *, trace_id: int, parent: int | None, content: bool) -> list[ReadableSpan]:
    """The run's own span, then one per turn and tool call, laid end to end from the run's start
    in the order :func:`closedloop.trace_layout.build_trace` gives (recorded latencies)."""
    from closedloop.trace_layout import build_trace

    start = to_ns(run.started_at)
    end = to_ns(run.ended_at or run.updated_at)
    spans = [run_span(run_id=run.id, trace_id=trace_id, parent=parent, kind=run.kind, graph=run.graph,
                      model_spec=run.model_spec, status=run.status, start=start, end=end,
                      prompt_tokens=run.prompt_tokens, completion_tokens=run.completion_tokens, cost_usd=run.cost_usd,
                      tags=run.tags, rewards=(run.outcome or {}).get("rewards"), error=run.error)]
    trace = build_trace(run)
    timing = {row.anchor: row for row in trace.waterfall}
    for step in trace.steps:
        row = timing.get(step.anchor)
        s = start + int((row.start_s if row else 0.0) * 1e9)
        e = s + int((row.duration_s if row else 0.0) * 1e9)
        if step.kind == "turn" and step.turn_index is not None:
            prompt = run.messages[:step.prompt_messages] if content else None
            spans.append(turn_span(run_id=run.id, trace_id=trace_id, index=step.turn_index,
                                   turn=run.turns[step.turn_index], start=s, end=e, prompt=prompt, content=content))
        elif step.kind == "tool" and step.tool is not None:
            c = step.tool
            spans.append(tool_span(run_id=run.id, trace_id=trace_id, index=c.idx, name=c.name, call_id=c.call_id,
                                   arguments=c.arguments, result=c.result, error=c.error, error_kind=c.error_kind,
                                   start=s, end=e, content=content))
    return spans


def _root_of(store: RunStore, run: RunRecord) -> str:
    seen = {run.id}
    current = run
    while current.parent_id is not None and current.parent_id not in seen:
        seen.add(current.parent_id)
        try:
            current = store.get_run(current.parent_id, media="refs")
        except KeyError:
            break
    return current.id


def run_tree_spans(store: RunStore, run_id: str, *, content: bool = False) -> Iterator[ReadableSpan]:
    """Spans of a run and, recursively, its child runs, in the trace of its top-level ancestor."""
    from closedloop.telemetry.spans import span_id_for

    run = store.get_run(run_id, media="refs")
    trace_id = trace_id_for(_root_of(store, run))
    stack = [(run, run.parent_id)]
    while stack:
        current, parent = stack.pop()
        yield from record_spans(current, trace_id=trace_id, parent=span_id_for(parent) if parent else None,
                                content=content)
        for child in reversed(store.list_runs(limit=None, parent_id=current.id)):
            stack.append((store.get_run(child.id, media="refs"), current.id))


def export_runs(store: RunStore, run_ids: Iterable[str], exporter: Any, *, content: bool | None = None) -> int:
    """Export the runs (with their children) through ``exporter``; returns the number of spans.
    Raises ``RuntimeError`` when the receiver refuses a batch (nothing is silently dropped)."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    with_content = capture_content(content)
    sent = 0
    batch: list[ReadableSpan] = []

    def flush() -> None:
        nonlocal sent
        if batch:
            if exporter.export(list(batch)) != SpanExportResult.SUCCESS:
                raise RuntimeError(f"the OTLP receiver did not accept a batch of {len(batch)} spans "
                                   f"({sent} were sent before it)")
            sent += len(batch)
            batch.clear()

    for rid in run_ids:
        for span in run_tree_spans(store, rid, content=with_content):
            batch.append(span)
            if len(batch) >= BATCH:
                flush()
    flush()
    return sent


def export_otlp_command(args: argparse.Namespace) -> int:
    """``closedloop runs export --format otlp``: the runs the filters select (top-level ones; their
    children ride along), sent to ``--endpoint``."""
    status = None if args.status == "any" else args.status
    store = RunStore(args.store)
    runs = store.list_runs(limit=None, status=status, graph=args.graph, kind=args.kind, tag=args.tag)
    selected = {r.id for r in runs}
    roots = [r.id for r in reversed(runs) if r.parent_id is None or r.parent_id not in selected]
    try:
        exporter = make_exporter(getattr(args, "endpoint", None))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        count = export_runs(store, roots, exporter)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        exporter.shutdown()
    print(f"exported {count} span(s) of {len(roots)} run(s) (with their child runs) over OTLP/HTTP")
    return 0
