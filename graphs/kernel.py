"""``kernel``: the single-agent kernel-writing baseline (write → evaluate → read feedback → refine, N rounds).

    START → prepare → write ──→ evaluate ──(rounds left)──→ write …
                                         └──(done)──→ END

One conversation: the reference architecture as the user message, then each round the model's
module (a fenced ``python`` block defining ``ModelNew``) and the evaluator's JSON verdict as the
next user message. The graph calls the ``evaluate_kernel`` tool of its run context
(:class:`KernelContext`; :func:`closedloop.evals.kernelbench.tools.make_kernel_tools` binds one
to a problem) itself after every reply
(recorded as a tool call of that turn), so no candidate goes unevaluated. The best *correct*
candidate is kept (:func:`closedloop.agents.kernel.feedback.better`: correct, then faster); when
none is correct the latest candidate is kept so the caller can still grade it.

Input: ``{"problem": <reference source>}`` or ``{"messages": [UserMessage(<source, or text with a
python block defining Model>)]}``. Output keys: ``final_code`` (str | None), ``best_result``
(the evaluator's JSON as a dict), ``attempts`` (one summary per round), plus the usual
``messages``/``turns``/``tool_records``. Every model call is a trainable policy turn.
"""

from __future__ import annotations

import operator
import uuid
from typing import Annotated, Any, ClassVar

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from pydantic import Field, field_validator, model_validator

from closedloop.agents.kernel import prompts
from closedloop.agents.kernel.evaluate import evaluate_code, require_evaluator
from closedloop.agents.kernel.extract import CodeExtractionError, extract_code, extract_problem
from closedloop.agents.kernel.feedback import EvalResult, better
from closedloop.messages import AssistantMessage, UserMessage
from closedloop.models.base import SamplingParams
from closedloop.runtime.context import AgentContext, context_of
from closedloop.runtime.convert import as_closedloop, to_langchain
from closedloop.runtime.nodes import call_model
from closedloop.runtime.state import AgentState

__all__ = ["graph", "builder", "KernelState", "KernelContext", "KernelRunContext", "KERNEL_PARAMS",
           "problem_from_state", "keep_best"]

#: KernelBench samples at temperature 0; kernels are long, so the token budget is too.
KERNEL_PARAMS = SamplingParams(temperature=0.0, max_tokens=4096)


class KernelState(AgentState, total=False):
    problem: str
    final_code: str | None
    best_result: dict[str, Any] | None
    attempts: Annotated[list[dict[str, Any]], operator.add]


class KernelRunContext(AgentContext):
    """What the kernel-writing graphs share: the backend, the round budget, an evaluator tool in
    ``tools`` (``evaluate_kernel``, and ``profile_kernel`` where the backend has a profiler), the
    backend's own system prompts (``system_prompt`` None) and :data:`KERNEL_PARAMS` (``params``
    None). ``approve`` and ``execute_tools=False`` do not apply: the graph runs its evaluator itself."""

    graph_name: ClassVar[str] = "kernel"

    backend: str = Field("cpu", description="cpu, cuda or triton")
    rounds: int | None = Field(None, ge=1, description="model replies per problem (default 4; max_turns is an alias)")
    system_prompt: str | None = Field(None, description="null: the backend's prompt")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        return prompts.check_backend(value)

    @model_validator(mode="after")
    def _runs_its_evaluator(self) -> "KernelRunContext":
        require_evaluator(self.tools, self.graph_name)
        if self.approve or not self.execute_tools:
            raise ValueError(f"the {self.graph_name} graph runs its evaluator itself: approve and "
                             "execute_tools=False do not apply")
        return self

    def sampling(self) -> SamplingParams:
        return self.params or KERNEL_PARAMS


class KernelContext(KernelRunContext):
    """The ``kernel`` graph's run context: ``rounds`` model replies (default 4, or ``max_turns``
    when that is set, so ``closedloop run kernel --max-turns`` works); ``stop_when_correct`` ends at
    the first correct candidate instead of spending the remaining rounds on speed."""

    stop_when_correct: bool = False

    def round_budget(self) -> int:
        if self.rounds is not None:
            return self.rounds
        return self.max_turns if "max_turns" in self.model_fields_set else 4


def problem_from_state(state: KernelState) -> tuple[str, bool]:
    """The reference source and whether a message holds it: the newest user message that arrived
    since the last problem was taken (``scratch["messages_seen"]``), else ``state["problem"]``
    (the input key; the caller then shows it to the model in a message of its own)."""
    messages = as_closedloop(state.get("messages", []))
    seen = int((state.get("scratch") or {}).get("messages_seen", 0))
    users = [m for m in messages[seen:] if isinstance(m, UserMessage)]
    if users and (not state.get("problem") or seen):
        return extract_problem(users[-1].text), True
    if state.get("problem"):
        return state["problem"], False
    raise ValueError("the kernel graphs need a problem: pass {'problem': <reference source>} or a user message "
                     "containing it")


