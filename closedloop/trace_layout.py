"""A run's steps in the order they happened, rebuilt from what the store keeps.

The store keeps messages (in order), turns (in order) and tool calls (each naming its turn).
A turn's assistant message is also one of the messages (recorded from the same object), so
matching them in order places every turn in the conversation; a turn with no matching message
(a helper call such as a goal proposal or a re-ask, or a context the graph rewrote) stays in its
own order between the matched ones. Tool calls follow their turn; a tool message that answers a
recorded call is shown with the call. Latencies are recorded per step, start times are not
(a bulk write stamps one time on a whole episode), so the waterfall lays steps end to end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from closedloop.messages import AssistantMessage, ToolMessage
from closedloop.store import RunRecord, ToolCallRecord

__all__ = ["Step", "Trace", "WaterfallRow", "build_trace"]


@dataclass
class WaterfallRow:
    """One bar of the trace's waterfall (the viewer draws it, the OTLP export times spans by it)."""

    label: str
    start_s: float
    duration_s: float
    kind: str  # "turn" | "tool" | "error"
    anchor: str  # the step's id on the page


@dataclass
class Step:
    kind: str  # "message" | "turn" | "tool"
    anchor: str
    message_index: int | None = None  # the message shown (the turn's own, for a turn)
    turn_index: int | None = None
    prompt_messages: int = 0  # messages recorded before this turn
    tool: ToolCallRecord | None = None
    tool_message_index: int | None = None


@dataclass
class Trace:
    steps: list[Step] = field(default_factory=list)
    waterfall: list[WaterfallRow] = field(default_factory=list)
    turn_messages: dict[int, int] = field(default_factory=dict)  # turn index -> its message index


def _same(a: Any, b: Any) -> bool:
    return a is b or (isinstance(a, AssistantMessage) and isinstance(b, AssistantMessage)
                      and a.model_dump() == b.model_dump())


def build_trace(run: RunRecord) -> Trace:
    out = Trace()
    turns = run.turns
    next_turn = 0
    for i, m in enumerate(run.messages):
        if isinstance(m, AssistantMessage):
            j = next((k for k in range(next_turn, len(turns)) if _same(turns[k].message, m)), None)
            if j is not None:
                out.turn_messages[j] = i
                next_turn = j + 1
    by_turn: dict[int | None, list[ToolCallRecord]] = {}
    for c in run.tool_calls:
        by_turn.setdefault(c.turn_idx if c.turn_idx is not None and 0 <= c.turn_idx < len(turns) else None,
                           []).append(c)
    answered: dict[str, int] = {}
    for i, m in enumerate(run.messages):
        if isinstance(m, ToolMessage):
            answered.setdefault(m.tool_call_id, i)
    calls_with_message = {c.call_id for c in run.tool_calls if c.call_id in answered}
    clock = 0.0
    emitted_turns: set[int] = set()

    def emit_turn(k: int, prompt_messages: int) -> None:
        nonlocal clock
        emitted_turns.add(k)
        t = turns[k]
        anchor = f"turn-{k}"
        out.steps.append(Step("turn", anchor, out.turn_messages.get(k), k, prompt_messages))
        latency = float(t.latency_s or 0.0)
        label = f"turn {k}" + (f" ({t.purpose})" if t.purpose != "policy" else "")
        out.waterfall.append(WaterfallRow(label, clock, latency, "turn", anchor))
        clock += latency
        longest = 0.0
        for c in by_turn.get(k, []):
            tool_anchor = f"tool-{c.idx}"
            out.steps.append(Step("tool", tool_anchor, turn_index=k, tool=c,
                                  tool_message_index=answered.get(c.call_id or "")))
            out.waterfall.append(WaterfallRow(f"  {c.name}", clock, float(c.latency_s or 0.0),
                                              "error" if c.error else "tool", tool_anchor))
            longest = max(longest, float(c.latency_s or 0.0))
        clock += longest  # a turn's calls may run concurrently: the next turn starts after the longest

    owner_of = {mi: k for k, mi in out.turn_messages.items()}
    unmatched = 0  # turns before this one without a message of their own are emitted in order
    for i, m in enumerate(run.messages):
        owner = owner_of.get(i)
        if owner is not None:
            for k in range(unmatched, owner):
                if k not in emitted_turns and k not in out.turn_messages:
                    emit_turn(k, i)
            unmatched = owner + 1
            emit_turn(owner, i)
            continue
        if isinstance(m, ToolMessage) and m.tool_call_id in calls_with_message:
            continue  # shown with its call
        out.steps.append(Step("message", f"msg-{i}", message_index=i))
    for k in range(len(turns)):
        if k not in emitted_turns:
            emit_turn(k, len(run.messages))
    for c in by_turn.get(None, []):
        out.steps.append(Step("tool", f"tool-{c.idx}", tool=c, tool_message_index=answered.get(c.call_id or "")))
    return out
