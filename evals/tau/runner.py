"""The τ batch runner: every (task, trial) episode of an evaluation, concurrently, recorded as it ends.

Why it is shaped this way:

* **Concurrency** is a pool of ``concurrency`` asyncio workers pulling episodes (trial-major, as
  tau2 does, so an interrupted run has whole early trials); the pool, the serialised writes and
  the settings-change refusal are the benchmark-independent :mod:`closedloop.evals.harness`,
  and an evaluation name is claimed by one live process at a time (``EvalClaim``). Model calls overlap; the CPU-bound
  parts (DB replays in grading) run on the loop and do not.
* **Crash safety**: an episode is written to the run store in one transaction only once it has
  ended and been graded (:func:`~closedloop.evals.tau.eval_store.record_episode`). A SIGKILL loses
  only the episodes in flight, which have no row and therefore run again on resume; a finished
  episode is never lost and never run twice. Writes are serialised (one writer at a time, in a
  thread) and shielded from cancellation, so Ctrl-C never abandons a finished episode.
* **Resume**: the eval is identified by its name. Reopening it loads the stored (task, trial)
  pairs and runs only the missing ones, plus those that must be re-run (infrastructure errors,
  grading failures; they stay in the store as failed children).
* **Seeds** derive from one master seed as in tau2: ``random.Random(seed)`` draws one seed per
  trial, passed to the agent's and the user's sampling.
* **Timeouts**: ``episode_timeout_s`` is checked by the orchestrator between steps and enforced
  mid-call by cancellation; either way the episode ends as ``timeout`` (scored 0, as tau2) with
  the messages it had.
* **Conventions** (:mod:`~closedloop.evals.tau.conventions`): tau2's unless the settings name ours
  (``gold_sync``, ``ungraded``, ``pass_k``); the summary and the export record which.
* **Executor** (:mod:`closedloop.evals.harness.executor`): episodes run in this process (``local``)
  or as Ray tasks (``ray``). One episode is :class:`EpisodeRunner`'s work either way; on Ray a
  worker builds its own from the settings (:func:`episode_parts`: clients from the model specs,
  the domain from its data root) and sends the finished, graded :class:`SimulationRun` back, and
  the driver writes it as above. The store, the claim and the plan never leave the driver.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, Field

from closedloop.evals.harness import (BatchRunner, EvalBusyError, EvalClaim, Executor, ItemWork, LocalExecutor,
                                      Resources, settings_differences)
from closedloop.evals.tau.agents import AgentFactory, make_agent_factory
from closedloop.evals.tau.conventions import Conventions, PassKRule, UngradedRule
from closedloop.evals.tau.data import DomainData, load_domain
from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.eval_store import (EpisodeRecord, find_eval, latest_episodes, load_episodes, needs_rerun,
                                             open_eval, record_episode, reopen_eval)
from closedloop.evals.tau.evaluator import evaluate
from closedloop.evals.tau.metrics import TauMetrics, compute_metrics
from closedloop.evals.tau.orchestrator import Orchestrator, UserGuidelines, make_user
from closedloop.evals.tau.results import RunInfo, write_results
from closedloop.evals.tau.simulation import SimulationRun, TerminationReason
from closedloop.messages import Usage
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.store import RunStateError, RunStore, pricing

__all__ = ["EvalSettings", "EvalProgress", "EvalReport", "EvalConfigError", "EpisodeParts", "EpisodeRunner",
           "TauRunner", "episode_parts", "run_remote_episode", "trial_seeds", "summarize", "export_results",
           "RESUME_KEYS"]

# Settings that change what an episode is; a resume with different values would mix two evals.
RESUME_KEYS = ("domain", "split", "task_file_sha256", "agent", "model", "user_model", "judge_model", "seed",
               "max_steps", "max_errors", "clarify", "temperature", "max_tokens", "user_temperature", "gold_sync")
# Evaluations stored before a setting existed were run the way these values say.
_STORED_BEFORE = {"gold_sync": True}  # the gold replay synced until tau2's unsynced replay became the default


class EvalConfigError(ValueError):
    """Bad settings, or a resume whose settings differ from the stored evaluation's."""


