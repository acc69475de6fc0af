"""``kernel``: the single-agent kernel-writing baseline (write → evaluate → read feedback → refine, N rounds).

    START → prepare → write ──→ evaluate ──(rounds left)──→ write …
                                         └──(done)──→ END

One conversation: the reference architecture as the user message, then each round the model's
module (a fenced ``python`` block defining ``ModelNew``) and the evaluator's JSON verdict as the
next user message. The graph calls the injected ``evaluate_kernel`` tool itself after every reply
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
from typing import Annotated, Any, Collection

from langgraph.graph import END, START, StateGraph

from closedloop.agents.kernel import prompts
from closedloop.agents.kernel.evaluate import evaluate_code, require_evaluator
from closedloop.agents.kernel.extract import CodeExtractionError, extract_code, extract_problem
from closedloop.agents.kernel.feedback import EvalResult, better
from closedloop.messages import AssistantMessage, UserMessage
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import AgentState, make_model_node
from closedloop.runtime.convert import as_closedloop
from closedloop.tool import ToolRegistry

__all__ = ["KernelState", "build_kernel_graph", "KERNEL_PARAMS", "problem_from_state", "keep_best"]

#: KernelBench samples at temperature 0; kernels are long, so the token budget is too.
KERNEL_PARAMS = SamplingParams(temperature=0.0, max_tokens=4096)


class KernelState(AgentState, total=False):
    problem: str
    final_code: str | None
    best_result: dict[str, Any] | None
    attempts: Annotated[list[dict[str, Any]], operator.add]


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


def build_kernel_graph(client: ModelClient, tools: ToolRegistry | None = None, *, backend: str = "cpu",
                       rounds: int | None = None, stop_when_correct: bool = False,
                       system_prompt: str | None = None, params: SamplingParams | None = None,
                       max_turns: int | None = None, approve: bool | Collection[str] = False,
                       stream_tokens: bool = False, execute_tools: bool = True, checkpointer: Any = None):
    """Compile the ``kernel`` graph for one problem (``tools`` holds its ``evaluate_kernel``).

    ``rounds`` model replies (default 4; ``max_turns`` is accepted as its alias so ``closedloop
    run kernel`` works). ``stop_when_correct`` ends at the first correct candidate instead of
    spending the remaining rounds on speed. ``approve``/``execute_tools=False`` do not apply: the
    graph's only tool is the evaluator, which it must run itself.
    """
    tools = require_evaluator(tools, "kernel")
    prompts.check_backend(backend)
    if approve or not execute_tools:
        raise ValueError("the kernel graph runs its evaluator itself: approve and execute_tools=False do not apply")
    rounds = rounds if rounds is not None else (max_turns if max_turns is not None else 4)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    system = system_prompt if system_prompt is not None else prompts.single_system(backend)

    def prepare(state: KernelState) -> dict[str, Any]:
        problem, in_message = problem_from_state(state)
        # Rounds count from here: a thread that goes on with a new problem gets a fresh budget.
        messages = as_closedloop(state.get("messages", []))
        update: dict[str, Any] = {"problem": problem, "final_code": None, "best_result": None}
        if not in_message:
            update["messages"] = [UserMessage(content=prompts.single_task(problem))]
        update["scratch"] = {**(state.get("scratch") or {}), "round_base": _policy_turns(state),
                             "messages_seen": len(messages) + len(update.get("messages", []))}
        return update

    async def evaluate(state: KernelState) -> dict[str, Any]:
        turns = state.get("turns", [])
        round_ = _round(state)
        last = as_closedloop(state["messages"][-1:])[-1]
        text = last.text if isinstance(last, AssistantMessage) else ""
        update: dict[str, Any] = {}
        try:
            code: str | None = extract_code(text)
        except CodeExtractionError as e:
            code, result = None, EvalResult(status="no_code", message=str(e))
        else:
            result, record = await evaluate_code(tools, code, call_id=f"eval-{uuid.uuid4().hex[:12]}",
                                                 turn_idx=len(turns) - 1)
            update["tool_records"] = [record]
        best = EvalResult.model_validate(state["best_result"]) if state.get("best_result") else None
        final_code, best = keep_best(code, result, state.get("final_code"), best)
        update.update(final_code=final_code, best_result=best.model_dump(mode="json") if best else None,
                      attempts=[{"stage": "kernel", "round": round_, "role": "code", "status": result.status,
                                 "speedup": result.speedup, "code": code, "kept": best is result}])
        if not _done(round_, best):
            update["messages"] = [UserMessage(content=prompts.single_feedback(result, round_, rounds))]
        return update

    def _done(round_: int, best: EvalResult | None) -> bool:
        return round_ >= rounds or (stop_when_correct and best is not None and best.correct)

    def route(state: KernelState) -> str:
        best = state.get("best_result")
        return END if _done(_round(state), EvalResult.model_validate(best) if best else None) else "write"

    graph = StateGraph(KernelState)
    graph.add_node("prepare", prepare)
    graph.add_node("write", make_model_node(client, None, system_prompt=system, params=params or KERNEL_PARAMS,
                                            stream_tokens=stream_tokens))
    graph.add_node("evaluate", evaluate)
    graph.add_edge(START, "prepare")
    graph.add_edge("prepare", "write")
    graph.add_edge("write", "evaluate")
    graph.add_conditional_edges("evaluate", route, {"write": "write", END: END})
    return graph.compile(checkpointer=checkpointer, name="kernel")
