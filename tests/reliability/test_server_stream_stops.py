"""Issue 26: one streaming request with long stop strings stalled every client for 15-42 s (the
server recomputed the visible text from the whole stream at every token, slicing each stop string
once per character of it, on the event loop).

Now stop strings are bounded (``MAX_STOP_CHARS``; longer is a 400) and streamed text goes through a
linear matcher (its work bound: ``tests/server/test_stream_text.py``). Here, through a real server:
while a stream with the worst stop strings allowed keeps running, another client is answered. The
hostile stream runs until the other client's answer is in (signals, no timing): the backend streams
until the test releases it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, AsyncIterator

import httpx
import pytest

from closedloop.messages import AssistantMessage, Turn, Usage, content_text
from closedloop.models.base import ModelClient, SamplingParams, StreamEvent, TextDelta, TurnDone
from closedloop.server import create_app
from closedloop.server.local import serve_app
from closedloop.server.schemas import MAX_STOP_CHARS

# Four stop strings of the longest length allowed that the stream keeps almost completing, or never
# starts: the former code did ~4 x 1024 slices of up to 1024 characters per token for these.
HOSTILE_STOPS = ["a" * (MAX_STOP_CHARS - 1) + "b", "a" * (MAX_STOP_CHARS - 1) + "c", "x" * MAX_STOP_CHARS,
                 "ab" * (MAX_STOP_CHARS // 2)]
LIVENESS_S = 120.0  # a guard against hanging, not a timing claim


class EndlessStream(ModelClient):
    """A model that, asked for ``"hostile"``, streams ``"aaa"`` until ``release`` is set; any other
    prompt is answered ``"pong"`` at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.deltas = 0

    def _turn(self, text: str, finish: str) -> Turn:
        return Turn(message=AssistantMessage(content=text), model="endless", completion_text=text,
                    finish_reason=finish, usage=Usage(prompt_tokens=1, completion_tokens=max(1, len(text) // 3)))

    async def generate(self, messages, tools=None, params: SamplingParams | None = None,
                       tool_choice: Any = None) -> Turn:
        return self._turn("pong", "stop")

    async def stream(self, messages, tools=None, params=None, tool_choice=None) -> AsyncIterator[StreamEvent]:
        if content_text(messages[-1].content) != "hostile":
            yield TextDelta("pong")
            yield TurnDone(self._turn("pong", "stop"))
            return
        sent = 0
        while not self.release.is_set():
            yield TextDelta("aaa")
            sent += 1
            self.deltas += 1
            await asyncio.sleep(0)  # as a decoder hands over between tokens
        yield TurnDone(self._turn("aaa" * sent, "length"))


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(LIVENESS_S):
        pytest.fail(f"{what} did not happen within {LIVENESS_S:.0f} s")


def test_another_client_is_answered_while_a_hostile_stream_runs():
    client = EndlessStream()
    receiving, finished = threading.Event(), threading.Event()
    content: list[str] = []
    errors: list[BaseException] = []

    with serve_app(create_app(client, "endless")) as url:
        def hostile() -> None:
            body = {"model": "endless", "stream": True, "n": 2, "stop": HOSTILE_STOPS,
                    "messages": [{"role": "user", "content": "hostile"}]}
            try:
                with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=LIVENESS_S) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        for choice in json.loads(line[6:])["choices"]:
                            if choice["index"] == 0 and choice["delta"].get("content"):
                                content.append(choice["delta"]["content"])
                                receiving.set()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
            finally:
                finished.set()

        thread = threading.Thread(target=hostile, daemon=True)
        thread.start()
        try:
            _wait(receiving, "the hostile stream's first text")
            # the hostile stream is being matched against its stop strings right now, and goes on
            answer = httpx.post(f"{url}/chat/completions", timeout=LIVENESS_S,
                                json={"model": "endless", "messages": [{"role": "user", "content": "ping"}]})
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "pong"
            assert httpx.get(url.removesuffix("/v1") + "/health", timeout=LIVENESS_S).status_code == 200
            assert not finished.is_set(), errors  # answered while the hostile stream was still running
        finally:
            client.release.set()
        _wait(finished, "the end of the hostile stream")
    assert not errors, errors
    # nothing lost and nothing extra: the held-back tail arrives with the final turn
    text = "".join(content)
    assert text and set(text) == {"a"} and len(text) % 3 == 0


@pytest.mark.parametrize("stop", [["s" * (MAX_STOP_CHARS + 1)], "s" * 1_000_000, ["ok", "t" * 1_000_000]])
def test_an_over_long_stop_string_is_a_400_naming_the_limit(stop):
    client = EndlessStream()
    with serve_app(create_app(client, "endless")) as url:
        for stream in (False, True):
            r = httpx.post(f"{url}/chat/completions", timeout=LIVENESS_S,
                           json={"model": "endless", "stream": stream, "stop": stop,
                                 "messages": [{"role": "user", "content": "hostile"}]})
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["param"] == "stop" and str(MAX_STOP_CHARS) in err["message"]
            assert err["type"] == "invalid_request_error"
    assert client.deltas == 0  # refused before any generation


def test_a_stop_string_of_the_longest_length_still_stops_the_stream():
    """The matcher cuts at a long stop string as at a short one (the streamed text and the final
    content agree)."""

    class Scripted(EndlessStream):
        async def stream(self, messages, tools=None, params=None, tool_choice=None):
            stop = params.stop[0]
            raw = "before " + stop + " after"
            for i in range(0, len(raw), 5):
                yield TextDelta(raw[i:i + 5])
            yield TurnDone(self._turn("before", "stop"))

    stop = "z" * (MAX_STOP_CHARS - 1) + "!"
    with serve_app(create_app(Scripted(), "endless")) as url:
        body = {"model": "endless", "stream": True, "stop": [stop], "messages": [{"role": "user", "content": "x"}]}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=LIVENESS_S) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(deltas) == "before" and all("z" not in d for d in deltas)


def test_a_huge_delta_is_cut_at_its_stop_string():
    """A delta of 64 KiB or more is matched on a thread: the same text comes out."""

    class OneBigDelta(EndlessStream):
        async def stream(self, messages, tools=None, params=None, tool_choice=None):
            yield TextDelta("  " + "w" * 200_000 + "END" + "v" * 1000)
            yield TurnDone(self._turn("w" * 200_000, "stop"))

    with serve_app(create_app(OneBigDelta(), "endless")) as url:
        body = {"model": "endless", "stream": True, "stop": ["END"], "messages": [{"role": "user", "content": "x"}]}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=LIVENESS_S) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      for line in r.iter_lines() if line.startswith("data: {")]
    assert deltas.count("w" * 200_000) == 1 and "".join(deltas) == "w" * 200_000
