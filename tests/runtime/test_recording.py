"""What a recorded graph run leaves in a real DuckDB run store, and how the store's writer batches.

The recording path was made cheaper (the custom stream only with an event callback, a turn's
message read back as the turn's own object, tool-call rows stored as given when no redaction rule
applies, few-row tables inserted by multi-row ``VALUES``, the writer's gathering stretched after
an expensive batch and the collector paused while it writes); these tests pin that nothing
recorded changed.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

from closedloop.graphs.react import graph
from closedloop.messages import AssistantMessage, FunctionCall, ToolCall, Turn, Usage, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.redact import REDACTED
from closedloop.runtime import AgentContext
from closedloop.runtime.convert import as_closedloop
from closedloop.runtime.execute import run_graph
from closedloop.runtime.recording import StoreRecorder
from closedloop.store import RunStore, batch
from closedloop.store.batch import UNRECORDABLE, prepare_tool_call
from closedloop.store.writer import CPU_SHARE, MAX_GATHER_S, BackgroundWriter


def _turn(message: AssistantMessage, first: int) -> Turn:
    prompt, completion = list(range(first, first + 5)), list(range(first + 100, first + 103))
    return Turn(message=message, model="scripted:exact", prompt_ids=prompt, completion_ids=completion,
                logprobs=[-0.5, -0.25, -0.125], usage=Usage(prompt_tokens=5, completion_tokens=3),
                finish_reason="tool_calls" if message.tool_calls else "stop", latency_s=0.01)


def _script() -> list[Turn]:
    spaced = ToolCall(id="call_spaced", function=FunctionCall(name="add", arguments='{"a": 3,  "b" :4}'))
    malformed = ToolCall(id="call_bad", function=FunctionCall(name="add", arguments='{"a": 1'))
    return [_turn(AssistantMessage(tool_calls=[spaced, malformed]), 0),
            _turn(AssistantMessage(content="7", reasoning="3 + 4"), 10)]


async def _recorded(store: RunStore, on_event=None):
    rid = store.start_run(kind="run", graph="react")
    context = AgentContext(client=ScriptedClient(_script()), tools=tool_registry(["arithmetic"]))
    result = await run_graph(graph, {"messages": [UserMessage(content="3+4?")]}, context=context,
                             recorder=StoreRecorder(store, rid), on_event=on_event)
    store.finish_run(rid)
    return store.get_run(rid), result


async def test_a_recorded_run_is_the_final_state_token_exact(tmp_path):
    store = RunStore(tmp_path / "runs.duckdb")
    rec, result = await _recorded(store)
    assert rec.messages == as_closedloop(result.state["messages"])
    assert [m.role for m in rec.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    script = _script()
    for stored, sent in zip(rec.turns, script, strict=True):
        assert (stored.prompt_ids, stored.completion_ids, stored.logprobs) == \
               (sent.prompt_ids, sent.completion_ids, sent.logprobs)
        assert stored.message == sent.message
    assert rec.turns[0].message == rec.messages[1] and rec.turns[1].message == rec.messages[4]
    assert [(c.turn_idx, c.call_id, c.arguments) for c in rec.tool_calls] == \
           [(0, "call_spaced", '{"a": 3,  "b" :4}'), (0, "call_bad", '{"a": 1')]  # as the model wrote them
    assert rec.tool_calls[0].result == "7.0" and rec.tool_calls[1].error_kind == "malformed_json"
    assert (rec.prompt_tokens, rec.completion_tokens) == (10, 6)


async def test_recording_is_the_same_with_and_without_an_event_callback(tmp_path):
    store = RunStore(tmp_path / "runs.duckdb")
    events: list = []
    with_events, _ = await _recorded(store, on_event=events.append)
    without, _ = await _recorded(store)
    assert with_events.messages == without.messages and with_events.turns == without.turns
    def calls(rec):  # latency is measured, so it differs
        return [c.model_dump(exclude={"latency_s"}) for c in rec.tool_calls]

    assert calls(with_events) == calls(without)
    assert [payload for kind, payload in events if kind == "message"] == with_events.messages[1:]


def test_few_row_tables_are_inserted_whole_across_values_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(batch, "VALUES_CHUNK", 3)
    store = RunStore(tmp_path / "runs.duckdb", flush_interval_s=3600)
    rid = store.start_run()
    turns = [_turn(AssistantMessage(content=f"t{i}"), i) for i in range(7)]
    turns[3] = turns[3].model_copy(update={"prompt_ids": None, "completion_ids": None, "logprobs": None})
    store.log_step(rid, [UserMessage(content=f"u{i}") for i in range(7)], turns)
    store.flush()
    rec = store.get_run(rid)
    assert [m.text for m in rec.messages] == [f"u{i}" for i in range(7)]
    assert [(t.message.text, t.prompt_ids, t.logprobs) for t in rec.turns] == \
           [(t.message.text, t.prompt_ids, t.logprobs) for t in turns]


def test_a_clean_tool_call_is_stored_as_given_and_a_key_in_any_field_is_not():
    clean = prepare_tool_call("call_1", "add", '{"a": 1,  "b": 2}', "3.0", None, None, 0.5, [])
    assert (clean.call_id, clean.name, clean.arguments, clean.result, clean.error, clean.error_kind) == \
           ("call_1", "add", '{"a": 1,  "b": 2}', "3.0", None, None)
    key = "sk-" + "a1b2c3d4" * 4
    fields = {"call_id": "call_1", "name": "add", "arguments": '{"a": 1}', "content": "3.0",
              "error": "boom", "error_kind": "exception"}
    stored_as = {"call_id": "call_id", "name": "name", "arguments": "arguments", "content": "result",
                 "error": "error", "error_kind": "error_kind"}
    for name in fields:
        dirty = dict(fields, **{name: f'{{"v": "{key}"}}' if name == "arguments" else f"x {key}"})
        row = prepare_tool_call(**dirty, latency_s=0.5, secrets=[])
        assert key not in getattr(row, stored_as[name]) and REDACTED in getattr(row, stored_as[name]), name
    secret = "my-own-env-secret-value"
    assert prepare_tool_call("c", "add", "{}", f"got {secret}", None, None, 0, [secret]).result == f"got {REDACTED}"
    odd = prepare_tool_call("c", "add", "{}", b"bytes", None, None, 0, [])  # type: ignore[arg-type]
    assert odd.result == REDACTED and odd.error_kind == UNRECORDABLE
    assert prepare_tool_call("c", "add", "{}", "bad \ud800 text", None, None, 0, []).result == "bad \ufffd text"


def test_the_writer_pauses_the_collector_while_it_writes_and_restores_it():
    seen: list[bool] = []

    def write(ops: list) -> None:
        seen.append(gc.isenabled())
        if ops == ["fail"]:
            raise ValueError("a failed batch")

    writer = BackgroundWriter(write, interval_s=3600, name="test-writer")
    writer.submit("ok")
    writer.flush()
    writer.submit("fail")
    with pytest.raises(ValueError):
        writer.flush()
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        writer.submit("ok")
        writer.flush()
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()
        writer.close()


def _spin_cpu(seconds: float) -> float:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    return time.thread_time() - start


@pytest.mark.parametrize("cost", [0.0, 0.02, 1.0])
def test_the_writer_gathers_longer_after_a_batch_that_cost_cpu(cost):
    """After a batch that cost ``c`` seconds of the writer thread's CPU, the next gathering lasts
    ``c / CPU_SHARE``, at least ``interval_s`` and at most ``MAX_GATHER_S``. CPU time, not wall
    time, is what is spent and measured, so the load of the machine does not change the outcome."""
    spent: list[float] = []
    written = threading.Event()

    def write(ops: list) -> None:
        spent.append(_spin_cpu(cost))
        written.set()

    writer = BackgroundWriter(write, interval_s=0.05, name="test-writer")
    writer.submit("op")
    writer.close()  # joins the thread after it wrote the op
    assert written.is_set() and len(spent) == 1
    assert writer._gather_s >= max(0.05, min(spent[0] / CPU_SHARE, MAX_GATHER_S))
    assert writer._gather_s <= max(0.05, MAX_GATHER_S)
