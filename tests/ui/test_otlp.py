"""OpenTelemetry export against a real OTLP/HTTP receiver (protobuf decoded as a collector does):
the stored export through the CLI, message content only when opted in, child runs nested in their
parent's trace, a refusal reported, and the live recorder giving the same ids as the stored export."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

from otlp_receiver import Receiver  # noqa: E402

from closedloop.cli import main  # noqa: E402
from closedloop.store import RunStore  # noqa: E402


def _export(sample, endpoint: str, *extra: str) -> int:
    return main(["runs", "export", "--format", "otlp", "--store", str(sample.path), "--endpoint", endpoint,
                 "--status", "any", *extra])


def test_stored_runs_arrive_with_the_genai_conventions(sample, monkeypatch, capsys):
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    with Receiver() as rx:
        assert _export(sample, rx.endpoint, "--graph", "react", "--kind", "run") == 0
    assert "exported" in capsys.readouterr().out
    assert rx.content_types and all(ct == "application/x-protobuf" for ct in rx.content_types)
    [agent] = [s for s in rx.named("invoke_agent react") if s.attributes["closedloop.run.id"] == sample.interactive]
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.agent.name"] == "react"
    assert agent.attributes["gen_ai.provider.name"] == "closedloop.hf"
    assert agent.parent_span_id == "" and agent.trace_id == sample.interactive  # a uuid4 hex run id is the trace id
    assert agent.resource["service.name"] == "closedloop"
    mine = [s for s in rx.spans if s.trace_id == agent.trace_id]
    chats = [s for s in mine if s.attributes.get("gen_ai.operation.name") == "chat"]
    tools = [s for s in mine if s.attributes.get("gen_ai.operation.name") == "execute_tool"]
    assert len(chats) == 3 and len(tools) == 3
    assert all(s.parent_span_id == agent.span_id for s in chats + tools)
    first = min(chats, key=lambda s: s.attributes["closedloop.turn.index"])
    assert first.attributes["gen_ai.usage.input_tokens"] > 0 and first.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert first.end - first.start == 400_000_000  # the recorded latency, 0.4 s
    remote = [s for s in chats if s.attributes["gen_ai.provider.name"] == "openai"]
    assert remote and remote[0].kind == 3  # SPAN_KIND_CLIENT: a model behind an API
    assert "rejected 'return_token_ids'" in remote[0].attributes["closedloop.turn.unavailable.token_ids"]
    failed = {s.attributes["gen_ai.tool.name"]: s for s in tools if s.status_code == 2}  # STATUS_CODE_ERROR
    assert set(failed) == {"add", "delete_everything"}
    assert failed["delete_everything"].attributes["error.type"] == "rejected"
    # content is Opt-In in the conventions: none of it without being asked
    assert not any(k in s.attributes for s in mine for k in ("gen_ai.input.messages", "gen_ai.output.messages",
                                                             "gen_ai.tool.call.arguments"))


def test_content_when_opted_in_follows_the_message_schema(sample, monkeypatch):
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    with Receiver() as rx:
        assert _export(sample, rx.endpoint, "--graph", "react", "--kind", "run") == 0
    first = next(s for s in rx.named("chat") if s.trace_id == sample.interactive
                 and s.attributes["closedloop.turn.index"] == 0)
    prompt = json.loads(first.attributes["gen_ai.input.messages"])
    assert [m["role"] for m in prompt] == ["system", "user"]
    image = [p for p in prompt[1]["parts"] if p["type"] == "uri"]
    assert image and image[0]["modality"] == "image" and image[0]["uri"].startswith("closedloop-media:sha256:")
    assert "base64" not in first.attributes["gen_ai.input.messages"]
    out = json.loads(first.attributes["gen_ai.output.messages"])
    assert out[0]["role"] == "assistant" and {p["name"] for p in out[0]["parts"] if p["type"] == "tool_call"} == \
        {"add", "delete_everything"}
    args = [s.attributes["gen_ai.tool.call.arguments"] for s in rx.named("execute_tool add") if s.trace_id == sample.interactive]
    assert '{"a": 3, "b": 4}' in args


def test_child_runs_nest_in_their_evaluations_trace(sample):
    with Receiver() as rx:
        assert _export(sample, rx.endpoint, "--tag", "eval:retail-sample") == 0
    [wf] = [s for s in rx.spans if s.attributes.get("closedloop.run.id") == sample.tau_eval]
    assert wf.name == "invoke_agent react" and wf.parent_span_id == ""  # the evaluation ran the react graph
    episodes = [s for s in rx.spans if s.attributes.get("closedloop.run.kind") == "episode"]
    assert len(episodes) == 4
    assert all(e.trace_id == wf.trace_id and e.parent_span_id == wf.span_id for e in episodes)
    assert sorted(e.attributes.get("closedloop.reward.reward") for e in episodes) == [0.0, 1.0, 1.0, 1.0]


def test_a_refusing_receiver_is_an_error_not_a_silent_drop(sample, capsys):
    with Receiver(status=400) as rx:
        assert _export(sample, rx.endpoint, "--kind", "run", "--graph", "react") == 1
    assert rx.requests >= 1
    assert "did not accept" in capsys.readouterr().err


def test_a_bad_endpoint_is_refused_before_anything_is_read(sample, capsys):
    assert _export(sample, "localhost:4318") == 2
    assert "must be an http(s) URL" in capsys.readouterr().err


def test_live_recorder_exports_during_the_run_with_the_stored_export_ids(tmp_path):
    from closedloop.graphs.react import graph
    from closedloop.messages import AssistantMessage, FunctionCall, ToolCall, UserMessage
    from closedloop.models.scripted import ScriptedClient
    from closedloop.plugins import tool_registry
    from closedloop.runtime.context import AgentContext
    from closedloop.runtime.execute import run_graph
    from closedloop.runtime.recording import StoreRecorder
    from closedloop.telemetry.live import OtelRecorder
    from closedloop.telemetry.otlp import export_runs, make_exporter

    client = ScriptedClient([AssistantMessage(tool_calls=[ToolCall(id="c1", function=FunctionCall(
        name="add", arguments='{"a": 3, "b": 4}'))]), AssistantMessage(content="7")])
    context = AgentContext(client=client, tools=tool_registry(["arithmetic"]))
    store = RunStore(tmp_path / "runs.duckdb")
    run_id = store.start_run(kind="run", graph="react", model_spec=client.spec)
    with Receiver() as live_rx:
        recorder = OtelRecorder(StoreRecorder(store, run_id), run_id, graph="react", model_spec=client.spec,
                                endpoint=live_rx.endpoint, content=True)
        asyncio.run(run_graph(graph, {"messages": [UserMessage(content="What is 3 plus 4?")]}, context=context,
                              recorder=recorder))
        recorder.flush()  # the turns and the tool call are out before the run ends
        assert {s.name for s in live_rx.spans} == {"chat scripted", "execute_tool add"}
        store.finish_run(run_id, "completed")
        recorder.end("completed")
    live = {(s.name, s.span_id, s.parent_span_id, s.trace_id) for s in live_rx.spans}
    assert len(live) == 4 and any(n == "invoke_agent react" for n, *_ in live)
    with Receiver() as stored_rx:
        exporter = make_exporter(stored_rx.endpoint)
        assert export_runs(store, [run_id], exporter) == 4
        exporter.shutdown()
    assert {(s.name, s.span_id, s.parent_span_id, s.trace_id) for s in stored_rx.spans} == live


def test_closedloop_run_exports_live_with_the_stored_export_ids(tiny_client, tmp_path):
    """``closedloop run --otlp URL``: the run's spans arrive while it runs (a model turn per step,
    the run's own span at the end), and exporting the stored run later gives the same trace."""
    from closedloop.server import create_app
    from closedloop.server.local import serve_app
    from closedloop.telemetry.otlp import export_runs, make_exporter

    store_path = tmp_path / "runs.duckdb"
    with serve_app(create_app(tiny_client, "tiny")) as url, Receiver() as live_rx:
        assert main(["run", "react", "--model", f"openai:tiny@{url}", "--input", "What is 2 plus 3?",
                     "--store", str(store_path), "--max-turns", "2", "--max-tokens", "32",
                     "--otlp", live_rx.endpoint]) == 0
    live = {(s.name, s.span_id, s.parent_span_id, s.trace_id) for s in live_rx.spans}
    assert any(n == "invoke_agent react" for n, *_ in live) and any(n.startswith("chat ") for n, *_ in live)
    store = RunStore(store_path)
    (run,) = store.list_runs(kind="run")
    with Receiver() as stored_rx:
        exporter = make_exporter(stored_rx.endpoint)
        export_runs(store, [run.id], exporter)
        exporter.shutdown()
    assert {(s.name, s.span_id, s.parent_span_id, s.trace_id) for s in stored_rx.spans} == live


def test_closedloop_run_refuses_a_bad_otlp_endpoint_before_the_model_loads(tmp_path, capsys):
    rc = main(["run", "react", "--model", f"hf:{tmp_path / 'no-model'}", "--input", "hi", "--no-store",
               "--otlp", "localhost:4318"])
    assert rc == 2
    err = capsys.readouterr().out
    assert "must be an http(s) URL" in err and "no such directory" not in err
