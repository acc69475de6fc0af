"""How the ``openai:`` backend copes with servers that are not ours: OpenAI's strictness about
unknown fields, ``transformers serve``'s 422s, FastAPI validation errors, servers that ignore
fields, rate limits and flaky 5xx (retried by the ``openai`` SDK, ``Retry-After`` honoured).

The servers here answer over real HTTP the way those servers do (the error texts are OpenAI's,
vLLM's, FastAPI's and transformers' own), so the client's parsing and retry paths run for real.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any, Callable

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from closedloop.messages import MissingTokensError, Trajectory, UserMessage
from closedloop.models import ModelError, ModelUnavailableError, SamplingParams, TextDelta, TurnDone
from closedloop.models.openai_client import OpenAIClient
from closedloop.models.retry import Backoff, retry_async
from closedloop.models.server_features import forget_server_features, rejected_fields, server_features

from .conftest import free_port, serve_app


@pytest.fixture(autouse=True)
def _fresh_server_memory():
    """What a client learns is kept per base URL for the process; ports get reused between tests."""
    forget_server_features()
    yield
    forget_server_features()


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
        client = OpenAIClient("m", base_url=url, max_retries=3)
        turn = await client.generate([UserMessage(content="hi")], params=SamplingParams(seed=1, stop=["x"]))
        await client.aclose()
    assert turn.message.content and len(seen) == 3
    assert seen[-1]["seed"] == 1 and seen[-1]["stop"] == ["x"]


async def test_retries_are_bounded():
    seen: list[dict[str, Any]] = []
    with serve_app(scripted_app(["503"], seen)) as url:
        client = OpenAIClient("m", base_url=url, max_retries=2)
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


# --------------------------------------------------------------------------- learning what a server takes


def judging_app(judge: Callable[[dict[str, Any]], JSONResponse | None], seen: list[dict[str, Any]]) -> FastAPI:
    """Each request is answered by ``judge(body)`` when it returns a response, else completed."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def cc(request: Request):
        body = await request.json()
        seen.append(body)
        return judge(body) or _completion(body)

    return app


def transformers_like(body: dict[str, Any]) -> JSONResponse | None:
    """``transformers serve``'s own answer to a field it does not know (a 422, FastAPI's shape)."""
    known = {"model", "messages", "temperature", "top_p", "max_tokens", "seed", "stop", "tools", "stream",
             "logprobs", "tool_choice", "stream_options"}
    unexpected = set(body) - known
    if unexpected:
        return JSONResponse({"detail": f"Unexpected fields in the request: {unexpected}"}, status_code=422)
    return None


async def test_transformers_422_is_learnt_once_per_server_and_explained_on_the_turn():
    seen: list[dict[str, Any]] = []
    with serve_app(judging_app(transformers_like, seen)) as url:
        first = OpenAIClient("m", base_url=url)
        turn = await first.generate([UserMessage(content="hi")])
        await first.aclose()
        second = OpenAIClient("m", base_url=url)  # a new client of the same server: asks correctly at once
        again = await second.generate([UserMessage(content="hi")])
        await second.aclose()
    assert ["return_token_ids" in b for b in seen] == [True, False, False]
    assert first.token_ids is False and second.token_ids is False
    for t in (turn, again):
        assert t.message.content == "you said 1 messages" and not t.has_tokens
        assert "rejected 'return_token_ids'" in t.unavailable["token_ids"]
        assert "Unexpected fields in the request" in t.unavailable["token_ids"]
        assert t.unavailable["logprobs"] == "the server does not return them (it ignores 'logprobs')"
        assert t.logprob_spec is None
    with pytest.raises(MissingTokensError, match="turn 0 has no token ids: the server does not return them"):
        Trajectory(turns=[again]).token_view()


