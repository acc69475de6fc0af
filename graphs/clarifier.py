"""``clarifier``: the react agent with an information-gain clarification gate in front.

Before acting on a new user message, the graph forms a belief over candidate goals (proposed by
the policy model, or given by the caller) with a frozen scorer, and asks one clarifying question
when the belief is uncertain; otherwise it proceeds exactly like ``react``.

    START → assess ──(uncertain, budget left)──→ ask → END   (the question goes to the user)
                   └──(confident)──→ model ⇄ tools → END

Its settings extend the run context (:class:`ClarifierContext`: the scorer, a candidate generator,
the threshold, the question budget); what it must remember between the steps of an environment
(questions asked, the belief) lives in ``scratch``.

Every model call lands in the state's ``turns`` (in call order), so a trainer sees all of them:

- the candidate-goal proposal (:func:`propose_goals`) is recorded with ``trainable=False,
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
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence, Union

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from pydantic import Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from closedloop.agents.clarifier.belief import BeliefTracker, should_ask
from closedloop.agents.clarifier.scorer import GoalScorer
from closedloop.messages import AssistantMessage, SystemMessage, Turn, UserMessage, _Message
from closedloop.models.base import ModelClient, Pausable, SamplingParams
from closedloop.runtime.context import AgentContext, context_of
from closedloop.runtime.convert import ai_message, as_closedloop, role_of
from closedloop.runtime.nodes import add_tool_loop, model_node
from closedloop.runtime.state import AgentState

__all__ = ["graph", "builder", "ClarifierContext", "GoalProposal", "Candidates", "propose_goals", "lent_scorer"]


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


def _can_lend(client: Any) -> bool:
    return hasattr(client, "model") and hasattr(client, "tokenizer")


class ClarifierContext(AgentContext):
    """The run context of the clarifier: the standard settings plus the gate's.

    - ``scorer``: the frozen goal scorer; without one, an ``hf:`` policy lends its own weights
      (:func:`lent_scorer`, a snapshot taken once per client).
    - ``candidates``: the candidate-goal generator; default: the policy proposes them
      (:func:`propose_goals`).
    - ``threshold``: ask while the belief's normalised entropy exceeds it; ``budget``: at most this
      many questions per thread; ``belief_temperature``: the belief's temperature τ.
    """

    scorer: SkipJsonSchema[GoalScorer | None] = None
    candidates: SkipJsonSchema[Candidates | None] = None
    threshold: float = Field(0.5, description="ask while the normalised entropy exceeds this")
    budget: int = Field(1, ge=0, description="clarifying questions per thread")
    belief_temperature: float = Field(1.0, gt=0.0, description="the belief's temperature")

    @model_validator(mode="after")
    def _a_scorer_can_be_had(self) -> "ClarifierContext":
        if self.scorer is None and self.client is not None and not _can_lend(self.client):
            raise ValueError("the clarifier needs a scorer: pass scorer=GoalScorer.from_pretrained(path) "
                             "(only hf: clients can lend their own model)")
        return self


_LENT: "weakref.WeakKeyDictionary[Any, GoalScorer]" = weakref.WeakKeyDictionary()


def lent_scorer(client: ModelClient) -> GoalScorer:
    """A frozen snapshot of an ``hf:`` client's own model as the scorer, taken on first use and
    kept for that client: the reward stays fixed while the policy trains."""
    if not _can_lend(client):
        raise ValueError("the clarifier needs a scorer: pass scorer=GoalScorer.from_pretrained(path) "
                         "(only hf: clients can lend their own model)")
    if client not in _LENT:
        with client.paused() if isinstance(client, Pausable) else contextlib.nullcontext():
            _LENT[client] = GoalScorer(client.model, client.tokenizer)  # type: ignore[attr-defined]
    return _LENT[client]


def _lines(text: str, k: int) -> list[str]:
    out: list[str] = []
    for line in text.splitlines():
        line = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", line).strip()
        if line and line not in out:
            out.append(line)
    return out[:k]


async def propose_goals(client: ModelClient, messages: Sequence[_Message], k: int = 4,
                        params: SamplingParams | None = None) -> GoalProposal:
    """Candidate goals from the policy model itself. Its turn is marked ``trainable=False,
    purpose="propose_goals"`` (see the module docstring for why)."""
    ask = list(messages) + [UserMessage(content=PROPOSE_PROMPT.format(k=k))]
    turn = await client.generate(ask, None, params or SamplingParams(temperature=0.0, max_tokens=96))
    turn = turn.model_copy(update={"trainable": False, "purpose": PROPOSE_PURPOSE})
    return GoalProposal(_lines(turn.message.text, k), [turn])


async def _proposal(ctx: ClarifierContext, conversation: Sequence[_Message]) -> GoalProposal:
    if ctx.candidates is None:
        return await propose_goals(ctx.model_client(), conversation)
    result = ctx.candidates(conversation)
    if hasattr(result, "__await__"):
        result = await result  # type: ignore[misc]
    if isinstance(result, GoalProposal):
        return result
    return GoalProposal(list(result))  # type: ignore[arg-type]


async def assess(state: AgentState, runtime: Runtime[ClarifierContext]) -> dict[str, Any]:
    """Form a belief over candidate goals for a new user message; decide to ask or proceed."""
    ctx = context_of(runtime, ClarifierContext)
    scratch = dict(state.get("scratch") or {})
    messages = state.get("messages", [])
    asked = int(scratch.get("asked", 0))
    if not messages or role_of(messages[-1]) != "user" or asked >= ctx.budget:
        scratch["decision"] = "proceed"
        return {"scratch": scratch}
    conversation = ([SystemMessage(content=ctx.system_prompt)] if ctx.system_prompt else []) + as_closedloop(messages)
    proposal = await _proposal(ctx, conversation)
    goals = proposal.goals
    recorded = {"turns": list(proposal.turns)} if proposal.turns else {}
    if len(goals) < 2:
        scratch.update(decision="proceed", belief={g: 1.0 for g in goals})
        return {"scratch": scratch, **recorded}
    scorer = ctx.scorer or lent_scorer(ctx.model_client())
    belief = BeliefTracker(scorer, temperature=ctx.belief_temperature).belief(conversation, goals)
    ask_now = should_ask(belief, threshold=ctx.threshold, asked=asked, budget=ctx.budget)
    scratch.update(decision="ask" if ask_now else "proceed", belief=belief.as_dict(),
                   entropy=belief.normalized_entropy)
    return {"scratch": scratch, **recorded}


async def ask(state: AgentState, runtime: Runtime[ClarifierContext]) -> dict[str, Any]:
    """Ask the user one question that tells the likely goals apart (the policy's action)."""
    ctx = context_of(runtime, ClarifierContext)
    scratch = dict(state["scratch"])
    goals = "\n".join(f"- {g}" for g in scratch["belief"])
    messages = as_closedloop(state.get("messages", [])) + [UserMessage(content=ASK_PROMPT.format(goals=goals))]
    turn = await ctx.model_client().generate(messages, None, ctx.params)
    scratch["asked"] = int(scratch.get("asked", 0)) + 1
    if not turn.message.tool_calls and turn.message.text.strip().endswith("?"):
        message = AssistantMessage(content=turn.message.text.strip())
        kept = turn.model_copy(update={"message": message})
        return {"messages": [ai_message(message, kept)], "turns": [kept], "scratch": scratch}
    # The model did not produce a question: the user gets a templated one. The model's reply is
    # kept as it was generated, marked not for training (it was not the action taken); the
    # template's words were generated by no model, so they have no turn.
    options = " or ".join(list(scratch["belief"])[:3])
    message = AssistantMessage(content=f"Could you tell me which you mean: {options}?")
    discarded = turn.model_copy(update={"trainable": False, "purpose": "ask_discarded"})
    return {"messages": [ai_message(message)], "turns": [discarded], "scratch": scratch}


async def _after_assess(state: AgentState) -> str:
    return "ask" if state["scratch"]["decision"] == "ask" else "model"


builder = StateGraph(AgentState, context_schema=ClarifierContext)
builder.add_node("assess", assess)
builder.add_node("ask", ask)
builder.add_node("model", model_node)
builder.add_edge(START, "assess")
builder.add_conditional_edges("assess", _after_assess, {"ask": "ask", "model": "model"})
builder.add_edge("ask", END)
add_tool_loop(builder)

graph = builder.compile(name="clarifier")
