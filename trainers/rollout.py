"""Rollouts that run the agent graph itself as the policy.

A registered graph (``react``, ``clarifier``, any plugin graph) is compiled as a one-step policy
(``execute_tools=False``) around the trainer's live model (``HFClient.from_model``): each
environment step sends the graph the messages it has not seen yet, the graph's model node samples
one turn (token-exact: the ids the trainer optimises are the ids that were sampled, never
re-tokenised text), and the environment executes the tool calls or lets its user answer. Each
episode has its own graph thread (in-memory checkpointer, written once as each step's run exits;
none for one-step episodes, whose thread never resumes), so graph state outside the messages
(the clarifier's belief and question budget) lives across the episode as it does in evaluation.

G episodes start from the identical initial state (``env.areset(seed)`` with the same seed) and
all episodes of a rollout batch run concurrently, so the client's micro-batcher decodes them
together on the device. The episodes of one :func:`collect_groups` call share one compiled graph
per tool list and sampling settings (compiling a LangGraph graph costs milliseconds per episode,
more than a small model's whole reply); each runs in its own thread of that graph, and its sample
seed travels in the run config (``configurable["sampling_seed"]``, read by the graph's model calls,
see :func:`closedloop.runtime.nodes.run_params`), so every episode still samples with its own seed,
exactly as with a graph of its own.

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
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from closedloop import plugins
from closedloop.env import AgentEnvironment
from closedloop.messages import AssistantMessage, Trajectory, Turn, _Message
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import make_checkpointer
from closedloop.runtime.nodes import SAMPLING_SEED
from closedloop.tool import ToolRegistry

EnvFactory = Callable[[], AgentEnvironment]

class SchemaTools(ToolRegistry):
    """The environment's tool schemas, for a graph that only proposes calls (the environment
    executes them): the model node needs the schemas, never the functions."""

    def __init__(self, schemas: list[dict[str, Any]]) -> None:
        super().__init__()
        self._schemas = list(schemas)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return list(self._schemas)

    def __len__(self) -> int:
        return len(self._schemas)


#: Compiled policy graphs a :class:`GraphPolicy` keeps across rollout batches.
_KEPT_GRAPHS = 8


@dataclass
class GraphPolicy:
    """A graph factory plus the model it runs on; ``graph`` names a ``closedloop.graphs`` entry point."""

    client: ModelClient
    graph: str | Callable[..., Any] = "react"
    params: SamplingParams = field(default_factory=SamplingParams)
    options: dict[str, Any] = field(default_factory=dict)
    _factory: Callable[..., Any] | None = field(default=None, init=False, repr=False, compare=False)
    #: Compiled graphs kept across rollout batches, by tool list (a few: environments rarely vary them).
    _compiled: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def factory(self) -> Callable[..., Any]:
        # Resolved once: an entry-point lookup scans every installed distribution's metadata
        # (~10 ms), which per episode cost more than the tiny model's whole rollout.
        if self._factory is None:
            self._factory = plugins.load("closedloop.graphs", self.graph) if isinstance(self.graph, str) else self.graph
        return self._factory

    def build(self, tools: list[dict[str, Any]], params: SamplingParams | None = None, *, persistent: bool = True):
        """Compile the graph as a one-step policy. ``persistent``: with an in-memory checkpointer,
        so a thread's state carries over between the steps of an episode; an episode of one step
        never resumes its thread and skips the checkpoint writes (``persistent=False``)."""
        return self.factory()(self.client, SchemaTools(tools), system_prompt=None, params=params or self.params,
                              execute_tools=False, checkpointer=make_checkpointer("memory") if persistent else None,
                              **self.options)

    def shared(self, tools: list[dict[str, Any]], *, persistent: bool = True):
        """The graph episodes share for these tools (each episode passes its sample seed in its run
        config). Compiled once and kept for later batches (compiling costs about as much as a tiny
        model's decode step); an episode deletes its checkpointer thread when it ends, so a kept
        graph holds no episode's state."""
        key = json.dumps([tools, persistent], sort_keys=True, default=str)
        if key not in self._compiled:
            if len(self._compiled) >= _KEPT_GRAPHS:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = self.build(tools, persistent=persistent)
        return self._compiled[key]


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
                      sample_seed: int | None = None, metadata: dict[str, Any] | None = None,
                      share_graph: bool = False) -> Episode:
    """One episode: the graph acts, the environment answers, until it ends or ``max_steps``.

    ``share_graph``: run the policy's kept graph for these tools (see :meth:`GraphPolicy.shared`);
    without it the episode compiles a graph of its own. ``sample_seed`` (else ``policy.params.seed``)
    seeds every model call of the episode, through the run config.
    """
    env = make_env()
    obs, info = await env.areset(seed=seed)
    tools = info.get("tools") or []
    persistent = max_steps > 1  # a one-step episode never resumes its graph thread
    graph = policy.shared(tools, persistent=persistent) if share_graph else policy.build(tools, persistent=persistent)
    # checkpoint once, as each step's run exits (LangGraph warns when there is no checkpointer to tell)
    durability: dict[str, Any] = {"durability": "exit"} if getattr(graph, "checkpointer", None) else {}
    config: dict[str, Any] = {"configurable": {"thread_id": uuid.uuid4().hex}}
    if sample_seed is not None:
        config["configurable"][SAMPLING_SEED] = sample_seed
    turns: list[Turn] = []
    turn_rewards: list[dict[str, float]] = []
    inapplicable: list[set[str] | None] = []  # per turn: components that applied to none of its steps
    totals: dict[str, float] = {}
    seen, steps, terminated, truncated, last_info, error = 0, 0, False, False, dict(info), None
    messages: list[_Message] = list(obs)
    while steps < max_steps:
        try:
            out = await graph.ainvoke({"messages": messages[seen:]}, config, **durability)
        except Exception as e:  # a policy failure ends the episode; it is reported, not hidden
            error = f"{type(e).__name__}: {e}"
            break
        new_turns = list(out.get("turns") or [])[len(turns):]
        last = out["messages"][-1]
        action: AssistantMessage | Turn
        action = new_turns[-1] if new_turns and new_turns[-1].message == last else (
            last if isinstance(last, AssistantMessage) else AssistantMessage(content=str(last)))
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
            inapplicable[owner] = skip if inapplicable[owner] is None else inapplicable[owner] & skip
        # The environment appends the agent's reply to its history; the graph's thread already
        # holds that reply, so only what comes after it is new to the graph (as in evaluation).
        seen = len(messages) + 1
        messages = list(obs)
        last_info = step_info
        if terminated or truncated:
            break
    else:
        truncated = True
    saver = getattr(graph, "checkpointer", None)
    if share_graph and persistent and hasattr(saver, "adelete_thread"):
        await saver.adelete_thread(config["configurable"]["thread_id"])  # the shared graph keeps no episode
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


