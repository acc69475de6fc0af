"""An agent whose prompt outgrows its model's context: tau2's ``context_window_exceeded``
termination, scored 0, counted in pass^k, and not run again on resume (an infrastructure error
would be dropped from the metrics and re-run, which inflates scores)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from closedloop.evals.tau import load_domain
from closedloop.evals.tau.agents import make_agent_factory
from closedloop.evals.tau.eval_store import find_eval, load_episodes
from closedloop.evals.tau.orchestrator import STOP, is_context_overflow
from closedloop.evals.tau.runner import EvalSettings, TauRunner, export_results
from closedloop.evals.tau.simulation import TerminationReason
from closedloop.messages import AssistantMessage, Turn
from closedloop.models import ContextLengthExceededError, ModelError
from closedloop.models.base import ModelClient
from closedloop.store import RunStore


class StopUser(ModelClient):
    spec = "stop-user"

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        spoken = sum(1 for m in messages if m.role == "assistant")
        return Turn(message=AssistantMessage(content="I want to cancel order #W1." if spoken == 0 else STOP))


def _runner(root: Path, store: RunStore, calls: list[str]) -> TauRunner:
    data = load_domain("retail", root)
    taskset = data.load_tasks("base")
    oracle = make_agent_factory("oracle")

    def factory(task):
        if task.id != "cancel":
            return oracle(task)

        async def overflowing(messages, tools):
            calls.append(task.id)
            raise ContextLengthExceededError("prompt of 40000 tokens exceeds the context (32768)",
                                             prompt_tokens=40000, limit=32768)
        return overflowing

    settings = EvalSettings(name="ctx", domain="retail", split="base", data_dir=str(root),
                            task_file_sha256=taskset.sha256, agent="oracle", trials=1)
    return TauRunner(settings, taskset.tasks, data, store, agents=lambda trial: factory,
                     user_for=lambda task: StopUser())


async def test_overflow_is_scored_counted_and_not_rerun(mini_root, tmp_path):
    store = RunStore(tmp_path / "runs.duckdb")
    calls: list[str] = []
    report = await _runner(mini_root, store, calls).run()
    sim = next(s for s in report.simulations if s.task_id == "cancel")
    assert sim.termination_reason == TerminationReason.CONTEXT_WINDOW_EXCEEDED
    assert sim.reward_info is not None and sim.reward_info.reward == 0.0
    assert sim.reward_info.info["note"] == "Simulation terminated prematurely. Termination reason: context_window_exceeded"
    m = report.metrics
    assert m.infrastructure_errors == [] and sim.id not in m.ungraded
    assert len(m.ungraded) == 1  # the NL task, no judge here: a failure in pass^k, as in tau2
    assert m.num_tasks[1] == len(report.simulations) and m.num_graded == len(report.simulations) - 1
    assert m.pass_hat_k[1] == (len(report.simulations) - 2) / len(report.simulations)  # the overflow fails too
    parent = find_eval(store, "ctx")
    assert {r.simulation.task_id: r.status for r in load_episodes(store, parent.id)}["cancel"] == "completed"

    resumed = await _runner(mini_root, store, calls).run(resume=True)
    assert resumed.ran == 0 and calls == ["cancel"]  # not run again
    out = tmp_path / "results.json"
    export_results(store, "ctx", load_domain("retail", mini_root).load_tasks("base").tasks, str(out))
    exported = next(s for s in json.loads(out.read_text())["simulations"] if s["task_id"] == "cancel")
    assert exported["termination_reason"] == "context_window_exceeded"
    assert exported["reward_info"]["reward"] == 0.0 and exported["reward_info"]["reward_basis"] is None


def test_openai_style_overflow_is_recognised_through_the_cause_chain():
    class BadRequest(Exception):
        code = "context_length_exceeded"

    try:
        try:
            raise BadRequest("This model's maximum context length is 8192 tokens")
        except BadRequest as inner:
            raise ModelError("the server refused the request") from inner
    except ModelError as outer:
        assert is_context_overflow(outer)
    assert not is_context_overflow(ModelError("connection refused"))
    assert not is_context_overflow(asyncio.TimeoutError())
