import asyncio

import pytest

from closedloop.messages import LogprobSpec, ToolMessage, UserMessage
from closedloop.models.base import GenerateRequest, SamplingParams, TextDelta, TurnDone
from closedloop.models.hf import HFClient

ARITH = ["What is 3 plus 4?", "Add 12 and 7.", "What is 9 + 2?", "Please add 5 and 8.", "Compute 6 plus 1."]


def _recompute_logprobs(client, turn, temperature):
    import torch

    ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
    with torch.no_grad():
        logits = client.model(input_ids=ids).logits[0].float()
    n = len(turn.prompt_ids)
    scaled = logits[n - 1:-1] / (temperature or 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0].tolist()


async def test_turn_is_token_exact_and_logprobs_match_a_fresh_forward_pass(tiny_client, tools):
    msgs = [UserMessage(content="What is 3 plus 4?")]
    turn = await tiny_client.generate(msgs, [tools["add"], tools["multiply"]],
                                      SamplingParams(temperature=0.8, seed=11, max_tokens=40))
    assert turn.prompt_ids == tiny_client.encode_prompt(msgs, [tools["add"], tools["multiply"]])
    assert tiny_client.decode(turn.completion_ids) == turn.completion_text
    assert len(turn.logprobs) == len(turn.completion_ids) == turn.usage.completion_tokens
    assert turn.loss_mask == [0] * len(turn.prompt_ids) + [1] * len(turn.completion_ids)
    recomputed = _recompute_logprobs(tiny_client, turn, 0.8)
    assert max(abs(a - b) for a, b in zip(turn.logprobs, recomputed)) < 1e-4
    assert turn.logprob_spec == LogprobSpec(mode="tempered", temperature=0.8, top_p=1.0, backend="hf")
    assert turn.latency_s > 0 and turn.finish_reason in {"stop", "tool_calls", "length"}


async def test_greedy_logprobs_are_unscaled(tiny_client):
    turn = await tiny_client.generate([UserMessage(content="Hello!")], None,
                                      SamplingParams(temperature=0, top_p=0.5, max_tokens=12))
    recomputed = _recompute_logprobs(tiny_client, turn, 0)
    assert max(abs(a - b) for a, b in zip(turn.logprobs, recomputed)) < 1e-4
    # Greedy reads the plain softmax: the spec says so by recording temperature 1 (top_p unused).
    assert turn.logprob_spec == LogprobSpec(mode="tempered", temperature=1.0, top_p=1.0, backend="hf")


async def test_top_p_changes_what_is_drawn_not_the_recorded_logprob(tiny_client, tools):
    """At temperature 0.7 and top_p 0.9 the recorded value is log_softmax(logits / 0.7) over the
    full vocabulary (an independent forward pass), not the renormalised top-p distribution."""
    import torch

    msgs = [UserMessage(content="What is 3 plus 4?")]
    turns = await tiny_client.generate_many(msgs, [tools["add"]],
                                            SamplingParams(temperature=0.7, top_p=0.9, seed=21, max_tokens=40), n=3)
    gaps = []
    for turn in turns:
        assert turn.logprob_spec == LogprobSpec(mode="tempered", temperature=0.7, top_p=0.9, backend="hf")
        assert turn.logprob_spec.comparable_to_tempered()
        recomputed = _recompute_logprobs(tiny_client, turn, 0.7)
        assert max(abs(a - b) for a, b in zip(turn.logprobs, recomputed)) < 1e-4
        # What "processed" (post-top-p, renormalised) logprobs would have been: where top-p cut
        # tokens they differ, so the comparison above is not vacuous.
        ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
        with torch.no_grad():
            logits = tiny_client.model(input_ids=ids).logits[0, len(turn.prompt_ids) - 1:-1].float() / 0.7
        probs = torch.softmax(logits, -1)
        for step, token in enumerate(turn.completion_ids):
            sorted_p, order = torch.sort(probs[step], descending=True)
            kept = order[(torch.cumsum(sorted_p, 0) - sorted_p) < 0.9]
            assert token in kept.tolist(), "a token outside the top-p set was drawn"
            gaps.append(float(torch.log(probs[step, kept].sum())))
    assert min(gaps) < -1e-3, "top-p never removed any mass; the test shows nothing"