def trial_seeds(seed: int, trials: int) -> list[int]:
    """tau2's derivation: ``random.seed(seed)`` then one ``randint(0, 1_000_000)`` per trial, so the
    first k seeds are the same whatever the number of trials."""
    rng = random.Random(seed)
    return [rng.randint(0, 1_000_000) for _ in range(trials)]


class EvalSettings(BaseModel):
    """Everything that defines an evaluation; stored as the parent run's config."""

    name: str
    domain: str
    split: str | None = None
    data_dir: str | None = None
    task_file_sha256: str = ""
    task_ids: list[str] | None = None
    agent: str
    model: str | None = None
    user_model: str | None = None  # None: the model-free scenario user
    judge_model: str | None = None
    trials: int = Field(1, ge=1)
    concurrency: int = Field(1, ge=1)
    max_steps: int = Field(200, ge=1)
    max_errors: int = Field(10, ge=1)
    episode_timeout_s: float | None = Field(None, gt=0)
    seed: int = 300
    clarify: bool = False
    temperature: float | None = None
    max_tokens: int | None = None
    user_temperature: float = 0.0  # tau2 samples the user at temperature 0
    workers: int | None = Field(None, ge=0)  # grading processes (tau2 --workers); None: by concurrency, 0: none
    gold_sync: bool = False  # conventions (closedloop.evals.tau.conventions); the defaults are tau2's
    ungraded: UngradedRule = "fail"
    pass_k: PassKRule = "capped"
    executor: str = "local"  # where episodes ran (recorded; a resume may use another)

    @property
    def seeds(self) -> list[int]:
        return trial_seeds(self.seed, self.trials)

    @property
    def conventions(self) -> Conventions:
        return Conventions(gold_sync=self.gold_sync, ungraded=self.ungraded, pass_k=self.pass_k)

    def differences(self, stored: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        return settings_differences({**_STORED_BEFORE, **stored}, self.model_dump(mode="json"), RESUME_KEYS)


@dataclass
class EvalProgress:
    """Shown while running: episodes done of the total, and the running average reward."""

    total: int
    done: int = 0
    graded: int = 0
    reward_sum: float = 0.0
    infra_errors: int = 0

    @property
    def avg_reward(self) -> float | None:
        return self.reward_sum / self.graded if self.graded else None

    def add(self, sim: SimulationRun) -> None:
        self.done += 1
        if sim.termination_reason == TerminationReason.INFRASTRUCTURE_ERROR:
            self.infra_errors += 1
        elif sim.reward_info is not None and sim.reward_info.reward is not None:
            self.graded += 1
            self.reward_sum += sim.reward_info.reward


@dataclass
class EvalReport:
    """The evaluation as stored after this invocation (all attempts together)."""

    parent_id: str
    name: str
    status: str
    simulations: list[SimulationRun]
    metrics: TauMetrics
    summary: dict[str, Any]
    ran: int  # episodes run by this invocation
    reused: int  # episodes found in the store and not run again
    total: int  # (task, trial) pairs in the plan
    wall_s: float
    resumed: bool = False


def _usage_dict(u: Usage, model: str | None) -> dict[str, Any]:
    cost = u.cost_usd
    if cost is None and model and (u.prompt_tokens or u.completion_tokens):
        cost = pricing.cost_usd(model, u.prompt_tokens, u.completion_tokens)  # as the store prices turns
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "cost_usd": cost}


