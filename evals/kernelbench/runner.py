"""Batch KernelBench evaluation into the run store: resumable, claimed, concurrent.

One ``eval`` parent run per evaluation name (tag ``eval:<name>``), one ``kernel_sample`` child per
(problem, sample) written when its verdict exists. Samples come from an agent graph (the
``closedloop.graphs`` entry point named by ``agent``, e.g. ``kernel`` or ``egg``, with
``evaluate_kernel``/``profile_kernel`` tools bound to the problem), from candidate files
(KernelBench's ``level_<L>_problem_<P>_sample_<S>_kernel.py``, or ``<id>_<Name>.py`` for sample 0),
or from the problems themselves (``candidate_source="reference"``: each problem's ``Model`` as its
``ModelNew``, a self-check of the harness that must come out correct at 1.0x).

Outcomes (``closedloop.evals.harness.Outcome``): ``graded`` (the kernel got a verdict, whatever it
is), ``agent_error`` (no code, or the agent failed), ``infra_error`` (the harness or the problem
failed; run again on resume), ``timeout`` (the item exceeded ``item_timeout_s``).

Where samples run (``executor``, :mod:`closedloop.evals.harness.executor`): in this process
(``local``), or as Ray tasks (``ray``), one per sample, each asking :func:`sample_resources` (one
GPU for a timed CUDA sample; for CPU timing one CPU slot and the node's one ``cpu_timing`` slot, so
two judges never time on one node at once). A Ray worker process builds its evaluator and agent
from the settings once per evaluation (:func:`run_remote_sample`) and runs the same
:func:`run_sample` as the local path; the sandbox and its fork server live inside that worker,
unchanged. Candidate files are read here, in the driver, and sent with the sample, so
``candidates_dir`` need not be on a shared path. The store, the claim and the plan never leave the
driver.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from closedloop.evals.harness import (BatchRunner, EvalBusyError, EvalClaim, Executor, ItemWork, LocalExecutor,
                                      ResourceSlots, Resources, settings_differences)
from closedloop.evals.kernelbench.evaluate import KernelEvalConfig, KernelEvaluator, KernelResult
from closedloop.evals.kernelbench.metrics import summarize
from closedloop.evals.kernelbench.problems import Problem
from closedloop.messages import Trajectory

EVAL_KIND = "eval"
SAMPLE_KIND = "kernel_sample"
#: The custom Ray resource a node declares once (``ray start --resources '{"cpu_timing": 1}'``): a
#: CPU-timed sample holds it, so the judges of one node never time at the same time.
CPU_TIMING = "cpu_timing"
RESUME_KEYS = ("benchmark", "problems_sha", "backend", "scale", "policy", "agent", "model", "candidates_dir",
               "candidate_source", "seed", "trials", "atol", "rtol", "rounds")


class KernelBenchConfigError(ValueError):
    """Bad settings, a resume with other settings, or a name another live process is running."""


class KernelBenchSettings(BaseModel):
    """Everything that defines a KernelBench evaluation; stored as the parent run's config."""

    name: str
    benchmark: str = "kernelbench"
    problems_dir: str | None = None
    problems_sha: str = ""
    level: int | None = None
    backend: str = "cpu"
    scale: float = 1.0
    policy: str = "strict"
    agent: str | None = None
    model: str | None = None
    rounds: int | None = None
    #: Sampling temperature of the agent's model calls (None: the graph's default, greedy for ours).
    temperature: float | None = None
    #: Sample ``i`` of a problem runs with sampling seed ``sampling_seed + i`` (distinct samples for pass@k).
    sampling_seed: int = 0
    candidates_dir: str | None = None
    #: Where candidates come from: an agent, candidate files, or each problem's own reference.
    candidate_source: Literal["agent", "files", "reference"] | None = None
    samples: int = Field(1, ge=1)
    concurrency: int = Field(1, ge=1)
    item_timeout_s: float | None = None
    seed: int = 42
    trials: int = 5
    atol: float = 1e-2
    rtol: float = 1e-2
    warmup: int = 3
    iters: int = 20
    compile_reference: bool = False
    cache_dir: str | None = None
    executor: str = "local"  # where samples ran (recorded; a resume may use another)

    def source(self) -> str:
        if self.candidate_source is not None:
            return self.candidate_source
        return "files" if self.candidates_dir is not None else "agent"

    def eval_config(self) -> KernelEvalConfig:
        return KernelEvalConfig(backend=self.backend, scale=self.scale, policy=self.policy, seed=self.seed,
                                trials=self.trials, atol=self.atol, rtol=self.rtol, warmup=self.warmup, iters=self.iters,
                                compile_reference=self.compile_reference, cache_dir=self.cache_dir)


