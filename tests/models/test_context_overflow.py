"""A prompt longer than the model's context is its own error type end to end: ``hf:`` raises
:class:`ContextLengthExceededError`, ``closedloop serve`` answers 400 ``context_length_exceeded``,
and the ``openai:`` client turns that 400 back into the same type (so a benchmark can score it)."""

from __future__ import annotations

import asyncio

import pytest

from closedloop.messages import UserMessage
from closedloop.models import ContextLengthExceededError, SamplingParams, make_client
from closedloop.models.openai_client import OpenAIClient


def test_overflow_is_one_type_through_hf_the_server_and_the_openai_client(tiny_model_path):
    from closedloop.server import create_app
    from closedloop.server.local import serve_app

    hf = make_client(f"hf:{tiny_model_path}")
    limit = hf.model.config.max_position_embeddings
    words = " ".join(["shark"] * (limit + 50))  # one token per word at least: over the context
    too_long = [UserMessage(content=words)]
    with pytest.raises(ContextLengthExceededError) as info:
        asyncio.run(hf.generate(too_long, params=SamplingParams(max_tokens=4)))
    assert info.value.limit == limit and info.value.prompt_tokens > limit
    with serve_app(create_app(hf, "tiny")) as base_url:
        client = OpenAIClient("tiny", base_url=base_url, api_key="none")

        async def call():
            try:
                await client.generate(too_long, params=SamplingParams(max_tokens=4))
            finally:
                await client.aclose()

        with pytest.raises(ContextLengthExceededError, match="context"):
            asyncio.run(call())
        ok = OpenAIClient("tiny", base_url=base_url, api_key="none")

        async def short():
            try:
                return await ok.generate([UserMessage(content="hi")], params=SamplingParams(max_tokens=2))
            finally:
                await ok.aclose()

        assert asyncio.run(short()).finish_reason in ("stop", "length", "tool_calls")  # the server still serves