async def test_fastapi_validation_error_names_the_field_by_its_location():
    def strict_seed(body):
        if "seed" in body:
            return JSONResponse({"detail": [{"type": "extra_forbidden", "loc": ["body", "seed"],
                                             "msg": "Extra inputs are not permitted", "input": body["seed"]}]},
                                status_code=422)
        return None

    seen: list[dict[str, Any]] = []
    with serve_app(judging_app(strict_seed, seen)) as url:
        client = OpenAIClient("m", base_url=url)
        turn = await client.generate([UserMessage(content="hi")], params=SamplingParams(seed=3))
        await client.aclose()
    assert ["seed" in b for b in seen] == [True, False]
    assert "seed" in client.features.rejected and "not reproducible" in turn.unavailable["seed"]
    assert all(b["return_token_ids"] is True for b in seen), "only the named field is dropped"


async def test_tool_choice_forms_are_learnt_separately():
    def no_required(body):
        if body.get("tool_choice") == "required":
            return _error(400, "tool_choice='required' is not supported by this server")
        return None

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    seen: list[dict[str, Any]] = []
    with serve_app(judging_app(no_required, seen)) as url:
        client = OpenAIClient("m", base_url=url)
        forced = await client.generate([UserMessage(content="hi")], tools=tools, tool_choice="required")
        forced_again = await client.generate([UserMessage(content="hi")], tools=tools, tool_choice="required")
        auto = await client.generate([UserMessage(content="hi")], tools=tools, tool_choice="auto")
        await client.aclose()
    assert [b.get("tool_choice") for b in seen] == ["required", None, None, "auto"]
    assert "tool_choice=required" in forced.unavailable["tool_choice"]
    assert forced_again.unavailable["tool_choice"] == forced.unavailable["tool_choice"]
    assert "tool_choice" not in auto.unavailable


async def test_vllm_error_text_names_parallel_tool_calls():
    def vllm_like(body):
        if "parallel_tool_calls" in body:
            msg = ("[{'type': 'extra_forbidden', 'loc': ('body', 'parallel_tool_calls'), "
                   "'msg': 'Extra inputs are not permitted', 'input': False}]")
            return JSONResponse({"object": "error", "message": msg, "type": "BadRequestError", "param": None,
                                 "code": 400}, status_code=400)
        return None

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    seen: list[dict[str, Any]] = []
    with serve_app(judging_app(vllm_like, seen)) as url:
        client = OpenAIClient("m", base_url=url, parallel_tool_calls=False)
        turn = await client.generate([UserMessage(content="hi")], tools=tools)
        await client.aclose()
    assert [b.get("parallel_tool_calls") for b in seen] == [False, None]
    assert "parallel_tool_calls" in turn.unavailable


async def test_a_field_wrongly_blamed_is_not_remembered():
    """The error names ``seed`` but is about something else: resending without it fails the same
    way, so the client reports the server's error and remembers nothing."""
    seen: list[dict[str, Any]] = []
    with serve_app(judging_app(lambda b: _error(400, "messages[0]: invalid role; see 'seed' docs"), seen)) as url:
        client = OpenAIClient("m", base_url=url)
        with pytest.raises(ModelError, match="invalid role"):
            await client.generate([UserMessage(content="hi")], params=SamplingParams(seed=1))
        await client.aclose()
    assert ["seed" in b for b in seen] == [True, False]
    assert client.features.rejected == {}


async def test_openai_max_tokens_refusal_switches_to_max_completion_tokens():
    def o_series(body):
        if "max_tokens" in body:
            return _error(400, "Unsupported parameter: 'max_tokens' is not supported with this model. "
                               "Use 'max_completion_tokens' instead.")
        return None

    seen: list[dict[str, Any]] = []
    with serve_app(judging_app(o_series, seen)) as url:
        client = OpenAIClient("o-model", base_url=url)
        await client.generate([UserMessage(content="hi")], params=SamplingParams(max_tokens=9))
        await client.generate([UserMessage(content="hi")], params=SamplingParams(max_tokens=9))
        await client.aclose()
    assert [(b.get("max_tokens"), b.get("max_completion_tokens")) for b in seen] == [(9, None), (None, 9), (None, 9)]


