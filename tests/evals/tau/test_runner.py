"""The τ batch runner through its Python API, on the small retail root of ``_support`` (real
domain, environment, orchestrator, evaluator and DuckDB store; the user simulators are small
ModelClients, or a real OpenAI-compatible client pointed at a dead port)."""

from __future__ import annotations

import asyncio
import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from closedloop.cli import main
from closedloop.evals.tau import load_domain
from closedloop.evals.tau.agents import make_agent_factory
from closedloop.evals.tau.eval_store import find_eval, load_episodes
from closedloop.evals.tau.orchestrator import STOP, agent_system_prompt
from closedloop.evals.tau.runner import EvalConfigError, EvalSettings, TauRunner, export_results, trial_seeds
from closedloop.evals.tau.simulation import SimulationRun, TerminationReason
from closedloop.messages import AssistantMessage, SystemMessage, Turn, Usage
from closedloop.models import make_client
from closedloop.models.base import ModelClient
from closedloop.store import RunStore, register_price

DEAD_SERVER = "openai:x@http://127.0.0.1:9/v1"


class SlowUser(ModelClient):
    """A stateless user: the reason for calling, then ``###STOP###``, each after ``delay_s``.

    Stateless (it counts its own earlier replies in the prompt), so one instance serves
    concurrent episodes, as one model server does; it records the seed of every call."""

    spec = "slow-user"

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.seeds: list[int | None] = []

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        self.seeds.append(params.seed if params is not None else None)
        await asyncio.sleep(self.delay_s)
        spoken = sum(1 for m in messages if m.role == "assistant")
        text = "I want to cancel order #W1." if spoken == 0 else STOP
        return Turn(message=AssistantMessage(content=text), model=self.spec,
                    usage=Usage(prompt_tokens=7, completion_tokens=3))


def _runner(root: Path, store: RunStore, name: str, user_for: Any, *, trials: int = 1, concurrency: int = 1,
            timeout: float | None = None, seed: int = 300, agents: Any = None, agent: str = "oracle",
            **kw: Any) -> TauRunner:
    data = load_domain("retail", root)
    taskset = data.load_tasks("base")
    settings = EvalSettings(name=name, domain="retail", split="base", data_dir=str(root),
                            task_file_sha256=taskset.sha256, agent=agent, trials=trials, concurrency=concurrency,
                            episode_timeout_s=timeout, seed=seed, **kw)
    oracle = make_agent_factory("oracle")
    return TauRunner(settings, taskset.tasks, data, store, agents=agents or (lambda trial: oracle), user_for=user_for)


def _interval(sim: SimulationRun) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(sim.start_time), datetime.fromisoformat(sim.end_time)


def _max_overlap(sims: list[SimulationRun]) -> int:
    events = sorted([(s, 1) for s, _ in map(_interval, sims)] + [(e, -1) for _, e in map(_interval, sims)],
                    key=lambda x: (x[0], x[1]))
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "runs.duckdb")


def test_trial_seeds_derive_from_the_master_seed():
    assert trial_seeds(300, 4)[:2] == trial_seeds(300, 2)  # more trials keep the first seeds
    assert len(set(trial_seeds(300, 4))) == 4
    assert trial_seeds(300, 2) != trial_seeds(301, 2)


async def test_concurrency_overlaps_episodes_and_records_each_once(mini_root, store):
    user = SlowUser(delay_s=0.15)
    report = await _runner(mini_root, store, "conc", lambda task: user, trials=2, concurrency=4).run()
    sims = report.simulations
    assert len(sims) == report.total == 8 and report.ran == 8
    assert {(s.task_id, s.trial) for s in sims} == {(t, k) for t in ("cancel", "cancel_nl", "cancel_action", "noop")
                                                     for k in (0, 1)}
    assert _max_overlap(sims) > 1
    wall = (max(_interval(s)[1] for s in sims) - min(_interval(s)[0] for s in sims)).total_seconds()
    assert wall < sum(s.duration for s in sims)
    # each trial's seed reached the user simulator's sampling
    seeds = trial_seeds(300, 2)
    assert sorted(set(user.seeds)) == sorted(seeds) and all(s.seed == seeds[s.trial] for s in sims)
    # the oracle scores 1 on every graded task; the NL task has no judge: listed, and a failure (tau2)
    m = report.metrics
    assert m.pass_hat_k == {1: 0.75, 2: 0.75} and m.num_tasks == {1: 4, 2: 4} and len(m.ungraded) == 2
    assert m.avg_reward == 1.0 and m.num_graded == 6
    assert report.summary["termination_reasons"] == {"user_stop": 8}
    assert report.summary["usage"]["user"]["prompt_tokens"] == 8 * 2 * 7
    parent = find_eval(store, "conc")
    assert parent.status == "completed" and parent.outcome["rewards"]["pass^2"] == 0.75
    assert parent.outcome["summary"]["conventions"] == {"gold_sync": False, "ungraded": "fail", "pass_k": "capped"}


