"""Continuous batching in ``hf:``: a request that arrives while others decode joins the running
batch at the next step and returns when it is done, not when the batch is; joining changes no
row's tokens or logprobs (rows are padded and masked, each keeps its own positions and seed)."""

import asyncio
import time

import pytest

from closedloop.messages import UserMessage
from closedloop.models.base import SamplingParams
from closedloop.models.hf import HFClient


@pytest.fixture(scope="module")
def endless(tiny_model_path):
    """The tiny model with its end tokens suppressed (a forward hook), so a row runs exactly to
    ``max_tokens``: the long request below is long whatever the model would say."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    probe = HFClient.from_model(model, tokenizer)
    eos = sorted(probe._eos_ids)

    def no_end(module, args, out):
        out.logits[..., eos] = float("-inf")
        return out

    model.register_forward_hook(no_end)
    return model, tokenizer


def _fresh_logprobs(model, turn):
    """The turn's token logprobs from one plain forward pass over prompt + completion, no cache."""
    import torch

    ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    k = len(turn.prompt_ids)
    return torch.log_softmax(logits[k - 1:-1], -1).gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0].tolist()


async def _until(predicate, what: str, timeout_s: float = 300.0) -> None:
    """Poll ``predicate`` while the event loop runs; the deadline only ends a test that would hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def _alone(model, tokenizer, msgs, params):
    client = HFClient.from_model(model, tokenizer, batch_wait_ms=0)
    try:
        return await client.generate(msgs, None, params)
    finally:
        await client.aclose()


async def test_a_late_request_joins_the_running_batch_and_returns_first(endless):
    model, tokenizer = endless
    client = HFClient.from_model(model, tokenizer, batch_wait_ms=0, max_batch_size=8)
    long_msgs, short_msgs = [UserMessage(content="Tell me a long story.")], [UserMessage(content="Hi")]
    long_params = SamplingParams(temperature=1.0, seed=7, max_tokens=400)
    short_params = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=5)
    long_task = asyncio.ensure_future(client.generate(long_msgs, None, long_params))
    await _until(lambda: client.decode_steps >= 10, "the long request decoding")
    assert not long_task.done()
    short = await client.generate(short_msgs, None, short_params)
    assert not long_task.done(), "the late request waited for the running batch to end"
    assert client.batch_sizes[-2:] == [1, 1]  # admitted on its own, into the running batch
    stats = client.batch_stats()
    long = await long_task
    await client.aclose()
    assert stats["mean_rows_per_step"] > 1.0  # the two rows really decoded side by side
    assert len(long.completion_ids) == 400 and long.finish_reason == "length"
    assert len(short.completion_ids) == 5
    # Joining changed neither row: each equals the same seeded request decoded alone.
    for turn, msgs, params in ((long, long_msgs, long_params), (short, short_msgs, short_params)):
        solo = await _alone(model, tokenizer, msgs, params)
        assert turn.completion_ids == solo.completion_ids
        assert max(abs(a - b) for a, b in zip(turn.logprobs, solo.logprobs)) < 1e-4


async def test_rows_of_different_lengths_share_steps_and_stay_exact(endless):
    """Many requests with different prompt lengths and budgets arriving at different times: every
    result equals its solo decode, and the batch never exceeds ``max_batch_size`` rows."""
    model, tokenizer = endless
    client = HFClient.from_model(model, tokenizer, batch_wait_ms=0, max_batch_size=3)
    prompts = ["a", "What is the weather in Oslo today, please?", "Hello there", "Multiply 6 by 7.", "x y z"]
    jobs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=8 + 9 * i)
        jobs.append((p, params, asyncio.ensure_future(client.generate([UserMessage(content=p)], None, params))))
        await asyncio.sleep(0.01 * i)
    turns = [await job for _, _, job in jobs]
    await client.aclose()
    assert sum(client.batch_sizes) == len(prompts) and max(client.batch_sizes) <= 3
    assert client.batch_stats()["mean_rows_per_step"] <= 3
    for (p, params, _), turn in zip(jobs, turns):
        assert len(turn.completion_ids) == params.max_tokens
        solo = await _alone(model, tokenizer, [UserMessage(content=p)], params)
        assert turn.completion_ids == solo.completion_ids
        assert max(abs(a - b) for a, b in zip(turn.logprobs, solo.logprobs)) < 1e-4


async def test_a_pause_lets_running_rows_drain_and_admits_nothing_new(endless):
    """While a trainer waits in ``paused()``, a request that arrives is not admitted into the
    running batch; it decodes after the block, on the weights changed inside it."""
    import torch

    model, tokenizer = endless
    client = HFClient.from_model(model, tokenizer, batch_wait_ms=0)
    running = asyncio.ensure_future(client.generate([UserMessage(content="go")], None,
                                                    SamplingParams(temperature=0, max_tokens=150)))
    await _until(lambda: client.decode_steps >= 5, "the running request decoding")
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    release = asyncio.Event()
    steps_at_entry: list[int] = []

    def trainer() -> None:
        with client.paused():
            steps_at_entry.append(client.decode_steps)
            loop.call_soon_threadsafe(entered.set)
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result()

    thread = loop.run_in_executor(None, trainer)
    await _until(lambda: client._pausing > 0, "the trainer waiting in paused()")  # for the running row
    late = asyncio.ensure_future(client.generate([UserMessage(content="late")], None,
                                                 SamplingParams(temperature=0, max_tokens=4)))
    await entered.wait()
    assert running.done(), "paused() was entered while a row was still decoding"
    assert not late.done()
    await asyncio.sleep(0.1)
    assert not late.done() and client.decode_steps == steps_at_entry[0], "a row decoded inside paused()"
    release.set()
    await thread
    assert (await late).completion_ids and len((await running).completion_ids) == 150
    await client.aclose()
    del torch


async def test_a_gap_ends_the_idle_gather_once_a_burst_is_over(tiny_model_path):
    """With ``batch_gap_ms``, an idle decoder gathers a burst (one admission for a group sent
    together) but does not sit out the whole ``batch_wait_ms`` after it: a lone request is
    answered although the wait is a minute."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    client = HFClient.from_model(model, AutoTokenizer.from_pretrained(tiny_model_path), batch_wait_ms=60_000,
                                 batch_gap_ms=50)
    params = SamplingParams(temperature=0, max_tokens=3)
    burst = await asyncio.wait_for(asyncio.gather(*(client.generate([UserMessage(content="Hi")], None, params)
                                                    for _ in range(4))), 30)
    assert len(burst) == 4 and client.batch_sizes == [4]
    lone = await asyncio.wait_for(client.generate([UserMessage(content="Hello")], None, params), 30)
    assert lone.completion_ids and client.batch_sizes == [4, 1]
    await client.aclose()
    with pytest.raises(ValueError):
        HFClient.from_model(model, client.tokenizer, batch_gap_ms=-1)