def summarize(sims: list[SimulationRun], metrics: TauMetrics, *, agent_model: str | None = None,
              user_model: str | None = None, judge_model: str | None = None) -> dict[str, Any]:
    """Counts and costs for the summary table and the parent run's outcome. Usage the backend did
    not price is priced from the model specs (``closedloop.store.pricing``), or left unknown."""
    agent, user, judge = Usage(), Usage(), Usage()
    for s in sims:
        agent, user = agent + s.agent_usage, user + s.user_usage
        if s.reward_info is not None and s.reward_info.judge_usage is not None:
            judge = judge + s.reward_info.judge_usage
    usage = {"agent": _usage_dict(agent, agent_model), "user": _usage_dict(user, user_model),
             "judge": _usage_dict(judge, judge_model)}
    costs = [u["cost_usd"] for u in usage.values() if u["cost_usd"] is not None]
    return {
        "episodes": len(sims),
        "conventions": metrics.conventions.model_dump(),
        "avg_reward": metrics.avg_reward,
        "pass_hat_k": {str(k): v for k, v in metrics.pass_hat_k.items()},
        "num_tasks": {str(k): v for k, v in metrics.num_tasks.items()},
        "termination_reasons": dict(Counter(s.termination_reason.value for s in sims)),
        "infrastructure_errors": [{"task_id": s.task_id, "trial": s.trial, "error": s.error} for s in sims
                                  if s.termination_reason == TerminationReason.INFRASTRUCTURE_ERROR],
        "ungraded": len(metrics.ungraded),
        "ungraded_reasons": dict(Counter(_ungraded_reason(s) for s in sims if s.reward_info is not None
                                         and s.reward_info.reward is None
                                         and s.termination_reason != TerminationReason.INFRASTRUCTURE_ERROR)),
        "db": {"checked": sum(1 for s in sims if s.reward_info is not None and s.reward_info.db_check is not None),
               "matched": sum(1 for s in sims if s.reward_info is not None and s.reward_info.db_check is not None
                              and s.reward_info.db_check.db_match)},
        "usage": usage,
        "cost_usd": sum(costs) if costs else None,
        "mean_duration_s": sum(s.duration for s in sims) / len(sims) if sims else None,
    }


def _ungraded_reason(sim: SimulationRun) -> str:
    """Why an episode has no reward, as one phrase: each ungraded component and its reason."""
    assert sim.reward_info is not None
    not_graded = sim.reward_info.not_graded or {}
    return "; ".join(f"{getattr(k, 'value', k)} {v}" for k, v in sorted(not_graded.items(), key=lambda kv: str(kv[0]))) \
        or "no reward recorded"


TrialAgents = Callable[[int], AgentFactory]  # trial index -> (task -> agent); per trial for its seed
UserFactory = Callable[[Task], ModelClient]


