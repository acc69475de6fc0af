"""The server's OpenAI wire format, driven by raw httpx and by our ``openai:`` backend.

The model here is :class:`WordClient` (deterministic, no torch) so these tests pin the protocol;
``test_tiny_model.py`` runs the same paths against the real tiny transformer.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from closedloop.messages import SystemMessage, ToolMessage, UserMessage
from closedloop.models import GenerateRequest, ModelError, ModelUnavailableError, SamplingParams, TextDelta, TurnDone
from closedloop.models.openai_client import OpenAIClient

from .conftest import free_port

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def chat(url: str, **body) -> httpx.Response:
    body.setdefault("model", "words")
    body.setdefault("messages", [{"role": "user", "content": "hello there"}])
    return httpx.post(f"{url}/chat/completions", json=body, timeout=30)


def sse_events(url: str, **body) -> list[str]:
    body.setdefault("model", "words")
    body.setdefault("messages", [{"role": "user", "content": "hello there"}])
    with httpx.stream("POST", f"{url}/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[len("data: "):] for line in lines]


def test_models_lists_the_served_name(word_server):
    body = httpx.get(f"{word_server}/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["words"]
    assert httpx.get(f"{word_server}/models/words").json()["id"] == "words"
    assert httpx.get(f"{word_server}/models/other").status_code == 404


def test_plain_chat_response_shape(word_server):
    body = chat(word_server, temperature=0, messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": " there"}]}]).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "words" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    assert choice["token_ids"] is None and body["prompt_token_ids"] is None  # not asked for
    u = body["usage"]
    assert u["prompt_tokens"] > 0 and u["completion_tokens"] == len(choice["message"]["content"].encode())
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_max_tokens_and_stop(word_server):
    short = chat(word_server, temperature=0, max_tokens=12).json()["choices"][0]
    assert short["finish_reason"] == "length" and len(short["message"]["content"].encode()) <= 12
    newer = chat(word_server, temperature=0, max_completion_tokens=12).json()["choices"][0]
    assert newer["message"]["content"] == short["message"]["content"]
    full = chat(word_server, temperature=0).json()["choices"][0]["message"]["content"]
    second = full.split()[1]
    stopped = chat(word_server, temperature=0, stop=second).json()["choices"][0]["message"]["content"]
    assert second not in stopped and full.startswith(stopped)
    events = sse_events(word_server, temperature=0, stop=[second])
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == stopped, "the stop string must not leak into streamed content"


def test_logprobs_and_token_ids(word_server):
    body = chat(word_server, temperature=0, logprobs=True, top_logprobs=2, return_token_ids=True).json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) > 0
    assert bytes(choice["token_ids"]).decode() == choice["message"]["content"]
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    assert all(t["bytes"] == list(t["token"].encode()) and t["logprob"] <= 0 and t["top_logprobs"] == []
               for t in content)
    assert body["prompt_token_ids"] and body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])


def test_n_choices_and_seeds(word_server):
    msgs = [{"role": "user", "content": "tell me words"}]
    a = chat(word_server, messages=msgs, n=3, temperature=1.0, seed=7).json()
    b = chat(word_server, messages=msgs, n=3, temperature=1.0, seed=7).json()
    c = chat(word_server, messages=msgs, n=3, temperature=1.0, seed=8).json()
    texts = lambda r: [ch["message"]["content"] for ch in r["choices"]]  # noqa: E731
    assert [ch["index"] for ch in a["choices"]] == [0, 1, 2]
    assert texts(a) == texts(b), "same seed must reproduce"
    assert len(set(texts(a))) == 3, "the n choices must differ"
    assert texts(a) != texts(c)
    assert a["usage"]["completion_tokens"] == sum(len(t.encode()) for t in texts(a))


def test_tool_call_and_tool_choice(word_server, word_client):
    msgs = [{"role": "user", "content": "what is the weather in Paris?"}]
    body = chat(word_server, messages=msgs, tools=[WEATHER, TIME], temperature=0).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    none = chat(word_server, messages=msgs, tools=[WEATHER], tool_choice="none", temperature=0).json()
    assert none["choices"][0]["message"]["tool_calls"] is None and word_client.calls[-1]["tools"] is None

    named = chat(word_server, messages=msgs, tools=[TIME, WEATHER], temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).json()
    assert [t["function"]["name"] for t in word_client.calls[-1]["tools"]] == ["get_weather"]
    assert named["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_required_tool_choice_reasks_only_when_sampling(word_server, word_client):
    """A local model cannot be forced to call; the server re-asks (max_reasks=2) when a new sample
    could differ, and returns the reply as is when it could not (greedy)."""
    msgs = [{"role": "user", "content": "just chat"}]  # WordClient calls tools only for "weather"
    before = len(word_client.calls)
    greedy = chat(word_server, messages=msgs, tools=[WEATHER], tool_choice="required", temperature=0).json()
    assert len(word_client.calls) - before == 1
    assert greedy["choices"][0]["finish_reason"] == "stop"
    assert "closedloop_discarded" not in greedy["choices"][0]  # nothing re-asked, nothing added
    assert "completion_tokens_details" not in greedy["usage"]
    before = len(word_client.calls)
    chat(word_server, messages=msgs, tools=[WEATHER], tool_choice="required", temperature=0.7, seed=1)
    assert len(word_client.calls) - before == 3
    seeds = [c["params"].seed for c in word_client.calls[-3:]]
    assert len(set(seeds)) == 3, "each re-ask must draw a new sample"
    before = len(word_client.calls)
    chat(word_server, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
         tool_choice="required", temperature=0.7)
    assert len(word_client.calls) - before == 1, "a reply that calls a tool is not re-asked"


def test_reasks_are_reported_and_counted(word_server, word_client):
    """The replies a re-ask threw away are not hidden: each choice lists them (with token ids and
    logprobs when asked for), and usage counts their tokens, broken out."""
    msgs = [{"role": "user", "content": "just chat"}]
    body = chat(word_server, messages=msgs, tools=[WEATHER], tool_choice="required", temperature=0.7, seed=3, n=2,
                logprobs=True, return_token_ids=True).json()
    thrown = 0
    for choice in body["choices"]:
        attempts = choice["closedloop_discarded"]
        assert len(attempts) == 2  # max_reasks, and the kept reply is the third sample
        texts = [a["content"] for a in attempts] + [choice["message"]["content"]]
        assert len(set(texts)) == 3, "each discarded attempt is its own sample"
        for a in attempts:
            assert a["finish_reason"] == "stop" and a["tool_calls"] is None
            assert a["completion_tokens"] == len(a["token_ids"]) == len(a["logprobs"]["content"]) > 0
            assert bytes(a["token_ids"]).decode() == a["content"]
            thrown += a["completion_tokens"]
    usage = body["usage"]
    kept = sum(len(c["token_ids"]) for c in body["choices"])
    assert usage["completion_tokens_details"] == {"closedloop_discarded_tokens": thrown}
    assert usage["completion_tokens"] == kept + thrown
    assert usage["prompt_tokens"] == len(body["prompt_token_ids"])  # the prompt counts once
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    plain = chat(word_server, messages=msgs, tools=[WEATHER], tool_choice="required", temperature=0.7, seed=3).json()
    assert plain["choices"][0]["closedloop_discarded"][0].get("token_ids") is None  # only when asked for


def test_tool_conversation_round_trip(word_server):
    """A follow-up request carrying the assistant's call and the tool result is accepted."""
    first = chat(word_server, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER]).json()
    assistant = first["choices"][0]["message"]
    follow = chat(word_server, tools=[WEATHER], messages=[
        {"role": "developer", "content": "you are terse"},
        {"role": "user", "content": "weather?"}, assistant,
        {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": "sunny"}])
    assert follow.status_code == 200, follow.text


def test_stream_joins_to_plain_text(word_server):
    plain = chat(word_server, temperature=0).json()
    events = sse_events(word_server, temperature=0, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 1, "not streamed"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_tool_call_hides_markup(word_server):
    events = sse_events(word_server, messages=[{"role": "user", "content": "weather in Paris"}], tools=[WEATHER],
                        logprobs=True, return_token_ids=True)
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert "<tool_call>" not in text and "<" not in text
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    final = chunks[-1]["choices"][0]
    assert final["finish_reason"] == "tool_calls"
    assert len(final["logprobs"]["content"]) == len(final["token_ids"]) > 0
    assert "<tool_call>" in bytes(final["token_ids"]).decode()
    assert chunks[-1]["prompt_token_ids"]


def test_stream_n_choices(word_server):
    events = sse_events(word_server, n=2, temperature=1.0, seed=3)
    chunks = [json.loads(e) for e in events[:-1]]
    texts = {i: "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                        if c["choices"][0]["index"] == i) for i in (0, 1)}
    plain = chat(word_server, n=2, temperature=1.0, seed=3).json()
    assert texts == {ch["index"]: ch["message"]["content"] for ch in plain["choices"]}


# --------------------------------------------------------------------------- errors


BAD_BODIES = [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": "words"}, 400, "messages"),
    ({"model": "words", "messages": []}, 400, "messages"),
    ({"model": "words", "messages": "hello"}, 400, "messages"),
    ({"model": "words", "messages": ["hello"]}, 400, "messages.0"),
    ({"model": "words", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"model": "words", "messages": [{"content": "hi"}]}, 400, "messages"),
    ({"model": "words", "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"model": "words", "messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, 400, "messages"),
    ({"model": "words", "messages": [{"role": "tool", "content": "no id"}]}, 400, "messages"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400, "temperature"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "n": 1000}, 400, "n"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, None),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, None),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, None),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools.0.function"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}], "stream": "yes please"}, 400, "stream"),
    ({"model": "words", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_object"}}, 400, None),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


def _assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    return err


@pytest.mark.parametrize("body,status,param", BAD_BODIES)
def test_malformed_request_is_a_4xx_json_error(word_server, body, status, param):
    err = _assert_error_shape(httpx.post(f"{word_server}/chat/completions", json=body), status)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b"null"])
def test_unparsable_body_is_400(word_server, raw):
    r = httpx.post(f"{word_server}/chat/completions", content=raw, headers={"content-type": "application/json"})
    _assert_error_shape(r, 400)


def test_unknown_route_and_method_are_json(word_server):
    _assert_error_shape(httpx.get(f"{word_server}/nothing-here"), 404)
    _assert_error_shape(httpx.get(f"{word_server}/chat/completions"), 405)


def test_model_failure_is_a_5xx_json_error(word_server):
    msgs = [{"role": "user", "content": "please EXPLODE"}]
    err = _assert_error_shape(chat(word_server, messages=msgs), 500)
    assert err["type"] == "server_error" and "simulated device failure" in err["message"]
    events = sse_events(word_server, messages=msgs)
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert chat(word_server).status_code == 200, "the server must survive a model failure"


# --------------------------------------------------------------------------- the openai: backend


async def test_client_generate_is_token_exact(word_server):
    client = OpenAIClient("words", base_url=word_server)
    try:
        turn = await client.generate([SystemMessage(content="be brief"), UserMessage(content="hello")],
                                     params=SamplingParams(temperature=0, max_tokens=400))
    finally:
        await client.aclose()
    assert client.token_ids is True, "auto must detect that this server returns token ids"
    assert turn.has_tokens and bytes(turn.completion_ids).decode() == turn.message.content
    assert len(turn.logprobs) == len(turn.completion_ids)
    assert turn.loss_mask == [0] * len(turn.prompt_ids) + [1] * len(turn.completion_ids)
    assert turn.usage.completion_tokens == len(turn.completion_ids) and turn.finish_reason == "stop"
    assert turn.latency_s is not None and turn.latency_s > 0 and turn.model == "words"


async def test_client_tool_calls_and_stream(word_server):
    client = OpenAIClient("words", base_url=word_server)
    try:
        msgs = [UserMessage(content="weather in Paris?")]
        turn = await client.generate(msgs, tools=[WEATHER], params=SamplingParams(temperature=0))
        assert turn.finish_reason == "tool_calls" and turn.message.tool_calls[0].parsed_arguments() == {"city": "Paris"}
        msgs += [turn.message, ToolMessage(tool_call_id=turn.message.tool_calls[0].id, content="sunny")]
        follow = await client.generate(msgs, tools=[WEATHER], params=SamplingParams(temperature=0))
        assert follow.message.content

        events = [e async for e in client.stream([UserMessage(content="hello")], params=SamplingParams(temperature=0))]
        plain = await client.generate([UserMessage(content="hello")], params=SamplingParams(temperature=0))
        *deltas, done = events
        assert isinstance(done, TurnDone) and all(isinstance(d, TextDelta) for d in deltas) and len(deltas) > 1
        assert "".join(d.text for d in deltas) == done.turn.message.content == plain.message.content
        assert done.turn.completion_ids == plain.completion_ids and done.turn.prompt_ids == plain.prompt_ids
        assert done.turn.usage.completion_tokens == plain.usage.completion_tokens

        streamed_call = [e async for e in client.stream([UserMessage(content="weather now")], tools=[WEATHER])][-1]
        assert streamed_call.turn.message.tool_calls[0].function.name == "get_weather"
        assert streamed_call.turn.finish_reason == "tool_calls"
    finally:
        await client.aclose()


async def test_spec_string_builds_the_client(word_server):
    from closedloop.models import make_client

    client = make_client(f"openai:words@{word_server}", max_retries=0)
    try:
        turn = await client.generate([UserMessage(content="hi")], params=SamplingParams(temperature=0))
    finally:
        await client.aclose()
    assert isinstance(client, OpenAIClient) and client.spec == f"openai:words@{word_server}"
    assert turn.message.content and turn.has_tokens


async def test_concurrent_requests_are_not_serialised(word_server, word_client):
    client = OpenAIClient("words", base_url=word_server, concurrency=8)
    word_client.max_in_flight = 0
    try:
        reqs = [GenerateRequest([UserMessage(content=f"question {i}")], params=SamplingParams(temperature=0))
                for i in range(8)]
        turns = await client.batch(reqs)
    finally:
        await client.aclose()
    assert len(turns) == 8 and all(t.message.content for t in turns)
    assert len({t.message.content for t in turns}) == 8
    assert word_client.max_in_flight >= 4, word_client.max_in_flight


async def test_client_reports_server_errors(word_server):
    client = OpenAIClient("not-served", base_url=word_server)
    with pytest.raises(ModelError, match="does not exist") as info:
        await client.generate([UserMessage(content="hi")])
    assert not isinstance(info.value, ModelUnavailableError)
    await client.aclose()
    client = OpenAIClient("words", base_url=word_server, max_retries=1, backoff_s=0.01)
    with pytest.raises(ModelError, match="simulated device failure"):
        await client.generate([UserMessage(content="EXPLODE now")])
    await client.aclose()


async def test_dead_server_fails_fast_and_names_url():
    url = f"http://127.0.0.1:{free_port()}/v1"
    client = OpenAIClient("words", base_url=url)
    start = time.perf_counter()
    with pytest.raises(ModelUnavailableError, match="127.0.0.1") as info:
        await client.generate([UserMessage(content="hi")])
    assert time.perf_counter() - start < client.connect_grace_s + 1.0
    assert url in str(info.value)
    await client.aclose()


def test_api_key_is_never_shown(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-123")
    client = OpenAIClient("m", base_url="http://127.0.0.1:9/v1")
    assert "sk-secret" not in repr(client) and "sk-secret" not in client.spec
    asyncio.run(client.aclose())


def test_client_needs_a_key_or_url(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ModelError, match="OPENAI_API_KEY"):
        OpenAIClient("gpt-4o-mini")


def test_one_client_serves_several_event_loops(word_server):
    """A trainer runs each rollout batch in its own asyncio.run: the SDK's connection pool of a
    closed loop must not be reused ("Event loop is closed")."""
    import asyncio

    client = OpenAIClient("words", base_url=word_server)
    for i in range(3):
        turn = asyncio.run(client.generate([UserMessage(content=f"loop {i}")], params=SamplingParams(temperature=0)))
        assert turn.message.content