def _policy_turns(state: KernelState) -> int:
    return sum(1 for t in state.get("turns", []) if t.trainable)


def _round(state: KernelState) -> int:
    """Model replies since ``prepare`` (this problem's rounds so far)."""
    return _policy_turns(state) - int((state.get("scratch") or {}).get("round_base", 0))


def keep_best(code: str | None, result: EvalResult, best_code: str | None,
              best: EvalResult | None) -> tuple[str | None, EvalResult | None]:
    """The better of (code, result) and the current best: correct-and-faster wins; while nothing
    is correct, the latest candidate with code is kept (the caller can still grade it)."""
    if better(result, best) or (code is not None and (best is None or not best.correct)):
        return code, result
    return best_code, best


def _done(ctx: KernelContext, round_: int, best: EvalResult | None) -> bool:
    return round_ >= ctx.round_budget() or (ctx.stop_when_correct and best is not None and best.correct)


async def prepare(state: KernelState, runtime: Runtime[KernelContext]) -> dict[str, Any]:
    """Take the problem; rounds count from here, so a thread that goes on with a new problem gets a fresh budget."""
    context_of(runtime, KernelContext)  # a bad context fails before any model call
    problem, in_message = problem_from_state(state)
    messages = state.get("messages", [])
    update: dict[str, Any] = {"problem": problem, "final_code": None, "best_result": None}
    if not in_message:
        update["messages"] = [to_langchain(UserMessage(content=prompts.single_task(problem)))]
    update["scratch"] = {**(state.get("scratch") or {}), "round_base": _policy_turns(state),
                         "messages_seen": len(messages) + len(update.get("messages", []))}
    return update


async def write(state: KernelState, runtime: Runtime[KernelContext]) -> dict[str, Any]:
    """The model writes (or rewrites) the module."""
    ctx = context_of(runtime, KernelContext)
    turn, message = await call_model(ctx.model_client(), state.get("messages", []), params=ctx.sampling(),
                                     system_prompt=ctx.system_prompt or prompts.single_system(ctx.backend),
                                     stream_tokens=ctx.stream_tokens, writer=runtime.stream_writer)
    return {"messages": [message], "turns": [turn]}


async def evaluate(state: KernelState, runtime: Runtime[KernelContext]) -> dict[str, Any]:
    """Evaluate the reply's module; keep the best; give the verdict back while rounds remain."""
    ctx = context_of(runtime, KernelContext)
    turns = state.get("turns", [])
    round_ = _round(state)
    last = as_closedloop(state["messages"][-1:])[-1]
    text = last.text if isinstance(last, AssistantMessage) else ""
    update: dict[str, Any] = {}
    try:
        extracted = extract_code(text)
    except CodeExtractionError as e:
        code, result = None, EvalResult(status="no_code", message=str(e))
    else:
        code = extracted
        result, record = await evaluate_code(ctx.tools, extracted, call_id=f"eval-{uuid.uuid4().hex[:12]}",
                                             turn_idx=len(turns) - 1)
        update["tool_records"] = [record]
    best = EvalResult.model_validate(state["best_result"]) if state.get("best_result") else None
    final_code, best = keep_best(code, result, state.get("final_code"), best)
    update.update(final_code=final_code, best_result=best.model_dump(mode="json") if best else None,
                  attempts=[{"stage": "kernel", "round": round_, "role": "code", "status": result.status,
                             "speedup": result.speedup, "code": code, "kept": best is result}])
    if not _done(ctx, round_, best):
        feedback = prompts.single_feedback(result, round_, ctx.round_budget())
        update["messages"] = [to_langchain(UserMessage(content=feedback))]
    return update


async def _after_evaluate(state: KernelState, runtime: Runtime[KernelContext]) -> str:
    best = state.get("best_result")
    done = _done(context_of(runtime, KernelContext), _round(state), EvalResult.model_validate(best) if best else None)
    return END if done else "write"


builder = StateGraph(KernelState, context_schema=KernelContext)
builder.add_node("prepare", prepare)
builder.add_node("write", write)
builder.add_node("evaluate", evaluate)
builder.add_edge(START, "prepare")
builder.add_edge("prepare", "write")
builder.add_edge("write", "evaluate")
builder.add_conditional_edges("evaluate", _after_evaluate, {"write": "write", END: END})

graph = builder.compile(name="kernel")
