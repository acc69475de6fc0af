"""Clarification-enhanced τ-bench tasks: the opening request withholds one disambiguating detail.

Following the clarification-enhanced τ-Bench of Deng et al. (ICML 2026), a task is made
underspecified by hiding one detail of its goal from the user's opening request; the simulated
user reveals it only when the agent asks. The ground-truth goal g* is recorded with the task, for
the information-gain reward.

How the detail is picked (deterministic under ``seed``):

1. Candidate slots come from the task's gold *write* actions, in this fixed order:
   - ``order``: an ``order_id`` of a write action that the user's reason for calling states
     verbatim (e.g. "#W2378156"); it is replaced there by "one of your orders";
   - ``payment``: the ``payment_method_id`` of a write action (the scenario rarely says it; the
     user is told which one they want and to keep it back until asked).
2. One candidate is drawn with ``random.Random(f"{seed}:{task.id}")``; tasks with no candidate
   are left out (or kept unchanged with ``keep_unclarifiable=True``).
3. The user's instructions gain a rule: do not give the detail in the first messages; give it
   when the agent asks for it. The task id becomes ``<id>[clarify:<slot>]`` and
   ``description.notes`` holds the :class:`Clarification` as JSON, so results stay traceable.
"""

from __future__ import annotations

import json
import random
import re
from typing import Iterable, Literal, Optional

from pydantic import BaseModel

from closedloop.evals.tau.data_model import Description, StructuredUserInstructions, Task
from closedloop.evals.tau.orchestrator import STOP
from closedloop.messages import Turn, Usage, _Message, AssistantMessage
from closedloop.models.base import ModelClient, SamplingParams, ToolChoice

Slot = Literal["order", "payment"]
NOTE_PREFIX = "clarify:"


class Clarification(BaseModel):
    slot: Slot
    value: str
    goal: str  # g*, the serialised ground-truth goal
    original_task_id: str


def _payment_phrase(pm_id: str) -> str:
    kind = pm_id.rsplit("_", 1)[0].replace("_", " ")
    return f"your {kind} ({pm_id})"


def _write_actions(task: Task) -> list:
    actions = (task.evaluation_criteria.actions if task.evaluation_criteria else None) or []
    return [a for a in actions if a.requestor == "assistant" and not a.name.startswith(("get_", "find_", "list_"))
            and a.name not in {"calculate", "think", "transfer_to_human_agents"}]


def candidate_slots(task: Task) -> list[tuple[Slot, str]]:
    instr = task.user_scenario.instructions
    if not isinstance(instr, StructuredUserInstructions):
        return []
    found: list[tuple[Slot, str]] = []
    for a in _write_actions(task):
        oid = a.arguments.get("order_id")
        if isinstance(oid, str) and oid in instr.reason_for_call and ("order", oid) not in found:
            found.append(("order", oid))
    for a in _write_actions(task):
        pm = a.arguments.get("payment_method_id")
        if isinstance(pm, str) and ("payment", pm) not in found:
            found.append(("payment", pm))
    return found


def clarify_task(task: Task, slot: Slot, value: str) -> Task:
    instr = task.user_scenario.instructions
    if not isinstance(instr, StructuredUserInstructions):
        raise ValueError(f"task {task.id}: only structured user instructions can be clarified")
    if slot == "order":
        reason = re.sub(rf"(your\s+)?order\s*{re.escape(value)}", "one of your orders", instr.reason_for_call)
        if value in reason:
            reason = reason.replace(value, "one of your orders")
        rule = (f"Your opening request must not say which order you mean. If the agent asks which order, "
                f"tell them it is order {value}.")
        goal = instr.reason_for_call
    else:
        reason = instr.reason_for_call
        phrase = _payment_phrase(value)
        rule = (f"You want any payment or refund to go through {phrase}. Do not mention how you want to pay "
                f"until the agent asks; when asked, say {phrase}.")
        goal = f"{instr.reason_for_call} Use {phrase} for any payment or refund."
    new_instr = instr.model_copy(update={"reason_for_call": reason,
                                         "task_instructions": f"{instr.task_instructions} {rule}"})
    info = Clarification(slot=slot, value=value, goal=goal, original_task_id=task.id)
    desc = (task.description or Description()).model_copy(update={"notes": NOTE_PREFIX + info.model_dump_json()})
    scenario = task.user_scenario.model_copy(update={"instructions": new_instr})
    return task.model_copy(update={"id": f"{task.id}[clarify:{slot}]", "user_scenario": scenario,
                                   "description": desc})


def make_clarification_tasks(tasks: Iterable[Task], seed: int = 0, *, keep_unclarifiable: bool = False) -> list[Task]:
    out = []
    for task in tasks:
        slots = candidate_slots(task)
        if not slots:
            if keep_unclarifiable:
                out.append(task)
            continue
        slot, value = random.Random(f"{seed}:{task.id}").choice(slots)
        out.append(clarify_task(task, slot, value))
    return out


def clarification_of(task: Task) -> Optional[Clarification]:
    """The recorded clarification (slot, withheld value, g*) of a transformed task, else None."""
    notes = task.description.notes if task.description else None
    if not notes or not notes.startswith(NOTE_PREFIX):
        return None
    return Clarification.model_validate(json.loads(notes[len(NOTE_PREFIX):]))


class ClarifyingScenarioUser(ModelClient):
    """A model-free user for clarification tasks: opens with the underspecified request, answers a
    question (an agent message ending in '?') with the withheld detail, otherwise stops."""

    spec = "clarifying-scenario-user"

    def __init__(self, task: Task) -> None:
        info = clarification_of(task)
        instr = task.user_scenario.instructions
        self._opening = instr.reason_for_call if isinstance(instr, StructuredUserInstructions) else str(instr)
        self._answer = None
        if info is not None:
            self._answer = (f"It is order {info.value}." if info.slot == "order"
                            else f"Please use {_payment_phrase(info.value)}.")
        self.calls = 0

    async def generate(self, messages: list[_Message], tools=None, params: SamplingParams | None = None,
                       tool_choice: ToolChoice | None = None) -> Turn:
        self.calls += 1
        last = messages[-1].text.strip() if messages else ""
        if self.calls == 1:
            text = self._opening
        elif last.endswith("?") and self._answer:
            text = self._answer
        else:
            text = STOP
        return Turn(message=AssistantMessage(content=text), model=self.spec, usage=Usage())