async def test_a_running_eval_cannot_be_resumed_by_a_second_writer(mini_root, store):
    first = _runner(mini_root, store, "busy", lambda task: SlowUser(delay_s=0.3), concurrency=1)
    job = asyncio.ensure_future(first.run())
    while find_eval(store, "busy") is None:
        await asyncio.sleep(0.05)
    with pytest.raises(EvalConfigError, match="still running"):
        await _runner(mini_root, store, "busy", lambda task: SlowUser()).run()
    report = await job
    assert len(report.simulations) == 4 and find_eval(store, "busy").status == "completed"


async def test_summary_prices_usage_the_backend_left_unpriced(mini_root, store):
    register_price("runner-test-user-model", 1.0, 2.0)  # usd per million tokens
    report = await _runner(mini_root, store, "priced", lambda task: SlowUser(),
                           user_model="openai:runner-test-user-model").run()
    user = report.summary["usage"]["user"]
    assert user["prompt_tokens"] == 4 * 2 * 7 and user["completion_tokens"] == 4 * 2 * 3
    assert user["cost_usd"] == pytest.approx((56 * 1.0 + 24 * 2.0) / 1e6)
    assert report.summary["usage"]["agent"]["cost_usd"] is None  # the oracle used no model


async def test_concurrency_one_runs_episodes_one_at_a_time(mini_root, store):
    report = await _runner(mini_root, store, "serial", lambda task: SlowUser(0.05), concurrency=1).run()
    assert len(report.simulations) == 4 and _max_overlap(report.simulations) == 1


async def test_infrastructure_errors_are_listed_apart_and_rerun_on_resume(mini_root, store, tmp_path):
    dead = make_client(DEAD_SERVER)
    good = SlowUser()
    try:
        report = await _runner(mini_root, store, "infra",
                               lambda task: dead if task.id == "noop" else good, concurrency=2).run()
    finally:
        await dead.aclose()
    m = report.metrics
    noop = next(s for s in report.simulations if s.task_id == "noop")
    assert noop.termination_reason == TerminationReason.INFRASTRUCTURE_ERROR and "127.0.0.1:9" in noop.error
    assert m.infrastructure_errors == [noop.id]
    assert m.num_tasks[1] == 3 and m.pass_hat_k[1] == 2 / 3  # not counted (the ungraded NL task fails)
    assert [e["task_id"] for e in report.summary["infrastructure_errors"]] == ["noop"]
    parent = find_eval(store, "infra")
    statuses = {r.simulation.task_id: r.status for r in load_episodes(store, parent.id)}
    assert statuses["noop"] == "failed" and statuses["cancel"] == "completed"

    resumed = await _runner(mini_root, store, "infra", lambda task: good, concurrency=2).run(resume=True)
    assert resumed.ran == 1 and resumed.reused == 3 and resumed.resumed
    assert resumed.metrics.infrastructure_errors == [] and resumed.metrics.num_tasks[1] == 4
    assert len(load_episodes(store, parent.id)) == 5  # the failed attempt stays on record
    out = tmp_path / "results.json"
    n = export_results(store, "infra", load_domain("retail", mini_root).load_tasks("base").tasks, str(out))
    data = json.loads(out.read_text())
    assert n == 4 and len(data["simulations"]) == 4
    assert sorted(s["task_id"] for s in data["simulations"]) == ["cancel", "cancel_action", "cancel_nl", "noop"]
    assert all(s["termination_reason"] == "user_stop" for s in data["simulations"])


async def test_episode_timeout_cuts_a_hung_call(mini_root, store):
    report = await _runner(mini_root, store, "timeout", lambda task: SlowUser(delay_s=30), timeout=0.3,
                           concurrency=4).run()
    assert {s.termination_reason for s in report.simulations} == {TerminationReason.TIMEOUT}
    assert all(s.duration < 5 and s.reward_info.reward == 0.0 for s in report.simulations)
    assert report.metrics.pass_hat_k[1] == 0.0 and report.metrics.infrastructure_errors == []


