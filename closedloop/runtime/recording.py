"""Bridges a running graph to the run store: what each step adds is written as it happens."""

from __future__ import annotations

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
        if messages:
            self.store.log_messages(self.run_id, messages)
        for turn in turns:
            self.store.log_turn(self.run_id, turn)
        for r in tool_records:
            call = ToolCall(id=r.call_id, function=FunctionCall(name=r.name, arguments=r.arguments))
            result = ToolResult(r.name, r.content, r.error, r.error_kind, r.latency_s)
            self.store.log_tool_call(self.run_id, call, result, r.turn_idx)