@dataclass
class SampleOutcome:
    problem: Problem
    sample_id: int
    outcome: str
    result: KernelResult | None
    code: str | None = None
    error: str | None = None
    trajectory: Trajectory | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.problem.key, self.sample_id)


@dataclass
class KernelBenchReport:
    parent_id: str
    name: str
    status: str
    results: list[KernelResult]
    outcomes: dict[str, int]
    summary: dict[str, Any]
    ran: int
    reused: int
    total: int
    wall_s: float
    resumed: bool = False
    errors: list[dict[str, Any]] = field(default_factory=list)


def candidate_file(root: str | Path, problem: Problem, sample_id: int) -> Path | None:
    """KernelBench's generation file name, else ``<root>/[level<N>/]<id>_<Name>.py`` for sample 0."""
    root = Path(root)
    names = [root / f"level_{problem.level}_problem_{problem.problem_id}_sample_{sample_id}_kernel.py"]
    if sample_id == 0:
        names += [root / f"level{problem.level}" / problem.name, root / problem.name]
    return next((p for p in names if p.is_file()), None)


AgentRunner = Callable[[Problem, int, KernelEvaluator], Any]  # async -> (code | None, Trajectory | None)


def graph_agent(agent: str, model: Any, *, backend: str = "cpu", rounds: int | None = None,
                params: Any = None, sampling_seed: int | None = 0) -> AgentRunner:
    """Runs the registered graph ``agent`` with ``model`` (a spec or a ``ModelClient``) on a problem,
    with ``evaluate_kernel``/``profile_kernel`` bound to it in the run context; returns (final code,
    trajectory).

    ``params`` (``SamplingParams``) replace the graph's default sampling; sample ``i`` of a
    problem runs with seed ``sampling_seed + i`` (the run context's ``params.seed``, as rollouts
    do), so the K samples of pass@k are distinct draws and a rerun draws the same ones."""
    from closedloop.evals.kernelbench.tools import make_kernel_tools
    from closedloop.graphs.kernel import KERNEL_PARAMS
    from closedloop.models import make_client
    from closedloop.runtime import context_for, load_graph
    from closedloop.runtime.convert import as_closedloop

    graph = load_graph(agent)
    client = make_client(model) if isinstance(model, str) else model

    async def run(problem: Problem, sample_id: int, evaluator: KernelEvaluator):
        tools = make_kernel_tools(problem, backend, config=evaluator.config, slots=evaluator.slots)
        base = params if params is not None else KERNEL_PARAMS
        seeded = base if sampling_seed is None else base.model_copy(update={"seed": sampling_seed + sample_id})
        context = context_for(graph, client=client, tools=tools, backend=backend, rounds=rounds, params=seeded)
        state = await graph.ainvoke({"problem": problem.code}, {"recursion_limit": 200}, context=context)
        traj = Trajectory(messages=as_closedloop(state.get("messages", [])), turns=list(state.get("turns", [])),
                          metadata={"agent": agent, "problem": problem.key, "sample": sample_id})
        return state.get("final_code"), traj

    run.client = client  # type: ignore[attr-defined]
    return run


def settings_agent(settings: KernelBenchSettings) -> AgentRunner | None:
    """The agent ``closedloop eval kernelbench`` runs for these settings (the graph ``agent`` with the
    model spec ``model``, the settings' rounds, temperature and sampling seed), or None when the
    candidates come from elsewhere. A Ray worker builds its agent the same way."""
    if settings.source() != "agent" or settings.agent is None or settings.model is None:
        return None
    params = None
    if settings.temperature is not None:
        from closedloop.graphs.kernel import KERNEL_PARAMS

        params = KERNEL_PARAMS.model_copy(update={"temperature": settings.temperature})
    return graph_agent(settings.agent, settings.model, backend=settings.backend, rounds=settings.rounds,
                       params=params, sampling_seed=settings.sampling_seed)


def sample_resources(settings: KernelBenchSettings) -> Resources:
    """What one sample asks a Ray cluster for: one GPU per timed CUDA sample; for CPU timing a CPU
    slot and the node's ``cpu_timing`` slot (timing on one node is serial, as locally); Triton runs
    under its CPU interpreter, untimed: a CPU slot. The sample holds it from its first model call
    to its verdict (locally only the judge holds the timing slot; builds overlap it)."""
    if settings.backend == "cuda":
        return Resources(num_cpus=1, num_gpus=1)
    if settings.backend == "cpu":
        return Resources(num_cpus=1, custom={CPU_TIMING: 1})
    return Resources(num_cpus=1)


