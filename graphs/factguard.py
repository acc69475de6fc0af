"""``factguard``: the FactGuard agent (paper 1) as a LangGraph graph.

    START → reason ──(tool calls)──→ tools → answer → END
                   └──(an answer)──→ END

* ``reason`` (stage 1, A⁽¹⁾): the model reads the video (frames when it reads images), the
  transcript and the metadata, reasons, and either answers or calls tools (``factprobe``,
  ``clipscout``) when it judges the evidence ambiguous.
* ``tools``: runs the calls; a ClipScout grid is attached to the conversation as an image (when the
  model reads images), then the stage-2 instruction is added.
* ``answer`` (stage 2, A⁽²⁾): the model reasons over the tool results and answers; no tools are
  offered, so the loop has the paper's two stages and ends.

Its settings extend the run context (:class:`FactGuardContext`: the paper's stage-1 prompt by
default, and whether a grid is shown to the model). ``execute_tools=False`` makes it a one-step policy for an environment that runs the tools itself
(:class:`~closedloop.evals.factguard.env.FactGuardEnv`, the GRPO trainer): each call runs the stage
the conversation is in (stage 2 once tool results are present) and ends.
"""

from __future__ import annotations

import json
from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from pydantic import Field

from closedloop.agents.factguard import STAGE1_SYSTEM_PROMPT, STAGE2_INSTRUCTION
from closedloop.messages import ImagePart, TextPart, ToolMessage, UserMessage, _Message
from closedloop.runtime.context import AgentContext, context_of
from closedloop.runtime.convert import as_closedloop, to_langchain
from closedloop.runtime.nodes import asked_for_tools, call_model, run_tool_calls
from closedloop.runtime.state import AgentState

__all__ = ["graph", "builder", "FactGuardContext", "frames_message", "stage2_messages", "in_stage2"]


class FactGuardContext(AgentContext):
    """The run context of the FactGuard graph: the stage-1 prompt by default, at most two model
    calls per invocation (the design's two stages), and ``attach_frames``: show a ClipScout grid to
    the model as an image (for a model that reads images)."""

    system_prompt: str | None = Field(STAGE1_SYSTEM_PROMPT, description="null for none")
    max_turns: int = Field(2, ge=1, description="fixed by the design: two stages")
    attach_frames: bool = Field(True, description="show a ClipScout grid to the model as an image")


def frames_message(tool_messages: list[ToolMessage]) -> UserMessage | None:
    """The ClipScout grid as an image the model can see (None when no grid was produced)."""
    for m in tool_messages:
        if m.name not in (None, "clipscout") or not isinstance(m.content, str):
            continue
        try:
            report = json.loads(m.content)
        except json.JSONDecodeError:
            continue
        if isinstance(report, dict) and report.get("grid_path"):
            times = ", ".join(f"{t:g}" for t in report.get("times_s", []))
            return UserMessage(content=[TextPart(text=f"ClipScout frames at {times} s (2x2, left to right, top to "
                                                      f"bottom): "), ImagePart.from_path(report["grid_path"])])
    return None


def stage2_messages(tool_messages: list[ToolMessage], *, attach_frames: bool) -> list[_Message]:
    """What follows the tool results: the grid (if any, and if the model reads images), then the
    stage-2 instruction."""
    extra: list[_Message] = []
    if attach_frames:
        frames = frames_message(tool_messages)
        if frames is not None:
            extra.append(frames)
    return extra + [UserMessage(content=STAGE2_INSTRUCTION)]


def in_stage2(messages: list[_Message]) -> bool:
    return any(isinstance(m, ToolMessage) for m in messages)


async def _stage(state: AgentState, runtime: Runtime[FactGuardContext],
                 with_tools: bool) -> dict[str, Any]:
    ctx = context_of(runtime, FactGuardContext)
    turn, message = await call_model(ctx.model_client(), state.get("messages", []),
                                     tools=ctx.offered_tools() if with_tools else None, params=ctx.params,
                                     system_prompt=ctx.system_prompt, stream_tokens=ctx.stream_tokens,
                                     writer=runtime.stream_writer)
    return {"messages": [message], "turns": [turn]}


async def reason(state: AgentState, runtime: Runtime[FactGuardContext]) -> dict[str, Any]:
    """Stage 1: answer, or call the tools when the evidence is ambiguous."""
    return await _stage(state, runtime, with_tools=True)


async def answer(state: AgentState, runtime: Runtime[FactGuardContext]) -> dict[str, Any]:
    """Stage 2: answer from the tool results (no tools offered)."""
    return await _stage(state, runtime, with_tools=False)


async def run_tools(state: AgentState, runtime: Runtime[FactGuardContext]) -> dict[str, Any]:
    """The tool calls, then the grid (as an image, when shown) and the stage-2 instruction."""
    ctx = context_of(runtime, FactGuardContext)
    update = await run_tool_calls(state, ctx.tools, ctx.needs_approval)
    results = [m for m in as_closedloop(update.get("messages", [])) if isinstance(m, ToolMessage)]
    extra = stage2_messages(results, attach_frames=ctx.attach_frames)
    update["messages"] = list(update.get("messages", [])) + [to_langchain(m) for m in extra]
    return update


async def _start(state: AgentState, runtime: Runtime[FactGuardContext]) -> str:
    """Each run starts at stage 1, or, for a one-step policy, at the stage the conversation is in."""
    if context_of(runtime, FactGuardContext).execute_tools:
        return "reason"
    return "answer" if in_stage2(as_closedloop(state.get("messages", []))) else "reason"


async def _after_reason(state: AgentState, runtime: Runtime[FactGuardContext]) -> str:
    if not context_of(runtime, FactGuardContext).execute_tools:
        return END
    return "tools" if asked_for_tools(state.get("messages", [])) else END


builder = StateGraph(AgentState, context_schema=FactGuardContext)
builder.add_node("reason", reason)
builder.add_node("tools", run_tools)
builder.add_node("answer", answer)
builder.add_conditional_edges(START, _start, ["reason", "answer"])
builder.add_conditional_edges("reason", _after_reason, ["tools", END])
builder.add_edge("tools", "answer")
builder.add_edge("answer", END)

graph = builder.compile(name="factguard")
