"""``orchestrator``: training-free multimodal orchestration (paper 4) as a LangGraph graph.

    START → controller ──(calls)──→ experts → controller …
                       ├──(invalid tokens)──→ controller (re-prompted with the reason, counted)
                       └──(speak / listen / interrupt)──→ END

* ``controller``: the controller model writes control tokens (:mod:`closedloop.agents.orchestrator.grammar`);
  they are parsed and validated; an invalid reply is rejected and the controller is re-prompted
  with the reason (``scratch["reprompts"]`` counts them; after ``max_reprompts`` the turn ends
  with an apology).
* ``experts``: the calls run in the order written; each first looks in the cross-modal memory
  (same source content, same expert, same question) and only calls the expert on a miss; every
  output becomes a memory record, and the records come back to the controller as text.
* The controller model is the context's client; the experts and the memory are in the run context
  (:class:`OrchestratorContext`), so a caller that keeps one context across turns keeps the memory.
* The final action is in ``scratch["final"]`` (``speak`` carries the answer); the interaction
  layer (:mod:`closedloop.agents.orchestrator.interaction`) streams it as text and speech.
"""

from __future__ import annotations

import hashlib
import os
from typing import Annotated, Any

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from pydantic import Field, InstanceOf, WithJsonSchema, field_validator
from pydantic.json_schema import SkipJsonSchema

from closedloop.agents.orchestrator.experts import ExpertPool, OrchestratorConfig, load_config
from closedloop.agents.orchestrator.grammar import GRAMMAR_HELP, Call, GrammarError, parse_program
from closedloop.memory.cross_modal import CrossModalMemory, MemoryRecord
from closedloop.messages import AudioPart, ImagePart, SystemMessage, UserMessage, _Message
from closedloop.models.base import SamplingParams
from closedloop.models.multimodal import part_bytes
from closedloop.runtime.context import AgentContext, context_of
from closedloop.runtime.convert import ai_message, as_closedloop, to_langchain
from closedloop.runtime.state import AgentState

__all__ = ["graph", "builder", "OrchestratorContext", "turn_sources", "controller_prompt", "APOLOGY"]

APOLOGY = "Sorry, I could not work that out."

#: The controller's sampling when the context gives none.
CONTROLLER_PARAMS = SamplingParams(temperature=0.0, max_tokens=256)


def controller_prompt(pool: ExpertPool) -> str:
    return ("You are the controller of a team of experts. You do not see images or hear audio yourself: ask the "
            "experts, then answer the user.\nExperts:\n" + pool.describe() + "\n" + GRAMMAR_HELP)


class OrchestratorContext(AgentContext):
    """The orchestrator's run context: the client is the controller; ``experts`` a pool, a config,
    or a YAML path (default ``$CLOSEDLOOP_EXPERTS``); ``memory`` the cross-modal memory (a fresh
    in-memory one by default: keep the context to keep it); ``max_reprompts`` re-prompts after
    invalid control tokens; ``max_rounds`` controller calls per turn. ``system_prompt`` None: the
    controller prompt listing the experts. Tools are reached as ``tool`` experts."""

    experts: Annotated[InstanceOf[ExpertPool], WithJsonSchema({"type": "string", "description": "experts YAML"})] = \
        Field(None, validate_default=True)  # type: ignore[assignment]
    memory: SkipJsonSchema[InstanceOf[CrossModalMemory]] = Field(default_factory=CrossModalMemory)
    max_reprompts: int = Field(2, ge=0, description="re-prompts after invalid control tokens")
    max_rounds: int = Field(4, ge=1, description="controller calls per turn")
    system_prompt: str | None = Field(None, description="null: the controller prompt listing the experts")

    @field_validator("experts", mode="before")
    @classmethod
    def _pool(cls, value: Any) -> Any:
        if value is None:
            value = os.environ.get("CLOSEDLOOP_EXPERTS")
            if not value:
                raise ValueError("the orchestrator needs experts: experts=<YAML path | OrchestratorConfig | "
                                 "ExpertPool> or CLOSEDLOOP_EXPERTS=<YAML path>")
        if isinstance(value, str):
            value = load_config(value)
        return ExpertPool(value) if isinstance(value, OrchestratorConfig) else value


