"""Servers for the server tests: real uvicorn on a free localhost port, in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from typing import Any, AsyncIterator, Iterator

import pytest

from closedloop.messages import AssistantMessage, ToolCall, Turn, Usage, _Message, content_text
from closedloop.models.base import ModelClient, SamplingParams, StreamEvent, TextDelta, ToolChoice, TurnDone
from closedloop.server import create_app
from closedloop.server.local import free_port, serve_app  # noqa: F401 (the tests import them from here)

WORDS = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "juliet"]


class ByteTokenizer:
    """One token per byte, so ids decode back to text exactly."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class WordClient(ModelClient):
    """A deterministic model for testing the server's wire format without torch.

    The reply is words drawn from a hash of (conversation, seed) at temperature > 0, or of the
    conversation alone at temperature 0, so seeds and greedy decoding behave as a real model's do.
    With tools offered and "weather" in the last user message it calls the first tool. It records
    the largest number of calls in flight, so tests can see the server did not serialise them.
    """

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None) -> None:
        self.tokenizer = ByteTokenizer()
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls: list[dict[str, Any]] = []
        self.spec = "test:words"

    def _reply(self, messages, tools, params: SamplingParams) -> tuple[str, AssistantMessage, str]:
        last = content_text(messages[-1].content) if hasattr(messages[-1], "content") else ""
        if self.fail_on and self.fail_on in last:
            raise RuntimeError("simulated device failure")
        if tools and "weather" in last:
            name = tools[0]["function"]["name"]
            call = ToolCall.make(name, {"city": "Paris"})
            raw = f'<tool_call>{{"name": "{name}", "arguments": {{"city": "Paris"}}}}</tool_call>'
            return raw, AssistantMessage(content=None, tool_calls=[call]), "tool_calls"
        key = json.dumps([m.to_openai() for m in messages])
        if params.temperature > 0:
            key += f"|{params.seed if params.seed is not None else time.perf_counter_ns()}"
        digest = hashlib.sha256(key.encode()).digest()
        words = [WORDS[b % len(WORDS)] for b in digest]
        text = ""
        for w in words:
            nxt = (text + " " + w).strip()
            if len(nxt.encode()) > params.max_tokens:
                return text, AssistantMessage(content=text), "length"
            text = nxt
            if params.stop and any(s in text for s in params.stop):
                # like a real backend: the raw completion runs through the stop string, the reply ends before it
                s = min((s for s in params.stop if s in text), key=text.index)
                cut = text.index(s)
                return text[:cut + len(s)], AssistantMessage(content=text[:cut].strip() or None), "stop"
        return text, AssistantMessage(content=text), "stop"

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        params = params or SamplingParams()
        self.calls.append({"tools": tools, "tool_choice": tool_choice, "params": params})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            raw, message, finish = self._reply(messages, tools, params)
        finally:
            self.in_flight -= 1
        prompt = self.tokenizer.encode(json.dumps([m.to_openai() for m in messages]))
        completion = self.tokenizer.encode(raw)
        return Turn(message=message, model=self.spec, prompt_ids=prompt, completion_ids=completion,
                    logprobs=[-0.01 * (i % 7) for i in range(len(completion))], completion_text=raw,
                    finish_reason=finish, usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(completion)))

    async def stream(self, messages, tools=None, params=None, tool_choice=None) -> AsyncIterator[StreamEvent]:
        turn = await self.generate(messages, tools, params, tool_choice)
        raw = turn.completion_text or ""
        for i in range(0, len(raw), 3):  # raw text, markup included, as a real backend streams it
            yield TextDelta(raw[i:i + 3])
        yield TurnDone(turn)


@contextlib.contextmanager
def serve_in_thread(client: ModelClient, model_name: str, **kw: Any) -> Iterator[str]:
    """Serve ``client`` under a real uvicorn server; yields the base URL (``.../v1``)."""
    with serve_app(create_app(client, model_name, **kw)) as url:
        yield url


@pytest.fixture(scope="module")
def word_client() -> WordClient:
    return WordClient(delay_s=0.05, fail_on="EXPLODE")


@pytest.fixture(scope="module")
def word_server(word_client: WordClient) -> Iterator[str]:
    with serve_in_thread(word_client, "words") as url:
        yield url