async def test_cached_decode_matches_a_fresh_forward_as_rows_leave_join_and_outgrow_the_slack(endless):
    """The decode fast paths (KV layers with spare columns written in place, a 4D step mask) give
    the logprobs of a plain full forward pass without any cache, for rows that join a running
    batch, outlive rows that leave it, and decode past the cache's spare room."""

    from closedloop.models.decode_batch import SLACK_TOKENS

    model, tokenizer = endless
    client = HFClient.from_model(model, tokenizer, batch_wait_ms=0, max_batch_size=4)
    budgets = [SLACK_TOKENS + 20, 5, 30, 12, 2 * SLACK_TOKENS + 3]
    jobs = []
    for i, n in enumerate(budgets):
        params = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=n)
        jobs.append(asyncio.ensure_future(client.generate([UserMessage(content="Hi " * (1 + 3 * i))], None, params)))
        await asyncio.sleep(0.02)
    turns = [await job for job in jobs]
    await client.aclose()
    assert len(client.batch_sizes) > 1, "the requests should have joined a running batch"
    for turn, n in zip(turns, budgets):
        assert len(turn.completion_ids) == n
        assert max(abs(a - b) for a, b in zip(turn.logprobs, _fresh_logprobs(model, turn))) < 1e-4


async def test_requests_queued_during_a_pause_start_as_one_batch(endless):
    """A trainer's next rollout submits its requests while the update holds ``paused()``: when the
    pause ends they are prefilled together, not the first few alone and the rest admitted later."""
    model, tokenizer = endless
    client = HFClient.from_model(model, tokenizer, batch_wait_ms=0, batch_gap_ms=1.0)
    params = SamplingParams(temperature=0, max_tokens=4)
    await client.generate([UserMessage(content="warm")], None, params)
    hold = client.paused()
    hold.__enter__()
    try:
        jobs = []
        for i in range(6):  # arrivals spread wider than the burst gap
            jobs.append(asyncio.ensure_future(client.generate([UserMessage(content=f"q{i}")], None, params)))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not any(j.done() for j in jobs)
    finally:
        hold.__exit__(None, None, None)  # the lock's owner releases it (an RLock)
    await asyncio.gather(*jobs)
    await client.aclose()
    assert client.batch_sizes[1:] == [6]


async def test_rows_that_finish_early_stay_exact_while_they_linger_in_the_batch(endless):
    """A finished row may stay in the running batch (its cache is cut out only once a quarter of
    the rows are done, or when rows join): the rows still decoding keep the tokens of their solo
    decode and the logprobs of a fresh forward pass, and nobody receives a lingering row's tokens."""

    model, tokenizer = endless
    client = HFClient.from_model(model, tokenizer, batch_wait_ms=50, max_batch_size=8)
    budgets = [3, 40, 5, 33, 7, 26, 9, 18]
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=n) for i, n in enumerate(budgets)]
    prompts = [f"row {i} " + "x " * i for i in range(len(budgets))]
    turns = await asyncio.gather(*(client.generate([UserMessage(content=p)], None, q) for p, q in zip(prompts, params)))
    await client.aclose()
    assert client.batch_sizes == [8]
    for p, q, turn in zip(prompts, params, turns):
        assert len(turn.completion_ids) == q.max_tokens
        solo = await _alone(model, tokenizer, [UserMessage(content=p)], q)
        assert turn.completion_ids == solo.completion_ids
        assert max(abs(a - b) for a, b in zip(turn.logprobs, _fresh_logprobs(model, turn))) < 1e-4