def turn_sources(messages: list[_Message]) -> dict[str, list[Any]]:
    """The media of the latest user message, by kind, in order (what ``image:0`` etc. refer to)."""
    user = next((m for m in reversed(messages) if isinstance(m, UserMessage) and isinstance(m.content, list)
                 and any(isinstance(p, (ImagePart, AudioPart)) for p in m.content)), None)
    out: dict[str, list[Any]] = {"image": [], "audio": [], "video": []}
    if user is not None and isinstance(user.content, list):
        for p in user.content:
            if isinstance(p, ImagePart):
                out["image"].append(p)
            elif isinstance(p, AudioPart):
                out["audio"].append(p)
    return out


def _source_hash(part: Any) -> str:
    return hashlib.sha256(part_bytes(part)[0]).hexdigest()


async def controller(state: AgentState, runtime: Runtime[OrchestratorContext]) -> dict[str, Any]:
    """The controller writes control tokens; they are parsed and validated (re-prompted when invalid)."""
    ctx = context_of(runtime, OrchestratorContext)
    scratch = dict(state.get("scratch") or {})
    messages = as_closedloop(state.get("messages", []))
    prompt = ctx.system_prompt or controller_prompt(ctx.experts)
    convo = [SystemMessage(content=prompt)] + [m for m in messages if not isinstance(m, SystemMessage)]
    turn = await ctx.model_client().generate(convo, None, ctx.params or CONTROLLER_PARAMS)
    sources = {k: len(v) for k, v in turn_sources(messages).items()}
    rounds = scratch.get("rounds", 0) + 1
    reply = ai_message(turn.message, turn)
    try:
        actions = parse_program(turn.message.text or "", ctx.experts.config.modalities(), sources)
    except GrammarError as e:
        scratch["reprompts"] = scratch.get("reprompts", 0) + 1
        if scratch["reprompts"] > ctx.max_reprompts or rounds >= ctx.max_rounds:
            scratch.update(final={"kind": "speak", "text": APOLOGY}, pending=[], rounds=rounds)
            return {"messages": [reply], "turns": [turn], "scratch": scratch}
        scratch.update(pending=[], rounds=rounds)
        return {"messages": [reply, to_langchain(UserMessage(content=f"Invalid control tokens: {e}"))],
                "turns": [turn], "scratch": scratch}
    calls = [a.model_dump() for a in actions if isinstance(a, Call)]
    final = next((a.model_dump() for a in actions if not isinstance(a, Call)), None)
    if final is None and rounds >= ctx.max_rounds:
        final = {"kind": "speak", "text": APOLOGY}
    scratch.update(pending=calls if final is None else [], final=final, rounds=rounds)
    return {"messages": [reply], "turns": [turn], "scratch": scratch}


async def experts(state: AgentState, runtime: Runtime[OrchestratorContext]) -> dict[str, Any]:
    """The calls in the order written; each looks in the memory first and calls its expert only on a miss."""
    ctx = context_of(runtime, OrchestratorContext)
    pool, mem = ctx.experts, ctx.memory
    scratch = dict(state.get("scratch") or {})
    sources = turn_sources(as_closedloop(state.get("messages", [])))
    lines = []
    hits = scratch.get("memory_hits", 0)
    for c in (Call(**d) for d in scratch.get("pending", [])):
        part = None
        source_hash = None
        if c.source:
            kind, idx = c.source.split(":")
            part = sources[kind][int(idx)]
            source_hash = _source_hash(part)
        modality = pool.specs[c.expert].modality
        record = mem.lookup(source_hash, expert=c.expert, query=c.query)
        if record is not None:
            hits += 1
        else:
            try:
                summary = await pool.run(c.expert, c.query, part)
            except Exception as e:  # an expert's failure is the controller's to handle
                summary = f"(expert failed: {type(e).__name__}: {e})"
            record = mem.add(MemoryRecord(modality=modality if source_hash else "text", source=source_hash,
                                          expert=c.expert, query=c.query, summary=summary))
        where = f" on {c.source}" if c.source else ""
        lines.append(f"[{c.expert}{where}] {c.query} -> {record.summary}")
    scratch.update(pending=[], memory_hits=hits)
    results = UserMessage(content="Expert results:\n" + "\n".join(lines))
    return {"messages": [to_langchain(results)], "scratch": scratch}


async def _after_controller(state: AgentState) -> str:
    scratch = state.get("scratch") or {}
    if scratch.get("final"):
        return END
    return "experts" if scratch.get("pending") else "controller"


builder = StateGraph(AgentState, context_schema=OrchestratorContext)
builder.add_node("controller", controller)
builder.add_node("experts", experts)
builder.add_edge(START, "controller")
builder.add_conditional_edges("controller", _after_controller, ["controller", "experts", END])
builder.add_edge("experts", "controller")

graph = builder.compile(name="orchestrator")
