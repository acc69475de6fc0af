"""``egg``: expert-guided kernel generation in two stages (EGG, paper 2, arXiv 2606.26758).

    START → prepare → seeds → refine → handoff ──(a correct kernel)──→ tune_parallel_mapping
                                                │                      → tune_tiling → tune_memory → finish → END
                                                └──(none)──────────────────────────────────────────→ finish

Stage A, algorithm design:
  - ``seeds``: one design per algorithmic paradigm (:func:`~closedloop.agents.kernel.paradigms.seed_paradigms`,
    e.g. im2col vs direct convolution), each written by the code agent in a fresh context and
    repaired by the debug agent (up to ``debug_rounds``) until the evaluator says ``correct``.
  - ``refine``: semantics-preserving refinement of the best seed (fusion, online softmax, ...);
    kept only when correct and faster.
Stage B, hardware tuning, in order: parallel mapping → tiling → memory (``tune_<step>``). Each
step: the profile agent reads ``profile_kernel``'s report and answers JSON ``{bottleneck,
modification_plan}`` (re-asked when invalid; re-asks counted in ``profile_reasks``), then the
code agent applies the step, the debug agent repairs it. A tuned kernel replaces the current
one only if it is ``correct`` (numerically equal within the evaluator's tolerance) *and*
faster; otherwise the last correct kernel stays: tuning never changes numerics.

Context rule (the paper's stage-aware context management): every agent call starts from a
fresh prompt built from the problem and what its stage holds; within a stage the feedback is
the evaluator's JSON. Between stages only ``handoff`` crosses: the final decision (the paradigm
and accepted refinements, written by the graph, not by a model) and the final kernel with its
status and speedup. Stage-B nodes read ``problem``, ``handoff`` and ``stage_b`` only, never
``stage_a`` or ``attempts``, so no stage-A attempt can reach a stage-B prompt.

Every model call is a turn in ``turns`` (``purpose``: ``code``, ``refine``, ``tune``, ``debug``,
``profile``; an invalid profile answer that was re-asked is kept with ``trainable=False,
purpose="profile_invalid"``: it was not the plan acted on). Output keys as in ``kernel``
(``final_code``, ``best_result``, ``attempts``) plus ``handoff``, ``stage_b``, ``profile_reasks``;
the final kernel is also the last message (an assistant message the graph composes; no turn).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Collection, Optional, Sequence

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from closedloop.agents.kernel import prompts
from closedloop.agents.kernel.evaluate import evaluate_code, profile_code, require_evaluator
from closedloop.agents.kernel.extract import CodeExtractionError, extract_code
from closedloop.agents.kernel.feedback import EvalResult, better
from closedloop.agents.kernel.paradigms import REFINEMENTS, TUNING_GUIDES, TUNING_STEPS, seed_paradigms
from closedloop.agents.kernel.profile import ProfileParseError, ProfilePlan, parse_profile_plan, reask_message
from closedloop.graphs.kernel import KERNEL_PARAMS, KernelState, keep_best, problem_from_state
from closedloop.messages import AssistantMessage, SystemMessage, Turn, UserMessage, _Message
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime.convert import as_closedloop
from closedloop.runtime.nodes import run_params
from closedloop.runtime.state import ToolRecord
from closedloop.tool import ToolRegistry

__all__ = ["EggState", "build_egg_graph"]


class EggState(KernelState, total=False):
    stage_a: dict[str, Any]   # stage A's own record (seeds, best, refinements): never read by stage B
    handoff: dict[str, Any]   # all that crosses: {"decision": str, "code": str, "result": {status, speedup}}
    stage_b: dict[str, Any]   # stage B's current kernel: {"code", "result", "applied": [steps]}
    profile_reasks: int


@dataclass
class _Log:
    """What one node adds: turns, tool records and attempt summaries, with turn indices kept right."""

    base: int  # turns already in the state
    turns: list[Turn] = field(default_factory=list)
    records: list[ToolRecord] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def update(self, **more: Any) -> dict[str, Any]:
        return {"turns": self.turns, "tool_records": self.records, "attempts": self.attempts, **more}


@dataclass
class _Outcome:
    code: str | None
    result: EvalResult


def _speed(result: EvalResult) -> str:
    return f"{result.speedup:.3g}x" if result.speedup is not None else "not timed"


def _check_steps(steps: Sequence[str]) -> tuple[str, ...]:
    steps = tuple(steps)
    unknown = [s for s in steps if s not in TUNING_STEPS]
    if unknown:
        raise ValueError(f"unknown tuning steps {unknown}; choose from {list(TUNING_STEPS)}")
    if list(steps) != sorted(steps, key=TUNING_STEPS.index) or len(set(steps)) != len(steps):
        raise ValueError(f"tuning steps run once each, in the order {list(TUNING_STEPS)}; got {list(steps)}")
    return steps


def build_egg_graph(client: ModelClient, tools: ToolRegistry | None = None, *, backend: str = "cpu",
                    num_seeds: int = 3, debug_rounds: int = 2, refine_rounds: int = 1,
                    tuning_steps: Sequence[str] = TUNING_STEPS, max_reasks: int = 2,
                    paradigms: Sequence[str] | None = None, rounds: int | None = None,
                    params: SamplingParams | None = None,
                    system_prompt: str | None = None, max_turns: int | None = None,
                    approve: bool | Collection[str] = False, stream_tokens: bool = False,
                    execute_tools: bool = True, checkpointer: Any = None):
    """Compile the ``egg`` graph for one problem (``tools``: its ``evaluate_kernel``, and
    ``profile_kernel`` when the backend has a profiler; without one the profile agent reasons
    from the evaluator's timings).

    ``paradigms`` overrides the stage-A seeds (default: :func:`seed_paradigms` of the problem,
    ``num_seeds`` of them). ``rounds`` (the harness's ``--rounds``) is the write/debug budget of
    each agent task: one write plus ``rounds - 1`` debug rounds (it sets ``debug_rounds``). ``system_prompt``/``max_turns``/``stream_tokens`` are accepted for the
    common graph options and ignored (each agent has its own prompt; the budget is the counts
    above; calls are not streamed). ``approve``/``execute_tools=False`` do not apply.
    """
    tools = require_evaluator(tools, "egg")
    prompts.check_backend(backend)
    if rounds is not None:
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {rounds}")
        debug_rounds = rounds - 1
    if approve or not execute_tools:
        raise ValueError("the egg graph runs its evaluator itself: approve and execute_tools=False do not apply")
    for name, value, low in (("num_seeds", num_seeds, 1), ("debug_rounds", debug_rounds, 0),
                             ("refine_rounds", refine_rounds, 0), ("max_reasks", max_reasks, 0)):
        if value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}")
    steps = _check_steps(tuning_steps)
    base_params = params or KERNEL_PARAMS
    code_sys, debug_sys = prompts.code_system(backend), prompts.debug_system(backend)
    tune_sys, profile_sys = prompts.tune_system(backend), prompts.profile_system(backend)

    async def generate(log: _Log, system: str, messages: list[_Message], purpose: str,
                       config: Optional[RunnableConfig]) -> Turn:
        turn = await client.generate([SystemMessage(content=system), *messages], None, run_params(base_params, config))
        turn = turn.model_copy(update={"purpose": purpose})
        log.turns.append(turn)
        return turn

    async def evaluate(log: _Log, turn: Turn, stage: str, role: str) -> _Outcome:
        try:
            code: str | None = extract_code(turn.message.text)
        except CodeExtractionError as e:
            outcome = _Outcome(None, EvalResult(status="no_code", message=str(e)))
        else:
            result, record = await evaluate_code(tools, code, call_id=f"eval-{uuid.uuid4().hex[:12]}",
                                                 turn_idx=log.base + len(log.turns) - 1)
            log.records.append(record)
            outcome = _Outcome(code, result)
        log.attempts.append({"stage": stage, "role": role, "status": outcome.result.status,
                             "speedup": outcome.result.speedup, "code": outcome.code})
        return outcome

    async def attempt(log: _Log, problem: str, system: str, task: str, *, stage: str, role: str, goal: str,
                      config: Optional[RunnableConfig]) -> _Outcome:
        """One agent attempt, then the debug agent on its latest failure (fresh context each time)."""
        outcome = await evaluate(log, await generate(log, system, [UserMessage(content=task)], role, config),
                                 stage, role)
        for _ in range(debug_rounds):
            if outcome.result.correct or not outcome.result.fixable:
                break  # correct, or the evaluator's/problem's own failure: nothing for the debug agent to fix
            code = outcome.code or "# (no code could be extracted from the reply)"
            task = prompts.debug_task(problem, code, outcome.result, goal)
            outcome = await evaluate(log, await generate(log, debug_sys, [UserMessage(content=task)], "debug",
                                                         config), stage, "debug")
        return outcome

    # ---------------------------------------------------------------- stage A

    def prepare(state: EggState) -> dict[str, Any]:
        problem, in_message = problem_from_state(state)
        messages = as_closedloop(state.get("messages", []))
        update: dict[str, Any] = {"problem": problem, "final_code": None, "best_result": None, "profile_reasks": 0,
                                  "handoff": {}, "stage_b": {}}
        if not in_message:
            update["messages"] = [UserMessage(content=prompts.problem_block(problem))]
        update["scratch"] = {**(state.get("scratch") or {}),
                             "messages_seen": len(messages) + len(update.get("messages", []))}
        return update

    async def seeds(state: EggState, config: Optional[RunnableConfig] = None) -> dict[str, Any]:
        problem = state["problem"]
        log = _Log(len(state.get("turns", [])))
        chosen = list(paradigms) if paradigms else seed_paradigms(problem, num_seeds)
        best_code, best, best_paradigm, summary = None, None, None, []
        for paradigm in chosen:
            out = await attempt(log, problem, code_sys, prompts.seed_task(problem, paradigm), stage="A", role="code",
                                goal=f"implement the paradigm: {paradigm}", config=config)
            summary.append({"paradigm": paradigm, **out.result.summary()})
            new_code, new_best = keep_best(out.code, out.result, best_code, best)
            if new_best is out.result:
                best_paradigm = paradigm
            best_code, best = new_code, new_best
        return log.update(stage_a={"seeds": summary, "paradigm": best_paradigm, "code": best_code,
                                   "result": best.model_dump(mode="json") if best else None, "refinements": []})

    async def refine(state: EggState, config: Optional[RunnableConfig] = None) -> dict[str, Any]:
        stage_a = dict(state["stage_a"])
        log = _Log(len(state.get("turns", [])))
        best = EvalResult.model_validate(stage_a["result"]) if stage_a["result"] else None
        if best is None or not best.correct:
            return log.update()
        code, applied = stage_a["code"], list(stage_a["refinements"])
        for i in range(refine_rounds):
            task = prompts.refine_task(state["problem"], code, best, REFINEMENTS)
            out = await attempt(log, state["problem"], code_sys, task, stage="A", role="refine",
                                goal="refine the algorithm without changing its result", config=config)
            if better(out.result, best):
                applied.append(f"round {i + 1} (speedup {_speed(best)} -> {_speed(out.result)})")
                code, best = out.code, out.result
        stage_a.update(code=code, result=best.model_dump(mode="json"), refinements=applied)
        return log.update(stage_a=stage_a)

    def handoff(state: EggState) -> dict[str, Any]:
        """Close stage A: only the decision and the final kernel (with its status) cross."""
        stage_a = state["stage_a"]
        result = EvalResult.model_validate(stage_a["result"]) if stage_a["result"] else None
        update: dict[str, Any] = {"final_code": stage_a["code"],
                                  "best_result": result.model_dump(mode="json") if result else None}
        if result is None or not result.correct:
            return {**update, "handoff": {}}
        refined = ", ".join(stage_a["refinements"]) or "none accepted"
        decision = (f"algorithmic paradigm: {stage_a['paradigm']}; refinements: {refined}; the kernel is correct, "
                    f"speedup {_speed(result)}")
        crossing = {"decision": decision, "code": stage_a["code"], "result": result.summary()}
        return {**update, "handoff": crossing,
                "stage_b": {"code": stage_a["code"], "result": result.summary(), "applied": []}}

    # ---------------------------------------------------------------- stage B

    async def plan(log: _Log, code: str, step: str, guide: str,
                   config: Optional[RunnableConfig]) -> tuple[ProfilePlan | None, int]:
        """The profile agent's plan for this step, re-asked on invalid JSON; (plan, re-asks used)."""
        report, record = await profile_code(tools, code, call_id=f"profile-{uuid.uuid4().hex[:12]}")
        if record is not None:
            log.records.append(record)
        messages: list[_Message] = [UserMessage(content=prompts.profile_task(code, report, step, guide))]
        for reasks in range(max_reasks + 1):
            turn = await generate(log, profile_sys, messages, "profile", config)
            try:
                return parse_profile_plan(turn.message.text), reasks
            except ProfileParseError as e:
                log.turns[-1] = turn.model_copy(update={"trainable": False, "purpose": "profile_invalid"})
                if reasks == max_reasks:
                    return None, reasks
                messages += [turn.message, UserMessage(content=reask_message(e))]
        raise AssertionError("unreachable")

    def make_tune(step: str):
        guide = TUNING_GUIDES[backend][step]

        async def tune(state: EggState, config: Optional[RunnableConfig] = None) -> dict[str, Any]:
            # Reads problem, handoff and stage_b only: stage A's attempts are not in reach.
            problem, crossing, current = state["problem"], state["handoff"], dict(state["stage_b"])
            log = _Log(len(state.get("turns", [])))
            result = EvalResult.model_validate(current["result"])
            profile, reasks = await plan(log, current["code"], step, guide, config)
            task = prompts.tune_task(problem, crossing["decision"], current["code"], result, step, guide, profile)
            out = await attempt(log, problem, tune_sys, task, stage="B", role="tune",
                                goal=f"tune the {step.replace('_', ' ')} without changing the result", config=config)
            for a in log.attempts:
                a["step"] = step
            if better(out.result, result):  # correct and faster; anything else keeps the last correct kernel
                current = {"code": out.code, "result": out.result.summary(),
                           "applied": [*current["applied"], step]}
                return log.update(stage_b=current, final_code=out.code,
                                  best_result=out.result.model_dump(mode="json"),
                                  profile_reasks=state.get("profile_reasks", 0) + reasks)
            return log.update(profile_reasks=state.get("profile_reasks", 0) + reasks)

        return tune

    def finish(state: EggState) -> dict[str, Any]:
        code = state.get("final_code")
        if not code:
            return {}
        return {"messages": [AssistantMessage(content=f"```python\n{code.strip()}\n```")]}

    graph = StateGraph(EggState)
    graph.add_node("prepare", prepare)
    graph.add_node("seeds", seeds)
    graph.add_node("refine", refine)
    graph.add_node("handoff", handoff)
    chain = [f"tune_{s}" for s in steps]
    for s, name in zip(steps, chain):
        graph.add_node(name, make_tune(s))
    graph.add_node("finish", finish)
    graph.add_edge(START, "prepare")
    graph.add_edge("prepare", "seeds")
    graph.add_edge("seeds", "refine")
    graph.add_edge("refine", "handoff")
    first = chain[0] if chain else "finish"
    graph.add_conditional_edges("handoff", lambda s: first if s.get("handoff") else "finish",
                                {first: first, "finish": "finish"})
    for a, b in zip(chain, chain[1:] + ["finish"]):
        graph.add_edge(a, b)
    graph.add_edge("finish", END)
    return graph.compile(checkpointer=checkpointer, name="egg")
