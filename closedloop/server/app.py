"""An OpenAI-compatible HTTP server over any :class:`~closedloop.models.base.ModelClient`.

It lets anything that speaks OpenAI (our own ``openai:`` backend, LangChain, other agents'
harnesses) drive a local model, while keeping what RL needs: exact token ids (vLLM's
``return_token_ids``) and per-token logprobs.

Requests are never serialised here: each one awaits the client concurrently, and the backend (the
HF client's micro-batching queue) batches them on the device.

Known limits, stated rather than hidden:

* ``tool_choice="required"`` and a named function cannot be forced on a local model's decoding.
  A named function is the only tool shown; when the reply has no (matching) call and sampling is
  random, the request is re-asked up to ``max_reasks`` times (non-streaming requests only); the
  last reply is returned as is. Greedy requests are not re-asked: the answer would not change.
  Re-asks are not hidden: each choice lists the replies it discarded under
  ``closedloop_discarded`` (finish reason, content, tool calls, token count, and token ids and
  logprobs when the request asked for them), and ``usage.completion_tokens`` counts their tokens
  (broken out in ``usage.completion_tokens_details.closedloop_discarded_tokens``), as OpenAI
  counts reasoning tokens the reply does not show. ``prompt_tokens`` counts the prompt once, as
  for ``n`` choices. Both fields are absent when nothing was re-asked. The returned reply was
  sampled with a derived seed (``seed + 1000 * attempt``), which is what its logprobs describe.
* ``top_logprobs`` entries are empty lists: the backends give the sampled token's logprob only.
* When streaming, text arrives as deltas but logprobs, ``token_ids`` and ``prompt_token_ids``
  arrive whole on each choice's final chunk (the one with ``finish_reason``), and tool calls
  arrive complete, one delta each, after the text.
* ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` are accepted and ignored.

Hostile input (``tests/reliability/test_server_*.py``): every malformed body is a 4xx in OpenAI's
error shape, never a 500.

* Size: a body over ``max_request_bytes`` (``closedloop serve --max-request-bytes``, default 8 MiB)
  is refused with 413 ``request_too_large`` before it is read whole (the ``Content-Length`` is
  checked first, a chunked body as it arrives). Large bodies are parsed off the event loop and
  the hf: backend tokenises off its decode worker, so a big request delays only itself.
* JSON: nesting deeper than ``MAX_JSON_DEPTH`` (64), a lone UTF-16 surrogate (``"\\ud800"``),
  ``NaN``/``Infinity`` and numbers that overflow (``1e400``) are 400 ``invalid_json``/``invalid_value``.
* ``max_tokens`` (or ``max_completion_tokens``) above ``max_tokens_cap`` (``--max-tokens-cap``,
  default 32768) is a 400 naming the cap, as OpenAI answers; it is not clamped silently.
* Tools: names must match ``^[a-zA-Z0-9_-]{1,64}$`` and be unique, ``parameters`` must be a valid
  JSON Schema of type object (OpenAI's rules), else 400. A reply may only call a tool the request
  offered: a ``<tool_call>`` naming any other tool (or any tool under ``tool_choice="none"``) is
  returned as the text the model wrote, in ``content``, not as a call.
* The history follows OpenAI's rules too: a ``tool`` message answers a call of the assistant
  message before it (by ``tool_call_id``), and message names and the names of calls in the
  history match the tool-name pattern (a call named ``<|im_start|>system`` or a 1 MB name is a
  400 naming the field).
* Stop strings: at most 4, each at most ``MAX_STOP_CHARS`` (1024) characters. Streamed text is
  matched against them and the markup in one linear pass (:mod:`closedloop.server.stream_text`):
  a stream with the longest stop strings costs the event loop microseconds per token.
* Errors and reports name the model as it is served: where a local model lives on this machine
  (its path, resolved or not) is replaced by the served name, and credentials in an ``openai:``
  spec are redacted (:func:`closedloop.redact.redact_spec`), in error bodies, in-band stream
  errors, ``GET /closedloop/v1/weights`` and the server's own log.
* Connections: header and body read timeouts, uvicorn's idle timeout and a connection cap
  (:mod:`closedloop.server.connections`; ``closedloop serve --header-timeout`` and its siblings).
* ``finish_reason`` is ``"length"`` whenever the token limit cut the reply, also when it cut a
  tool call: the call is returned as generated (its arguments usually invalid JSON), as OpenAI does;
  ``"tool_calls"`` means every call was completed.
* A client that disconnects (streaming or not) cancels its generation: the hf: backend drops the
  row from the running batch (``/health`` reports ``cancelled_rows``).
* Sampling values inside OpenAI's ranges are never refused for being tiny: a ``temperature`` of
  1e-300 is sampled at 0.01 and a ``top_p`` of 1e-300 keeps the top token (vLLM's handling, done
  per row in hf:), so one request cannot fail the others in its device batch.

Admin endpoints (closedloop-specific, for a trainer whose rollouts come from this server):

* ``GET /closedloop/v1/weights`` reports whether weight updates are allowed and the last load.
* ``POST /closedloop/v1/load_weights {"path": DIR, "step": N}`` reloads the served ``hf:`` (or
  ``vllm:``) model's weights in place from a Hugging Face directory (``config.json`` +
  safetensors) on the server's filesystem (:mod:`closedloop.models.weights`): checked whole
  before anything is copied (400 naming the problem otherwise), applied while no batch decodes.
  It is off unless the server was started with ``--allow-weight-updates`` (403 otherwise),
  because it lets any caller replace the model and read local directories: meant for a trainer
  on the same machine, on a loopback address. A backend without local weights answers 501.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from closedloop.messages import AssistantMessage, MessageBase, Turn, content_text
from closedloop.models.chat_format import END_MARKERS, THINK_OPEN, TOOL_CALL_OPEN
from closedloop.models.base import (EndMarkers, LocalTokenizer, ModelClient, ModelError, ReportsBatches, SamplingParams,
                                    TextDelta, TurnDone)
from closedloop.server.api_error import APIError, log_failure, model_failure, validation_error
from closedloop.server.request_body import parse_json, read_body, release_memory
from closedloop.server.schemas import (ChatCompletion, ChatCompletionRequest, Choice, ChoiceLogprobs,
                                       CompletionTokensDetails, ConversationError, DiscardedAttempt, LoadWeightsRequest,
                                       ModelCard, ModelList, ResponseFunctionCall, ResponseMessage, ResponseToolCall,
                                       TokenLogprob, UsageInfo, WeightsStatus)
from closedloop.server.stream_text import VisibleText
from closedloop.redact import redact_spec

log = logging.getLogger("closedloop.server")

# Markup a local model writes that never reaches ``content``; a streamed delta is held back while
# the text so far could be the start of one of these (see closedloop.server.stream_text).
_MARKERS = (TOOL_CALL_OPEN, THINK_OPEN, *END_MARKERS)
#: A streamed delta at least this long is matched against the markers on a thread, not on the event loop
#: (a token's few characters cost microseconds there, less than the hop to a thread).
_BIG_DELTA = 64 * 1024

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS_CAP = 32768
#: Bodies at least this large are parsed on a thread, not on the event loop.
_BIG_BODY = 1 << 20
#: After a request at least this large, freed memory is handed back to the OS (see release_memory).
_RELEASE_BODY = 256 * 1024


# --------------------------------------------------------------------------- conversions


def _finish_reason(turn: Turn) -> str:
    # The token limit wins: a call it cut off is not a completed call (OpenAI also says "length").
    if turn.finish_reason == "length":
        return "length"
    return "tool_calls" if turn.message.tool_calls else "stop"


def _offered_only(client: ModelClient, turn: Turn, offered: set[str], stops: list[str] | None) -> Turn:
    """``turn`` with every tool call that names a tool the request did not offer turned back into
    the text the model wrote (see the module docstring)."""
    calls = turn.message.tool_calls or []
    if all(c.function.name in offered for c in calls):
        return turn
    from closedloop.models.chat_format import parse_completion

    if turn.completion_text is not None:
        text = turn.completion_text
        if stops and turn.finish_reason != "length":
            cut = min((i for i in (text.find(s) for s in stops) if i != -1), default=-1)
            if cut != -1:
                text = text[:cut]
        markers = (client._end_markers if isinstance(client, EndMarkers) else None) or END_MARKERS
        message = parse_completion(text, end_markers=tuple(markers), tool_names=offered)
    else:  # no raw text (a remote backend): write the unoffered calls back as the Hermes text
        kept = [c for c in calls if c.function.name in offered]
        extra = "".join(f'\n<tool_call>\n{json.dumps({"name": c.function.name, "arguments": c.function.arguments})}'
                        f"\n</tool_call>" for c in calls if c.function.name not in offered)
        message = AssistantMessage(content=((content_text(turn.message.content) or "") + extra).strip() or None,
                                   tool_calls=kept or None, reasoning=turn.message.reasoning)
    finish = turn.finish_reason
    if finish == "tool_calls" and not message.tool_calls:
        finish = "stop"
    return turn.model_copy(update={"message": message, "finish_reason": finish})


def _decode_tokens(client: ModelClient, ids: list[int]) -> list[str]:
    """Each token's text, for logprobs. Without a tokenizer, vLLM's ``token_id:N`` convention."""
    tok = client.tokenizer if isinstance(client, LocalTokenizer) else None
    if tok is not None:
        try:
            if hasattr(tok, "batch_decode"):
                return list(tok.batch_decode([[i] for i in ids]))  # one call, not one per token
            return [tok.decode([i]) for i in ids]
        except Exception:  # noqa: BLE001 - a tokenizer quirk must not fail the request
            log.warning("could not decode token ids for logprobs", exc_info=True)
    return [f"token_id:{i}" for i in ids]


def _logprobs(client: ModelClient, turn: Turn) -> ChoiceLogprobs:
    if turn.completion_ids is None or turn.logprobs is None:
        return ChoiceLogprobs(content=[])
    tokens = _decode_tokens(client, turn.completion_ids)
    # JSON has no -inf; vLLM clamps the same way.
    return ChoiceLogprobs(content=[TokenLogprob(token=t, logprob=max(lp, -9999.0) if lp == lp else -9999.0,
                                                bytes=list(t.encode("utf-8")), top_logprobs=[])
                                   for t, lp in zip(tokens, turn.logprobs)])


def _tool_calls(turn: Turn) -> list[ResponseToolCall] | None:
    if not turn.message.tool_calls:
        return None
    return [ResponseToolCall(id=c.id,
                             function=ResponseFunctionCall(name=c.function.name, arguments=c.function.arguments))
            for c in turn.message.tool_calls]


def _content(turn: Turn) -> str | None:
    if turn.message.content is None:
        return None
    return content_text(turn.message.content)


def _completion_tokens(turn: Turn) -> int:
    return turn.usage.completion_tokens or len(turn.completion_ids or [])


def _usage(turns: list[Turn], discarded: list[Turn] | None = None) -> UsageInfo:
    """OpenAI counts the prompt once for ``n`` choices and sums the completions; the completions
    of discarded re-asks are counted too (they were generated), and broken out."""
    prompt = max((t.usage.prompt_tokens or len(t.prompt_ids or []) for t in turns), default=0)
    thrown = sum(_completion_tokens(t) for t in discarded or [])
    completion = sum(_completion_tokens(t) for t in turns) + thrown
    details = CompletionTokensDetails(closedloop_discarded_tokens=thrown) if discarded else None
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     completion_tokens_details=details)


def _discarded(client: ModelClient, turn: Turn, req: ChatCompletionRequest) -> DiscardedAttempt:
    return DiscardedAttempt(finish_reason=_finish_reason(turn), content=_content(turn), tool_calls=_tool_calls(turn),
                            completion_tokens=_completion_tokens(turn),
                            token_ids=list(turn.completion_ids) if req.return_token_ids and turn.completion_ids
                            is not None else None,
                            logprobs=_logprobs(client, turn) if req.logprobs else None)


# --------------------------------------------------------------------------- the app


def _private_names(client: ModelClient) -> list[str]:
    """Where a local served model lives on this machine, as its backend writes it in errors
    (``hf:/srv/models/x is a text-only model``): the path or hub id of an ``hf:``/``vllm:`` spec,
    and that path made absolute and resolved. Longest first, so a resolved path is replaced whole."""
    backend, _, model = str(getattr(client, "spec", "") or "").partition(":")
    if backend not in ("hf", "vllm") or not model:
        return []
    names = {model}
    if os.path.exists(model):
        names |= {os.path.realpath(model), os.path.abspath(model)}
    return sorted(names, key=len, reverse=True)


class _Server:
    def __init__(self, client: ModelClient, model_name: str, default_max_tokens: int, max_reasks: int,
                 allow_weight_updates: bool = False, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP) -> None:
        self.client = client
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.max_reasks = max_reasks
        self.max_request_bytes = max_request_bytes
        self.max_tokens_cap = max_tokens_cap
        #: Requests whose client went away before the reply (their generation was cancelled).
        self.disconnected = 0
        self.created = int(time.time())
        self._private = _private_names(client)
        self.weights = WeightsStatus(weight_updates=allow_weight_updates,
                                     backend=self.public(str(getattr(client, "spec", type(client).__name__))))
        self._weights_lock = asyncio.Lock()

    def public(self, text: str) -> str:
        """``text`` as a client may read it: where the served model lives on this machine is
        replaced by the name it is served as, and credentials (a proxied ``openai:`` spec's
        ``user:key@`` or ``?api_key=``) are redacted (:func:`closedloop.redact.redact_spec`)."""
        for private in self._private:
            text = text.replace(private, self.model_name)
        return redact_spec(text) or ""

    def failure(self, e: Exception) -> APIError:
        return model_failure(e, self.public)

    # ----------------------------------------------------------------- admin: weights

    async def load_weights(self, request: Request) -> WeightsStatus:
        """Reload the served weights from a directory (see the module docstring)."""
        from closedloop.models.weights import UnsupportedBackend, WeightsError, load_weights_into, read_hf_weights, \
            served_model_type

        if not self.weights.weight_updates:
            raise APIError(403, "weight updates are disabled on this server; start it with --allow-weight-updates "
                                "(an admin endpoint for a trainer on the same machine)", type="permission_error",
                           code="weight_updates_disabled")
        body = parse_json(await read_body(request, self.max_request_bytes))
        try:
            req = LoadWeightsRequest.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        async with self._weights_lock:  # one load at a time; generation waits only for the copy itself
            t0 = time.perf_counter()

            def load() -> int:
                state = read_hf_weights(req.path, model_type=served_model_type(self.client))
                return load_weights_into(self.client, state)

            try:
                count = await asyncio.to_thread(load)
            except WeightsError as e:
                raise APIError(400, self.public(str(e)), param="path", code="invalid_weights") from None
            except UnsupportedBackend as e:
                raise APIError(501, self.public(str(e)), type="server_error", code="unsupported_backend") from None
            except Exception as e:  # noqa: BLE001 - the model may be half-loaded: say so loudly
                log_failure("weight load failed", e)
                raise APIError(500, self.public(f"weight load failed: {type(e).__name__}: {e}"), type="server_error",
                               code="weight_load_failed") from None
            self.weights = self.weights.model_copy(update={
                "loads": self.weights.loads + 1, "step": req.step, "path": req.path, "tensors": count,
                "load_s": time.perf_counter() - t0})
            return self.weights

    # ----------------------------------------------------------------- request parsing

    async def parse(self, request: Request) -> tuple[ChatCompletionRequest, list[MessageBase]]:
        raw = await read_body(request, self.max_request_bytes)
        if len(raw) >= _BIG_BODY:  # parsing megabytes would stall every other request on this loop
            return await asyncio.to_thread(self._parse_raw, raw)
        return self._parse_raw(raw)

    def _parse_raw(self, raw: bytes) -> tuple[ChatCompletionRequest, list[MessageBase]]:
        body = parse_json(raw)
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        asked = req.max_new_tokens
        if asked is not None and asked > self.max_tokens_cap:
            which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"{which} is too large: {asked}. This server allows at most {self.max_tokens_cap} "
                                f"completion tokens (closedloop serve --max-tokens-cap).", param=which,
                           code="invalid_value")
        if req.model != self.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")
        try:
            messages = req.typed_messages()
        except ValidationError as e:
            raise validation_error(e, "messages") from None
        except ConversationError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        return req, messages

    def sampling(self, req: ChatCompletionRequest, choice: int = 0) -> SamplingParams:
        # n choices with one seed would be n copies; each choice gets its own derived seed.
        seed = None if req.seed is None else req.seed + choice
        return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p,
                              max_tokens=req.max_new_tokens or self.default_max_tokens,
                              stop=req.stop, seed=seed, logprobs=True)

    @staticmethod
    def tools_for(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, Any]:
        choice = req.tool_choice_value()
        tools = req.tool_dicts()
        if choice == "none":
            return None, None
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            tools = [t for t in tools or [] if t["function"]["name"] == name]
        return tools, choice

    def satisfies(self, turn: Turn, choice: Any) -> bool:
        calls = turn.message.tool_calls or []
        if choice == "required":
            return bool(calls)
        if isinstance(choice, dict):
            return any(c.function.name == choice["function"]["name"] for c in calls)
        return True

    # ----------------------------------------------------------------- generation

    def offered(self, turn: Turn, tools: list[dict[str, Any]] | None, params: SamplingParams) -> Turn:
        names = {t["function"]["name"] for t in tools or []}
        return _offered_only(self.client, turn, names, params.stop)

    async def one(self, messages: list[MessageBase], tools, choice, params: SamplingParams) -> tuple[Turn, list[Turn]]:
        """The reply for one choice, and the replies discarded on the way (re-asks), oldest first."""
        turn = self.offered(await self.client.generate(messages, tools, params, choice), tools, params)
        discarded: list[Turn] = []
        while not self.satisfies(turn, choice) and params.temperature > 0 and len(discarded) < self.max_reasks:
            discarded.append(turn)
            if params.seed is not None:
                params = params.model_copy(update={"seed": params.seed + 1000 * len(discarded)})
            turn = self.offered(await self.client.generate(messages, tools, params, choice), tools, params)
        return turn, discarded

    async def complete(self, req: ChatCompletionRequest, messages: list[MessageBase]) -> ChatCompletion:
        tools, choice = self.tools_for(req)
        try:
            results = await asyncio.gather(*(self.one(messages, tools, choice, self.sampling(req, i))
                                             for i in range(req.n)))
        except Exception as e:  # noqa: BLE001 - mapped to a JSON error, never a bare 500
            raise self.failure(e) from None
        choices = []
        for i, (turn, discarded) in enumerate(results):
            choices.append(Choice(
                index=i,
                message=ResponseMessage(content=_content(turn), tool_calls=_tool_calls(turn),
                                        reasoning_content=turn.message.reasoning),
                logprobs=_logprobs(self.client, turn) if req.logprobs else None,
                finish_reason=_finish_reason(turn),
                token_ids=list(turn.completion_ids) if req.return_token_ids and turn.completion_ids is not None
                else None,
                closedloop_discarded=[_discarded(self.client, t, req) for t in discarded] or None))
        turns = [turn for turn, _ in results]
        thrown = [t for _, discarded in results for t in discarded]
        prompt_ids = turns[0].prompt_ids if req.return_token_ids else None
        return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
                              choices=choices, usage=_usage(turns, thrown),
                              prompt_token_ids=list(prompt_ids) if prompt_ids is not None else None)

    async def stream(self, req: ChatCompletionRequest, messages: list[MessageBase]) -> AsyncIterator[str]:
        """SSE lines. Each choice runs as its own task; their events interleave as they come."""
        tools, choice = self.tools_for(req)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        queue: asyncio.Queue = asyncio.Queue()

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                    "model": self.model_name, "system_fingerprint": None, "choices": choices}
            if include_usage:
                body["usage"] = None
            body.update(extra)
            return f"data: {json.dumps(body)}\n\n"

        async def run_choice(i: int) -> None:
            params = self.sampling(req, i)
            try:
                done = False
                # aclosing: when this task is cancelled (the client went away) the backend's stream is
                # closed at once, which cancels its generation, instead of whenever it is collected.
                async with contextlib.aclosing(self.client.stream(messages, tools, params, choice)) as events:
                    async for ev in events:
                        done = done or isinstance(ev, TurnDone)
                        await queue.put((i, ev))
                if not done:
                    raise ModelError("the backend's stream ended without a final turn")
            except Exception as e:  # noqa: BLE001 - reported in-band below
                await queue.put((i, e))

        tasks = [asyncio.create_task(run_choice(i)) for i in range(req.n)]
        markers = tuple(dict.fromkeys(_MARKERS + tuple(req.stop or ())))
        visible = [VisibleText(markers) for _ in range(req.n)]
        turns: list[Turn | None] = [None] * req.n
        try:
            for i in range(req.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            remaining = req.n
            while remaining:
                i, ev = await queue.get()
                if isinstance(ev, Exception):
                    err = self.failure(ev)  # headers are sent: the error goes in-band, as vLLM does
                    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
                    yield f"data: {json.dumps(body)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if isinstance(ev, TextDelta):
                    # Linear in the text whatever the stop strings (stream_text); a huge delta on a thread.
                    delta = await asyncio.to_thread(visible[i].feed, ev.text) if len(ev.text) >= _BIG_DELTA \
                        else visible[i].feed(ev.text)
                    if delta:
                        yield chunk([{"index": i, "delta": {"content": delta}, "logprobs": None,
                                      "finish_reason": None}])
                    continue
                if not isinstance(ev, TurnDone):
                    continue
                turn = turns[i] = self.offered(ev.turn, tools, self.sampling(req, i))
                remaining -= 1
                final, sent = _content(turn) or "", visible[i].sent()
                if final.startswith(sent) and len(final) > len(sent):
                    yield chunk([{"index": i, "delta": {"content": final[len(sent):]}, "logprobs": None,
                                  "finish_reason": None}])
                elif not final.startswith(sent):
                    log.warning("streamed text diverged from the final content of choice %d", i)
                for k, call in enumerate(_tool_calls(turn) or []):
                    yield chunk([{"index": i, "delta": {"tool_calls": [{"index": k, **call.model_dump()}]},
                                  "logprobs": None, "finish_reason": None}])
                final_choice: dict[str, Any] = {
                    "index": i, "delta": {},
                    "logprobs": _logprobs(self.client, turn).model_dump() if req.logprobs else None,
                    "finish_reason": _finish_reason(turn)}
                extra: dict[str, Any] = {}
                if req.return_token_ids:
                    final_choice["token_ids"] = turn.completion_ids
                    extra["prompt_token_ids"] = turn.prompt_ids
                yield chunk([final_choice], **extra)
            if include_usage:
                yield chunk([], usage=_usage([t for t in turns if t is not None]).model_dump(exclude_none=True))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator. Starlette cancels the response
    when the client disconnects; if that lands while it awaits ``send`` (not inside our generator),
    the generator would stay suspended, its ``finally`` (which cancels the generation) unrun until
    garbage collection. Closing it here makes a disconnect cancel the generation every time."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so this only waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(client: ModelClient, model_name: str, *, default_max_tokens: int = 256, max_reasks: int = 2,
               allow_weight_updates: bool = False, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP) -> FastAPI:
    """The FastAPI app serving ``client`` as ``model_name`` (the only name requests may use).

    ``allow_weight_updates`` enables the admin endpoint ``POST /closedloop/v1/load_weights``
    (off by default; see the module docstring). ``max_request_bytes`` and ``max_tokens_cap`` bound
    what one request may ask (413 / 400 above them)."""
    if max_request_bytes < 1:
        raise ValueError("max_request_bytes must be >= 1")
    if not 1 <= default_max_tokens <= max_tokens_cap:
        raise ValueError(f"default_max_tokens ({default_max_tokens}) must be between 1 and max_tokens_cap "
                         f"({max_tokens_cap})")
    server = _Server(client, model_name, default_max_tokens, max_reasks, allow_weight_updates, max_request_bytes,
                     max_tokens_cap)
    app = FastAPI(title="closedloop", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, code=str(exc.status_code)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, str(exc.errors()[0].get("msg", "invalid request")), code="invalid_value").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log_failure("unhandled error", exc)
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # The micro-batcher's record (when the backend keeps one) shows whether requests batched.
        # Off the event loop: an engine process answers over its pipe.
        batches = {"batches": await asyncio.to_thread(client.batch_stats)} if isinstance(client, ReportsBatches) else {}
        return {"status": "ok", "disconnected": server.disconnected, **batches}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=model_name, created=server.created)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return ModelCard(id=model_name, created=server.created).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) >= _RELEASE_BODY:
            try:  # hand the heap a big body and its tokens used back to the OS (see release_memory)
                return await answer(request)
            finally:
                await asyncio.to_thread(release_memory)
        return await answer(request)

    async def answer(request: Request):
        req, messages = await server.parse(request)
        if req.stream:
            return _ClosingStreamingResponse(server.stream(req, messages), media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
        # A client that goes away stops its generation (the stream above is cancelled by Starlette).
        work = asyncio.ensure_future(server.complete(req, messages))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            server.disconnected += 1
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        return JSONResponse(work.result().to_wire())

    @app.get("/closedloop/v1/weights")
    async def weights() -> dict[str, Any]:
        return server.weights.model_dump()

    @app.post("/closedloop/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        return (await server.load_weights(request)).model_dump()

    return app
