"""``clarifier``: the react agent with an information-gain clarification gate in front.

Before acting on a new user message, the graph forms a belief over candidate goals (proposed by
the policy model, or given by the caller) with a frozen scorer, and asks one clarifying question
when the belief is uncertain; otherwise it proceeds exactly like ``react``.

    START → assess ──(uncertain, budget left)──→ ask → END   (the question goes to the user)
                   └──(confident)──→ model ⇄ tools → END

Every model call lands in the state's ``turns`` (in call order), so a trainer sees all of them:

- the candidate-goal proposal (:func:`propose_with_model`) is recorded with ``trainable=False,
  purpose="propose_goals"``. It is a helper call, not an action: its output only feeds the frozen
  scorer's belief, which decides whether to ask. Rewarding it with the episode's return would
  teach the policy to propose candidate sets that steer the gate (one candidate never asks) rather
  than to act well, so it is kept for audit and skipped by ``Trajectory.token_view``.
- the clarifying question is the policy's action and is trainable (``purpose="policy"``); its
  prompt ends with the ask instruction the model really saw, so its tokens start a new sequence.
- when the model does not produce a question, its reply is recorded as generated with
  ``trainable=False, purpose="ask_discarded"`` and the user gets a templated question, which no
  model generated and which therefore has no turn.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection, Optional, Sequence, Union

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from closedloop.agents.clarifier.belief import BeliefTracker, should_ask
from closedloop.agents.clarifier.scorer import GoalScorer
from closedloop.graphs.react import DEFAULT_SYSTEM_PROMPT
from closedloop.messages import AssistantMessage, SystemMessage, Turn, UserMessage, _Message
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import AgentState, make_model_node, wire_tool_loop
from closedloop.runtime.nodes import run_params
from closedloop.tool import ToolRegistry


@dataclass
class GoalProposal:
    """Candidate goals plus the model calls that produced them (recorded in the graph's turns)."""

    goals: list[str]
    turns: list[Turn] = field(default_factory=list)


_Proposed = Union[Sequence[str], GoalProposal]
#: A candidate generator: conversation -> goals (or a :class:`GoalProposal`), sync or async.
Candidates = Callable[[Sequence[_Message]], Union[_Proposed, Awaitable[_Proposed]]]

PROPOSE_PURPOSE = "propose_goals"

PROPOSE_PROMPT = ("List up to {k} distinct, specific goals the user might have given the conversation so far, "
                  "one per line, no numbering.")
ASK_PROMPT = ("The user's request is ambiguous between these goals:\n{goals}\n"
              "Ask the user one short question that tells them apart.")


def _lines(text: str, k: int) -> list[str]:
    out = []
    for line in text.splitlines():
        line = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", line).strip()
        if line and line not in out:
            out.append(line)
    return out[:k]


def propose_with_model(client: ModelClient, k: int = 4,
                       params: SamplingParams | None = None) -> Callable[[Sequence[_Message]], Awaitable[GoalProposal]]:
    """A candidate generator that asks the policy model itself. Its turn is marked
    ``trainable=False, purpose="propose_goals"`` (see the module docstring for why)."""

    async def propose(messages: Sequence[_Message]) -> GoalProposal:
        ask = list(messages) + [UserMessage(content=PROPOSE_PROMPT.format(k=k))]
        turn = await client.generate(ask, None, params or SamplingParams(temperature=0.0, max_tokens=96))
        turn = turn.model_copy(update={"trainable": False, "purpose": PROPOSE_PURPOSE})
        return GoalProposal(_lines(turn.message.text, k), [turn])

    return propose


async def _proposal(propose: Candidates, context: Sequence[_Message]) -> GoalProposal:
    result = propose(context)
    if hasattr(result, "__await__"):
        result = await result
    if isinstance(result, GoalProposal):
        return result
    return GoalProposal(list(result))


def build_clarifier_graph(client: ModelClient, tools: ToolRegistry | None = None, *,
                          scorer: GoalScorer | None = None, candidates: Candidates | None = None,
                          threshold: float = 0.5, budget: int = 1, belief_temperature: float = 1.0,
                          system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, params: SamplingParams | None = None,
                          max_turns: int = 8, approve: bool | Collection[str] = False,
                          stream_tokens: bool = False, execute_tools: bool = True, checkpointer: Any = None):
    """Compile the clarifier. Without ``scorer``, an ``hf:`` client's own model is snapshotted.

    ``execute_tools=False``: a one-step policy for environments that run the tools (τ-bench).
    """
    tools = tools or ToolRegistry()
    if scorer is None:
        if not (hasattr(client, "model") and hasattr(client, "tokenizer")):
            raise ValueError("the clarifier needs a scorer: pass scorer=GoalScorer.from_pretrained(path) "
                             "(only hf: clients can lend their own model)")
        with client.paused() if hasattr(client, "paused") else contextlib.nullcontext():
            scorer = GoalScorer(client.model, client.tokenizer)  # a consistent snapshot, never mid-update
    tracker = BeliefTracker(scorer, temperature=belief_temperature)
    propose = candidates or propose_with_model(client, params=None)

    async def assess(state: AgentState) -> dict[str, Any]:
        scratch = dict(state.get("scratch") or {})
        messages = state.get("messages", [])
        asked = int(scratch.get("asked", 0))
        if not messages or not isinstance(messages[-1], UserMessage) or asked >= budget:
            scratch["decision"] = "proceed"
            return {"scratch": scratch}
        context = ([SystemMessage(content=system_prompt)] if system_prompt else []) + list(messages)
        proposal = await _proposal(propose, context)
        goals = proposal.goals
        recorded = {"turns": list(proposal.turns)} if proposal.turns else {}
        if len(goals) < 2:
            scratch.update(decision="proceed", belief={g: 1.0 for g in goals})
            return {"scratch": scratch, **recorded}
        belief = tracker.belief(context, goals)
        ask = should_ask(belief, threshold=threshold, asked=asked, budget=budget)
        scratch.update(decision="ask" if ask else "proceed", belief=belief.as_dict(),
                       entropy=belief.normalized_entropy)
        return {"scratch": scratch, **recorded}

    async def ask(state: AgentState, config: Optional[RunnableConfig] = None) -> dict[str, Any]:
        scratch = dict(state["scratch"])
        goals = "\n".join(f"- {g}" for g in scratch["belief"])
        messages = list(state.get("messages", [])) + [UserMessage(content=ASK_PROMPT.format(goals=goals))]
        turn = await client.generate(messages, None, run_params(params, config))  # the run's seed, if any
        scratch["asked"] = int(scratch.get("asked", 0)) + 1
        if not turn.message.tool_calls and turn.message.text.strip().endswith("?"):
            message = AssistantMessage(content=turn.message.text.strip())
            return {"messages": [message], "turns": [turn.model_copy(update={"message": message})], "scratch": scratch}
        # The model did not produce a question: the user gets a templated one. The model's reply is
        # kept as it was generated, marked not for training (it was not the action taken); the
        # template's words were generated by no model, so they have no turn.
        options = " or ".join(list(scratch["belief"])[:3])
        message = AssistantMessage(content=f"Could you tell me which you mean: {options}?")
        discarded = turn.model_copy(update={"trainable": False, "purpose": "ask_discarded"})
        return {"messages": [message], "turns": [discarded], "scratch": scratch}

    graph = StateGraph(AgentState)
    graph.add_node("assess", assess)
    graph.add_node("ask", ask)
    graph.add_node("model", make_model_node(client, tools, system_prompt=system_prompt, params=params,
                                            stream_tokens=stream_tokens))
    graph.add_edge(START, "assess")
    graph.add_conditional_edges("assess", lambda s: "ask" if s["scratch"]["decision"] == "ask" else "model",
                                {"ask": "ask", "model": "model"})
    graph.add_edge("ask", END)
    wire_tool_loop(graph, tools, approve=approve, max_turns=max_turns, execute_tools=execute_tools)
    return graph.compile(checkpointer=checkpointer, name="clarifier")


def make_graph(config: Any = None):
    """The ``langgraph.json`` entry (see :func:`closedloop.graphs.react.make_graph`). Without a
    scorer the clarifier lends the policy's own weights, so the model must be ``hf:``; before a model
    is chosen (the server's schema pass) the graph is the react graph's shape over no model."""
    from closedloop.runtime.factory import MissingModel, served_graph

    def factory(client, tools=None, **kwargs):
        if isinstance(client, MissingModel):
            from closedloop.graphs.react import build_react_graph

            return build_react_graph(client, tools, **kwargs)
        return build_clarifier_graph(client, tools, **kwargs)

    return served_graph(factory, config)
