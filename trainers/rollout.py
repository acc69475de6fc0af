"""Rollouts that run the agent graph itself as the policy.

A registered graph (``react``, ``clarifier``, any plugin graph) acts as a one-step policy
(``execute_tools=False``) around the trainer's live model (``HFClient.from_model``): each
environment step runs the graph on the environment's observation (the conversation so far), the
graph's model node samples one turn (token-exact: the ids the trainer optimises are the ids that
were sampled, never re-tokenised text), and the environment executes the tool calls or lets its
user answer. What the graph must remember between the steps of an episode (the clarifier's belief
and question budget) is its ``scratch``, handed back on the next step, as in evaluation
(:mod:`closedloop.evals.tau.agents`).

G episodes start from the identical initial state (``env.areset(seed)`` with the same seed) and
all episodes of a rollout batch run concurrently, so the client's micro-batcher decodes them
together on the device. Every episode runs the one compiled graph with a run context of its own:
the policy's settings, the environment's tool schemas, and its sample seed (``params.seed``), so
every episode samples with its own seed.

Rewards: ``info["rewards"]`` of every step (named components, see :mod:`closedloop.env`) are
summed per episode into ``Trajectory.rewards``; components the trainer treats as per-turn (such
as ``info_gain``) are also kept per turn, on the last trainable turn the graph produced in that
step, in ``Trajectory.metadata["turn_rewards"]`` (one dict per turn). Components a step reports
as 0.0 only because they do not apply to it (``info["inapplicable_rewards"]``, e.g. clarify's
``info_gain`` on a step that asked nothing) and that applied to none of a turn's steps are listed
per turn in ``metadata["inapplicable_rewards"]`` (present only when some turn has one): the
trainer gives such a turn no per-turn reward (None), not a reward of 0.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from closedloop.env import AgentEnvironment
from closedloop.messages import Trajectory, Turn, _Message
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import AgentContext, check_graph, context_for, load_graph
from closedloop.runtime.convert import action_of

EnvFactory = Callable[[], AgentEnvironment]


@dataclass
class GraphPolicy:
    """A graph and the model it runs on; ``graph`` names a ``closedloop.graphs`` entry point (or is
    a compiled graph); ``options`` are fields of its run context (e.g. the clarifier's ``threshold``)."""

    client: ModelClient
    graph: str | Any = "react"
    params: SamplingParams = field(default_factory=SamplingParams)
    options: dict[str, Any] = field(default_factory=dict)
    _loaded: Any = field(default=None, init=False, repr=False, compare=False)
    _context: AgentContext | None = field(default=None, init=False, repr=False, compare=False)

    def compiled(self) -> Any:
        """The compiled graph, looked up once (an entry-point lookup scans every installed
        distribution's metadata, ~10 ms, more than the tiny model's whole rollout)."""
        if self._loaded is None:
            self._loaded = load_graph(self.graph) if isinstance(self.graph, str) else check_graph(self.graph)
        return self._loaded

    def context(self, tools: list[dict[str, Any]], sample_seed: int | None = None) -> AgentContext:
        """One episode's run context: the policy's (made once; the environment's tools are schemas
        only, since it executes the calls) with ``sample_seed`` as the seed when given."""
        if self._context is None:
            self._context = context_for(self.compiled(), client=self.client, params=self.params, system_prompt=None,
                                        execute_tools=False, **self.options)
        update: dict[str, Any] = {"tool_schemas": list(tools)}
        if sample_seed is not None:
            update["params"] = self.params.model_copy(update={"seed": sample_seed})
        return self._context.model_copy(update=update)


@dataclass
class Episode:
    trajectory: Trajectory
    terminated: bool
    truncated: bool
    steps: int
    info: dict[str, Any]
    error: str | None = None

    @property
    def reward(self) -> float:
        return float(sum(self.trajectory.rewards.values()))


def _add(into: dict[str, float], comps: dict[str, float]) -> None:
    for k, v in comps.items():
        into[k] = into.get(k, 0.0) + float(v)


async def run_episode(make_env: EnvFactory, policy: GraphPolicy, seed: int, *, max_steps: int = 16,
                      sample_seed: int | None = None, metadata: dict[str, Any] | None = None) -> Episode:
    """One episode: the graph acts, the environment answers, until it ends or ``max_steps``.

    ``sample_seed`` (else ``policy.params.seed``) seeds every model call of the episode.
    """
    env = make_env()
    obs, info = await env.areset(seed=seed)
    graph = policy.compiled()
    context = policy.context(info.get("tools") or [], sample_seed)
    scratch: dict[str, Any] = {}
    turns: list[Turn] = []
    turn_rewards: list[dict[str, float]] = []
    inapplicable: list[set[str] | None] = []  # per turn: components that applied to none of its steps
    totals: dict[str, float] = {}
    steps, terminated, truncated, last_info, error = 0, False, False, dict(info), None
    messages: list[_Message] = list(obs)
    while steps < max_steps:
        try:
            out = await graph.ainvoke({"messages": messages, "scratch": scratch}, context=context)
        except Exception as e:  # a policy failure ends the episode; it is reported, not hidden
            error = f"{type(e).__name__}: {e}"
            break
        scratch = out.get("scratch") or {}
        new_turns = list(out.get("turns") or [])
        action = action_of(out["messages"][-1])
        turns += new_turns
        turn_rewards += [{} for _ in new_turns]
        inapplicable += [None for _ in new_turns]
        obs, reward, terminated, truncated, step_info = await env.astep(action)
        steps += 1
        comps = dict(step_info.get("rewards") or {"reward": float(reward)})
        _add(totals, comps)
        owner = next((i for i in range(len(turns) - 1, -1, -1) if turns[i].trainable), None)
        if owner is not None:
            _add(turn_rewards[owner], comps)
            skip = set(step_info.get("inapplicable_rewards") or ())
            before = inapplicable[owner]
            inapplicable[owner] = skip if before is None else before & skip
        messages = list(obs)
        last_info = step_info
        if terminated or truncated:
            break
    else:
        truncated = True
    traj = Trajectory(messages=messages, turns=turns, rewards=totals,
                      step_rewards=[sum(r.values()) if r else None for r in turn_rewards],
                      metadata={"seed": seed, "sample_seed": sample_seed, "steps": steps, "terminated": terminated,
                                "truncated": truncated, "turn_rewards": turn_rewards, **(metadata or {}),
                                **({"inapplicable_rewards": [sorted(s or ()) for s in inapplicable]}
                                   if any(inapplicable) else {}),
                                **({"error": error} if error else {})})
    return Episode(traj, terminated, truncated, steps, last_info, error)


@dataclass
class Group:
    """G episodes from the identical initial state (one environment seed)."""

    seed: int
    episodes: list[Episode]

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]


