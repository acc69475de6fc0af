"""Issue 9, finding 1: one request's sampling settings can never fail (or change) its batch-mates.

A temperature or top_p of 1e-300 is valid OpenAI input. Before the fix it became 0 in float32: the
row's logits were divided by zero, its draw read NaNs and it returned token 0 instead of a sample,
and on CUDA the bad index failed the whole device batch. Now (as vLLM) a temperature in (0, 0.01)
samples at 0.01 and a tiny top_p keeps the top token; a row with non-finite logits fails alone.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from closedloop.messages import UserMessage
from closedloop.models.base import ModelError, SamplingParams
from closedloop.models.hf import MIN_TEMPERATURE, HFClient
from closedloop.server import create_app
from closedloop.server.local import serve_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tiny_model_path):
    torch.set_num_threads(1)
    return HFClient.from_pretrained(tiny_model_path, batch_wait_ms=100, max_batch_size=16)


def _msgs(text: str) -> list:
    return [UserMessage(content=text)]


async def test_tiny_temperature_and_top_p_do_not_fail_or_change_batch_mates(client):
    plain_a = SamplingParams(temperature=1.0, seed=2, max_tokens=12)
    plain_b = SamplingParams(temperature=0.8, seed=4, max_tokens=12)
    tiny_t = SamplingParams(temperature=1e-300, seed=1, max_tokens=12)
    tiny_p = SamplingParams(temperature=0.7, top_p=1e-300, seed=3, max_tokens=12)
    alone_a = await client.generate(_msgs("Hi"), None, plain_a)
    alone_b = await client.generate(_msgs("Who are you?"), None, plain_b)
    at_floor = await client.generate(_msgs("Hello"), None, tiny_t.model_copy(update={"temperature": MIN_TEMPERATURE}))
    greedy = await client.generate(_msgs("Hello there"), None, SamplingParams(temperature=0, max_tokens=12))

    before = len(client.batch_sizes)
    a, t, b, p = await asyncio.gather(client.generate(_msgs("Hi"), None, plain_a),
                                      client.generate(_msgs("Hello"), None, tiny_t),
                                      client.generate(_msgs("Who are you?"), None, plain_b),
                                      client.generate(_msgs("Hello there"), None, tiny_p))
    assert max(client.batch_sizes[before:]) > 1, "the requests did not share a batch"
    # batch-mates are untouched: the same seeded sample as alone
    assert a.completion_ids == alone_a.completion_ids
    assert b.completion_ids == alone_b.completion_ids
    # a 1e-300 temperature samples at vLLM's floor, and says so in its logprob spec
    assert t.completion_ids == at_floor.completion_ids
    assert t.logprob_spec.temperature == MIN_TEMPERATURE
    assert all(lp == lp and lp > -1e30 for lp in t.logprobs)
    # a 1e-300 top_p keeps only the most likely token: greedy, not "token 0"
    assert p.completion_ids == greedy.completion_ids


async def test_a_row_with_non_finite_logits_fails_alone(client, tiny_model_path):
    """A model that turns one row's logits into NaN (a hook on the real model: row 0 of every
    forward pass over more than one row) fails that request only; its batch-mate gets the sample
    it gets alone (and, once alone in the batch, decodes on unpoisoned)."""
    solo = HFClient.from_model(client.model, client.tokenizer, batch_wait_ms=400, max_batch_size=4)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10)
    alone = await solo.generate(_msgs("Who are you?"), None, params)

    def poison(module, inputs, output):
        if output.shape[0] < 2:
            return output
        output = output.clone()
        output[0] = float("nan")
        return output

    handle = client.model.lm_head.register_forward_hook(poison)
    try:
        first = asyncio.ensure_future(solo.generate(_msgs("Hi"), None, params))
        await asyncio.sleep(0.02)  # queued first: row 0 of the batch
        second = asyncio.ensure_future(solo.generate(_msgs("Who are you?"), None, params))
        results = await asyncio.gather(first, second, return_exceptions=True)
    finally:
        handle.remove()
    assert solo.batch_sizes[-1] == 2, "the two requests did not share a batch"
    assert isinstance(results[0], ModelError) and "non-finite" in str(results[0])
    assert not isinstance(results[1], BaseException), results[1]
    assert results[1].completion_ids == alone.completion_ids


def test_server_batch_with_tiny_sampling_values_is_all_200(client):
    """Nine concurrent requests through the server, two with 1e-300 values: all answered."""
    with serve_app(create_app(client, "tiny", default_max_tokens=8)) as url:
        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                bodies = [{"model": "tiny", "messages": [{"role": "user", "content": f"Hello {i}"}],
                           "max_tokens": 8, "seed": i} for i in range(9)]
                bodies[3]["temperature"] = 1e-300
                bodies[6]["top_p"] = 1e-300
                return await asyncio.gather(*(http.post(f"{url}/chat/completions", json=b) for b in bodies))

        responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 9, [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["choices"][0]["message"]["content"] for r in responses)