class EpisodeRunner:
    """One episode of an evaluation, run and graded: the work an executor places (this process, or a
    Ray worker that built its own from the settings).

    ``agents(trial)`` returns the agent factory for a trial (its sampling seed differs);
    ``user_for(task)`` the user simulator's client for an episode (one shared model client, or a
    fresh model-free user per episode). ``workers``: grading processes (``None``: the settings').
    """

    def __init__(self, settings: EvalSettings, data: DomainData, *, agents: TrialAgents, user_for: UserFactory,
                 judge: ModelClient | None = None, guidelines: str | UserGuidelines | None = None,
                 workers: int | None = None) -> None:
        self.settings, self.data, self.agents, self.user_for = settings, data, agents, user_for
        self.judge, self.guidelines = judge, guidelines
        self._seeds = settings.seeds
        self._workers_setting = workers if workers is not None else settings.workers
        self._pool: Any = None  # GradingPool, started with the first episode when settings ask for workers

    async def _simulate(self, task: Task, trial: int) -> SimulationRun:
        s, seed = self.settings, self._seeds[trial]
        env = await asyncio.to_thread(self.data.make_environment)  # CPU-bound: see _grade
        user_params = SamplingParams(temperature=s.user_temperature, max_tokens=1024, logprobs=False, seed=seed)
        user = make_user(task, self.user_for(task), guidelines=self.guidelines, params=user_params, seed=seed)
        orch = Orchestrator(task, env, user, domain=self.data.name, max_steps=s.max_steps, max_errors=s.max_errors,
                            timeout_s=s.episode_timeout_s, seed=seed, trial=trial)
        agent = self.agents(trial)(task)

        async def drive() -> None:
            await orch.start()
            while not orch.done:
                try:
                    output = await agent(orch.agent_messages(), orch.tools)
                except Exception as e:  # the orchestrator decides: infrastructure or agent error
                    orch.fail_agent(e)
                    break
                await orch.submit(output)

        try:
            await asyncio.wait_for(drive(), s.episode_timeout_s)
        except TimeoutError:
            if not orch.done:  # cut mid-call; the orchestrator only checks between steps
                orch.done, orch.termination = True, TerminationReason.TIMEOUT
                orch.error = f"episode exceeded {s.episode_timeout_s:g} s"
        return orch.result()

    async def episode(self, task: Task, trial: int) -> SimulationRun:
        """The finished, graded episode; a harness or grading failure is part of the result."""
        try:
            sim = await self._simulate(task, trial)
        except Exception as e:  # a harness failure is not the agent's: listed apart, re-run on resume
            sim = SimulationRun(task_id=task.id, domain=self.data.name, trial=trial, seed=self._seeds[trial],
                                termination_reason=TerminationReason.INFRASTRUCTURE_ERROR,
                                error=f"harness: {type(e).__name__}: {e}", task_file_sha256=task.source_sha256)
        try:
            sim.reward_info = await self._grade(sim, task)
        except Exception as e:  # e.g. the judge server failed: stored as failed, graded on resume
            sim.reward_info = None
            sim.error = f"grading failed: {type(e).__name__}: {e}"
        return sim

    def _workers(self) -> int:
        workers = self._workers_setting
        if workers is None:
            from closedloop.evals.tau.workers import default_workers
            workers = default_workers(self.settings.concurrency)
        return workers

    def start_pool(self) -> None:
        """Start the grading processes before the first episode: their start-up (interpreter,
        imports, DB) then overlaps the first episodes' model calls instead of delaying their grades."""
        if self._pool is None and self._workers() > 0:
            from closedloop.evals.tau.workers import GradingPool
            self._pool = GradingPool.for_data(self.data, self._workers(),
                                              grade_options={"gold_sync": self.settings.gold_sync})
            self._pool.start()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    async def _grade(self, sim: SimulationRun, task: Task) -> Any:
        if self._workers() > 0:  # in processes (closedloop.evals.tau.workers): grading no longer holds this GIL
            self.start_pool()
            return await self._pool.grade(sim, task, self.judge)
        return await self._grade_here(sim, task)

    async def _grade_here(self, sim: SimulationRun, task: Task) -> Any:
        """Grading builds fresh environments and replays DBs: hundreds of ms of CPU on the retail DB.
        On the event loop that would stall every other episode's model calls (at concurrency 32 a
        single loop iteration could run for seconds, long enough for HTTP connects to time out),
        so without a judge it runs in a worker thread with its own loop; the loop thread then gets
        the GIL between the worker's calls. A judge is an async client bound to this loop, so with
        one, grading stays here."""
        gold_sync = self.settings.gold_sync
        if self.judge is not None:
            return await evaluate(sim, task, self.data.make_environment, self.judge, gold_sync=gold_sync)
        return await asyncio.to_thread(lambda: asyncio.run(evaluate(sim, task, self.data.make_environment, None,
                                                                    gold_sync=gold_sync)))


@dataclass
class EpisodeParts:
    """The model-facing parts of an evaluation built from its settings, and the clients to close."""

    agents: TrialAgents
    user_for: UserFactory
    judge: ModelClient | None
    clients: list[ModelClient]

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()


def episode_parts(settings: EvalSettings) -> EpisodeParts:
    """Agents, users and judge as ``closedloop eval tau`` runs them: clients from the settings' model
    specs (``user_model`` None: the model-free scenario user, clarifying with ``clarify``), one
    agent factory per trial with that trial's sampling seed."""
    from closedloop.models import make_client

    oracle = settings.agent == "oracle"
    agent_client = None if oracle or settings.model is None else make_client(settings.model)
    user_client = None if settings.user_model is None else make_client(settings.user_model)
    judge = make_client(settings.judge_model) if settings.judge_model else None
    factories: dict[int, AgentFactory] = {}

    def agents(trial: int) -> AgentFactory:
        if trial not in factories:
            given = {"temperature": settings.temperature, "max_tokens": settings.max_tokens}
            params = None if oracle else SamplingParams(**{k: v for k, v in given.items() if v is not None},
                                                        seed=settings.seeds[trial])
            factories[trial] = make_agent_factory(settings.agent, agent_client, params=params)
        return factories[trial]

    def user_for(task: Task) -> ModelClient:
        if user_client is not None:
            return user_client
        if settings.clarify:
            from closedloop.evals.tau.clarify import ClarifyingScenarioUser

            return ClarifyingScenarioUser(task)
        from closedloop.evals.tau.oracle import ScenarioUser

        return ScenarioUser(task)

    return EpisodeParts(agents, user_for, judge, [c for c in (agent_client, user_client, judge) if c is not None])