def read_candidate(settings: KernelBenchSettings, problem: Problem, sample_id: int) -> str | None:
    """The candidate file's code for a sample (``candidate_source`` files), None when there is none."""
    path = candidate_file(settings.candidates_dir or ".", problem, sample_id)
    return path.read_text() if path is not None else None


async def run_sample(settings: KernelBenchSettings, evaluator: KernelEvaluator, agent: AgentRunner | None,
                     problem: Problem, sample_id: int, candidate: str | None = None) -> SampleOutcome:
    """One sample, wherever it runs: the candidate (from the agent, the given candidate file's code
    or the problem's reference), then its verdict. Never raises for what the agent or the candidate
    does; a model server out of reach is an ``infra_error``."""
    source = settings.source()
    traj = None
    if source == "reference":
        return _graded(problem, sample_id, await evaluator.aevaluate_reference(problem, sample_id), None, None)
    if source == "agent":
        if agent is None:
            raise RuntimeError("an agent evaluation without an agent")
        try:
            code, traj = await agent(problem, sample_id, evaluator)
        except (OSError, ConnectionError) as e:
            return SampleOutcome(problem, sample_id, "infra_error", None, error=f"model: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - the agent's own failure
            return SampleOutcome(problem, sample_id, "agent_error", None, error=f"{type(e).__name__}: {e}")
    elif candidate is None:
        return SampleOutcome(problem, sample_id, "agent_error", None,
                             error=f"no candidate file for {problem.key} sample {sample_id}")
    else:
        code = candidate
    if not code:
        return SampleOutcome(problem, sample_id, "agent_error", None, error="the agent produced no code",
                             trajectory=traj)
    result = await evaluator.aevaluate(problem, code, sample_id)
    return _graded(problem, sample_id, result, code, traj)


def _graded(problem: Problem, sample_id: int, result: KernelResult, code: str | None,
            traj: Trajectory | None) -> SampleOutcome:
    outcome = "infra_error" if result.status in ("reference_error", "infra_error") else "graded"
    return SampleOutcome(problem, sample_id, outcome, result, code=code, trajectory=traj,
                         error=result.message if outcome == "infra_error" else None)


@dataclass(frozen=True)
class RemoteSample:
    """What a Ray task is sent for one sample (pickled): the settings, the problem, the sample id and,
    for candidate files, the file's code as the driver read it. It comes back as the
    :class:`SampleOutcome`."""

    settings: KernelBenchSettings
    problem: Problem
    sample_id: int
    candidate: str | None = None


# One evaluation at a time per worker process: its evaluator (build cache, the fork server's
# preloads, semaphores on the worker's one loop) and its agent (graph, model client).
_WORKER: dict[str, tuple[KernelEvaluator, AgentRunner | None]] = {}


async def run_remote_sample(job: RemoteSample) -> SampleOutcome:
    """One sample in a Ray worker: the evaluator and the agent are built from the settings' specs
    once per worker process and evaluation, then :func:`run_sample` runs as it does locally."""
    key = job.settings.model_dump_json()
    parts = _WORKER.get(key)
    if parts is None:
        for _, previous in _WORKER.values():  # the previous evaluation's model client goes
            client = getattr(previous, "client", None)
            if client is not None:
                await client.aclose()
        _WORKER.clear()
        evaluator = KernelEvaluator(job.settings.eval_config(), slots=ResourceSlots({"cpu-timing": 1, "gpu0": 1}))
        parts = _WORKER[key] = (evaluator, settings_agent(job.settings))
    evaluator, agent = parts
    return await run_sample(job.settings, evaluator, agent, job.problem, job.sample_id, job.candidate)


class KernelBenchRunner:
    """Runs (or resumes) one named KernelBench evaluation against a run store.

    ``executor``: where samples run (default: this process). On a remote executor the workers build
    the agent from the settings (``agent`` and ``model`` specs, :func:`settings_agent`), so no
    ``agent`` object is given then."""

    def __init__(self, settings: KernelBenchSettings, problems: list[Problem], store: Any, *,
                 agent: AgentRunner | None = None, on_sample: Callable[[SampleOutcome], None] | None = None,
                 on_plan: Callable[[int, int], None] | None = None, executor: Executor | None = None):
        if not problems:
            raise KernelBenchConfigError("no problems to run")
        self.executor: Executor = executor or LocalExecutor()
        source = settings.source()
        if source == "agent" and not self.executor.in_process:
            if agent is not None:
                raise KernelBenchConfigError(f"an in-process agent cannot run on the {self.executor.name} executor; "
                                             "give the graph and the model spec in the settings (agent, model)")
            if settings.agent is None or settings.model is None:
                raise KernelBenchConfigError(f"samples on the {self.executor.name} executor build their agent from "
                                             "the settings: give agent and model")
        elif source == "agent" and agent is None:
            raise KernelBenchConfigError("give an agent (graph + model), a candidates directory or candidate_source "
                                         "'reference'")
        if source == "files" and settings.candidates_dir is None:
            raise KernelBenchConfigError("candidate_source 'files' needs a candidates directory")
        self.settings = settings.model_copy(update={"executor": self.executor.name})
        self.problems, self.store = problems, store
        self.agent, self.on_sample, self.on_plan = agent, on_sample, on_plan
        self.slots = ResourceSlots({"cpu-timing": 1, "gpu0": 1})
        # samples judged here share one evaluator (and its device slot); remote workers build theirs
        self.evaluator = (KernelEvaluator(self.settings.eval_config(), slots=self.slots)
                          if self.executor.in_process else None)
        self.parent_id: str | None = None

    # ---------------------------------------------------------------- store
    def _find(self):
        runs = self.store.list_runs(limit=None, kind=EVAL_KIND, tag=f"eval:{self.settings.name}")
        return runs[0] if runs else None

    def _open(self, resume: bool) -> tuple[str, dict[tuple[str, int], dict], bool]:
        s = self.settings
        config = s.model_dump(mode="json")
        existing = self._find()
        if existing is None:
            if resume:
                raise KernelBenchConfigError(f"no evaluation named {s.name!r} in {self.store.path} to resume")
            rid = self.store.start_run(kind=EVAL_KIND, graph=s.agent, model_spec=s.model, config=config,
                                       tags=[f"eval:{s.name}", "benchmark:kernelbench"], metadata={"name": s.name})
            return rid, {}, False
        diff = settings_differences(existing.config, config, RESUME_KEYS)
        if diff:
            lines = ", ".join(f"{k}: stored {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise KernelBenchConfigError(f"evaluation {s.name!r} exists with other settings ({lines}); "
                                         "use another --name or the same settings")
        self.store.reopen_run(existing.id, config)
        return existing.id, self._stored(existing.id), True

    def _stored(self, parent_id: str) -> dict[tuple[str, int], dict]:
        """Latest good record per (problem, sample); infra errors are kept only if nothing better."""
        best: dict[tuple[str, int], dict] = {}
        runs = sorted(self.store.list_runs(limit=None, parent_id=parent_id, kind=SAMPLE_KIND), key=lambda r: r.started_at)
        for run in runs:
            out = run.outcome or {}
            problem, sample_id = out.get("problem"), out.get("sample_id")
            if problem is None or sample_id is None:
                continue
            key = (str(problem), int(sample_id))
            prev = best.get(key)
            if prev is None or prev["outcome"] == "infra_error" or out.get("outcome") != "infra_error":
                best[key] = out
        return best

    def _record(self, so: SampleOutcome) -> None:
        res = so.result.model_dump(mode="json") if so.result is not None else None
        rewards = {}
        if so.result is not None:
            # a reward never credits a speedup the judge did not (suspicious, untimed, too noisy)
            rewards = {"correct": float(so.result.correct), "speedup": float(so.result.credited_speedup or 0.0)}
        outcome = {"problem": so.problem.key, "sample_id": so.sample_id, "outcome": so.outcome, "result": res,
                   "code": so.code, "error": so.error, "rewards": rewards}
        traj = so.trajectory or Trajectory(messages=[], metadata={"problem": so.problem.key})
        self.store.record_trajectory(traj, kind=SAMPLE_KIND, status="failed" if so.outcome == "infra_error" else "completed",
                                     graph=self.settings.agent, model_spec=self.settings.model,
                                     config={"eval": self.settings.name, "problem": so.problem.key,
                                             "sample_id": so.sample_id},
                                     tags=[f"problem:{so.problem.key}", f"sample:{so.sample_id}"], outcome=outcome,
                                     parent_id=self.parent_id, error=so.error)

    # ---------------------------------------------------------------- one sample
    def _candidate(self, problem: Problem, sample_id: int) -> str | None:
        return read_candidate(self.settings, problem, sample_id) if self.settings.source() == "files" else None

    async def _sample(self, item: tuple[Problem, int]) -> SampleOutcome:
        problem, sample_id = item
        assert self.evaluator is not None  # local samples only
        return await run_sample(self.settings, self.evaluator, self.agent, problem, sample_id,
                                self._candidate(problem, sample_id))

    def _work(self) -> ItemWork[tuple[Problem, int], SampleOutcome]:
        """A sample for the executor: here, or (built from the settings) in a Ray task asking
        :func:`sample_resources`, with what ``--ray-cpus``/``--ray-gpus`` replace."""
        resources = self.executor.config.item_resources(sample_resources(self.settings))
        return ItemWork(local=self._sample, remote=run_remote_sample,
                        payload=lambda item: RemoteSample(self.settings, item[0], item[1],
                                                          self._candidate(item[0], item[1])),
                        resources=lambda item: resources)

    # ---------------------------------------------------------------- the evaluation
    async def run(self, *, resume: bool = False) -> KernelBenchReport:
        claim = EvalClaim(self.store.path, self.settings.name)
        try:
            claim.acquire()
        except EvalBusyError as e:
            raise KernelBenchConfigError(str(e)) from None
        try:
            return await self._run(resume)
        finally:
            claim.release()

    async def _run(self, resume: bool) -> KernelBenchReport:
        start = time.perf_counter()
        s = self.settings
        self.parent_id, stored, resumed = await asyncio.to_thread(self._open, resume)
        plan = [(p, k) for k in range(s.samples) for p in self.problems]
        done = {key for key, out in stored.items() if out.get("outcome") != "infra_error"}
        queue = [(p, k) for p, k in plan if (p.key, k) not in done]
        if self.on_plan is not None:
            self.on_plan(len(plan), len(plan) - len(queue))
        ran = {"n": 0}

        def after(so: SampleOutcome) -> None:
            ran["n"] += 1
            if self.on_sample is not None:
                self.on_sample(so)

        def on_timeout(item, exc) -> SampleOutcome:
            return SampleOutcome(item[0], item[1], "timeout", None, error=f"exceeded {s.item_timeout_s:g} s")

        def on_error(item, exc) -> SampleOutcome:
            return SampleOutcome(item[0], item[1], "infra_error", None, error=f"harness: {type(exc).__name__}: {exc}")

        batch = BatchRunner(self._work(), self._record, concurrency=s.concurrency, item_timeout_s=s.item_timeout_s,
                            on_timeout=on_timeout, on_error=on_error, after_write=after, executor=self.executor)
        try:
            await batch.run(queue)
        except BaseException as exc:
            interrupted = isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt))
            status = "interrupted" if interrupted else "failed"
            report = await asyncio.to_thread(self._report, status, ran["n"], len(plan) - len(queue), len(plan), start,
                                             resumed)
            await asyncio.to_thread(self.store.finish_run, self.parent_id, status, {"summary": report.summary},
                                    None if interrupted else exc)
            raise
        report = await asyncio.to_thread(self._report, "completed", ran["n"], len(plan) - len(queue), len(plan), start,
                                         resumed)
        rewards = {k: v for k, v in report.summary["fast_p"].items()}
        if report.summary.get("geomean_speedup") is not None:
            rewards["geomean_speedup"] = report.summary["geomean_speedup"]
        await asyncio.to_thread(self.store.finish_run, self.parent_id, "completed",
                                {"summary": report.summary, "rewards": rewards})
        return report

    def stored_results(self) -> tuple[list[KernelResult], dict[str, int], list[dict[str, Any]]]:
        if self.parent_id is None:
            raise RuntimeError("the evaluation has not been opened")
        planned = {(p.key, k) for p in self.problems for k in range(self.settings.samples)}
        results: list[KernelResult] = []
        outcomes: dict[str, int] = {}
        errors: list[dict[str, Any]] = []
        for key, out in sorted(self._stored(self.parent_id).items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            if key not in planned:
                continue
            outcomes[out["outcome"]] = outcomes.get(out["outcome"], 0) + 1
            if out.get("result"):
                results.append(KernelResult.model_validate(out["result"]))
            if out.get("error"):
                errors.append({"problem": key[0], "sample_id": key[1], "outcome": out["outcome"], "error": out["error"]})
        return results, outcomes, errors

    def _report(self, status: str, ran: int, reused: int, total: int, start: float, resumed: bool) -> KernelBenchReport:
        results, outcomes, errors = self.stored_results()
        ks = [k for k in (1, 5, 10) if k <= self.settings.samples]
        summary = summarize(results, num_problems=len(self.problems), ks=ks)
        summary["outcomes"] = outcomes
        summary["scale"] = self.settings.scale
        summary["backend"] = self.settings.backend
        return KernelBenchReport(parent_id=self.parent_id or "", name=self.settings.name, status=status,
                                 results=results, outcomes=outcomes, summary=summary, ran=ran, reused=reused,
                                 total=total, wall_s=time.perf_counter() - start, resumed=resumed, errors=errors)
