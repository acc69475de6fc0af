"""The ``openai:`` backend: OpenAI itself or any OpenAI-compatible server (vLLM, SGLang, ``closedloop serve``).

Where the server can give them (vLLM, ``closedloop serve``), turns come back token-exact: vLLM's
``return_token_ids`` gives prompt and completion token ids, and ``logprobs`` the sampled tokens'
log-probabilities, so a trainer can use a remote server's rollouts. Servers that reject those
fields (OpenAI) are detected once and then asked without them.

Retries are our own loop rather than the ``openai`` package's: transient failures (429, 5xx,
timeouts) back off exponentially, honouring ``Retry-After``; a refused connection is retried only
for ``connect_grace_s`` seconds, because a dead address will not come back within a retry chain
and the user should hear so at once.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

import openai

from closedloop.messages import (AssistantMessage, FunctionCall, ToolCall, Turn, Usage, _Message,
                                 to_openai_messages)
from closedloop.models.base import (GenerateRequest, ModelClient, ModelError, ModelUnavailableError, SamplingParams,
                                    StreamEvent, TextDelta, ToolChoice, TurnDone)

Support = bool | Literal["auto"]

# Phrases servers use when rejecting a parameter they do not know; these make "auto" turn it off.
_UNSUPPORTED_HINTS = ("unrecognized", "unknown", "not supported", "unsupported", "extra inputs", "not permitted",
                      "does not support", "invalid parameter")


@dataclass
class _Assembly:
    """A streamed choice, put back together."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    finish_reason: str | None = None
    usage: Any = None
    model: str = ""
    saw_ids: bool = False