async def test_resume_with_other_settings_is_refused(mini_root, store):
    await _runner(mini_root, store, "same", lambda task: SlowUser()).run()
    with pytest.raises(EvalConfigError, match="seed"):
        await _runner(mini_root, store, "same", lambda task: SlowUser(), seed=1).run()
    with pytest.raises(EvalConfigError, match="no evaluation named"):
        await _runner(mini_root, store, "absent", lambda task: SlowUser()).run(resume=True)


def test_gold_sync_is_a_resume_setting_and_evals_stored_before_it_synced(mini_root):
    settings = EvalSettings(name="g", domain="retail", agent="oracle")
    stored = settings.model_dump(mode="json")
    assert settings.differences(stored) == {}
    assert EvalSettings(name="g", domain="retail", agent="oracle", gold_sync=True).differences(stored) == \
        {"gold_sync": (False, True)}
    # a config stored before the setting existed was graded with a synced gold replay
    old = {k: v for k, v in stored.items() if k not in ("gold_sync", "ungraded", "pass_k")}
    assert settings.differences(old) == {"gold_sync": (True, False)}
    assert EvalSettings(name="g", domain="retail", agent="oracle", gold_sync=True).differences(old) == {}
    # the metric conventions only change what is computed from the stored episodes: no refusal
    assert EvalSettings(name="g", domain="retail", agent="oracle", ungraded="exclude").differences(stored) == {}


async def test_our_conventions_by_name_change_the_metrics_and_are_recorded(mini_root, store, tmp_path):
    report = await _runner(mini_root, store, "ours", lambda task: SlowUser(), trials=2, ungraded="exclude",
                           pass_k="per-task").run()
    m = report.metrics
    assert m.pass_hat_k == {1: 1.0, 2: 1.0} and m.num_tasks == {1: 3, 2: 3}  # the unjudged NL task left out
    assert report.summary["conventions"] == {"gold_sync": False, "ungraded": "exclude", "pass_k": "per-task"}
    out = tmp_path / "results.json"
    export_results(store, "ours", load_domain("retail", mini_root).load_tasks("base").tasks, str(out))
    assert json.loads(out.read_text())["info"]["conventions"] == report.summary["conventions"]
    # rerun under tau2's conventions: the same stored episodes, tau2's figures
    again = await _runner(mini_root, store, "ours", lambda task: SlowUser(), trials=2).run()
    assert again.ran == 0 and again.metrics.pass_hat_k == {1: 0.75, 2: 0.75}
    # an evaluation stored before gold_sync existed was graded with it, and its export says so
    parent = find_eval(store, "ours")
    store.reopen_run(parent.id, {k: v for k, v in parent.config.items() if k not in ("gold_sync", "ungraded", "pass_k")})
    store.finish_run(parent.id, "completed", {})
    export_results(store, "ours", load_domain("retail", mini_root).load_tasks("base").tasks, str(out))
    assert json.loads(out.read_text())["info"]["conventions"] == {"gold_sync": True, "ungraded": "fail",
                                                                  "pass_k": "capped"}


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("workers", [0, 1])
async def test_gold_sync_reaches_grading_here_and_in_worker_processes(tmp_path, workers):
    """Telecom tasks whose user surroundings change on sync: the oracle reaches the gold actions'
    live state, which tau2's unsynced gold state is not (db_match false, reward 1); with
    ``gold_sync`` db_match is true, whether grading runs here or in a worker process."""
    from closedloop.evals.tau.oracle import ScenarioUser

    data = load_domain("telecom", FIXTURES, tau2_source=False)
    taskset = data.load_tasks("train")
    expected = json.loads((FIXTURES / "expected.json").read_text())["telecom"]["tasks"]
    tasks = [t for t in taskset.tasks if expected[t.id]["evaluator"]["db_match"] is False][:2]
    assert len(tasks) == 2
    store = RunStore(tmp_path / "runs.duckdb")
    oracle = make_agent_factory("oracle")
    for gold_sync in (False, True):
        settings = EvalSettings(name=f"sync-{gold_sync}", domain="telecom", split="train", data_dir=str(FIXTURES),
                                task_file_sha256=taskset.sha256, agent="oracle", workers=workers, gold_sync=gold_sync)
        report = await TauRunner(settings, tasks, data, store, agents=lambda trial: oracle,
                                 user_for=ScenarioUser).run()
        infos = [s.reward_info for s in report.simulations]
        assert [i.db_check.db_match for i in infos] == [gold_sync] * 2 and [i.reward for i in infos] == [1.0] * 2


