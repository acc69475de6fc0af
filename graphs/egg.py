"""``egg``: expert-guided kernel generation in two stages (EGG, paper 2, arXiv 2606.26758).

    START → prepare → seeds → refine → handoff ──(a correct kernel)──→ tune ⟲ (one step each) → finish → END
                                                └──(none)─────────────────────────────────────→ finish

Stage A, algorithm design:
  - ``seeds``: one design per algorithmic paradigm (:func:`~closedloop.agents.kernel.paradigms.seed_paradigms`,
    e.g. im2col vs direct convolution), each written by the code agent in a fresh context and
    repaired by the debug agent (up to ``debug_rounds``) until the evaluator says ``correct``.
  - ``refine``: semantics-preserving refinement of the best seed (fusion, online softmax, ...);
    kept only when correct and faster.
Stage B, hardware tuning, in order: parallel mapping → tiling → memory (the ``tune`` node runs
one step per visit; :class:`EggContext` ``tuning_steps`` chooses them). Each step: the profile agent reads ``profile_kernel``'s report and answers JSON ``{bottleneck,
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
from typing import Any, ClassVar

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from pydantic import Field, field_validator

from closedloop.agents.kernel import prompts
from closedloop.agents.kernel.evaluate import evaluate_code, profile_code
from closedloop.agents.kernel.extract import CodeExtractionError, extract_code
from closedloop.agents.kernel.feedback import EvalResult, better
from closedloop.agents.kernel.paradigms import REFINEMENTS, TUNING_GUIDES, TUNING_STEPS, seed_paradigms
from closedloop.agents.kernel.profile import ProfileParseError, ProfilePlan, parse_profile_plan, reask_message
from closedloop.graphs.kernel import KernelRunContext, KernelState, keep_best, problem_from_state
from closedloop.messages import AssistantMessage, SystemMessage, Turn, UserMessage, _Message
from closedloop.runtime.context import context_of
from closedloop.runtime.convert import to_langchain
from closedloop.runtime.state import ToolRecord

__all__ = ["graph", "builder", "EggState", "EggContext"]


class EggState(KernelState, total=False):
    stage_a: dict[str, Any]   # stage A's own record (seeds, best, refinements): never read by stage B
    handoff: dict[str, Any]   # all that crosses: {"decision": str, "code": str, "result": {status, speedup}}
    stage_b: dict[str, Any]   # stage B's current kernel: {"code", "result", "applied": [steps]}
    profile_reasks: int


class EggContext(KernelRunContext):
    """The ``egg`` graph's run context (``tools``: the problem's ``evaluate_kernel``, and
    ``profile_kernel`` when the backend has a profiler; without one the profile agent reasons from
    the evaluator's timings).

    ``paradigms`` overrides the stage-A seeds (default: :func:`seed_paradigms` of the problem,
    ``num_seeds`` of them). ``rounds`` (the harness's ``--rounds``) is the write/debug budget of
    each agent task: one write plus ``rounds - 1`` debug rounds (it replaces ``debug_rounds``).
    ``system_prompt``, ``max_turns`` and ``stream_tokens`` do not apply (each agent has its own
    prompt; the budget is the counts here; calls are not streamed).
    """

    graph_name: ClassVar[str] = "egg"

    num_seeds: int = Field(3, ge=1, description="stage-A designs, one per paradigm")
    debug_rounds: int = Field(2, ge=0, description="debug-agent repairs per task")
    refine_rounds: int = Field(1, ge=0, description="refinement rounds on the best seed")
    tuning_steps: tuple[str, ...] = Field(TUNING_STEPS, description="stage-B steps, in order")
    max_reasks: int = Field(2, ge=0, description="re-asks of an invalid profile answer")
    paradigms: list[str] | None = Field(None, description="the stage-A seeds (default: chosen for the problem)")

    @field_validator("tuning_steps")
    @classmethod
    def _steps_in_order(cls, steps: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [s for s in steps if s not in TUNING_STEPS]
        if unknown:
            raise ValueError(f"unknown tuning steps {unknown}; choose from {list(TUNING_STEPS)}")
        if list(steps) != sorted(steps, key=TUNING_STEPS.index) or len(set(steps)) != len(steps):
            raise ValueError(f"tuning steps run once each, in the order {list(TUNING_STEPS)}; got {list(steps)}")
        return steps

    def debug_budget(self) -> int:
        return self.rounds - 1 if self.rounds is not None else self.debug_rounds


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


@dataclass
class _Agents:
    """The agents of one node's work (code, debug, profile), over the run's context, logging what they do."""

    ctx: EggContext
    log: _Log

    async def generate(self, system: str, messages: list[_Message], purpose: str) -> Turn:
        convo: list[_Message] = [SystemMessage(content=system), *messages]
        turn = await self.ctx.model_client().generate(convo, None, self.ctx.sampling())
        turn = turn.model_copy(update={"purpose": purpose})
        self.log.turns.append(turn)
        return turn

    async def evaluate(self, turn: Turn, stage: str, role: str) -> _Outcome:
        try:
            code = extract_code(turn.message.text)
        except CodeExtractionError as e:
            outcome = _Outcome(None, EvalResult(status="no_code", message=str(e)))
        else:
            result, record = await evaluate_code(self.ctx.tools, code, call_id=f"eval-{uuid.uuid4().hex[:12]}",
                                                 turn_idx=self.log.base + len(self.log.turns) - 1)
            self.log.records.append(record)
            outcome = _Outcome(code, result)
        self.log.attempts.append({"stage": stage, "role": role, "status": outcome.result.status,
                                  "speedup": outcome.result.speedup, "code": outcome.code})
        return outcome

    async def attempt(self, problem: str, system: str, task: str, *, stage: str, role: str, goal: str) -> _Outcome:
        """One agent attempt, then the debug agent on its latest failure (fresh context each time)."""
        outcome = await self.evaluate(await self.generate(system, [UserMessage(content=task)], role), stage, role)
        for _ in range(self.ctx.debug_budget()):
            if outcome.result.correct or not outcome.result.fixable:
                break  # correct, or the evaluator's/problem's own failure: nothing for the debug agent to fix
            code = outcome.code or "# (no code could be extracted from the reply)"
            task = prompts.debug_task(problem, code, outcome.result, goal)
            turn = await self.generate(prompts.debug_system(self.ctx.backend), [UserMessage(content=task)], "debug")
            outcome = await self.evaluate(turn, stage, "debug")
        return outcome

    async def plan(self, code: str, step: str, guide: str) -> tuple[ProfilePlan | None, int]:
        """The profile agent's plan for this step, re-asked on invalid JSON; (plan, re-asks used)."""
        report, record = await profile_code(self.ctx.tools, code, call_id=f"profile-{uuid.uuid4().hex[:12]}")
        if record is not None:
            self.log.records.append(record)
        messages: list[_Message] = [UserMessage(content=prompts.profile_task(code, report, step, guide))]
        system = prompts.profile_system(self.ctx.backend)
        for reasks in range(self.ctx.max_reasks + 1):
            turn = await self.generate(system, messages, "profile")
            try:
                return parse_profile_plan(turn.message.text), reasks
            except ProfileParseError as e:
                self.log.turns[-1] = turn.model_copy(update={"trainable": False, "purpose": "profile_invalid"})
                messages += [turn.message, UserMessage(content=reask_message(e))]
        return None, self.ctx.max_reasks


def _agents(state: EggState, runtime: Runtime[EggContext]) -> _Agents:
    return _Agents(context_of(runtime, EggContext), _Log(len(state.get("turns", []))))


# ---------------------------------------------------------------- stage A


async def prepare(state: EggState, runtime: Runtime[EggContext]) -> dict[str, Any]:
    """Take the problem and start a fresh record for it."""
    context_of(runtime, EggContext)  # a bad context fails before any model call
    problem, in_message = problem_from_state(state)
    messages = state.get("messages", [])
    update: dict[str, Any] = {"problem": problem, "final_code": None, "best_result": None, "profile_reasks": 0,
                              "handoff": {}, "stage_b": {}}
    if not in_message:
        update["messages"] = [to_langchain(UserMessage(content=prompts.problem_block(problem)))]
    update["scratch"] = {**(state.get("scratch") or {}), "tuned": [],
                         "messages_seen": len(messages) + len(update.get("messages", []))}
    return update


async def seeds(state: EggState, runtime: Runtime[EggContext]) -> dict[str, Any]:
    """One design per algorithmic paradigm, each written and repaired in a fresh context."""
    agents = _agents(state, runtime)
    problem, ctx = state["problem"], agents.ctx
    chosen = list(ctx.paradigms) if ctx.paradigms else seed_paradigms(problem, ctx.num_seeds)
    best_code: str | None = None
    best: EvalResult | None = None
    best_paradigm, summary = None, []
    for paradigm in chosen:
        out = await agents.attempt(problem, prompts.code_system(ctx.backend), prompts.seed_task(problem, paradigm),
                                   stage="A", role="code", goal=f"implement the paradigm: {paradigm}")
        summary.append({"paradigm": paradigm, **out.result.summary()})
        new_code, new_best = keep_best(out.code, out.result, best_code, best)
        if new_best is out.result:
            best_paradigm = paradigm
        best_code, best = new_code, new_best
    return agents.log.update(stage_a={"seeds": summary, "paradigm": best_paradigm, "code": best_code,
                                      "result": best.model_dump(mode="json") if best else None, "refinements": []})


async def refine(state: EggState, runtime: Runtime[EggContext]) -> dict[str, Any]:
    """Semantics-preserving refinement of the best seed, kept only when correct and faster."""
    agents = _agents(state, runtime)
    stage_a = dict(state["stage_a"])
    best = EvalResult.model_validate(stage_a["result"]) if stage_a["result"] else None
    if best is None or not best.correct:
        return agents.log.update()
    code, applied = stage_a["code"], list(stage_a["refinements"])
    for i in range(agents.ctx.refine_rounds):
        task = prompts.refine_task(state["problem"], code, best, REFINEMENTS)
        out = await agents.attempt(state["problem"], prompts.code_system(agents.ctx.backend), task, stage="A",
                                   role="refine", goal="refine the algorithm without changing its result")
        if better(out.result, best):
            applied.append(f"round {i + 1} (speedup {_speed(best)} -> {_speed(out.result)})")
            code, best = out.code, out.result
    stage_a.update(code=code, result=best.model_dump(mode="json"), refinements=applied)
    return agents.log.update(stage_a=stage_a)


async def handoff(state: EggState) -> dict[str, Any]:
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


def _next_step(state: EggState, ctx: EggContext) -> str | None:
    tuned = (state.get("scratch") or {}).get("tuned", [])
    return next((s for s in ctx.tuning_steps if s not in tuned), None)


async def tune(state: EggState, runtime: Runtime[EggContext]) -> dict[str, Any]:
    """The next hardware-tuning step: the profile agent's plan, the code agent's change, the debug
    agent's repair. Reads problem, handoff and stage_b only: stage A's attempts are not in reach."""
    agents = _agents(state, runtime)
    ctx = agents.ctx
    step = _next_step(state, ctx)
    if step is None:
        return {}
    guide = TUNING_GUIDES[ctx.backend][step]
    problem, crossing, current = state["problem"], state["handoff"], dict(state["stage_b"])
    scratch = {**(state.get("scratch") or {}), "tuned": [*(state.get("scratch") or {}).get("tuned", []), step]}
    result = EvalResult.model_validate(current["result"])
    profile, reasks = await agents.plan(current["code"], step, guide)
    task = prompts.tune_task(problem, crossing["decision"], current["code"], result, step, guide, profile)
    out = await agents.attempt(problem, prompts.tune_system(ctx.backend), task, stage="B", role="tune",
                               goal=f"tune the {step.replace('_', ' ')} without changing the result")
    for a in agents.log.attempts:
        a["step"] = step
    reasked = state.get("profile_reasks", 0) + reasks
    if better(out.result, result):  # correct and faster; anything else keeps the last correct kernel
        current = {"code": out.code, "result": out.result.summary(), "applied": [*current["applied"], step]}
        return agents.log.update(stage_b=current, final_code=out.code, best_result=out.result.model_dump(mode="json"),
                                 profile_reasks=reasked, scratch=scratch)
    return agents.log.update(profile_reasks=reasked, scratch=scratch)


async def finish(state: EggState) -> dict[str, Any]:
    """The final kernel as the last message (composed by the graph; no turn)."""
    code = state.get("final_code")
    if not code:
        return {}
    return {"messages": [to_langchain(AssistantMessage(content=f"```python\n{code.strip()}\n```"))]}


async def _after_handoff(state: EggState, runtime: Runtime[EggContext]) -> str:
    return "tune" if state.get("handoff") and _next_step(state, context_of(runtime, EggContext)) else "finish"


builder = StateGraph(EggState, context_schema=EggContext)
# stage A, nodes named after their functions (add_sequence is typed for one node signature; these differ)
builder.add_sequence([prepare, seeds, refine, handoff])  # type: ignore[arg-type]
builder.add_node("tune", tune)
builder.add_node("finish", finish)
builder.add_edge(START, "prepare")
builder.add_conditional_edges("handoff", _after_handoff, ["tune", "finish"])
builder.add_conditional_edges("tune", _after_handoff, ["tune", "finish"])
builder.add_edge("finish", END)

graph = builder.compile(name="egg")