async def test_warmed_up_model_calls_the_add_tool(tiny_client, tools):
    turns = await asyncio.gather(*(tiny_client.generate([UserMessage(content=q)], [tools["add"]],
                                                        SamplingParams(temperature=0, max_tokens=48))
                                   for q in ARITH))
    good = 0
    for turn in turns:
        calls = turn.message.tool_calls or []
        if calls and calls[0].name == "add" and set(calls[0].parsed_arguments()) == {"a", "b"}:
            good += 1
            assert turn.finish_reason == "tool_calls"
    assert good >= 4, [t.completion_text for t in turns]


async def test_seeded_sampling_is_the_same_alone_and_inside_a_batch(tiny_client, tools):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=40)
    msgs = [UserMessage(content="What is 2 times 9?")]
    alone = await tiny_client.generate(msgs, [tools["multiply"]], params)
    others = [tiny_client.generate([UserMessage(content=q)], list(tools.values()),
                                   SamplingParams(temperature=1.0, seed=i, max_tokens=60))
              for i, q in enumerate(["Hi", "What is the weather in Oslo? Tell me please, it matters a lot.", "x"])]
    n_batches = len(tiny_client.batch_sizes)
    results = await asyncio.gather(others[0], tiny_client.generate(msgs, [tools["multiply"]], params), *others[1:])
    assert max(tiny_client.batch_sizes[n_batches:]) > 1, "the requests did not share a batch"
    in_batch = results[1]
    assert in_batch.completion_ids == alone.completion_ids
    assert max(abs(a - b) for a, b in zip(in_batch.logprobs, alone.logprobs)) < 1e-4
    # Different seeds give different samples (the seed is really used).
    third = await tiny_client.generate(msgs, [tools["multiply"]], params.model_copy(update={"seed": 99}))
    fourth = await tiny_client.generate(msgs, [tools["multiply"]], params.model_copy(update={"seed": 98}))
    assert len({tuple(t.completion_ids) for t in (alone, third, fourth)}) > 1 or \
        len({tuple(t.logprobs) for t in (alone, third, fourth)}) > 1


async def test_concurrent_requests_share_a_device_batch(tiny_client):
    client = HFClient.from_model(tiny_client.model, tiny_client.tokenizer, max_batch_size=4, batch_wait_ms=50)
    turns = await asyncio.gather(*(client.generate([UserMessage(content=f"Hello {i}")], None,
                                                   SamplingParams(max_tokens=4, seed=i)) for i in range(6)))
    assert len(turns) == 6
    assert sum(client.batch_sizes) == 6
    assert max(client.batch_sizes) == 4  # capped by max_batch_size, and really batched
    batched = await client.batch([GenerateRequest([UserMessage(content="Hi")], params=SamplingParams(max_tokens=3))] * 3)
    assert len(batched) == 3 and client.batch_sizes[-1] == 3
    await client.aclose()


async def test_stream_deltas_join_to_the_turn_text(tiny_client, tools):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=40)
    msgs = [UserMessage(content="What is 3 plus 4?")]
    events = [e async for e in tiny_client.stream(msgs, [tools["add"]], params)]
    assert isinstance(events[-1], TurnDone)
    deltas = [e.text for e in events[:-1]]
    assert all(isinstance(e, TextDelta) for e in events[:-1]) and len(deltas) > 1
    turn = events[-1].turn
    assert "".join(deltas) == turn.completion_text
    plain = await tiny_client.generate(msgs, [tools["add"]], params)
    assert plain.completion_ids == turn.completion_ids


async def test_stop_strings_max_tokens_and_generate_many(tiny_client, tools):
    msgs = [UserMessage(content="What is 3 plus 4?")]
    stopped = await tiny_client.generate(msgs, [tools["add"]], SamplingParams(temperature=0, stop=['"name"']))
    assert stopped.finish_reason == "stop"
    assert '"name"' in stopped.completion_text
    assert '"name"' not in (stopped.message.text or "")
    assert tiny_client.decode(stopped.completion_ids) == stopped.completion_text
    short = await tiny_client.generate(msgs, [tools["add"]], SamplingParams(temperature=0, max_tokens=3))
    assert short.finish_reason == "length" and len(short.completion_ids) == 3
    many = await tiny_client.generate_many(msgs, [tools["add"]], SamplingParams(seed=7, max_tokens=20), n=3)
    again = await tiny_client.generate_many(msgs, [tools["add"]], SamplingParams(seed=7, max_tokens=20), n=3)
    assert [t.completion_ids for t in many] == [t.completion_ids for t in again]
    with pytest.raises(ValueError):
        await tiny_client.generate_many(msgs, None, None, n=0)


