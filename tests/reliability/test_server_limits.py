"""Issue 9, findings 10 and 11: request size, tokenisation off the decode worker, max_tokens cap,
and generation cancelled when the client goes away.

No timed assertions: ordering is shown with events (the small request finishes while the big one
is provably still tokenising), and cancellation by the backend's own counter of dropped rows.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

from closedloop.messages import UserMessage
from closedloop.models.base import SamplingParams
from closedloop.models.hf import HFClient
from closedloop.server import create_app
from closedloop.server.local import serve_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tiny_model_path) -> HFClient:
    torch.set_num_threads(1)
    return HFClient.from_pretrained(tiny_model_path, batch_wait_ms=5)


def _body(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def _wait_for(predicate, what: str, limit_s: float = 60.0) -> None:
    """Liveness guard, not a timing claim: fail instead of hanging if ``what`` never happens."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {limit_s:.0f} s")
        time.sleep(0.05)


# --------------------------------------------------------------------------- size


def test_body_over_the_cap_is_413_and_the_server_lives_on(tiny):
    with serve_app(create_app(tiny, "tiny", default_max_tokens=4, max_request_bytes=64 * 1024)) as url:
        big = _body("x" * (100 * 1024), max_tokens=4)
        r = httpx.post(f"{url}/chat/completions", json=big, timeout=60)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: the cap is enforced while reading
            raw = json.dumps(big).encode()
            for i in range(0, len(raw), 8192):
                yield raw[i:i + 8192]

        r = httpx.post(f"{url}/chat/completions", content=chunked(), timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        ok = httpx.post(f"{url}/chat/completions", json=_body("Hi", max_tokens=4), timeout=60)
        assert ok.status_code == 200, ok.text


class _GatedTokenizerClient(HFClient):
    """The real tiny model whose prompt encoding waits for ``release`` when the prompt holds the
    word ``BIG`` (a stand-in for a 20 MB prompt that takes a minute to tokenise)."""

    started = threading.Event()
    release = threading.Event()

    def encode_prompt(self, messages, tools=None, tool_choice=None):
        if any("BIG" in (m.content or "") for m in messages if isinstance(m.content, str)):
            self.started.set()
            if not self.release.wait(120):
                raise RuntimeError("never released")
        return super().encode_prompt(messages, tools, tool_choice)


async def test_a_slow_prompt_does_not_block_the_decode_worker(tiny):
    client = _GatedTokenizerClient(tiny.model, tiny.tokenizer, batch_wait_ms=5)
    # Above hf:'s inline limit (short prompts are rendered on the caller's loop; long ones go to
    # the tokenizer pool, which is what this test is about).
    big = asyncio.ensure_future(client.generate([UserMessage(content="BIG " + "word " * 1700)], None,
                                                SamplingParams(temperature=0, max_tokens=4)))
    await asyncio.get_running_loop().run_in_executor(None, client.started.wait, 60)
    assert client.started.is_set()
    try:
        small = await asyncio.wait_for(client.generate([UserMessage(content="Hi")], None,
                                                       SamplingParams(temperature=0, max_tokens=4)), 60)
        assert small.completion_ids
        assert not big.done(), "the big request finished first; the test shows nothing"
    finally:
        client.release.set()
    assert (await big).prompt_ids


# --------------------------------------------------------------------------- max_tokens


def test_max_tokens_above_the_cap_is_400_like_openai(tiny):
    with serve_app(create_app(tiny, "tiny", default_max_tokens=4, max_tokens_cap=16)) as url:
        for field in ("max_tokens", "max_completion_tokens"):
            r = httpx.post(f"{url}/chat/completions", json=_body("Hi", **{field: 10 ** 9}), timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and "16" in err["message"]
        assert httpx.post(f"{url}/chat/completions", json=_body("Hi", max_tokens=16), timeout=60).status_code == 200
    with pytest.raises(ValueError):
        create_app(tiny, "tiny", default_max_tokens=64, max_tokens_cap=16)


# --------------------------------------------------------------------------- disconnects


@pytest.fixture
def endless(tiny) -> HFClient:
    """The real model with its end-of-sequence ids removed: it decodes until max_tokens."""
    client = HFClient.from_model(tiny.model, tiny.tokenizer, batch_wait_ms=100)  # batch-mates meet on busy CI
    client._eos_ids = set()
    return client


def test_a_disconnected_stream_cancels_its_generation(endless):
    with serve_app(create_app(endless, "tiny", default_max_tokens=4, max_tokens_cap=8000)) as url:
        with httpx.stream("POST", f"{url}/chat/completions", timeout=60,
                          json=_body("Tell me a story", max_tokens=7000, stream=True, temperature=0)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():  # greedy, its reply starts with plain text (a sampled one may open
                # with <tool_call>, which the server holds back to the end: there would be nothing to cancel)
                if '"content": "' in line and '"content": ""' not in line:
                    break  # generation is under way; now walk away
        _wait_for(lambda: endless.cancelled_rows == 1, "cancelling the disconnected stream's row")
        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()
        assert health["batches"]["cancelled_rows"] == 1
        after = httpx.post(f"{url}/chat/completions", json=_body("Hi", max_tokens=4), timeout=60)
        assert after.status_code == 200


def test_a_disconnected_plain_request_cancels_its_generation(endless):
    with serve_app(create_app(endless, "tiny", default_max_tokens=4, max_tokens_cap=8000)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/chat/completions", json=_body("Tell me a story", max_tokens=7000),
                       timeout=httpx.Timeout(60, read=0.5))
        _wait_for(lambda: endless.cancelled_rows == 1, "cancelling the abandoned request's row")
        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()
        assert health["disconnected"] == 1


async def test_a_cancelled_row_leaves_the_batch_and_its_mate_is_unchanged(endless):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40)
    alone = await endless.generate([UserMessage(content="Who are you?")], None, params)

    async def walk_away() -> None:
        async for _ in endless.stream([UserMessage(content="Tell me a story")], None,
                                      SamplingParams(temperature=1.0, max_tokens=4000)):
            break  # the first delta: decoding is under way; leaving closes the stream

    before = len(endless.batch_sizes)
    survivor, _ = await asyncio.gather(endless.generate([UserMessage(content="Who are you?")], None, params),
                                       walk_away())
    assert endless.batch_sizes[before:] == [2], "the two requests did not share one batch"
    assert endless.cancelled_rows == 1
    assert survivor.completion_ids == alone.completion_ids
    assert max(abs(a - b) for a, b in zip(survivor.logprobs, alone.logprobs)) < 1e-4


async def test_a_prompt_certain_to_overflow_is_refused_before_tokenising(tiny):
    from closedloop.models.base import ContextLengthExceededError

    client = _GatedTokenizerClient(tiny.model, tiny.tokenizer)
    client.started.clear()
    limit = tiny.model.config.max_position_embeddings
    with pytest.raises(ContextLengthExceededError):
        await client.generate([UserMessage(content="BIG " + "x" * (limit * client._max_token_chars + 1))])
    assert not client.started.is_set(), "the prompt was tokenised"
