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

``execute_tools=False`` makes it a one-step policy for an environment that runs the tools itself
(:class:`~closedloop.evals.factguard.env.FactGuardEnv`, the GRPO trainer): each call runs the stage
the conversation is in (stage 2 once tool results are present) and ends.
"""

from __future__ import annotations

import json
from typing import Any, Collection

from langgraph.graph import END, START, StateGraph

from closedloop.agents.factguard import STAGE1_SYSTEM_PROMPT, STAGE2_INSTRUCTION
from closedloop.messages import AssistantMessage, ImagePart, TextPart, ToolMessage, UserMessage, _Message
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import AgentState, make_model_node, make_tool_node
from closedloop.runtime.convert import as_closedloop, in_form, thread_form
from closedloop.tool import ToolRegistry

__all__ = ["build_factguard_graph", "frames_message", "stage2_messages", "in_stage2"]


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


def build_factguard_graph(client: ModelClient, tools: ToolRegistry | None = None, *,
                          system_prompt: str | None = STAGE1_SYSTEM_PROMPT, params: SamplingParams | None = None,
                          max_turns: int = 2, approve: bool | Collection[str] = False, stream_tokens: bool = False,
                          execute_tools: bool = True, checkpointer: Any = None, attach_frames: bool = True):
    """Compile the FactGuard graph over ``tools`` (a sample's ``factprobe`` and ``clipscout``).

    ``max_turns`` is fixed by the design (two stages, at most two model calls per invocation) and
    accepted for the factory contract; ``approve`` pauses before the named tool calls.
    """
    tools = tools or ToolRegistry()
    reason = make_model_node(client, tools, system_prompt=system_prompt, params=params, stream_tokens=stream_tokens)
    answer = make_model_node(client, None, system_prompt=system_prompt, params=params, stream_tokens=stream_tokens)
    graph = StateGraph(AgentState)
    graph.add_node("reason", reason)
    graph.add_node("answer", answer)

    if not execute_tools:
        def route_start(state: AgentState) -> str:
            return "answer" if in_stage2(as_closedloop(state.get("messages", []))) else "reason"

        graph.add_conditional_edges(START, route_start, ["reason", "answer"])
        graph.add_edge("reason", END)
        graph.add_edge("answer", END)
        return graph.compile(checkpointer=checkpointer, name="factguard")

    run_tools = make_tool_node(tools, approve=approve)

    async def tools_node(state: AgentState) -> dict[str, Any]:
        update = await run_tools(state)
        results = [m for m in as_closedloop(update.get("messages", [])) if isinstance(m, ToolMessage)]
        extra = stage2_messages(results, attach_frames=attach_frames)
        update["messages"] = list(update.get("messages", [])) + in_form(extra, thread_form(state.get("messages", [])))
        return update

    def after_reason(state: AgentState) -> str:
        last = as_closedloop(state.get("messages", [])[-1:])
        return "tools" if last and isinstance(last[0], AssistantMessage) and last[0].tool_calls else END

    graph.add_node("tools", tools_node)
    graph.add_edge(START, "reason")
    graph.add_conditional_edges("reason", after_reason, ["tools", END])
    graph.add_edge("tools", "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=checkpointer, name="factguard")
