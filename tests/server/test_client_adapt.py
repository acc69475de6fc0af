"""How the ``openai:`` backend copes with servers that are not ours: OpenAI's strictness about
unknown fields, servers that ignore them, rate limits and flaky 5xx.

The servers here answer over real HTTP the way those servers do (the error texts are OpenAI's and
vLLM's own), so the client's parsing and retry paths run for real.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from closedloop.messages import UserMessage
from closedloop.models import ModelError, ModelUnavailableError, SamplingParams, TextDelta, TurnDone
from closedloop.models.openai_client import OpenAIClient

from .conftest import serve_app


def _completion(body: dict[str, Any]) -> dict[str, Any]:
    text = f"you said {len(body['messages'])} messages"
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=status, headers=headers)


def scripted_app(script: list[str], seen: list[dict[str, Any]]) -> FastAPI:
    """Each request takes the next behaviour from ``script`` (the last repeats):
    ``strict`` rejects ``return_token_ids`` as OpenAI does, ``ignore`` answers without ids,
    ``429``/``503`` fail with that status."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def cc(request: Request):
        body = await request.json()
        seen.append(body)
        what = script[min(len(seen) - 1, len(script) - 1)]
        if what == "strict" and "return_token_ids" in body:
            return _error(400, "Unrecognized request argument supplied: return_token_ids")
        if what == "nologprobs" and "logprobs" in body:
            return _error(400, "Unsupported parameter: 'logprobs' is not supported with this model.")
        if what == "429":
            return _error(429, "Rate limit reached, slow down", {"retry-after": "0.05"})
        if what == "503":
            return _error(503, "The engine is overloaded")
        return _completion(body)

    return app


async def test_auto_drops_token_ids_a_strict_server_rejects():
    seen: list[dict[str, Any]] = []
    with serve_app(scripted_app(["strict"], seen)) as url:
        client = OpenAIClient("gpt-x", base_url=url)
        turn = await client.generate([UserMessage(content="hi")])
        assert turn.message.content == "you said 1 messages" and turn.completion_ids is None
        assert client.token_ids is False
        await client.generate([UserMessage(content="again")])
        await client.aclose()
    assert ["return_token_ids" in b for b in seen] == [True, False, False], "detect once, then remember"


async def test_auto_drops_logprobs_a_model_rejects():
    seen: list[dict[str, Any]] = []
    with serve_app(scripted_app(["nologprobs"], seen)) as url:
        client = OpenAIClient("o-model", base_url=url)
        await client.generate([UserMessage(content="hi")])
        await client.generate([UserMessage(content="hi")])
        await client.aclose()
    assert ["logprobs" in b for b in seen] == [True, False, False] and client.logprobs is False


async def test_auto_stops_asking_a_server_that_ignores_token_ids():
    seen: list[dict[str, Any]] = []
    with serve_app(scripted_app(["ignore"], seen)) as url:
        client = OpenAIClient("m", base_url=url)
        await client.generate([UserMessage(content="hi")])
        await client.generate([UserMessage(content="hi")])
        await client.aclose()
    assert ["return_token_ids" in b for b in seen] == [True, False]
    assert all(b["logprobs"] is True for b in seen) and all(b["max_tokens"] == 256 for b in seen)


async def test_forced_token_ids_stay_on_and_rejection_is_an_error():
    seen: list[dict[str, Any]] = []
    with serve_app(scripted_app(["strict"], seen)) as url:
        client = OpenAIClient("m", base_url=url, token_ids=True)
        with pytest.raises(ModelError, match="return_token_ids"):
            await client.generate([UserMessage(content="hi")])
        await client.aclose()
    assert len(seen) == 1


async def test_rate_limit_and_5xx_are_retried():
    seen: list[dict[str, Any]] = []
    with serve_app(scripted_app(["429", "503", "ok"], seen)) as url:
        client = OpenAIClient("m", base_url=url, max_retries=3, backoff_s=0.05)
        start = time.perf_counter()
        turn = await client.generate([UserMessage(content="hi")], params=SamplingParams(seed=1, stop=["x"]))
        await client.aclose()
    assert turn.message.content and len(seen) == 3
    assert time.perf_counter() - start < 2.0
    assert seen[-1]["seed"] == 1 and seen[-1]["stop"] == ["x"]


async def test_retries_are_bounded():
    seen: list[dict[str, Any]] = []
    with serve_app(scripted_app(["503"], seen)) as url:
        client = OpenAIClient("m", base_url=url, max_retries=2, backoff_s=0.01)
        with pytest.raises(ModelUnavailableError, match="503 after 3 attempts"):
            await client.generate([UserMessage(content="hi")])
        await client.aclose()
    assert len(seen) == 3


def fragmenting_app() -> FastAPI:
    """Streams the way vLLM does: prompt ids on the first chunk, token ids and logprobs on every
    chunk, a tool call's name first and its arguments in pieces, usage in a trailing chunk."""
    app = FastAPI()

    def chunk(choices, **extra) -> str:
        return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                      "choices": choices, **extra}) + "\n\n"

    def lp(tok: str) -> dict:
        return {"content": [{"token": tok, "logprob": -0.5, "bytes": list(tok.encode()), "top_logprobs": []}]}

    async def events():
        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                    prompt_token_ids=[1, 2, 3])
        yield chunk([{"index": 0, "delta": {"content": "Let me"}, "logprobs": lp("Let me"), "token_ids": [10],
                      "finish_reason": None}])
        yield chunk([{"index": 0, "delta": {"content": " check."}, "logprobs": lp(" check."), "token_ids": [11],
                      "finish_reason": None}])
        yield chunk([{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                                            "function": {"name": "get_weather", "arguments": ""}}]},
                      "logprobs": lp("<tc>"), "token_ids": [12], "finish_reason": None}])
        for piece, tid in (('{"city": ', 13), ('"Paris"}', 14)):
            yield chunk([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]},
                          "logprobs": lp(piece), "token_ids": [tid], "finish_reason": None}])
        yield chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls", "token_ids": []}])
        yield chunk([], usage={"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def cc(request: Request):
        body = await request.json()
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def test_stream_assembles_fragmented_tool_calls_and_ids():
    with serve_app(fragmenting_app()) as url:
        client = OpenAIClient("m", base_url=url)
        events = [e async for e in client.stream([UserMessage(content="weather?")])]
        await client.aclose()
    *deltas, done = events
    assert [d.text for d in deltas if isinstance(d, TextDelta)] == ["Let me", " check."]
    assert isinstance(done, TurnDone)
    turn = done.turn
    assert turn.message.content == "Let me check."
    (call,) = turn.message.tool_calls
    assert call.id == "call_a" and call.name == "get_weather" and call.parsed_arguments() == {"city": "Paris"}
    assert turn.prompt_ids == [1, 2, 3] and turn.completion_ids == [10, 11, 12, 13, 14]
    assert turn.logprobs == [-0.5] * 5 and turn.finish_reason == "tool_calls"
    assert turn.usage.prompt_tokens == 3 and turn.usage.completion_tokens == 5
    assert client.token_ids is True
