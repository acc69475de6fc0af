"""Runs, turns and tool calls as OpenTelemetry spans with the GenAI semantic conventions.

Conventions followed (semantic-conventions GenAI, status Development; span names and attributes
as its agent and inference span documents define them):

- a run of a graph is ``invoke_agent {graph}`` (INTERNAL: the agent runs in this process);
  an evaluation or training run, which has no graph, is ``invoke_workflow {kind}``; child runs
  (episodes, samples, rollouts) are child spans of their parent run's span, in the same trace;
- a model call is ``chat {model}`` with ``gen_ai.provider.name``, ``gen_ai.request.model``,
  ``gen_ai.usage.input_tokens``/``output_tokens``, ``gen_ai.response.finish_reasons``; CLIENT
  when the model is behind an API (``openai:``), INTERNAL for in-process ``hf:`` models;
- a tool call is ``execute_tool {name}`` (``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
  ``gen_ai.tool.type``), a sibling of the chat spans under the agent span; a failed call has
  status ERROR and ``error.type`` (its ``error_kind``);
- message content (``gen_ai.input.messages``, ``gen_ai.output.messages``,
  ``gen_ai.tool.call.arguments``/``result``) is Opt-In in the conventions, so it is left out unless
  asked for (``content=True``, or ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`` as the
  OpenTelemetry GenAI instrumentations read it); media parts are ``uri`` parts naming their
  content address, never their bytes.

What only closedloop knows goes under ``closedloop.*`` (run kind, status, rewards, a turn's
purpose, whether it is trained, what its backend could not give).

Ids are derived from run ids, so exporting a run twice (or live, then again from the store) gives
the same trace and span ids. The store keeps each step's latency but not its start time (a bulk
write stamps one time on a whole episode), so stored steps are laid end to end from the run's
start, as the viewer's waterfall does; the live exporter uses the real clock.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

import closedloop
from closedloop.messages import AssistantMessage, ToolMessage, Turn
from closedloop.store.media import REF_PREFIX

__all__ = ["CONTENT_ENV", "capture_content", "trace_id_for", "span_id_for", "provider_and_model", "run_span",
           "turn_span", "tool_span", "input_messages", "output_messages", "to_ns", "RESOURCE", "SCOPE"]

CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
RESOURCE = Resource.create({"service.name": "closedloop", "service.version": closedloop.__version__})
SCOPE = InstrumentationScope("closedloop", closedloop.__version__)
_EPOCH = datetime(1970, 1, 1)
_ERROR_STATUSES = ("failed", "killed")


def capture_content(content: bool | None) -> bool:
    """``content`` if given, else the OpenTelemetry GenAI environment switch (default off)."""
    if content is not None:
        return content
    return os.environ.get(CONTENT_ENV, "").strip().lower() in ("1", "true", "yes")


def to_ns(ts: datetime) -> int:
    """Naive UTC (the store's timestamps) or aware datetime to nanoseconds since the epoch, exactly."""
    if ts.tzinfo is not None:
        ts = ts.astimezone(timezone.utc).replace(tzinfo=None)
    return (ts - _EPOCH) // timedelta(microseconds=1) * 1000


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\x1f".join(parts).encode()).digest()


def trace_id_for(run_id: str) -> int:
    """The trace of a top-level run: its uuid4 hex id is 128 bits already; other ids are hashed."""
    try:
        value = int(run_id.replace("-", ""), 16)
        if 0 < value < 2 ** 128 and len(run_id.replace("-", "")) == 32:
            return value
    except ValueError:
        pass
    return int.from_bytes(_digest("trace", run_id)[:16], "big") or 1


def span_id_for(run_id: str, what: str = "run", index: int = 0) -> int:
    return int.from_bytes(_digest(run_id, what, str(index))[:8], "big") or 1


def provider_and_model(spec: str | None) -> tuple[str, str | None]:
    """``gen_ai.provider.name`` and ``gen_ai.request.model`` from a model spec (keys never appear:
    specs are stored redacted)."""
    if not spec:
        return "closedloop", None
    prefix, _, rest = spec.partition(":")
    if not rest:
        return "closedloop", spec
    model = rest.split("@", 1)[0]
    return {"openai": "openai", "vllm": "vllm", "hf": "closedloop.hf", "policy": "closedloop.hf"}.get(
        prefix, prefix), model


def _context(trace_id: int, span_id: int) -> SpanContext:
    return SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def _span(name: str, trace_id: int, span_id: int, parent: int | None, kind: SpanKind, attrs: dict[str, Any],
          start: int, end: int, error: str | None = None) -> ReadableSpan:
    clean = {k: v for k, v in attrs.items() if v is not None}
    status = Status(StatusCode.ERROR, error[:500]) if error else Status(StatusCode.UNSET)
    return ReadableSpan(name=name, context=_context(trace_id, span_id),
                        parent=_context(trace_id, parent) if parent is not None else None, resource=RESOURCE,
                        attributes=clean, kind=kind, status=status, start_time=start, end_time=max(end, start),
                        instrumentation_scope=SCOPE)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    out: list[dict[str, Any]] = []
    for p in content:
        kind = getattr(p, "type", None)
        if kind == "text":
            out.append({"type": "text", "content": p.text})
        elif kind == "image_url":
            url = p.image_url.url
            if url.startswith(REF_PREFIX):
                sha, _, mime = url[len(REF_PREFIX):].partition(";mime=")
                out.append({"type": "uri", "modality": "image", "mime_type": mime or None,
                            "uri": f"{REF_PREFIX}{sha}"})
            elif url.startswith("data:"):
                out.append({"type": "blob", "modality": "image", "mime_type": url[5:].split(";", 1)[0] or None,
                            "content": url.split(",", 1)[-1]})
            else:
                out.append({"type": "uri", "modality": "image", "uri": url})
        elif kind == "input_audio":
            out.append({"type": "uri", "modality": "audio", "uri": p.input_audio.data}
                       if p.input_audio.data.startswith(REF_PREFIX) else
                       {"type": "blob", "modality": "audio", "mime_type": f"audio/{p.input_audio.format}",
                        "content": p.input_audio.data})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _message(m: Any) -> dict[str, Any]:
    parts = _parts(getattr(m, "content", None))
    if isinstance(m, AssistantMessage):
        for c in m.tool_calls or []:
            parts.append({"type": "tool_call", "id": c.id, "name": c.function.name,
                          "arguments": _arguments(c.function.arguments)})
    if isinstance(m, ToolMessage):
        parts = [{"type": "tool_call_response", "id": m.tool_call_id, "response": m.text}]
    out = {"role": m.role, "parts": parts}
    if getattr(m, "name", None):
        out["name"] = m.name
    return out


def input_messages(messages: Sequence[Any]) -> str:
    """``gen_ai.input.messages``: the conventions' JSON schema (role + typed parts), as a JSON string."""
    return _json([_message(m) for m in messages])


def output_messages(turn: Turn) -> str:
    out = _message(turn.message)
    out["finish_reason"] = turn.finish_reason or ("tool_call" if turn.message.tool_calls else "stop")
    return _json([out])


def run_span(*, run_id: str, trace_id: int, parent: int | None, kind: str, graph: str | None, model_spec: str | None,
             status: str, start: int, end: int, prompt_tokens: int = 0, completion_tokens: int = 0,
             cost_usd: float | None = None, tags: Iterable[str] = (), rewards: dict[str, Any] | None = None,
             error: str | None = None) -> ReadableSpan:
    provider, model = provider_and_model(model_spec)
    if graph:
        name, op = f"invoke_agent {graph}", "invoke_agent"
        extra = {"gen_ai.agent.name": graph, "gen_ai.agent.id": run_id}
    else:
        name, op = f"invoke_workflow {kind}", "invoke_workflow"
        extra = {"gen_ai.workflow.name": kind}
    attrs: dict[str, Any] = {"gen_ai.operation.name": op, "gen_ai.provider.name": provider,
                             "gen_ai.request.model": model, "gen_ai.conversation.id": run_id,
                             "gen_ai.usage.input_tokens": int(prompt_tokens),
                             "gen_ai.usage.output_tokens": int(completion_tokens), **extra,
                             "closedloop.run.id": run_id, "closedloop.run.kind": kind, "closedloop.run.status": status,
                             "closedloop.run.tags": list(tags) or None, "closedloop.run.cost_usd": cost_usd}
    for k, v in (rewards or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            attrs[f"closedloop.reward.{k}"] = float(v)
    failed = status in _ERROR_STATUSES
    if failed:
        attrs["error.type"] = status if not error else error.strip().splitlines()[-1].split(":", 1)[0][:100]
    return _span(name, trace_id, span_id_for(run_id), parent, SpanKind.INTERNAL, attrs, start, end,
                 (error or status) if failed else None)


def turn_span(*, run_id: str, trace_id: int, index: int, turn: Turn, start: int, end: int,
              prompt: Sequence[Any] | None, content: bool) -> ReadableSpan:
    provider, model = provider_and_model(turn.model)
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": provider, "gen_ai.request.model": model,
        "gen_ai.response.model": model, "gen_ai.conversation.id": run_id,
        "gen_ai.usage.input_tokens": int(turn.usage.prompt_tokens),
        "gen_ai.usage.output_tokens": int(turn.usage.completion_tokens),
        "gen_ai.response.finish_reasons": [turn.finish_reason] if turn.finish_reason else None,
        "closedloop.turn.index": index, "closedloop.turn.purpose": turn.purpose,
        "closedloop.turn.trainable": turn.trainable, "closedloop.turn.cost_usd": turn.usage.cost_usd,
        "closedloop.turn.token_ids": turn.has_tokens,
    }
    if turn.logprob_spec is not None:
        attrs["gen_ai.request.temperature"] = float(turn.logprob_spec.temperature)
        attrs["gen_ai.request.top_p"] = float(turn.logprob_spec.top_p)
    for what, why in turn.unavailable.items():
        attrs[f"closedloop.turn.unavailable.{what}"] = why
    if content:
        if prompt is not None:
            attrs["gen_ai.input.messages"] = input_messages(prompt)
        attrs["gen_ai.output.messages"] = output_messages(turn)
    kind = SpanKind.CLIENT if provider == "openai" else SpanKind.INTERNAL
    return _span(f"chat {model}" if model else "chat", trace_id, span_id_for(run_id, "turn", index),
                 span_id_for(run_id), kind, attrs, start, end)


def tool_span(*, run_id: str, trace_id: int, index: int, name: str, call_id: str | None, arguments: str | None,
              result: str | None, error: str | None, error_kind: str | None, start: int, end: int,
              content: bool) -> ReadableSpan:
    attrs: dict[str, Any] = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                             "gen_ai.tool.call.id": call_id, "gen_ai.tool.type": "function",
                             "gen_ai.conversation.id": run_id}
    if error:
        attrs["error.type"] = error_kind or "_OTHER"
    if content:
        attrs["gen_ai.tool.call.arguments"] = arguments
        attrs["gen_ai.tool.call.result"] = error if error else result
    return _span(f"execute_tool {name}", trace_id, span_id_for(run_id, "tool", index), span_id_for(run_id),
                 SpanKind.INTERNAL, attrs, start, end, error)