@dataclass(frozen=True)
class RemoteEpisode:
    """What a Ray task is sent for one episode (pickled): the settings, where the domain's data is,
    the user guidelines, the task (clarified ones included) and the trial. It comes back as the
    graded :class:`SimulationRun`."""

    settings: EvalSettings
    domain: tuple[str, str, dict]  # (name, data root, options): load_domain's arguments
    guidelines: str | UserGuidelines | None
    task: Task
    trial: int


_WORKER_EPISODES: dict[str, EpisodeRunner] = {}
_WORKER_DOMAINS: dict[str, DomainData] = {}


async def run_remote_episode(job: RemoteEpisode) -> SimulationRun:
    """One episode in a Ray worker. The worker loads a domain's data once (DB parsed once) and builds
    an :class:`EpisodeRunner` (clients) once per evaluation, then reuses them for every episode it
    is sent; grading runs here, in the episode's own CPU slot (no grading processes in a worker)."""
    key = f"{job.settings.model_dump_json()}|{job.domain!r}|{job.guidelines!r}"
    runner = _WORKER_EPISODES.get(key)
    if runner is None:
        name, root, options = job.domain
        data = _WORKER_DOMAINS.get(repr(job.domain))
        if data is None:
            data = _WORKER_DOMAINS[repr(job.domain)] = load_domain(name, root, options=options)
        parts = episode_parts(job.settings)
        runner = EpisodeRunner(job.settings, data, agents=parts.agents, user_for=parts.user_for, judge=parts.judge,
                               guidelines=job.guidelines, workers=0)
        _WORKER_EPISODES.clear()  # one evaluation at a time per worker: the previous one's clients go
        _WORKER_EPISODES[key] = runner
    return await runner.episode(job.task, job.trial)


