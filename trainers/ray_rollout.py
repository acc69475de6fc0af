"""GRPO rollouts on Ray: a batch's episodes spread over rollout actors that each hold a copy of the policy.

What runs where (``executor: {kind: ray, workers: N, resources: {...}}`` in a GRPO config):

* the **trainer** (the Ray driver) draws the step's seeds, plans the episodes exactly as a local
  run does (:func:`~closedloop.trainers.rollout.plan_jobs`: each episode's sample seed is fixed by
  its group and index), deals them round-robin to the actors, waits for all of them and puts the
  episodes back in plan order (:func:`~closedloop.trainers.rollout.assemble_groups`); the batch,
  the loss, the optimizer and the store stay here;
* each **rollout actor** (a Ray actor with ``executor.resources``, one CPU by default; a GPU with
  ``num_gpus: 1``) loads the policy's architecture and tokenizer from ``model`` (so every node must
  reach that path or hub id), wraps it in an ``hf:`` client with the live policy's settings and
  runs its episodes with :func:`~closedloop.trainers.rollout.run_jobs`, the graph and environment
  the local run uses, all its episodes at once in one continuous-batching decode;
* **weights**: before the first batch and after every update the trainer pushes its weights
  (:class:`RaySync`, a :class:`~closedloop.trainers.weight_sync.WeightSync`): the merged tensors
  of :func:`~closedloop.trainers.weight_sync.named_weights` go once into Ray's object store and
  every actor copies them in with :func:`~closedloop.models.weights.load_into_hf` (the in-process
  sync's path) before the trainer goes on, so each batch is sampled from the weights of the
  step before it, as locally.

The same seeds therefore give the same episodes as a local run (the same tokens: each row samples
with its own seeded generator); only the batch-mates a row decodes beside differ, which moves
logprobs in the last float bits (as ``prefetch_rollouts`` does). ``prefetch_rollouts`` itself does
not apply on Ray: an actor samples the next batch only after the update's weights have arrived.

Over the wire: per step, the episode jobs (seed, index, sample seed, metadata: bytes) to the actors
and the episodes back (trajectories with their token ids and logprobs: a few kB each); per update,
the full merged weights once into the object store (4 bytes x parameters in float32), read by
each actor's node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import ray

from closedloop.evals.harness.executor import ExecutorConfig, Resources, worker_loop
from closedloop.evals.harness.ray_executor import connect
from closedloop.models.base import SamplingParams
from closedloop.trainers.rollout import EnvFactory, Episode, EpisodeJob, GraphPolicy, Group, assemble_groups, \
    plan_jobs, run_jobs
from closedloop.trainers.weight_sync import named_weights

__all__ = ["ActorSpec", "RayRollouts", "RaySync", "RolloutActor"]


@dataclass
class ActorSpec:
    """What a rollout actor builds its policy copy from (sent pickled when the actor starts)."""

    model_path: str
    client_name: str  # the live policy's client name: recorded on every turn, so trajectories match
    make_env: EnvFactory
    graph: str = "react"
    graph_options: dict[str, Any] = field(default_factory=dict)
    params: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "float32"
    max_batch_size: int = 64
    torch_threads: int = 1


class RolloutActor:
    """A copy of the policy and the environment factory; runs episode jobs, takes weights."""

    def __init__(self, spec: ActorSpec) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from closedloop.models.hf import HFClient

        torch.set_num_threads(spec.torch_threads)
        device = "cuda" if ray.get_gpu_ids() else "cpu"
        dtype: Any = "auto" if spec.dtype == "auto" else getattr(torch, spec.dtype)
        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=dtype)
        model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to), as in models/hf.py
        tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
        # the live policy's client settings (trainers/grpo.py: _rollout_client)
        self.client = HFClient.from_model(model, tokenizer, name=spec.client_name, max_batch_size=spec.max_batch_size,
                                          batch_gap_ms=1.0)
        self.policy = GraphPolicy(self.client, spec.graph, spec.params, dict(spec.graph_options))
        self.make_env = spec.make_env
        self.step = -1

    def run(self, jobs: list[EpisodeJob], max_steps: int, concurrency: int | None) -> list[Episode]:
        return worker_loop().run(run_jobs(self.make_env, self.policy, jobs, max_steps=max_steps,
                                          concurrency=concurrency))

    def load_weights(self, state: dict[str, Any], step: int) -> int:
        from closedloop.models.weights import load_into_hf

        count = load_into_hf(self.client, state)
        self.step = step
        return count


class RaySync:
    """Pushes the trainer's weights to every rollout actor: once into the object store, then each
    actor loads them in place; returns when all have (the next batch samples the new weights)."""

    kind = "ray"

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def push(self, model: Any, step: int) -> None:
        state = {name: tensor.detach().to("cpu") for name, tensor in named_weights(model)}
        ref = ray.put(state)
        ray.get([a.load_weights.remote(ref, step) for a in self.actors])

    def close(self) -> None:
        return None


class RayRollouts:
    """``executor.workers`` rollout actors and the batch's episodes spread over them."""

    def __init__(self, spec: ActorSpec, executor: ExecutorConfig) -> None:
        self._connected = connect(executor)
        resources = executor.resources or Resources()
        actor_class = ray.remote(RolloutActor).options(max_restarts=0, **resources.ray_options())
        self.actors: list[Any] = [actor_class.remote(spec) for _ in range(executor.workers)]  # ActorHandles
        self.sync = RaySync(self.actors)

    @classmethod
    def for_config(cls, config: Any, make_env: EnvFactory, client_name: str) -> "RayRollouts":
        """From a :class:`~closedloop.trainers.grpo.GRPOConfig` (its ``executor``, model, graph, sampling)."""
        executor: ExecutorConfig = config.executor
        cpus = (executor.resources or Resources()).num_cpus
        spec = ActorSpec(model_path=config.model_path, client_name=client_name, make_env=make_env,
                         graph=config.graph, graph_options=dict(config.graph_options), params=config.sampling,
                         dtype=config.dtype, max_batch_size=config.max_batch_size,
                         torch_threads=config.torch_threads or max(1, int(cpus)))
        return cls(spec, executor)

    async def collect_groups(self, seeds: list[int], group_size: int, *, max_steps: int = 16,
                             sample_seed: int | None = None, concurrency: int | None = None,
                             metadata: dict[str, Any] | None = None) -> list[Group]:
        """As :func:`~closedloop.trainers.rollout.collect_groups`, the episodes run on the actors
        (``concurrency``, if set, is shared among them)."""
        jobs = plan_jobs(seeds, group_size, sample_seed=sample_seed, metadata=metadata)
        n = len(self.actors)
        per_actor = None if concurrency is None else max(1, math.ceil(concurrency / n))
        shares = [jobs[k::n] for k in range(n)]
        refs = [a.run.remote(share, max_steps, per_actor) for a, share in zip(self.actors, shares) if share]
        results = [await ref for ref in refs]
        episodes: list[Episode] = [results[i % n][i // n] for i in range(len(jobs))]
        return assemble_groups(jobs, episodes)

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False
