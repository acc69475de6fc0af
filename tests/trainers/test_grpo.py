"""Multi-turn GRPO: rollouts run the graph on the live policy, the trainer optimises exactly the
sampled ids with the sampling logprobs as old logprobs, micro-batching does not change the
update, and per-turn rewards land on their own turn's tokens."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from closedloop.models.base import SamplingParams
from closedloop.trainers.grpo import GRPOConfig, GRPOObjective, reward_spec, sequence_logprobs, train_grpo
from closedloop.trainers.grpo_batch import RewardSpec, build_batch
from closedloop.trainers.rollout import GraphPolicy, collect_groups

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy_parts(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    return model, tok


def _calc():
    from closedloop.evals.envs import make_env

    return make_env("calc", level=1)


def _rollouts(model, tok, seeds, g, temperature=1.0, env=_calc, graph="react"):
    from closedloop.models.hf import HFClient

    client = HFClient.from_model(model, tok, max_batch_size=32)
    policy = GraphPolicy(client, graph, SamplingParams(temperature=temperature, max_tokens=32))
    return asyncio.run(collect_groups(env, policy, seeds, g, max_steps=3, sample_seed=11))


def test_trained_ids_are_the_sampled_ids_and_old_logprobs_match_the_trainer(policy_parts):
    model, tok = policy_parts
    model.eval()
    groups = _rollouts(model, tok, [3, 4], 4, temperature=0.7)
    assert all(len(g.episodes) == 4 for g in groups)
    # Identical initial state within a group.
    for g in groups:
        firsts = {tuple(e.trajectory.turns[0].prompt_ids) for e in g.episodes}
        assert len(firsts) == 1
    batch = build_batch(groups, RewardSpec(), pad_id=0)
    row = 0
    for g in groups:
        for ep in g.episodes:
            views = ep.trajectory.token_view()
            for v in views:
                ids = batch.input_ids[row, :len(v.input_ids)].tolist()
                assert ids == v.input_ids
                # every sampled completion of the view's turns appears verbatim where the mask is 1
                # (an episode has several views when a prompt does not extend the previous sequence,
                # e.g. after a reply cut at max_tokens whose markup re-renders as text)
                trained = [i for i, m in zip(ids, batch.loss_mask[row].tolist()) if m]
                view_turns = sorted({t for t in v.turn_index if t >= 0})
                assert trained == [t for k in view_turns for t in ep.trajectory.turns[k].completion_ids]
                row += 1
    assert row == len(batch)
    # The recorded sampling logprobs (hf:, tempered) are what the trainer recomputes at the same
    # temperature: the first-pass importance ratio is 1 up to float error.
    recomputed = sequence_logprobs(model, batch, 0.7, micro=4)
    sel = batch.logprob_mask.bool()
    assert sel.sum() > 20
    assert torch.allclose(recomputed[sel], batch.old_logps[sel], atol=2e-4)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batching_does_not_change_the_update(policy_parts, loss_type):
    model, tok = policy_parts
    model.eval()
    groups = _rollouts(model, tok, [5, 6], 3)
    batch = build_batch(groups, RewardSpec(), pad_id=0)
    assert batch.advantages.abs().sum() > 0, "the rollouts need reward variance for this test"
    grads = []
    for micro in (len(batch), 2):
        m = copy.deepcopy(model).train()
        cfg = GRPOConfig(model="unused", output_dir="unused", per_device_batch_size=micro, loss_type=loss_type,
                         max_env_steps=3, max_new_tokens=32)
        objective = GRPOObjective(m, batch, cfg, old_logps=batch.old_logps, ref_logps=None, is_weights=None)
        for rows in objective.micro_batches():  # what TrainingSession.train_step accumulates
            objective(rows).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_per_turn_rewards_land_on_their_turns_tokens(policy_parts):
    """clarify's info_gain as a per-turn component: a turn's tokens carry its own advantage."""
    from closedloop.evals.envs import make_env

    model, tok = policy_parts
    model.eval()
    groups = _rollouts(model, tok, [1], 4, env=lambda: make_env("clarify"))
    spec = RewardSpec(turn_components=["info_gain"])
    batch = build_batch(groups, spec, pad_id=0, scale="none")
    # context tokens never carry advantage
    assert (batch.advantages[batch.loss_mask == 0] == 0).all()
    row = 0
    for g in groups:
        for ep in g.episodes:
            views = ep.trajectory.token_view()
            for v in views:
                per_tok = batch.advantages[row, :len(v.turn_index)].tolist()
                by_turn: dict[int, set[float]] = {}
                for k, a in zip(v.turn_index, per_tok):
                    if k >= 0:
                        by_turn.setdefault(k, set()).add(round(a, 6))
                assert all(len(s) == 1 for s in by_turn.values()), "one advantage per turn"
                row += 1


def test_train_grpo_end_to_end_records_rollouts_metrics_and_a_loadable_model(tiny_model_path, tmp_path):
    from closedloop.models.hf import HFClient
    from closedloop.store import RunStore

    store_path = tmp_path / "runs.duckdb"
    cfg = GRPOConfig(model=str(tiny_model_path), output_dir=str(tmp_path / "out"), store=str(store_path),
                     env="calc", env_options={"level": 1}, prompts_per_step=2, num_generations=3, max_steps=2,
                     max_env_steps=3, max_new_tokens=32, learning_rate=1e-3, per_device_batch_size=4, seed=1,
                     torch_threads=1, beta=0.04, num_iterations=2)
    before = {k: v.clone() for k, v in HFClient.from_pretrained(tiny_model_path).model.state_dict().items()}
    result = train_grpo(cfg)
    assert result.steps == 2 and len(result.history) == 2
    for h in result.history:
        for key in ("reward", "rewards/success", "rewards/format", "rewards/turn_cost", "kl", "entropy",
                    "clip_ratio/region_mean", "completion_length_mean", "tokens_per_s", "step_s"):
            assert key in h, key
    final = HFClient.from_pretrained(tmp_path / "out")
    changed = any(not torch.equal(before[k], v) for k, v in final.model.state_dict().items())
    assert changed
    store = RunStore(store_path)
    run = store.get_run(result.run_id)
    assert run.status == "completed"
    rollouts = [r for r in store.list_runs(limit=None) if r.id != result.run_id]
    assert len(rollouts) == 2 * 2 * 3  # steps x prompts x generations, each a child run
    if hasattr(store, "metrics"):
        assert [m["step"] for m in store.metrics(result.run_id)] == [1, 2]


def test_reward_functions_are_named_components(tmp_path):
    cfg = GRPOConfig(model="m", output_dir=str(tmp_path), reward_funcs=["closedloop.trainers.rewards:completion_tokens"],
                     reward_weights={"completion_tokens": -0.01})
    spec = reward_spec(cfg)
    assert "completion_tokens" in spec.functions and spec.w("completion_tokens") == -0.01
    with pytest.raises(ValueError, match="module:function"):
        reward_spec(GRPOConfig(model="m", output_dir=str(tmp_path), reward_funcs=["nocolon"]))


def test_ctrl_c_saves_and_resume_continues_the_same_run(tiny_model_path, tmp_path):
    """The first SIGINT finishes the step, saves checkpoint-<step> and stops; resume='auto' picks up
    at the next step, draws the seeds it would have drawn, and reopens the same store run."""
    import os
    import signal

    from closedloop.store import RunStore
    from closedloop.trainers.checkpoint import latest_checkpoint

    store_path = tmp_path / "runs.duckdb"
    common = dict(model=str(tiny_model_path), output_dir=str(tmp_path / "out"), store=str(store_path), env="calc",
                  prompts_per_step=2, num_generations=2, max_steps=3, max_env_steps=2, max_new_tokens=24,
                  learning_rate=1e-3, per_device_batch_size=4, seed=3, torch_threads=1)

    def interrupt_after_first(step, metrics):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    first = train_grpo(GRPOConfig(**common), on_step=interrupt_after_first)
    assert first.steps == 1 and [h["step"] for h in first.history] == [1]
    assert latest_checkpoint(tmp_path / "out").name == "checkpoint-1"
    store = RunStore(store_path)
    assert store.get_run(first.run_id).status == "interrupted"
    second = train_grpo(GRPOConfig(**common, resume="auto"))
    assert [h["step"] for h in second.history] == [2, 3]
    assert second.run_id == first.run_id
    assert store.get_run(first.run_id).status == "completed"
    steps_with_rollouts = {t for r in store.list_runs(limit=None) if r.parent_id == first.run_id
                           for t in r.tags if t.startswith("step:")}
    assert steps_with_rollouts == {"step:0", "step:1", "step:2"}


def test_prefetched_rollouts_train_exactly_as_sequential_ones(tiny_model_path, tmp_path):
    """With ``prefetch_rollouts`` the next batch's episodes start during the update but generate
    only after it: every sampled token and every metric equal those of the sequential loop."""
    from closedloop.store import RunStore

    runs = {}
    for prefetch in (False, True):
        store = tmp_path / f"runs-{prefetch}.duckdb"
        cfg = GRPOConfig(model=str(tiny_model_path), output_dir=str(tmp_path / f"out-{prefetch}"), env="calc",
                         env_options={"level": 1}, prompts_per_step=2, num_generations=3, max_steps=3,
                         max_env_steps=3, max_new_tokens=24, learning_rate=3e-3, per_device_batch_size=6, seed=5,
                         torch_threads=1, prefetch_rollouts=prefetch, save_steps=None, store=str(store))
        result = train_grpo(cfg)
        sampled = sorted((t.metadata["step"], t.metadata["group"], t.metadata["sample"],
                          tuple(tuple(turn.completion_ids) for turn in t.turns))
                         for t in RunStore(store).iter_trajectories(parent_id=result.run_id))
        runs[prefetch] = (result.history, sampled)
    (h0, s0), (h1, s1) = runs[False], runs[True]
    assert len(s0) == 3 * 2 * 3 and s0 == s1  # the same tokens, so drawn from the same weights at every step
    # Rows decode beside different batch-mates in the two runs, which moves logprobs (never the
    # drawn tokens: each row has its own seeded uniforms) in the last float bits.
    timing = {"rollout_s", "train_s", "step_s", "tokens_per_s"}
    assert [sorted(h) for h in h0] == [sorted(h) for h in h1]
    for a, b in zip(h0, h1):
        for k in set(a) - timing:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