class TauRunner:
    """Runs (or resumes) one named evaluation against a run store.

    The episode's parts are :class:`EpisodeRunner`'s (``agents``, ``user_for``, ``judge``,
    ``guidelines``); :meth:`from_settings` builds them from the settings' model specs, which is
    what an ``executor`` other than local needs (its workers build their own the same way).
    ``on_episode(sim, progress)`` is called after each episode has been written; ``on_plan(progress)``
    once, before the first one starts.
    """

    def __init__(self, settings: EvalSettings, tasks: list[Task], data: DomainData, store: RunStore, *,
                 agents: TrialAgents, user_for: UserFactory, judge: ModelClient | None = None,
                 guidelines: str | UserGuidelines | None = None,
                 on_episode: Callable[[SimulationRun, EvalProgress], None] | None = None,
                 on_plan: Callable[[EvalProgress], None] | None = None, executor: Executor | None = None,
                 remote: bool = False, clients: list[ModelClient] | None = None) -> None:
        if not tasks:
            raise EvalConfigError("no tasks to run")
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            raise EvalConfigError(f"duplicate task ids: {sorted({i for i in ids if ids.count(i) > 1})}")
        self.settings, self.tasks, self.data, self.store = settings, tasks, data, store
        self.guidelines = guidelines
        self.on_episode, self.on_plan = on_episode, on_plan
        self.executor: Executor = executor or LocalExecutor()
        if not self.executor.in_process and not remote:
            raise EvalConfigError(f"episodes with in-process agents cannot run on the {self.executor.name} executor; "
                                  "build the runner with TauRunner.from_settings (model specs)")
        self.episodes = EpisodeRunner(settings, data, agents=agents, user_for=user_for, judge=judge,
                                      guidelines=guidelines)
        self._remote = remote  # the parts can be rebuilt from the settings (from_settings)
        self._clients = list(clients or [])
        self.parent_id: str | None = None
        self._ran = 0

    @classmethod
    def from_settings(cls, settings: EvalSettings, tasks: list[Task], data: DomainData, store: RunStore, *,
                      guidelines: str | UserGuidelines | None = None, executor: Executor | None = None,
                      **kw: Any) -> "TauRunner":
        """A runner whose agents, users and judge come from the settings' model specs
        (:func:`episode_parts`), so its episodes can run on any executor. On a remote executor no
        model client is built here: the workers build theirs."""
        executor = executor or LocalExecutor()
        settings = settings.model_copy(update={"executor": executor.name})
        if executor.in_process:
            parts = episode_parts(settings)
            return cls(settings, tasks, data, store, agents=parts.agents, user_for=parts.user_for, judge=parts.judge,
                       guidelines=guidelines, executor=executor, remote=True, clients=parts.clients, **kw)

        def unused(_: Any) -> Any:
            raise RuntimeError("episodes of this evaluation run on the executor's workers")

        return cls(settings, tasks, data, store, agents=unused, user_for=unused, guidelines=guidelines,
                   executor=executor, remote=True, **kw)

    def _work(self) -> ItemWork[tuple[Task, int], SimulationRun]:
        """An episode for the executor: here, or (built from the settings) in a Ray task asking
        ``executor.config.resources`` (default: one CPU slot, for grading)."""
        domain = (self.data.name, str(self.data.folder.parents[2]), dict(self.data.options))
        resources = self.executor.config.resources or Resources()
        return ItemWork(local=lambda item: self.episodes.episode(*item),
                        remote=run_remote_episode if self._remote else None,
                        payload=lambda item: RemoteEpisode(self.settings, domain, self.guidelines, item[0], item[1]),
                        resources=lambda item: resources)

    # ------------------------------------------------------------------ the parent run

    async def _open(self, resume: bool) -> tuple[str, list[EpisodeRecord], bool]:
        s = self.settings
        config = s.model_dump(mode="json")
        existing = await asyncio.to_thread(find_eval, self.store, s.name)
        if existing is None:
            if resume:
                raise EvalConfigError(f"no evaluation named {s.name!r} in {self.store.path} to resume")
            run_id = await asyncio.to_thread(open_eval, self.store, s.name, config, graph=s.agent, model_spec=s.model)
            return run_id, [], False
        diff = s.differences(existing.config)
        if diff:
            lines = ", ".join(f"{k}: stored {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise EvalConfigError(f"evaluation {s.name!r} exists with other settings ({lines}); "
                                  f"use another --name or the same settings")
        records = await asyncio.to_thread(load_episodes, self.store, existing.id)
        try:
            await asyncio.to_thread(reopen_eval, self.store, existing.id, config)
        except RunStateError as e:
            raise EvalConfigError(str(e)) from None
        return existing.id, records, True

    def _record(self, sim: SimulationRun) -> None:
        assert self.parent_id is not None  # _run opens the parent before any episode is written
        record_episode(self.store, self.parent_id, sim, eval_name=self.settings.name, graph=self.settings.agent,
                       model_spec=self.settings.model)

    # ------------------------------------------------------------------ the evaluation

    async def run(self, *, resume: bool = False) -> EvalReport:
        """Run the missing episodes; the parent ends ``completed``, or ``interrupted`` on
        cancellation/Ctrl-C, or ``failed`` on an unexpected error (then the error propagates).
        Refused (``EvalConfigError``) while another live process runs the same evaluation name."""
        claim = EvalClaim(self.store.path, self.settings.name)
        try:
            claim.acquire()
        except EvalBusyError as e:
            raise EvalConfigError(str(e)) from None
        try:
            return await self._run(resume)
        finally:
            claim.release()
            self.episodes.close()
            for client in self._clients:
                await client.aclose()
            self._clients = []

    async def _run(self, resume: bool) -> EvalReport:
        start = time.perf_counter()
        s = self.settings
        self.parent_id, records, resumed = await self._open(resume)
        done = {r.key for r in latest_episodes(records) if not needs_rerun(r.simulation)}
        plan = [(t, k) for k in range(s.trials) for t in self.tasks]
        queue = [(t, k) for t, k in plan if (t.id, k) not in done]
        reused = len(plan) - len(queue)
        progress = EvalProgress(total=len(plan))
        planned = {(t.id, k) for t, k in plan}
        for rec in latest_episodes(records):
            if rec.key in done and rec.key in planned:
                progress.add(rec.simulation)
        if self.on_plan is not None:
            self.on_plan(progress)

        def after_write(sim: SimulationRun) -> None:
            self._ran += 1
            progress.add(sim)
            if self.on_episode is not None:
                self.on_episode(sim, progress)

        batch: BatchRunner[tuple[Task, int], SimulationRun] = BatchRunner(
            self._work(), self._record, concurrency=s.concurrency, after_write=after_write, executor=self.executor)
        if queue and self.executor.in_process:
            self.episodes.start_pool()
        try:
            await batch.run(queue)
        except BaseException as exc:
            interrupted = isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt))
            status = "interrupted" if interrupted else "failed"
            report = await self._report(status, self._ran, reused, len(plan), start, resumed)
            await asyncio.to_thread(self.store.finish_run, self.parent_id, status, {"summary": report.summary},
                                    None if interrupted else exc)
            raise
        report = await self._report("completed", self._ran, reused, len(plan), start, resumed)
        outcome = {"summary": report.summary, "rewards": {k: v for k, v in {
            "avg_reward": report.metrics.avg_reward,
            **{f"pass^{k}": v for k, v in report.metrics.pass_hat_k.items()}}.items() if v is not None}}
        await asyncio.to_thread(self.store.finish_run, self.parent_id, "completed", outcome)
        return report

    async def _report(self, status: str, ran: int, reused: int, total: int, start: float,
                      resumed: bool) -> EvalReport:
        sims = await asyncio.to_thread(self.stored_simulations)
        metrics = compute_metrics(sims, ks=range(1, self.settings.trials + 1), conventions=self.settings.conventions)
        summary = summarize(sims, metrics, agent_model=self.settings.model, user_model=self.settings.user_model,
                            judge_model=self.settings.judge_model)
        return EvalReport(parent_id=self.parent_id or "", name=self.settings.name, status=status, simulations=sims,
                          metrics=metrics, summary=summary, ran=ran, reused=reused, total=total,
                          wall_s=time.perf_counter() - start, resumed=resumed)

    def stored_simulations(self) -> list[SimulationRun]:
        """The evaluation's episodes as stored, one per (task, trial) of the plan, in plan order."""
        if self.parent_id is None:
            raise RuntimeError("the evaluation has not been opened")
        return _plan_order(latest_episodes(load_episodes(self.store, self.parent_id)), self.tasks,
                           self.settings.trials)


