"""Run a compiled agent graph once: stream its events to a callback and record them as they happen.

Recording happens per super-step (each node's update), not at the end, so a run killed midway
keeps everything up to its last completed step in the run store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from closedloop.messages import Turn, _Message
from closedloop.runtime.convert import as_closedloop
from closedloop.runtime.state import ToolRecord

Event = tuple[str, Any]  # ("token", str) | ("message", Message) | ("tool", ToolRecord) | ("interrupt", value)


class Recorder(Protocol):
    """Receives what a graph adds, step by step (the run store implements this)."""

    def record(self, messages: list[_Message], turns: list[Turn], tool_records: list[ToolRecord]) -> None: ...


@dataclass
class GraphRun:
    """The outcome of one invocation: final state, and pending interrupts if it paused."""

    state: dict[str, Any]
    interrupts: list[Any] = field(default_factory=list)

    @property
    def paused(self) -> bool:
        return bool(self.interrupts)


async def run_graph(graph: Any, graph_input: Any, *, config: dict[str, Any] | None = None, context: Any = None,
                    on_event: Callable[[Event], None] | None = None, recorder: Recorder | None = None,
                    durability: str | None = None) -> GraphRun:
    """Invoke ``graph`` with streaming; ``graph_input`` may be a state dict, a ``Command(resume=...)``,
    or ``None`` (continue a checkpointed thread from where it stopped: its pending node re-runs).
    ``context`` is the run's :class:`~closedloop.runtime.context.AgentContext` (model, tools, settings).

    ``durability="sync"`` writes each checkpoint before the next step starts (LangGraph's default,
    ``"async"``, overlaps them), so a process killed mid-step resumes from the step it was in.
    """
    interrupts: list[Any] = []
    values: dict[str, Any] = {}
    if recorder is not None and isinstance(graph_input, dict) and graph_input.get("messages"):
        recorder.record(as_closedloop(_as_list(graph_input["messages"])), [], [])  # the input is part of the run too
    extra: dict[str, Any] = {"durability": durability} if durability else {}
    if context is not None:
        extra["context"] = context
    # The custom stream only carries tokens for ``on_event``: without one it is not asked for (a
    # subscribed mode costs LangGraph work at every step).
    modes = ["updates", "custom", "values"] if on_event is not None else ["updates", "values"]
    async for mode, chunk in graph.astream(graph_input, config, stream_mode=modes, **extra):
        if mode == "values":
            values = chunk
            continue
        if mode == "custom":
            if on_event is not None and isinstance(chunk, dict) and "token" in chunk:
                on_event(("token", chunk["token"]))
            continue
        for node, update in chunk.items():
            if node == "__interrupt__":
                for item in update:
                    interrupts.append(item.value)
                    if on_event is not None:
                        on_event(("interrupt", item.value))
                continue
            if not isinstance(update, dict):
                continue
            messages = as_closedloop(_as_list(update.get("messages", ())))
            turns = list(update.get("turns", ()))
            records = list(update.get("tool_records", ()))
            if on_event is not None:
                for m in messages:
                    on_event(("message", m))
            if recorder is not None and (messages or turns or records):
                recorder.record(messages, turns, records)
    return GraphRun(state={k: v for k, v in values.items() if not k.startswith("__")}, interrupts=interrupts)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else ([] if value is None else [value])