class OpenAIClient(ModelClient):
    """A :class:`ModelClient` over ``openai.AsyncOpenAI``.

    ``token_ids`` / ``logprobs``: ``True`` always asks, ``False`` never, ``"auto"`` asks and stops
    asking after the server rejects (or silently ignores, for token ids) the field once.
    """

    def __init__(self, model: str, base_url: str | None = None, *, api_key: str | None = None,
                 max_retries: int = 3, timeout_s: float = 120.0, connect_timeout_s: float = 5.0,
                 connect_grace_s: float = 2.0, backoff_s: float = 0.5, max_backoff_s: float = 16.0,
                 token_ids: Support = "auto", logprobs: Support = "auto", concurrency: int = 32,
                 extra_body: dict[str, Any] | None = None) -> None:
        if max_retries < 0 or concurrency < 1:
            raise ValueError("max_retries must be >= 0 and concurrency >= 1")
        self.model = model
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        key = api_key or os.environ.get("OPENAI_API_KEY")
        if not key:
            if self.base_url is None:
                raise ModelError("OPENAI_API_KEY is not set; set it, or give a base URL "
                                 "(openai:<model>@http://host:port/v1) for a local server")
            key = "EMPTY"  # local servers accept any key
        self.spec = f"openai:{model}" + (f"@{self.base_url}" if self.base_url else "")
        self.url = self.base_url or "https://api.openai.com/v1"
        self.max_retries, self.connect_grace_s = max_retries, connect_grace_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.token_ids: Support = token_ids
        self.logprobs: Support = logprobs
        self.extra_body = dict(extra_body or {})
        # OpenAI's newer models reject max_tokens; many OpenAI-compatible servers only know it.
        self._max_tokens_field = "max_completion_tokens" if self.base_url is None else "max_tokens"
        self._sem = asyncio.Semaphore(concurrency)
        self._client = openai.AsyncOpenAI(api_key=key, base_url=self.base_url, max_retries=0,
                                          timeout=openai.Timeout(timeout_s, connect=connect_timeout_s))

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIClient({self.model!r}, base_url={self.url!r})"

    # ----------------------------------------------------------------- requests

    def _kwargs(self, messages: list[_Message], tools, params: SamplingParams | None, tool_choice) -> dict[str, Any]:
        p = params or SamplingParams()
        kw: dict[str, Any] = {"model": self.model, "messages": to_openai_messages(messages),
                              "temperature": p.temperature, "top_p": p.top_p, self._max_tokens_field: p.max_tokens}
        if p.stop:
            kw["stop"] = p.stop
        if p.seed is not None:
            kw["seed"] = p.seed
        if tools:
            kw["tools"] = tools
            if tool_choice is not None:
                kw["tool_choice"] = tool_choice
        if p.logprobs and self.logprobs is not False:
            kw["logprobs"] = True
        extra = dict(self.extra_body)
        if self.token_ids is not False:
            extra["return_token_ids"] = True
        if extra:
            kw["extra_body"] = extra
        return kw

    def _drop_rejected(self, err: openai.APIStatusError, kw: dict[str, Any]) -> bool:
        """On "auto", a 400 that names a field we added turns that field off; True to resend."""
        text = str(getattr(err, "message", err)).lower()
        if not any(h in text for h in _UNSUPPORTED_HINTS):
            return False
        changed = False
        if self.token_ids == "auto" and "return_token_ids" in text:
            self.token_ids = False
            kw.get("extra_body", {}).pop("return_token_ids", None)
            changed = True
        if self.logprobs == "auto" and "logprobs" in text and "logprobs" in kw:
            self.logprobs = False
            kw.pop("logprobs")
            changed = True
        return changed

    async def _call(self, kw: dict[str, Any]) -> Any:
        """One API call with retries; raises :class:`ModelError`/:class:`ModelUnavailableError`."""
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return await self._client.chat.completions.create(**kw)
            except (openai.BadRequestError, openai.UnprocessableEntityError) as e:
                if self._drop_rejected(e, kw):
                    continue
                raise ModelError(f"{self.url} rejected the request ({e.status_code}): {e.message}") from None
            except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError,
                    openai.ConflictError) as e:
                raise ModelError(f"{self.url} answered {e.status_code}: {e.message}") from None
            except openai.APITimeoutError as e:
                if attempt >= self.max_retries:
                    raise ModelUnavailableError(f"{self.url} timed out after {attempt + 1} attempts") from e
            except openai.APIConnectionError as e:
                delay = self._backoff(attempt + 1)
                if attempt >= self.max_retries or time.monotonic() - start + delay > self.connect_grace_s:
                    raise ModelUnavailableError(f"cannot reach the model server at {self.url}: "
                                                f"{e.__cause__ or e}") from None
                attempt += 1
                await asyncio.sleep(delay)
                continue
            except openai.APIStatusError as e:
                retryable = e.status_code == 429 or e.status_code >= 500
                if not retryable:
                    raise ModelError(f"{self.url} answered {e.status_code}: {e.message}") from None
                if attempt >= self.max_retries:
                    cls = ModelUnavailableError if e.status_code in (502, 503, 504) else ModelError
                    raise cls(f"{self.url} answered {e.status_code} after {attempt + 1} attempts: "
                              f"{e.message}") from None
                delay = self._retry_after(e)
                attempt += 1
                await asyncio.sleep(delay if delay is not None else self._backoff(attempt))
                continue
            attempt += 1  # a timeout: back off and resend
            await asyncio.sleep(self._backoff(attempt))

    def _backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * (0.75 + random.random() / 2)

    def _retry_after(self, e: openai.APIStatusError) -> float | None:
        try:
            value = float(e.response.headers.get("retry-after", ""))
        except (ValueError, AttributeError):
            return None
        return min(max(value, 0.0), self.max_backoff_s)

    # ----------------------------------------------------------------- responses

    def _note_token_ids(self, got: bool) -> None:
        # A server that ignores the field (OpenAI, old vLLM) never will send ids: stop asking.
        if self.token_ids == "auto":
            self.token_ids = True if got else False

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        kw = self._kwargs(messages, tools, params, tool_choice)
        start = time.perf_counter()
        async with self._sem:
            resp = await self._call(kw)
        latency = time.perf_counter() - start
        if not resp.choices:
            raise ModelError(f"{self.url} returned no choices")
        choice = resp.choices[0]
        extra_resp = resp.model_extra or {}
        extra_choice = choice.model_extra or {}
        prompt_ids = extra_resp.get("prompt_token_ids")
        completion_ids = extra_choice.get("token_ids")
        self._note_token_ids(completion_ids is not None)
        lps = [t.logprob for t in choice.logprobs.content] if choice.logprobs and choice.logprobs.content else None
        m = choice.message
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments or "{}"))
                 for c in (m.tool_calls or []) if getattr(c, "function", None) is not None]
        reasoning = (m.model_extra or {}).get("reasoning_content") or (m.model_extra or {}).get("reasoning")
        message = AssistantMessage(content=m.content, tool_calls=calls or None, reasoning=reasoning)
        return self._turn(message, resp.model, prompt_ids, completion_ids, lps, choice.finish_reason, resp.usage,
                          latency)

    def _turn(self, message: AssistantMessage, model: str, prompt_ids, completion_ids, lps, finish_reason, usage,
              latency: float) -> Turn:
        if completion_ids is not None and lps is not None and len(lps) != len(completion_ids):
            lps = None  # the server's logprob tokens do not align with its ids; keep the ids, drop those
        u = Usage(prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
                  completion_tokens=getattr(usage, "completion_tokens", 0) or 0)
        return Turn(message=message, model=model or self.model,
                    prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
                    completion_ids=list(completion_ids) if completion_ids is not None else None,
                    logprobs=list(lps) if lps is not None else None,
                    finish_reason=finish_reason, usage=u, latency_s=latency)

    async def stream(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                     params: SamplingParams | None = None,
                     tool_choice: ToolChoice | None = None) -> AsyncIterator[StreamEvent]:
        kw = self._kwargs(messages, tools, params, tool_choice)
        kw["stream"] = True
        kw["stream_options"] = {"include_usage": True}
        start = time.perf_counter()
        acc = _Assembly()
        async with self._sem:
            stream = await self._call(kw)
            try:
                async for chunk in stream:
                    extra = chunk.model_extra or {}
                    if extra.get("prompt_token_ids") is not None:
                        acc.prompt_ids = list(extra["prompt_token_ids"])
                    if extra.get("error"):
                        raise ModelError(f"{self.url} failed mid-stream: {extra['error']}")
                    acc.model = chunk.model or acc.model
                    if chunk.usage is not None:
                        acc.usage = chunk.usage
                    for choice in chunk.choices:
                        if choice.index != 0:
                            continue
                        text = self._absorb(acc, choice)
                        if text:
                            yield TextDelta(text)
            except openai.APIConnectionError as e:
                raise ModelUnavailableError(f"stream from {self.url} broke off: {e}") from None
            except openai.APIError as e:
                raise ModelError(f"{self.url} failed mid-stream: {getattr(e, 'message', e)}") from None
            finally:
                await stream.close()
        self._note_token_ids(acc.saw_ids)
        calls = [ToolCall(id=c.get("id") or ToolCall.model_fields["id"].default_factory(),
                          function=FunctionCall(name=c["name"], arguments=c["arguments"] or "{}"))
                 for _, c in sorted(acc.calls.items()) if c["name"]]
        message = AssistantMessage(content="".join(acc.content) or None, tool_calls=calls or None,
                                   reasoning="".join(acc.reasoning) or None)
        turn = self._turn(message, acc.model, acc.prompt_ids, acc.token_ids if acc.saw_ids else None,
                          acc.logprobs if acc.logprobs else None, acc.finish_reason, acc.usage,
                          time.perf_counter() - start)
        yield TurnDone(turn)

    @staticmethod
    def _absorb(acc: _Assembly, choice: Any) -> str:
        """Fold one streamed choice delta into ``acc``; returns its new text."""
        extra = choice.model_extra or {}
        if extra.get("token_ids") is not None:
            acc.saw_ids = True
            acc.token_ids.extend(extra["token_ids"])
        if choice.logprobs is not None and choice.logprobs.content:
            acc.logprobs.extend(t.logprob for t in choice.logprobs.content)
        if choice.finish_reason:
            acc.finish_reason = choice.finish_reason
        delta = choice.delta
        if delta is None:
            return ""
        dextra = delta.model_extra or {}
        reasoning = dextra.get("reasoning_content") or dextra.get("reasoning")
        if reasoning:
            acc.reasoning.append(reasoning)
        for tc in delta.tool_calls or []:
            slot = acc.calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                slot["id"] = tc.id
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
        if delta.content:
            acc.content.append(delta.content)
            return delta.content
        return ""

    async def batch(self, requests: list[GenerateRequest]) -> list[Turn]:
        """Concurrent requests, at most ``concurrency`` in flight (the server batches them)."""
        return list(await asyncio.gather(*(self.generate(r.messages, r.tools, r.params, r.tool_choice)
                                           for r in requests)))

    async def aclose(self) -> None:
        await self._client.close()
