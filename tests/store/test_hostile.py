"""Hostile values in what a model or a tool produced: recorded (with an error where needed), never a lost batch.

Issue 26: ``redact_arguments`` raised on a 5,000-digit integer or deep nesting, the background
writer then dropped the whole batch, and another run in the same store lost 3/4 messages, 2/2
turns, 1/1 tool call and stayed ``running``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from closedloop.messages import AssistantMessage, ToolCall, ToolMessage, Turn, Usage, UserMessage
from closedloop.redact import REDACTED, redact_arguments
from closedloop.store import RunStore
from closedloop.store.batch import UNRECORDABLE
from closedloop.tool import ToolResult

HUGE_INT = "9" * 5000
DEEP = "[" * 5000 + "]" * 5000
HOSTILE_ARGUMENTS = [
    f'{{"a": {HUGE_INT}, "b": 1}}',
    f'{{"a": {DEEP}, "b": 1}}',
    '{"a": ' + "[" * 900 + "]" * 900 + ', "api_key": "plain-value-1"}',  # parses, then too deep to walk
    '{"path": "caf\udce9", "b": 1}',  # a lone surrogate: bytes decoded with surrogateescape
    '{"a": "x\\u0000y"}',
]


@pytest.mark.parametrize("arguments", HOSTILE_ARGUMENTS)
def test_redact_arguments_never_raises(arguments):
    out = redact_arguments(arguments)
    assert isinstance(out, str)
    assert "plain-value-1" not in out  # keys it could not walk are caught as text ("api_key": ...)


def _other_run_step(i: int) -> tuple[list, list, list]:
    call = ToolCall.make("add", {"a": i, "b": 1})
    turn = Turn(message=AssistantMessage(content=f"calling {i}", tool_calls=[call]), prompt_ids=[i], completion_ids=[i])
    return ([UserMessage(content=f"q{i}"), turn.message, ToolMessage(tool_call_id=call.id, content=str(i + 1))],
            [turn], [(call, ToolResult("add", str(i + 1)), None)])


def test_a_hostile_step_costs_no_other_run_anything(store_path):
    store = RunStore(store_path, flush_interval_s=3600)  # everything lands in one batch, written by flush()
    good, bad = store.start_run(graph="good"), store.start_run(graph="bad")
    messages, turns, calls = _other_run_step(0)
    store.log_step(good, messages, turns, calls)
    hostile_calls = [ToolCall(id=f"c{i}", function={"name": "add", "arguments": a})
                     for i, a in enumerate(HOSTILE_ARGUMENTS)]
    results = [ToolResult("add", "Error: no", "bad arguments", "invalid_arguments") for _ in hostile_calls]
    results[3] = ToolResult("add", "listing caf\udce9 done")  # a result with a lone surrogate
    results[4] = ToolResult("add", b"\xff\x00 bytes, not text")  # type: ignore[arg-type]  # a tool's bug
    store.log_step(bad, [UserMessage(content="go \udcff"), AssistantMessage(tool_calls=hostile_calls)],
                   [Turn(message=AssistantMessage(content="x"), usage=Usage(prompt_tokens=3))],
                   [(c, r, 2**40) for c, r in zip(hostile_calls, results)])  # turn_idx past INTEGER too
    messages, turns, calls = _other_run_step(1)
    store.log_step(good, messages, turns, calls)
    store.flush()  # raises if any queued write was dropped
    rec = store.get_run(good)
    assert [m.text for m in rec.messages] == ["q0", "calling 0", "1", "q1", "calling 1", "2"]
    assert len(rec.turns) == 2 and [c.result for c in rec.tool_calls] == ["1", "2"]
    hostile = store.get_run(bad)
    assert len(hostile.messages) == 2 and hostile.messages[0].text == "go \ufffd"
    assert len(hostile.tool_calls) == len(HOSTILE_ARGUMENTS)
    by_id = {c.call_id: c for c in hostile.tool_calls}
    assert by_id["c0"].arguments == HOSTILE_ARGUMENTS[0]  # kept as the model wrote it
    assert by_id["c1"].arguments == HOSTILE_ARGUMENTS[1]
    assert "plain-value-1" not in by_id["c2"].arguments and REDACTED in by_id["c2"].arguments
    assert by_id["c3"].result == "listing caf\ufffd done" and "\ufffd" in by_id["c3"].arguments
    assert (by_id["c4"].result, by_id["c4"].error_kind) == (REDACTED, UNRECORDABLE)  # this call alone says so
    assert "could not record this call's result" in by_id["c4"].error
    assert {c.turn_idx for c in hostile.tool_calls} == {0}  # the run's latest turn
    for rid in (good, bad):
        store.finish_run(rid)
    assert {r.status for r in store.list_runs()} == {"completed"}


def test_a_row_the_database_refuses_costs_only_its_own_step(store_path):
    """Usage of 2**70 tokens (a broken backend) cannot go into a BIGINT: that step is reported by
    ``flush`` and dropped; the batch's other steps, of this run and others, are written."""
    store = RunStore(store_path, flush_interval_s=3600)
    good, broken = store.start_run(), store.start_run()
    store.log_step(good, [UserMessage(content="before")])
    store.log_step(broken, [UserMessage(content="lost")], [Turn(message=AssistantMessage(content="x"),
                                                                usage=Usage(prompt_tokens=2**70))])
    store.log_step(broken, [UserMessage(content="kept")])
    store.log_step(good, [UserMessage(content="after")])
    with pytest.warns(RuntimeWarning, match=f"queued writes for run {broken} were dropped"):
        with pytest.raises(Exception, match="out of range|INT128|BIGINT"):
            store.flush()
    assert [m.text for m in store.get_run(good).messages] == ["before", "after"]
    assert [m.text for m in store.get_run(broken).messages] == ["kept"]


def test_the_cli_records_a_call_with_a_5000_digit_argument(tmp_path):
    db = tmp_path / "runs.duckdb"
    other = RunStore(db)
    keep = other.start_run(graph="other")
    other.log_messages(keep, [UserMessage(content="mine")])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for arguments in (f'{{"a": {HUGE_INT}, "b": 1}}', f'{{"a": {DEEP}, "b": 1}}'):
        proc = subprocess.run([sys.executable, "-m", "closedloop", "tool", "call", "add", "--args", arguments,
                               "--store", str(db)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode in (1, 2)  # the tool refuses the arguments; the call is recorded
    store = RunStore(db)
    calls = [c for r in store.list_runs(kind="tool") for c in store.get_run(r.id).tool_calls]
    assert len(calls) == 2 and all(c.error and c.arguments for c in calls)
    assert json.dumps([m.text for m in store.get_run(keep).messages]) == '["mine"]'
