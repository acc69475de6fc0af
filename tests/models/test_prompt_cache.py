"""``hf:``'s prompt cache: a repeated prompt joins the batch from its cached prefill state with the
same tokens and logprobs as a prefill would give, copies of one prompt are prefilled once, and no
state outlives a change of the weights (in place, under ``paused()``, or through ``.data``) or is
used in train mode."""

from __future__ import annotations

import asyncio

import pytest

from closedloop.messages import UserMessage
from closedloop.models.base import SamplingParams
from closedloop.models.hf import HFClient
from closedloop.models.prompt_cache import PromptCache, PromptState, weights_signature


def _state(n: int) -> PromptState:
    import torch

    return PromptState(keys=(torch.zeros(2, n, 4),), values=(torch.zeros(2, n, 4),), logits=torch.zeros(8))


def test_the_budget_counts_prompt_tokens_and_drops_the_least_recently_used():
    cache = PromptCache(max_tokens=10)
    cache.put("a", _state(4))
    cache.put("b", _state(4))
    assert cache.get("a") is not None  # "a" is now the most recent
    cache.put("c", _state(4))  # 12 tokens: the oldest ("b") goes
    assert cache.holds("a") and cache.holds("c") and not cache.holds("b")
    assert cache.tokens == 8
    cache.put("huge", _state(11))  # longer than the whole budget: not kept, nothing evicted for it
    assert not cache.holds("huge") and len(cache) == 2
    assert (cache.hits, cache.misses) == (1, 0)
    assert cache.get("b") is None and cache.misses == 1
    cache.validate(("w", 1))
    assert len(cache) == 0  # a first signature: whatever was there is not known to match it
    cache.put("a", _state(4))
    cache.validate(("w", 1))
    assert cache.holds("a")
    cache.validate(("w", 2))
    assert not cache.holds("a") and cache.tokens == 0
    with pytest.raises(ValueError):
        PromptCache(-1)


@pytest.fixture
def pair(tiny_model_path):
    """A client with the prompt cache and one without, on separate copies of the tiny model."""
    cached = HFClient.from_pretrained(tiny_model_path, prompt_cache_tokens=4096, max_batch_size=32,
                                      batch_wait_ms=20)
    plain = HFClient.from_pretrained(tiny_model_path, max_batch_size=32, batch_wait_ms=20)
    yield cached, plain
    for c in (cached, plain):
        c._tokenizer_pool.shutdown(wait=False)


async def _run(client, prompts, params):
    return await asyncio.gather(*(client.generate([UserMessage(content=p)], None, params) for p in prompts))


def _same(a, b):
    assert [t.completion_ids for t in a] == [t.completion_ids for t in b]
    assert max(abs(x - y) for ta, tb in zip(a, b) for x, y in zip(ta.logprobs, tb.logprobs)) < 1e-5


async def test_repeated_prompts_sample_as_if_prefilled(pair):
    cached, plain = pair
    prompts = [f"question {i % 3}" for i in range(9)]
    sampled = SamplingParams(temperature=0.9, max_tokens=16, seed=11)
    first = await _run(cached, prompts, sampled)
    _same(first, await _run(plain, prompts, sampled))
    stats = cached.batch_stats()["prompt_cache"]
    # one admission of nine rows: three distinct prompts prefilled, six copies from that pass
    assert stats == {"hits": 6, "misses": 3, "entries": 3, "tokens": stats["tokens"]}
    assert plain.batch_stats()["prompt_cache"] is None
    again = await _run(cached, prompts, sampled)  # every row from the cache now: no prefill pass
    assert cached.batch_stats()["prompt_cache"]["hits"] == 15
    _same(again, first)
    # rows from the cache join a batch that is already decoding, beside prefilled newcomers
    long = asyncio.ensure_future(cached.generate([UserMessage(content="tell me a story")], None,
                                                 SamplingParams(temperature=0.9, max_tokens=40, seed=3)))
    await asyncio.sleep(0.3)
    mixed = ["question 1", "something new", "question 2"]
    joined = await _run(cached, mixed, sampled)
    _same(joined, await _run(plain, mixed, sampled))
    await long


async def test_no_state_outlives_a_change_of_the_weights(pair):
    import torch

    cached, plain = pair
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["Who are you?"]
    await _run(cached, prompts, greedy)
    assert cached.prompt_cache.holds(tuple(cached.encode_prompt([UserMessage(content="Who are you?")])))
    for client in (cached, plain):
        with torch.no_grad():  # in place: the version counters move
            client.model.model.norm.weight.mul_(3.0)
    _same(await _run(cached, prompts, greedy), await _run(plain, prompts, greedy))
    for client in (cached, plain):  # through .data: invisible to version counters, so under paused()
        with client.paused():
            client.model.model.norm.weight.data.mul_(0.1)
    _same(await _run(cached, prompts, greedy), await _run(plain, prompts, greedy))
    hits = cached.prompt_cache.hits
    cached.model.train()  # (the tiny model has no dropout: the logits are the same in train mode)
    plain.model.train()
    _same(await _run(cached, prompts * 2, greedy), await _run(plain, prompts * 2, greedy))
    assert cached.prompt_cache.hits == hits  # no state is read or written in train mode


async def test_a_state_from_the_cache_decodes_like_its_prefill(tiny_model_path):
    """``DecodeBatch.from_states`` rebuilt from ``row_state`` gives the prefill's logits and the same
    next step, at a different padding width."""
    import torch

    from closedloop.models.decode_batch import DecodeBatch

    client = HFClient.from_pretrained(tiny_model_path)

    class Row:
        def __init__(self, ids):
            self.prompt_ids, self.max_new, self.generator = ids, 4, None
            self.req = type("Req", (), {"params": SamplingParams(temperature=0.0)})()

    rows = [Row(client.encode_prompt([UserMessage(content=c)])) for c in ("Hi", "What is the weather in Paris?")]
    with torch.inference_mode():
        fresh = DecodeBatch.prefill(client.model, rows, pad=client._pad_id, cache_kw=client._cache_kw, device="cpu",
                                    extra_inputs={})
        states = [fresh.row_state(i) for i in range(2)]
        rebuilt = DecodeBatch.from_states(client.model, rows[:1], states[:1], device="cpu")
        assert rebuilt.attn.shape[1] < fresh.attn.shape[1]  # the short prompt alone: no padding
        assert torch.equal(rebuilt.last[0], fresh.last[0])
        tokens = fresh.last.argmax(-1)
        fresh.forward(client.model, tokens, client._cache_kw)
        rebuilt.forward(client.model, tokens[:1], client._cache_kw)
        assert torch.allclose(rebuilt.last[0], fresh.last[0], atol=1e-5)
    assert weights_signature(client.model) == weights_signature(client.model)
    client._tokenizer_pool.shutdown(wait=False)