@dataclass(frozen=True)
class EpisodeJob:
    """One episode of a rollout batch: its environment seed (the group), its index in the group,
    its sample seed and metadata. Picklable, so it can be sent to a rollout actor."""

    seed: int
    sample: int
    sample_seed: int | None
    metadata: dict[str, Any]


def plan_jobs(seeds: Iterable[int], group_size: int, *, sample_seed: int | None = None,
              metadata: dict[str, Any] | None = None) -> list[EpisodeJob]:
    """The batch's episodes, group by group. ``sample_seed`` makes sampling reproducible: episode j
    of seed s samples with ``sample_seed + 1000 * s + j`` (distinct within a group, so the group
    explores), wherever it runs."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    return [EpisodeJob(s, j, None if sample_seed is None else sample_seed + 1000 * s + j,
                       {"group": s, "sample": j, **(metadata or {})})
            for s in seeds for j in range(group_size)]


async def run_jobs(make_env: EnvFactory, policy: GraphPolicy, jobs: list[EpisodeJob], *, max_steps: int = 16,
                   concurrency: int | None = None,
                   on_episode: Callable[[Episode], None] | None = None) -> list[Episode]:
    """Every job's episode, all run concurrently (bounded by ``concurrency``), in job order."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(job: EpisodeJob) -> Episode:
        async with sem if sem is not None else contextlib.nullcontext():
            ep = await run_episode(make_env, policy, job.seed, max_steps=max_steps, sample_seed=job.sample_seed,
                                   metadata=job.metadata)
        if on_episode is not None:
            on_episode(ep)
        return ep

    return list(await asyncio.gather(*(one(j) for j in jobs)))


def assemble_groups(jobs: list[EpisodeJob], episodes: list[Episode]) -> list[Group]:
    """Episodes (in :func:`plan_jobs` order) back into their groups, one per seed given (a seed drawn
    twice is two groups, as it was two initial states of the batch)."""
    groups: list[Group] = []
    for job, ep in zip(jobs, episodes, strict=True):
        if job.sample == 0:
            groups.append(Group(job.seed, []))
        groups[-1].episodes.append(ep)
    return groups


async def collect_groups(make_env: EnvFactory, policy: GraphPolicy, seeds: Iterable[int], group_size: int, *,
                         max_steps: int = 16, sample_seed: int | None = None, concurrency: int | None = None,
                         on_episode: Callable[[Episode], None] | None = None,
                         metadata: dict[str, Any] | None = None) -> list[Group]:
    """``group_size`` episodes per seed, all run concurrently (bounded by ``concurrency``), seeded as
    :func:`plan_jobs` says. (:class:`closedloop.trainers.ray_rollout.RayRollouts` runs the same jobs
    on rollout actors.)"""
    jobs = plan_jobs(seeds, group_size, sample_seed=sample_seed, metadata=metadata)
    return assemble_groups(jobs, await run_jobs(make_env, policy, jobs, max_steps=max_steps, concurrency=concurrency,
                                                on_episode=on_episode))


__all__ = ["Episode", "EpisodeJob", "EnvFactory", "GraphPolicy", "Group", "assemble_groups", "collect_groups",
           "plan_jobs", "run_episode", "run_jobs"]
