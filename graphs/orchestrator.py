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
* The final action is in ``scratch["final"]`` (``speak`` carries the answer); the interaction
  layer (:mod:`closedloop.agents.orchestrator.interaction`) streams it as text and speech.
"""

from __future__ import annotations

import hashlib
from typing import Any

from langgraph.graph import END, START, StateGraph

from closedloop.agents.orchestrator.experts import ExpertPool, OrchestratorConfig, load_config
from closedloop.agents.orchestrator.grammar import GRAMMAR_HELP, Call, GrammarError, parse_program
from closedloop.memory.cross_modal import CrossModalMemory, MemoryRecord
from closedloop.messages import AudioPart, ImagePart, SystemMessage, UserMessage, _Message
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.models.multimodal import part_bytes
from closedloop.runtime import AgentState
from closedloop.runtime.convert import as_closedloop

__all__ = ["build_orchestrator_graph", "turn_sources", "controller_prompt"]

APOLOGY = "Sorry, I could not work that out."


def turn_sources(messages: list[_Message]) -> dict[str, list[Any]]:
    """The media of the latest user message, by kind, in order (what ``image:0`` etc. refer to)."""
    user = next((m for m in reversed(messages) if isinstance(m, UserMessage) and isinstance(m.content, list)
                 and any(isinstance(p, (ImagePart, AudioPart)) for p in m.content)), None)
    out: dict[str, list[Any]] = {"image": [], "audio": [], "video": []}
    if user is not None:
        for p in user.content:  # type: ignore[union-attr]
            if isinstance(p, ImagePart):
                out["image"].append(p)
            elif isinstance(p, AudioPart):
                out["audio"].append(p)
    return out


def controller_prompt(pool: ExpertPool) -> str:
    return ("You are the controller of a team of experts. You do not see images or hear audio yourself: ask the "
            "experts, then answer the user.\nExperts:\n" + pool.describe() + "\n" + GRAMMAR_HELP)


def _source_hash(part: Any) -> str:
    return hashlib.sha256(part_bytes(part)[0]).hexdigest()


def build_orchestrator_graph(client: ModelClient, tools: Any = None, *,
                             experts: ExpertPool | OrchestratorConfig | str | None = None,
                             memory: CrossModalMemory | None = None, params: SamplingParams | None = None,
                             max_reprompts: int = 2, max_rounds: int = 4, system_prompt: str | None = None,
                             checkpointer: Any = None, **_: Any):
    """Compile the orchestrator. ``experts``: a pool, a config, or a YAML path (default:
    ``$CLOSEDLOOP_EXPERTS``); ``client`` is the controller. Tools are reached as ``tool`` experts."""
    if experts is None:
        import os

        experts = os.environ.get("CLOSEDLOOP_EXPERTS")
        if not experts:
            raise TypeError("the orchestrator needs experts: experts=<YAML path | OrchestratorConfig | ExpertPool> "
                            "or CLOSEDLOOP_EXPERTS=<YAML path>")
    if isinstance(experts, str):
        experts = load_config(experts)
    pool = experts if isinstance(experts, ExpertPool) else ExpertPool(experts)
    mem = memory if memory is not None else CrossModalMemory()
    params = params or SamplingParams(temperature=0.0, max_tokens=256)
    prompt = system_prompt or controller_prompt(pool)

    async def controller(state: AgentState) -> dict[str, Any]:
        scratch = dict(state.get("scratch") or {})
        messages = as_closedloop(state.get("messages", []))
        convo = [SystemMessage(content=prompt)] + [m for m in messages if not isinstance(m, SystemMessage)]
        turn = await client.generate(convo, None, params)
        sources = {k: len(v) for k, v in turn_sources(messages).items()}
        rounds = scratch.get("rounds", 0) + 1
        try:
            actions = parse_program(turn.message.text or "", pool.config.modalities(), sources)
        except GrammarError as e:
            scratch["reprompts"] = scratch.get("reprompts", 0) + 1
            if scratch["reprompts"] > max_reprompts or rounds >= max_rounds:
                scratch.update(final={"kind": "speak", "text": APOLOGY}, pending=[], rounds=rounds)
                return {"messages": [turn.message], "turns": [turn], "scratch": scratch}
            scratch.update(pending=[], rounds=rounds)
            return {"messages": [turn.message, UserMessage(content=f"Invalid control tokens: {e}")],
                    "turns": [turn], "scratch": scratch}
        calls = [a.model_dump() for a in actions if isinstance(a, Call)]
        final = next((a.model_dump() for a in actions if not isinstance(a, Call)), None)
        if final is None and rounds >= max_rounds:
            final = {"kind": "speak", "text": APOLOGY}
        scratch.update(pending=calls if final is None else [], final=final, rounds=rounds)
        return {"messages": [turn.message], "turns": [turn], "scratch": scratch}

    async def run_experts(state: AgentState) -> dict[str, Any]:
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
        return {"messages": [UserMessage(content="Expert results:\n" + "\n".join(lines))], "scratch": scratch}

    def after_controller(state: AgentState) -> str:
        scratch = state.get("scratch") or {}
        if scratch.get("final"):
            return END
        return "experts" if scratch.get("pending") else "controller"

    graph = StateGraph(AgentState)
    graph.add_node("controller", controller)
    graph.add_node("experts", run_experts)
    graph.add_edge(START, "controller")
    graph.add_conditional_edges("controller", after_controller, ["controller", "experts", END])
    graph.add_edge("experts", "controller")
    compiled = graph.compile(checkpointer=checkpointer, name="orchestrator")
    compiled.experts = pool  # type: ignore[attr-defined]
    compiled.memory = mem  # type: ignore[attr-defined]
    return compiled