async def test_follow_up_turn_after_tool_result_extends_the_token_sequence(tiny_client, tools):
    msgs = [UserMessage(content="What is 3 plus 4?")]
    first = await tiny_client.generate(msgs, [tools["add"]], SamplingParams(temperature=0, max_tokens=48))
    assert first.message.tool_calls
    call = first.message.tool_calls[0]
    history = msgs + [first.message, ToolMessage(tool_call_id=call.id, content="7", name="add")]
    second = await tiny_client.generate(history, [tools["add"]], SamplingParams(temperature=0, max_tokens=24))
    assert second.finish_reason in {"stop", "length"}
    # The re-rendered history starts with exactly the tokens of the first turn (minus the
    # template's newline after <|im_end|>), so trainers can merge both into one sequence.
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == \
        first.prompt_ids + first.completion_ids


async def test_from_model_wraps_the_live_model_without_copying(tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.eval()
    client = HFClient.from_model(model, AutoTokenizer.from_pretrained(tiny_model_path), name="policy")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8)
    msgs = [UserMessage(content="Hi")]
    before = await client.generate(msgs, None, params)
    assert client.model is model and before.model == "policy"
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # an optimizer step, in effect
    after = await client.generate(msgs, None, params)
    assert after.logprobs[0] != pytest.approx(before.logprobs[0], abs=1e-6)
    await client.aclose()


async def test_bad_request_fails_alone(tiny_client):
    good = tiny_client.generate([UserMessage(content="Hi")], None, SamplingParams(max_tokens=3))
    bad = tiny_client.generate([UserMessage(content="Hi")], [{"type": "function", "function": {"name": "a"}}],
                               SamplingParams(max_tokens=3), tool_choice={"type": "function", "function": {"name": "z"}})
    results = await asyncio.gather(good, bad, return_exceptions=True)
    assert results[0].completion_ids and isinstance(results[1], ValueError)


async def test_generation_leaves_the_train_mode_of_a_live_policy_alone(tiny_model_path):
    """A trainer's policy in train mode (dropout > 0) stays in train mode during and after a
    generation: the client never flips the mode of a module a trainer is using."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attention_dropout=0.3)
    model.train()
    modes: list[bool] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: modes.append(mod.training))
             for m in (model, model.model.layers[0].self_attn)]
    client = HFClient.from_model(model, AutoTokenizer.from_pretrained(tiny_model_path), name="policy")
    turns = await client.generate_many([UserMessage(content="Hi")], None, SamplingParams(seed=1, max_tokens=6), n=2)
    assert all(t.completion_ids for t in turns)
    assert modes and all(modes), "the model left train mode during generation"
    assert model.training and model.model.layers[0].self_attn.training
    for h in hooks:
        h.remove()
    await client.aclose()


async def test_paused_keeps_generation_out_until_the_block_exits(tiny_model_path):
    """A generation submitted while a trainer holds ``paused()`` decodes only after the block: no
    forward pass runs while the (simulated) optimizer step changes the weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    client = HFClient.from_model(model, AutoTokenizer.from_pretrained(tiny_model_path), batch_wait_ms=0)
    state = {"updating": False}
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(lambda mod, args: seen.append(state["updating"]))
    params = SamplingParams(temperature=0, max_tokens=4)
    await client.generate([UserMessage(content="Hi")], None, params)  # the worker thread is up
    seen.clear()
    with client.paused():
        state["updating"] = True
        pending = asyncio.ensure_future(client.generate([UserMessage(content="Hi")], None, params))
        for _ in range(200):  # until the worker has taken the request and waits on the lock
            await asyncio.sleep(0.01)
            if client._queue.empty():
                break
        await asyncio.sleep(0.2)  # ample time to decode if the lock did not hold it back
        assert not pending.done() and not seen, "a generation decoded inside paused()"
        with torch.no_grad():
            model.lm_head.weight.mul_(0.5)  # the optimizer step
        with client.paused():  # re-entrant
            pass
        state["updating"] = False
    turn = await pending
    assert seen and not any(seen) and turn.completion_ids
    hook.remove()
    await client.aclose()
