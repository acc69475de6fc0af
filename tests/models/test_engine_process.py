"""The ``hf:`` engine in a child process (what ``closedloop serve`` runs by default): the same
turns as the in-process client, streaming, cancellation that reaches the child's batch, errors that
keep their type across the pipe, weight loads through shared memory, and a dead child reported as
:class:`ModelUnavailableError` rather than a hang."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from closedloop.messages import UserMessage
from closedloop.models import ContextLengthExceededError, SamplingParams, TextDelta, TurnDone
from closedloop.models.base import ModelUnavailableError
from closedloop.models.engine_process import EngineProcessClient
from closedloop.models.tiny import endless_client
from closedloop.models.weights import WeightsError, served_model_type

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    client = EngineProcessClient(f"hf:{tiny_model_path}", torch_threads=1)
    yield client
    client.close()


async def _wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out {what}")
        await asyncio.sleep(0.02)  # the event loop runs meanwhile (a dropped stream closes on it)


async def test_turns_match_the_in_process_client(engine, tiny_client, tools):
    msgs = [UserMessage(content="What is 3 plus 4?")]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24)
    here = await tiny_client.generate(msgs, [tools["add"]], params)
    there = await engine.generate(msgs, [tools["add"]], params)
    assert there.completion_ids == here.completion_ids
    assert there.prompt_ids == here.prompt_ids
    assert max(abs(a - b) for a, b in zip(there.logprobs, here.logprobs)) < 1e-4
    assert there.completion_text == here.completion_text and there.finish_reason == here.finish_reason
    assert there.message.content == here.message.content
    assert [c.function for c in there.message.tool_calls or []] == [c.function for c in here.message.tool_calls or []]
    # What the server needs of it without a model object in this process.
    assert engine._end_markers == tiny_client._end_markers
    assert served_model_type(engine) == tiny_client.model.config.model_type
    assert engine.tokenizer.decode(there.completion_ids) == tiny_client.tokenizer.decode(there.completion_ids)


async def test_concurrent_requests_batch_in_the_child(engine):
    before = engine.batch_stats()["requests"]
    turns = await asyncio.gather(*(engine.generate([UserMessage(content=f"Hello {i}")], None,
                                                   SamplingParams(max_tokens=6, seed=i)) for i in range(6)))
    assert len(turns) == 6 and all(t.completion_ids for t in turns)
    stats = engine.batch_stats()
    assert stats["requests"] - before == 6
    assert stats["max_batch"] > 1  # the six met in the child's running batch


async def test_stream_deltas_join_to_the_turn(engine, tools):
    msgs = [UserMessage(content="What is 3 plus 4?")]
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=40)
    events = [e async for e in engine.stream(msgs, [tools["add"]], params)]
    assert isinstance(events[-1], TurnDone) and all(isinstance(e, TextDelta) for e in events[:-1])
    assert len(events) > 2
    turn = events[-1].turn
    assert "".join(e.text for e in events[:-1]) == turn.completion_text
    assert (await engine.generate(msgs, [tools["add"]], params)).completion_ids == turn.completion_ids


async def test_errors_keep_their_type_across_the_process(engine, tiny_client):
    limit = tiny_client.model.config.max_position_embeddings
    with pytest.raises(ContextLengthExceededError) as info:
        await engine.generate([UserMessage(content=" ".join(["shark"] * (limit + 50)))], None,
                              SamplingParams(max_tokens=4))
    assert info.value.limit == limit and info.value.prompt_tokens > limit
    with pytest.raises(WeightsError, match="shape"):
        engine.load_weights([(k, v[:1].clone()) for k, v in tiny_client.model.state_dict().items()])
    ok = await engine.generate([UserMessage(content="Hi")], None, SamplingParams(max_tokens=3))
    assert ok.completion_ids  # the child still serves


async def test_weight_loads_reach_the_child(engine, tiny_client):
    import torch

    msgs = [UserMessage(content="Who are you?")]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    original = {k: v.detach().clone() for k, v in tiny_client.model.state_dict().items()}
    before = await engine.generate(msgs, None, greedy)
    torch.manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()}
    assert engine.load_weights(noisy.items()) == len(noisy)
    changed = await engine.generate(msgs, None, greedy)
    assert changed.logprobs != before.logprobs
    assert engine.load_weights(original.items()) == len(original)
    restored = await engine.generate(msgs, None, greedy)
    assert restored.completion_ids == before.completion_ids
    assert max(abs(a - b) for a, b in zip(restored.logprobs, before.logprobs)) < 1e-5


async def test_cancellation_reaches_the_child_and_a_dead_child_fails_fast(tiny_model_path):
    endless = EngineProcessClient(f"hf:{tiny_model_path}", torch_threads=1, factory=endless_client)
    try:
        stream = endless.stream([UserMessage(content="Tell me a story")], None,
                                SamplingParams(temperature=1.0, max_tokens=4000))
        async with contextlib.aclosing(stream):
            async for event in stream:
                assert isinstance(event, TextDelta)
                break  # decoding is under way; closing the stream walks away
        await _wait_for(lambda: endless.batch_stats()["cancelled_rows"] == 1, "cancelling the abandoned stream's row")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(endless.generate([UserMessage(content="Tell me a story")], None,
                                                    SamplingParams(max_tokens=4000)), 0.5)
        await _wait_for(lambda: endless.batch_stats()["cancelled_rows"] == 2, "cancelling the timed-out request's row")
        short = await endless.generate([UserMessage(content="Hi")], None, SamplingParams(max_tokens=5))
        assert len(short.completion_ids) == 5  # no end of sequence: it decodes to max_tokens

        steps = endless.batch_stats()["decode_steps"]
        pending = asyncio.ensure_future(endless.generate([UserMessage(content="Tell me a story")], None,
                                                         SamplingParams(max_tokens=4000)))
        await _wait_for(lambda: endless.batch_stats()["decode_steps"] > steps, "the request decoding in the child")
        endless._process.kill()  # the engine dies mid-request
        with pytest.raises(ModelUnavailableError, match="exited"):
            await asyncio.wait_for(pending, 30)
        with pytest.raises(ModelUnavailableError):
            await endless.generate([UserMessage(content="Hi")], None, SamplingParams(max_tokens=2))
        assert not endless.alive
    finally:
        endless.close()


def test_a_model_that_cannot_load_raises_in_the_caller(tmp_path):
    with pytest.raises(Exception, match="not-a-model|does not appear|Can't load|config"):
        EngineProcessClient(f"hf:{tmp_path / 'not-a-model'}", start_timeout_s=120)
    with pytest.raises(ValueError, match="hf:"):
        EngineProcessClient("openai:gpt-4o")