async def collect_groups(make_env: EnvFactory, policy: GraphPolicy, seeds: Iterable[int], group_size: int, *,
                         max_steps: int = 16, sample_seed: int | None = None, concurrency: int | None = None,
                         on_episode: Callable[[Episode], None] | None = None,
                         metadata: dict[str, Any] | None = None) -> list[Group]:
    """``group_size`` episodes per seed, all run concurrently (bounded by ``concurrency``).

    ``sample_seed`` makes sampling reproducible: episode j of seed s samples with
    ``sample_seed + 1000 * s + j`` (distinct within a group, so the group explores).
    """
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    seeds = list(seeds)
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(seed: int, j: int) -> Episode:
        ss = None if sample_seed is None else sample_seed + 1000 * seed + j
        meta = {"group": seed, "sample": j, **(metadata or {})}
        if sem is None:
            ep = await run_episode(make_env, policy, seed, max_steps=max_steps, sample_seed=ss, metadata=meta,
                                   share_graph=True)
        else:
            async with sem:
                ep = await run_episode(make_env, policy, seed, max_steps=max_steps, sample_seed=ss, metadata=meta,
                                       share_graph=True)
        if on_episode is not None:
            on_episode(ep)
        return ep

    episodes = await asyncio.gather(*(one(s, j) for s in seeds for j in range(group_size)))
    return [Group(s, list(episodes[i * group_size:(i + 1) * group_size])) for i, s in enumerate(seeds)]


__all__ = ["Episode", "EnvFactory", "GraphPolicy", "Group", "SchemaTools", "collect_groups", "run_episode"]
