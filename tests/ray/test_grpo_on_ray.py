"""GRPO with rollouts on Ray actors (each an ``hf:`` copy of the tiny policy on CPU) trains step for
step as the local run with the same seeds: every sampled token is the same at every step (so the
actors sampled from the weights the trainer pushed after each update), hence every batch, and
every metric of every step is (up to the last float bits: rows decode beside other batch-mates on
two actors than in one local batch, as with ``prefetch_rollouts``). The final weights are not
compared element by element: Adam turns a last-bit difference in a near-zero gradient into an
update-sized one on that element."""

from __future__ import annotations

import pytest

from closedloop.store import RunStore
from closedloop.trainers.grpo import GRPOConfig, train_grpo

pytestmark = pytest.mark.slow

TIMING = {"rollout_s", "train_s", "step_s", "tokens_per_s"}


def test_grpo_with_ray_rollout_actors_equals_local_step_for_step(ray_cluster, tiny_model_path, tmp_path):
    runs = {}
    for kind in ("local", "ray"):
        store = tmp_path / f"runs-{kind}.duckdb"
        cfg = GRPOConfig(model=str(tiny_model_path), output_dir=str(tmp_path / f"out-{kind}"), env="calc",
                         env_options={"level": 1}, prompts_per_step=2, num_generations=3, max_steps=2,
                         max_env_steps=3, max_new_tokens=24, learning_rate=3e-3, per_device_batch_size=6, seed=5,
                         torch_threads=1, prefetch_rollouts=False, store=str(store),
                         executor={"kind": kind, "address": ray_cluster, "workers": 2})
        result = train_grpo(cfg)
        sampled = sorted((t.metadata["step"], t.metadata["group"], t.metadata["sample"],
                          tuple(tuple(turn.completion_ids) for turn in t.turns))
                         for t in RunStore(store).iter_trajectories(parent_id=result.run_id))
        runs[kind] = (result.history, sampled)
    (h0, s0), (h1, s1) = runs["local"], runs["ray"]
    assert len(s0) == 2 * 2 * 3 and s0 == s1  # the same tokens at both steps (the second after an update)
    assert any(h["grad_norm"] > 0 for h in h0)  # the weights did change between steps
    assert [sorted(h) for h in h0] == [sorted(h) for h in h1]
    for a, b in zip(h0, h1):
        for k in set(a) - TIMING:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_ray_and_another_rollout_engine_are_refused_together(tmp_path):
    with pytest.raises(ValueError, match="set one of them"):
        GRPOConfig(model="m", output_dir=str(tmp_path), executor="ray", rollout_model="vllm:/m")