def _plan_order(records: list[EpisodeRecord], tasks: list[Task], trials: int) -> list[SimulationRun]:
    order = {t.id: i for i, t in enumerate(tasks)}
    kept = [r.simulation for r in records if r.simulation.task_id in order
            and r.simulation.trial is not None and r.simulation.trial < trials]
    return sorted(kept, key=lambda s: (s.trial, order[s.task_id]))


def export_results(store: RunStore, name: str, tasks: list[Task], path: str, *, git_commit: str = "") -> int:
    """tau2's results.json from what the store holds for the evaluation (every attempt); returns the
    number of simulations written."""
    parent = find_eval(store, name)
    if parent is None:
        raise EvalConfigError(f"no evaluation named {name!r} in {store.path}")
    cfg = EvalSettings.model_validate({**_STORED_BEFORE, **parent.config})  # an old eval says how it was graded
    sims = _plan_order(latest_episodes(load_episodes(store, parent.id)), tasks, cfg.trials)
    used = {s.task_id for s in sims}
    user_info: dict[str, Any] = {"implementation": "user_simulator" if cfg.user_model else "scenario_user",
                                 "llm": cfg.user_model}
    info = RunInfo(git_commit=git_commit, num_trials=cfg.trials, max_steps=cfg.max_steps, max_errors=cfg.max_errors,
                   seed=cfg.seed, user_info=user_info,
                   agent_info={"implementation": cfg.agent, "llm": cfg.model,
                               "llm_args": {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}},
                   environment_info={"domain_name": cfg.domain, "clarify": cfg.clarify, "eval_name": cfg.name,
                                     "eval_run_id": parent.id},
                   task_file_sha256=cfg.task_file_sha256, data_dir=cfg.data_dir, task_split=cfg.split,
                   conventions=cfg.conventions)
    write_results(path, sims, [t for t in tasks if t.id in used], info)
    return len(sims)

