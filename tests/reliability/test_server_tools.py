"""Issue 9, findings 12 and 13: a tool call cut off by the token limit reports ``"length"``; tool
schemas are validated as OpenAI validates them; a reply may only call a tool the request offered.

The tiny model calls ``add`` for "What is 2 plus 3?" whatever tools it is shown, which is exactly
the unoffered-tool case a real model produces now and then.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from closedloop.messages import AssistantMessage, ToolCall, UserMessage
from closedloop.models.base import SamplingParams
from closedloop.models.hf import HFClient
from closedloop.models.scripted import ScriptedClient
from closedloop.server import create_app
from closedloop.server.local import serve_app

pytestmark = pytest.mark.slow
QUESTION = "What is 2 plus 3?"


def _tool(name: str, parameters: object = None) -> dict:
    fn: dict = {"name": name, "description": name}
    fn["parameters"] = parameters if parameters is not None else {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
    return {"type": "function", "function": fn}


@pytest.fixture(scope="module")
def tiny(tiny_model_path) -> HFClient:
    torch.set_num_threads(1)
    return HFClient.from_pretrained(tiny_model_path, batch_wait_ms=5)


@pytest.fixture(scope="module")
def url(tiny):
    with serve_app(create_app(tiny, "tiny", default_max_tokens=48)) as base:
        yield base


def _post(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", timeout=60,
                      json={"model": "tiny", "temperature": 0, **body})


# --------------------------------------------------------------------------- 12: truncated calls


async def test_truncated_tool_call_reports_length(tiny, url):
    full = await tiny.generate([UserMessage(content=QUESTION)], [_tool("add")], SamplingParams(temperature=0))
    assert full.message.tool_calls and full.finish_reason == "tool_calls"
    cut = len(full.completion_ids) - 6  # inside the arguments: the call is parsed, its JSON is not whole
    turn = await tiny.generate([UserMessage(content=QUESTION)], [_tool("add")],
                               SamplingParams(temperature=0, max_tokens=cut))
    assert turn.message.tool_calls, "the cut did not leave a (partial) call; the test shows nothing"
    with pytest.raises(json.JSONDecodeError):
        json.loads(turn.message.tool_calls[0].function.arguments)
    assert turn.finish_reason == "length"  # hf: itself

    r = _post(url, messages=[{"role": "user", "content": QUESTION}], tools=[_tool("add")], max_tokens=cut)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"
    finishes = []
    with httpx.stream("POST", f"{url}/chat/completions", timeout=60, json={
            "model": "tiny", "temperature": 0, "stream": True, "max_tokens": cut, "tools": [_tool("add")],
            "messages": [{"role": "user", "content": QUESTION}]}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                finishes += [c.get("finish_reason") for c in json.loads(line[6:])["choices"]]
    assert [f for f in finishes if f] == ["length"]

    whole = _post(url, messages=[{"role": "user", "content": QUESTION}], tools=[_tool("add")])
    assert whole.json()["choices"][0]["finish_reason"] == "tool_calls"


# --------------------------------------------------------------------------- 13: schemas


@pytest.mark.parametrize("tools, what", [
    ([_tool("my tool; rm -rf /")], "name"),
    ([_tool("a" * 65)], "name"),
    ([_tool("")], "name"),
    ([_tool("add"), _tool("add")], "unique"),
    ([_tool("add", {"type": "string"})], "object"),
    ([_tool("add", {"type": "object", "properties": {"a": {"type": "nope"}}})], "JSON Schema"),
    ([_tool("add", {"type": "object", "required": "a"})], "JSON Schema"),
    ([_tool("add", [1, 2])], "dict"),
])
def test_invalid_tool_schemas_are_400(url, tools, what):
    r = _post(url, messages=[{"role": "user", "content": QUESTION}], tools=tools, max_tokens=4)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and (err["param"] or "").startswith("tools")
    assert what.lower() in err["message"].lower() or what == "name", err["message"]


def test_valid_names_and_schemas_are_accepted(url):
    tools = [_tool("add"), _tool("get-weather_2"), {"type": "function", "function": {"name": "noargs"}}]
    assert _post(url, messages=[{"role": "user", "content": "Hi"}], tools=tools, max_tokens=4).status_code == 200


# --------------------------------------------------------------------------- 13: only offered tools


def test_a_call_to_a_tool_not_offered_comes_back_as_text(url):
    r = _post(url, messages=[{"role": "user", "content": QUESTION}], tools=[_tool("multiply")])
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"] is None, choice
    assert choice["finish_reason"] == "stop"
    assert '"name": "add"' in choice["message"]["content"]  # what the model wrote, as text
    # the same under tool_choice="none", and when streaming
    r = _post(url, messages=[{"role": "user", "content": QUESTION}], tools=[_tool("add")], tool_choice="none")
    assert r.json()["choices"][0]["message"]["tool_calls"] is None
    text, calls = "", []
    with httpx.stream("POST", f"{url}/chat/completions", timeout=60, json={
            "model": "tiny", "temperature": 0, "stream": True, "tools": [_tool("multiply")],
            "messages": [{"role": "user", "content": QUESTION}]}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
                    calls += c["delta"].get("tool_calls") or []
    assert not calls and '"name": "add"' in text
    # an offered tool still comes back as a call
    ok = _post(url, messages=[{"role": "user", "content": QUESTION}], tools=[_tool("add")])
    assert ok.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"


def test_a_backend_without_raw_text_also_only_calls_offered_tools():
    """A remote (``openai:``) or scripted backend gives no raw completion text: an unoffered call is
    written back into the content in the Hermes form, next to the offered ones."""
    reply = AssistantMessage(content="Sure.", tool_calls=[ToolCall.make("add", {"a": 1}),
                                                           ToolCall.make("rm_rf", {"path": "/"})])
    with serve_app(create_app(ScriptedClient([reply], cycle=True), "s")) as base:
        r = httpx.post(f"{base}/chat/completions", timeout=30, json={
            "model": "s", "messages": [{"role": "user", "content": "x"}], "tools": [_tool("add")]})
    msg = r.json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["add"]
    assert "rm_rf" in msg["content"] and msg["content"].startswith("Sure.")
