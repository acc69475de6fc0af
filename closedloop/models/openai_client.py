"""The ``openai:`` backend: OpenAI itself or any OpenAI-compatible server (vLLM, SGLang,
``transformers serve``, ``closedloop serve``).

Where the server can give them (vLLM, ``closedloop serve``), turns come back token-exact: vLLM's
``return_token_ids`` gives prompt and completion token ids, and ``logprobs`` the sampled tokens'
log-probabilities, so a trainer can use a remote server's rollouts. Servers differ in the optional
fields they take; the client asks for what it wants, and when a server refuses a field (400/422
naming it) resends once without it and remembers that for the server's base URL
(:mod:`closedloop.models.server_features`). Whatever a turn lacks for that reason is written in
``Turn.unavailable`` (``{"token_ids": "the server does not return them: ..."}``), so a trainer
refuses the turn with the reason instead of failing later.

Retries are the ``openai`` package's own (429, 5xx, timeouts, dropped connections; ``Retry-After``
in seconds or as an HTTP date), with one exception: a refused connection is retried only for
``connect_grace_s`` seconds (:func:`closedloop.models.retry.retry_async`), because a dead address
will not come back within a retry chain and the user should hear so at once.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Literal

import openai

from closedloop.messages import (AssistantMessage, FunctionCall, LogprobSpec, ToolCall, Turn, Usage, _Message,
                                 to_openai_messages)
from closedloop.models.base import (ContextLengthExceededError, GenerateRequest, ModelClient, ModelError, ModelUnavailableError, SamplingParams,
                                    StreamEvent, TextDelta, ToolChoice, TurnDone)
from closedloop.models.retry import Backoff, retry_async
from closedloop.models.server_features import (MAX_TOKENS_FIELDS, OPTIONAL_FIELDS, ServerFeatures, error_text,
                                               names_other_max_tokens_field, rejected_fields, server_features,
                                               tool_choice_key)

Support = bool | Literal["auto"]

# What a turn lacks when the server refused the field that asks for it (Turn.unavailable keys).
_WHAT = {"return_token_ids": "token_ids", "logprobs": "logprobs", "top_logprobs": "top_logprobs", "seed": "seed",
         "parallel_tool_calls": "parallel_tool_calls", "tool_choice": "tool_choice", "stream_options": "usage"}
_CONSEQUENCE = {"token_ids": "the server does not return them", "logprobs": "the server does not return them",
                "top_logprobs": "the server does not return them",
                "seed": "the sample is not reproducible from the seed",
                "parallel_tool_calls": "the server chose how many calls to make",
                "tool_choice": "the model was not constrained", "usage": "the server may not count tokens"}


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


@dataclass
class _Request:
    """One request body being negotiated with a server: ``keys`` maps each optional field sent to
    its feature key; ``missing`` collects what the turn will lack and why."""

    body: dict[str, Any]
    keys: dict[str, str]
    params: SamplingParams
    missing: dict[str, str] = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _http_client_class() -> type:
    """``openai.DefaultAsyncHttpxClient`` whose ``send`` gives a refused connection only
    ``connect_grace_s``: the SDK would back off through its whole retry budget. An
    :class:`openai.APIConnectionError` raised from ``send`` is not retried by the SDK (openai>=2;
    older SDKs retry it too, which only makes a dead address slower to report).
    Built on whichever httpx flavour the installed SDK uses (httpx, or httpx2 for openai>=3)."""
    base = openai.DefaultAsyncHttpxClient
    hx = next(importlib.import_module(c.__module__.split(".")[0]) for c in base.__mro__ if c.__name__ == "AsyncClient")

    class GraceClient(base):  # type: ignore[misc, valid-type]
        def __init__(self, *, connect_grace_s: float, connect_attempts: int, backoff: Backoff, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.connect_grace_s, self.connect_attempts, self.backoff = connect_grace_s, connect_attempts, backoff

        async def send(self, request: Any, **kwargs: Any) -> Any:
            try:
                return await retry_async(lambda: base.send(self, request, **kwargs),
                                         retry_on=lambda e: isinstance(e, hx.ConnectError),
                                         max_attempts=self.connect_attempts, backoff=self.backoff,
                                         deadline_s=self.connect_grace_s)
            except hx.ConnectError as e:
                raise openai.APIConnectionError(message=f"cannot connect: {e}", request=request) from e

    return GraceClient


def _is_context_overflow(e: Any) -> bool:
    """An OpenAI-style 400 for a prompt that does not fit: code ``context_length_exceeded`` (OpenAI,
    closedloop serve), or vLLM's/SGLang's wording ("maximum context length")."""
    body = e.body if isinstance(getattr(e, "body", None), dict) else {}
    inner = body.get("error")
    err: dict[str, Any] = inner if isinstance(inner, dict) else body
    if getattr(e, "code", None) == "context_length_exceeded" or err.get("code") == "context_length_exceeded":
        return True
    text = f"{err.get('message', '')} {getattr(e, 'message', '')}".lower()
    return "maximum context length" in text or "context length exceeded" in text


class OpenAIClient(ModelClient):
    """A :class:`ModelClient` over ``openai.AsyncOpenAI``.

    ``token_ids`` / ``logprobs``: ``True`` always asks (a refusal is an error), ``False`` never,
    ``"auto"`` asks unless this server is known to refuse the field (or, for token ids, to ignore
    it). Other optional fields (``seed``, ``tool_choice`` forms, ``stream_options``, and
    ``top_logprobs``/``parallel_tool_calls`` given through ``extra_body`` or the constructor) are
    always negotiated that way. ``max_retries`` is the SDK's retry budget for 429/5xx/timeouts.
    """

    def __init__(self, model: str, base_url: str | None = None, *, api_key: str | None = None,
                 max_retries: int = 3, timeout_s: float = 120.0, connect_timeout_s: float = 5.0,
                 connect_grace_s: float = 2.0, backoff_s: float = 0.25, max_backoff_s: float = 2.0,
                 token_ids: Support = "auto", logprobs: Support = "auto", parallel_tool_calls: bool | None = None,
                 concurrency: int = 32, extra_body: dict[str, Any] | None = None) -> None:
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
        # spec and url are what is shown and recorded (errors, LogprobSpec.backend, checkpoints, the store):
        # a base URL's ``user:key@`` or ``?api_key=`` is redacted there; only the SDK gets base_url itself.
        from closedloop.redact import redact_spec

        shown = redact_spec(self.base_url)
        self.spec = f"openai:{model}" + (f"@{shown}" if shown else "")
        self.url = shown or "https://api.openai.com/v1"
        self.features: ServerFeatures = server_features(self.url, model)
        self.max_retries, self.connect_grace_s = max_retries, connect_grace_s
        self._token_ids: Support = token_ids
        self._logprobs: Support = logprobs
        self.parallel_tool_calls = parallel_tool_calls
        self.extra_body = dict(extra_body or {})
        # OpenAI's newer models reject max_tokens; many OpenAI-compatible servers only know it.
        self._max_tokens_field = "max_completion_tokens" if self.base_url is None else "max_tokens"
        self._concurrency = concurrency

        def make_sdk() -> openai.AsyncOpenAI:
            http = _http_client_class()(connect_grace_s=connect_grace_s, connect_attempts=max_retries + 1,
                                        backoff=Backoff(backoff_s, max_backoff_s))
            return openai.AsyncOpenAI(api_key=key, base_url=self.base_url, max_retries=max_retries,
                                      timeout=openai.Timeout(timeout_s, connect=connect_timeout_s), http_client=http)

        self._make_sdk = make_sdk
        # The SDK's connection pool and our semaphore belong to the event loop that first used
        # them; one client used from several loops (a trainer runs each rollout batch in its own
        # asyncio.run) gets one SDK client per loop, dropped with its loop.
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                                  tuple[openai.AsyncOpenAI, asyncio.Semaphore]] = \
            weakref.WeakKeyDictionary()

    def _loop_state(self) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(loop)
        if state is None:
            state = self._per_loop[loop] = (self._make_sdk(), asyncio.Semaphore(self._concurrency))
        return state

    @property
    def _client(self) -> openai.AsyncOpenAI:
        return self._loop_state()[0]

    @property
    def _sem(self) -> asyncio.Semaphore:
        return self._loop_state()[1]

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIClient({self.model!r}, base_url={self.url!r})"

    @property
    def token_ids(self) -> Support:
        """Whether token ids are asked for: the setting, or on ``"auto"`` what was learnt."""
        if self._token_ids != "auto":
            return self._token_ids
        if "return_token_ids" in self.features.rejected or self.features.ignores_token_ids:
            return False
        return True if self.features.returns_token_ids else "auto"

    @property
    def logprobs(self) -> Support:
        if self._logprobs != "auto":
            return self._logprobs
        return False if "logprobs" in self.features.rejected else "auto"

    # ----------------------------------------------------------------- requests

    def _request(self, messages: list[_Message], tools, params: SamplingParams | None, tool_choice,
                 stream: bool) -> _Request:
        p = params or SamplingParams()
        f = self.features
        body: dict[str, Any] = {"messages": to_openai_messages(messages), "temperature": p.temperature,
                                "top_p": p.top_p, (f.max_tokens_field or self._max_tokens_field): p.max_tokens}
        req = _Request(body, {}, p)

        def offer(name: str, value: Any, key: str | None = None, force: bool = False) -> None:
            key = key or name
            if key in f.rejected and not force:
                what = _WHAT[name]
                req.missing[what] = f"{_CONSEQUENCE[what]}: it rejected {key!r} ({f.rejected[key]})"
            else:
                body[name], req.keys[name] = value, key

        if p.stop:
            body["stop"] = p.stop
        for name, value in self.extra_body.items():
            if name in OPTIONAL_FIELDS:
                offer(name, value)
            else:
                body[name] = value
        if p.seed is not None:
            offer("seed", p.seed)
        if tools:
            body["tools"] = tools
            if tool_choice is not None:
                offer("tool_choice", tool_choice, tool_choice_key(tool_choice))
            if self.parallel_tool_calls is not None:
                offer("parallel_tool_calls", self.parallel_tool_calls)
        if p.logprobs and self._logprobs is not False:
            offer("logprobs", True, force=self._logprobs is True)
        if self._token_ids is not False:
            if self._token_ids == "auto" and f.ignores_token_ids:
                req.missing["token_ids"] = "the server does not return them (it ignores 'return_token_ids')"
            else:
                offer("return_token_ids", True, force=self._token_ids is True)
        if stream:
            offer("stream_options", {"include_usage": True})
        return req

    def _learn(self, e: openai.APIStatusError, req: _Request, tried: dict[str, str]) -> bool:
        """Drop the optional field(s) a 400/422 names from ``req``; True to resend. The refusal is
        kept in ``tried`` and remembered for the server only once a resend gets past it."""
        text = error_text(e.body, e.message)
        sent = [*req.keys, *(n for n in MAX_TOKENS_FIELDS if n in req.body)]
        names = [n for n in rejected_fields(e.body, e.message, sent) if n not in tried]
        changed = False
        for name in names:
            if name in MAX_TOKENS_FIELDS:
                other = names_other_max_tokens_field(name, text)
                if other is not None:
                    req.body[other] = req.body.pop(name)
                    tried[name] = other
                    changed = True
                continue
            if (name == "return_token_ids" and self._token_ids is True) or \
                    (name in ("logprobs", "top_logprobs") and self._logprobs is True):
                return False  # asked for explicitly: the refusal is the caller's to see
            key = req.keys.pop(name)
            req.body.pop(name, None)
            tried[key] = text
            what = _WHAT[name]
            req.missing[what] = f"{_CONSEQUENCE[what]}: it rejected {key!r} ({text})"
            if name == "logprobs" and "top_logprobs" in req.body:  # meaningless without logprobs
                tried[req.keys.pop("top_logprobs")] = text
                req.body.pop("top_logprobs")
            changed = True
        return changed

    def _commit(self, tried: dict[str, str]) -> None:
        for key, value in tried.items():
            if key in MAX_TOKENS_FIELDS:
                self.features.max_tokens_field = value
            else:
                self.features.rejected[key] = value

    async def _call(self, req: _Request, stream: bool) -> Any:
        """One API call (the SDK retries transient failures); raises :class:`ModelError` or
        :class:`ModelUnavailableError`."""
        tried: dict[str, str] = {}
        while True:
            body = dict(req.body)
            messages = body.pop("messages")
            try:
                resp = await self._client.chat.completions.create(model=self.model, messages=messages,
                                                                  stream=stream, extra_body=body)
            except (openai.BadRequestError, openai.UnprocessableEntityError) as e:
                if _is_context_overflow(e):  # its own type end to end (a benchmark scores it)
                    raise ContextLengthExceededError(f"{self.url}: {error_text(e.body, e.message)}") from None
                if self._learn(e, req, tried):
                    continue
                raise ModelError(f"{self.url} rejected the request ({e.status_code}): "
                                 f"{error_text(e.body, e.message)}") from None
            except openai.APITimeoutError as e:
                raise ModelUnavailableError(f"{self.url} timed out after {self.max_retries + 1} attempts") from e
            except openai.APIConnectionError as e:
                raise ModelUnavailableError(f"cannot reach the model server at {self.url}: "
                                            f"{e.__cause__ or e}") from None
            except openai.APIStatusError as e:
                text = error_text(e.body, e.message)
                if e.status_code == 429 or e.status_code >= 500:
                    attempts = int(e.response.request.headers.get("x-stainless-retry-count", 0) or 0) + 1
                    cls = ModelUnavailableError if e.status_code in (502, 503, 504) else ModelError
                    raise cls(f"{self.url} answered {e.status_code} after {attempts} attempts: {text}") from None
                raise ModelError(f"{self.url} answered {e.status_code}: {text}") from None
            self._commit(tried)
            return resp

    # ----------------------------------------------------------------- responses

    def _note_token_ids(self, req: _Request, got: bool) -> None:
        # A server that ignores the field (OpenAI, old vLLM) never will send ids: stop asking.
        if "return_token_ids" in req.body:
            if got:
                self.features.returns_token_ids = True
            elif not self.features.returns_token_ids:
                self.features.ignores_token_ids = True

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        req = self._request(messages, tools, params, tool_choice, stream=False)
        start = time.perf_counter()
        async with self._sem:
            resp = await self._call(req, stream=False)
        latency = time.perf_counter() - start
        if not resp.choices:
            raise ModelError(f"{self.url} returned no choices")
        choice = resp.choices[0]
        extra_resp = resp.model_extra or {}
        extra_choice = choice.model_extra or {}
        prompt_ids = extra_resp.get("prompt_token_ids")
        completion_ids = extra_choice.get("token_ids")
        self._note_token_ids(req, completion_ids is not None)
        lps = [t.logprob for t in choice.logprobs.content] if choice.logprobs and choice.logprobs.content else None
        m = choice.message
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments or "{}"))
                 for c in (m.tool_calls or []) if getattr(c, "function", None) is not None]
        reasoning = (m.model_extra or {}).get("reasoning_content") or (m.model_extra or {}).get("reasoning")
        # Some servers send "" beside tool calls, others null; one form, so histories replay the same.
        content = m.content if m.content or not calls else None
        message = AssistantMessage(content=content, tool_calls=calls or None, reasoning=reasoning)
        return self._turn(req, message, resp.model, prompt_ids, completion_ids, lps, choice.finish_reason,
                          resp.usage, latency)

    def _unavailable(self, req: _Request, has_ids: bool, lps_state: str, usage: Any) -> dict[str, str]:
        """Why the turn lacks what it lacks; ``lps_state`` is "ok", "none" or "misaligned"."""
        out = dict(req.missing)
        if not has_ids and "token_ids" not in out:
            if self._token_ids is False:
                out["token_ids"] = "not asked for (token_ids=False)"
            else:
                out["token_ids"] = "the server does not return them (it ignores 'return_token_ids')"
        if lps_state != "ok" and "logprobs" not in out:
            if not req.params.logprobs:
                out["logprobs"] = "not asked for (SamplingParams.logprobs=False)"
            elif self._logprobs is False:
                out["logprobs"] = "not asked for (logprobs=False)"
            elif lps_state == "misaligned":
                out["logprobs"] = "the server's logprobs do not align with its token ids"
            else:
                out["logprobs"] = "the server does not return them (it ignores 'logprobs')"
        if usage is not None:
            out.pop("usage", None)
        return out

    def _turn(self, req: _Request, message: AssistantMessage, model: str, prompt_ids, completion_ids, lps,
              finish_reason, usage, latency: float) -> Turn:
        lps_state = "none" if lps is None else "ok"
        if completion_ids is not None and lps is not None and len(lps) != len(completion_ids):
            lps, lps_state = None, "misaligned"  # keep the ids, drop logprobs that cannot be placed on them
        u = Usage(prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
                  completion_tokens=getattr(usage, "completion_tokens", 0) or 0)
        p = req.params
        spec = LogprobSpec(mode="server", temperature=p.temperature, top_p=p.top_p, backend=self.spec) \
            if lps is not None else None
        return Turn(message=message, model=model or self.model,
                    prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
                    completion_ids=list(completion_ids) if completion_ids is not None else None,
                    logprobs=list(lps) if lps is not None else None, logprob_spec=spec,
                    finish_reason=finish_reason, usage=u, latency_s=latency,
                    unavailable=self._unavailable(req, prompt_ids is not None and completion_ids is not None,
                                                  lps_state, usage))

    async def stream(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                     params: SamplingParams | None = None,
                     tool_choice: ToolChoice | None = None) -> AsyncGenerator[StreamEvent, None]:
        req = self._request(messages, tools, params, tool_choice, stream=True)
        start = time.perf_counter()
        acc = _Assembly()
        async with self._sem:
            stream = await self._call(req, stream=True)
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
        self._note_token_ids(req, acc.saw_ids)
        calls = [ToolCall.make(c["name"], c["arguments"] or "{}", id=c.get("id") or None)
                 for _, c in sorted(acc.calls.items()) if c["name"]]
        message = AssistantMessage(content="".join(acc.content) or None, tool_calls=calls or None,
                                   reasoning="".join(acc.reasoning) or None)
        turn = self._turn(req, message, acc.model, acc.prompt_ids, acc.token_ids if acc.saw_ids else None,
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
        loop = asyncio.get_running_loop()
        state = self._per_loop.pop(loop, None)
        if state is not None:
            await state[0].close()