async def test_a_refusal_is_remembered_per_model_on_one_server():
    """OpenAI refuses ``logprobs`` for its reasoning models only: what one model taught the client
    must not stop another model on the same URL from getting logprobs."""
    def reasoning_models_refuse(body):
        if body["model"].startswith("o") and "logprobs" in body:
            return _error(400, "Unsupported parameter: 'logprobs' is not supported with this model.")
        return None

    seen: list[dict[str, Any]] = []
    with serve_app(judging_app(reasoning_models_refuse, seen)) as url:
        for model in ("o-model", "o-model", "gpt-model"):
            client = OpenAIClient(model, base_url=url)
            await client.generate([UserMessage(content="hi")])
            await client.aclose()
    assert [(b["model"], "logprobs" in b) for b in seen] == \
        [("o-model", True), ("o-model", False), ("o-model", False), ("gpt-model", True)]


def test_rejected_fields_reads_each_shape_and_only_whole_words():
    sent = ["logprobs", "top_logprobs", "seed"]
    assert rejected_fields({"error": {"message": "bad", "param": "seed"}}, "Error code: 400", sent) == ["seed"]
    assert rejected_fields({"detail": "Unexpected fields in the request: {'top_logprobs'}"}, "", sent) == \
        ["top_logprobs"]
    assert rejected_fields(None, "Error code: 400 - top_logprobs must be <= 5", sent) == ["top_logprobs"]
    assert rejected_fields({"detail": [{"loc": ["body", "messages", 0]}]}, "", sent) == []
    assert server_features("http://x/v1/") is server_features("http://x/v1")


# --------------------------------------------------------------------------- retries


def retry_after_app(header: Callable[[], str], seen: list[float]) -> FastAPI:
    """503 with ``Retry-After: header()`` on the first request, then a completion."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def cc(request: Request):
        body = await request.json()
        seen.append(time.monotonic())
        if len(seen) == 1:
            return _error(503, "warming up", {"retry-after": header()})
        return _completion(body)

    return app


@pytest.mark.parametrize("form", ["seconds", "http-date"])
async def test_5xx_retry_honours_retry_after(form):
    """The SDK's first backoff without the header is at most 0.5 s; asked to wait >= 1 s, it does."""
    header = (lambda: "1") if form == "seconds" else (lambda: email.utils.formatdate(time.time() + 2, usegmt=True))
    seen: list[float] = []
    with serve_app(retry_after_app(header, seen)) as url:
        client = OpenAIClient("m", base_url=url, max_retries=2)
        turn = await client.generate([UserMessage(content="hi")])
        await client.aclose()
    assert turn.message.content and len(seen) == 2
    assert seen[1] - seen[0] >= 0.95


async def test_a_refused_connection_is_not_retried_through_the_sdk_budget():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    client = OpenAIClient("m", base_url=url, max_retries=5, connect_grace_s=0.0)
    attempts: list[str] = []

    async def count(request):
        attempts.append(str(request.url))

    client._client._client.event_hooks["request"].append(count)
    with pytest.raises(ModelUnavailableError, match="cannot reach the model server"):
        await client.generate([UserMessage(content="hi")])
    await client.aclose()
    assert len(attempts) == 1


async def test_retry_async_is_bounded_by_attempts_and_deadline():
    calls: list[int] = []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("down")
        return "up"

    fast = Backoff(0.001, 0.002)
    assert await retry_async(flaky, retry_on=lambda e: isinstance(e, ConnectionError), max_attempts=5,
                             backoff=fast) == "up" and len(calls) == 3
    calls.clear()
    with pytest.raises(ConnectionError):
        await retry_async(flaky, retry_on=lambda e: True, max_attempts=2, backoff=fast)
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(ConnectionError):  # the next backoff would pass the deadline: give up now
        await retry_async(flaky, retry_on=lambda e: True, max_attempts=9, backoff=Backoff(10.0, 10.0),
                          deadline_s=1.0)
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(ConnectionError):  # not retryable: raised at once
        await retry_async(flaky, retry_on=lambda e: isinstance(e, TimeoutError), max_attempts=9, backoff=fast)
    assert len(calls) == 1
    assert all(0.375 <= Backoff(0.5, 8.0).delay(1) <= 0.625 for _ in range(50))
    assert Backoff(0.5, 8.0, jitter=0.0).delay(10) == 8.0