async def test_cancel_marks_interrupted_keeps_finished_episodes_and_resume_completes(mini_root, store):
    runner = _runner(mini_root, store, "cancel", lambda task: SlowUser(delay_s=0.1), trials=2, concurrency=2)
    first = asyncio.Event()
    runner.on_episode = lambda sim, progress: first.set()
    job = asyncio.ensure_future(runner.run())
    await asyncio.wait_for(first.wait(), 30)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    parent = find_eval(store, "cancel")
    kept = load_episodes(store, parent.id)
    assert parent.status == "interrupted" and 1 <= len(kept) < 8
    report = await _runner(mini_root, store, "cancel", lambda task: SlowUser(), trials=2, concurrency=2).run()
    assert report.ran == 8 - len(kept) and report.reused == len(kept)
    records = load_episodes(store, parent.id)
    assert len(records) == 8 and len({r.key for r in records}) == 8
    after = find_eval(store, "cancel")
    assert after.status == "completed" and after.metadata["attempts"] == 2


@pytest.fixture(scope="module")
def tiny_model(request) -> Path:
    """An untrained tiny chat model (real tokenizer, template and weights), cached across runs; the
    context is long enough for the retail tool schemas."""
    pytest.importorskip("closedloop.models.hf")
    from closedloop.models.tiny import TINY_CONFIG_FILE, build_tiny_model

    cached = Path(request.config.cache.mkdir("closedloop-tiny-untrained-ctx8k"))
    if not (cached / TINY_CONFIG_FILE).exists():
        staging = cached.with_name(cached.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny_model(staging, seed=0, train_steps=0, max_position_embeddings=8192)
        shutil.rmtree(cached)
        staging.rename(cached)
    return cached


@pytest.mark.slow
async def test_react_graph_with_a_real_model_is_recorded_token_exactly(mini_root, store, tiny_model, capsys):
    from closedloop.models.hf import HFClient

    client = HFClient.from_pretrained(tiny_model)
    from closedloop.models import SamplingParams

    def agents(trial: int):
        return make_agent_factory("react", client, params=SamplingParams(temperature=0.0, max_tokens=24,
                                                                         seed=trial_seeds(300, 1)[trial]))

    data = load_domain("retail", mini_root)
    tasks = data.load_tasks("train")
    settings = EvalSettings(name="react", domain="retail", split="train", task_file_sha256=tasks.sha256,
                            agent="react", model=f"hf:{tiny_model}", trials=1, concurrency=2, max_steps=6)
    from closedloop.evals.tau.oracle import ScenarioUser

    try:
        report = await TauRunner(settings, tasks.tasks, data, store, agents=agents, user_for=ScenarioUser).run()
    finally:
        await client.aclose()
    assert len(report.simulations) == 2 and report.metrics.infrastructure_errors == []
    parent = find_eval(store, "react")
    assert parent.graph == "react" and parent.model_spec == f"hf:{tiny_model}"
    for rec in load_episodes(store, parent.id):
        sim = rec.simulation
        assert sim.agent_turns, "the graph returned Turns"
        run = store.get_run(rec.run_id)
        assert run.parent_id == parent.id and len(run.turns) == len(sim.agent_turns)
        assert len(run.messages) == len(sim.messages)
        for stored, turn in zip(run.turns, sim.agent_turns):
            assert stored.prompt_ids == turn.prompt_ids and stored.completion_ids == turn.completion_ids
            assert stored.prompt_ids and stored.logprobs == turn.logprobs
            assert client.decode(stored.completion_ids) == stored.completion_text
        assert run.prompt_tokens == sum(len(t.prompt_ids) for t in sim.agent_turns)
        # the first prompt is exactly the agent's view: tau2's system prompt with the policy, the
        # greeting and the user's opening, with the environment's tool schemas
        env = data.make_environment()
        view = [SystemMessage(content=agent_system_prompt(env.policy)), *sim.messages[:2]]
        assert run.turns[0].prompt_ids == client.encode_prompt(view, [t.schema for t in env.tool_list])
    rid = load_episodes(store, parent.id)[0].run_id
    capsys.readouterr()
    assert main(["runs", "show", rid, "--store", str(store.path)]) == 0
    shown = capsys.readouterr().out
    assert "kind=episode" in shown and "turns (" in shown and "termination_reason" in shown
