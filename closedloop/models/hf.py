"""``hf:`` backend: a local transformers model, micro-batched and token-exact.

Why a hand-written decode loop instead of ``model.generate``: every request in a batch needs its
own seed (a per-row ``torch.Generator``), so a seeded sample is the same whether the request ran
alone or next to others, and trainers need the exact ids and the logprobs of the distribution that
was sampled from. Requests from any event loop go onto one thread-safe queue; a worker thread
decodes them with continuous batching (:mod:`closedloop.models.decode_batch`): requests that
arrive while a batch decodes are prefilled and join it at the next step (up to
``max_batch_size`` rows), and a row that ends is returned at once. When idle, the worker gathers
what arrives within ``batch_wait_ms`` so a group sent together starts together. The queue lives
in a thread rather than in one event loop so a client can be shared across loops (tests,
notebooks, a server).

Logprobs (``Turn.logprob_spec``, mode ``"tempered"``, backend ``"hf"``): the recorded value is
``log_softmax(logits / temperature)`` at the chosen token, computed in float32 on the full
vocabulary. Top-p truncation changes which tokens can be drawn, not the recorded value, which is
exactly what closedloop's trainers recompute for importance ratios. At temperature 0 decoding is
greedy and the recorded logprobs are those of the unscaled logits, so the spec records
``temperature=1.0`` (and ``top_p=1.0``: greedy decoding used neither), which is what those values
equal. ``vllm:`` records the same quantity by default (see :mod:`closedloop.models.vllm_client`).

Train/eval mode and weight updates: the client never changes the model's mode. The caller owns it:
a trainer that samples from its live policy (:meth:`HFClient.from_model`) puts the model in
``eval()`` for rollouts if it wants them without dropout, and back in ``train()`` for its update.
(An earlier version toggled the mode from the worker thread, which raced with a trainer using the
same module.) To keep generation off the weights while they change, the trainer holds
:meth:`HFClient.paused` around its optimizer step (or mode switch): a running batch finishes
first, no batch starts inside the block, and requests submitted meanwhile run after it.

Hostile or careless requests (see ``tests/reliability/``):

* Sampling settings are made safe per request, as vLLM does: a temperature in ``(0, 0.01)`` is
  raised to 0.01 (vLLM's ``_MAX_TEMP``: dividing logits by less overflows), and the recorded
  ``logprob_spec`` says 0.01, the distribution actually sampled; top-p is applied in float64 and
  always keeps the most likely token (a ``top_p`` of 1e-300 is greedy, not an empty set). A row
  whose logits are not finite fails alone; its batch-mates finish normally.
* Prompts are rendered and tokenised on a small tokenizer pool, never on the decode worker, so a
  huge prompt delays only itself (a GRPO group's identical prompts are tokenised once).
* A request whose caller goes away (its future cancelled: a streaming client disconnected) leaves
  the running batch at the next step (its row is dropped from the batch and the KV cache);
  :attr:`HFClient.cancelled_rows` counts them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import json
import logging
import queue
import secrets
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncGenerator, Callable, Iterator

from closedloop.messages import LogprobSpec, MediaRef, Turn, Usage, _Message
from closedloop.models.base import (ContextLengthExceededError, GenerateRequest, ModelClient, ModelError, SamplingParams,
                                    StreamEvent,
                                    TextDelta, ToolChoice, TurnDone)
from closedloop.models.batching import settle, settle_many
from closedloop.models.decode_batch import DecodeBatch
from closedloop.models.prompt_cache import PromptCache, PromptState, weights_signature
from closedloop.models.chat_format import END_MARKERS, decode_ids, encode_prompt, parse_completion
from closedloop.models.multimodal import require_text_only

log = logging.getLogger("closedloop.models.hf")


#: The smallest non-zero temperature sampled with (vLLM's ``_MAX_TEMP``); smaller ones are raised to it.
MIN_TEMPERATURE = 1e-2
#: Prompts whose text is at most this many characters are keyed for sharing one tokenisation.
_SHARE_PROMPT_CHARS = 1 << 16
#: Text prompts of at most this many characters are rendered on the caller's loop (see
#: ``HFClient._encode_off_worker``); the last ``_RECENT_PROMPTS`` renderings are kept.
_INLINE_PROMPT_CHARS = 1 << 13
_RECENT_PROMPTS = 256
#: A request waiting beside a running batch joins it after at most this many decode steps, or
#: sooner once the waiting requests number at least 1/_ADMIT_WAITING_RATIO of the running rows (TGI
#: has the same two knobs: max_waiting_tokens, waiting_served_ratio). Measured on the tiny model at 8
#: and 32 in-process clients: 8 steps and a ratio of 2 gave 15-30% more requests/s than 2 and 8,
#: because each admission costs a prefill pass, about as much as a decode step of the whole batch.
#: Admitting prompt-cache hits at once instead (they cost no prefill pass) was no faster at 32
#: clients over HTTP (593 vs 614 requests/s, medians of 4 interleaved runs): each admission still
#: copies the batch's KV cache.
_ADMIT_AFTER_STEPS = 8
_ADMIT_WAITING_RATIO = 2


def safe_params(params: SamplingParams) -> SamplingParams:
    """``params`` as sampled: a temperature in ``(0, MIN_TEMPERATURE)`` raised to ``MIN_TEMPERATURE``
    (as vLLM's ``SamplingParams``), so one request's 1e-300 cannot overflow the batch's logits."""
    if 0 < params.temperature < MIN_TEMPERATURE:
        log.info("temperature %g raised to %g (smaller values overflow the logits)", params.temperature,
                 MIN_TEMPERATURE)
        return params.model_copy(update={"temperature": MIN_TEMPERATURE})
    return params


def _prompt_chars(messages: list[_Message]) -> int:
    """About how much text the messages hold (content and tool-call arguments), without copying it."""
    total = 0
    for m in messages:
        content = getattr(m, "content", None)
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(getattr(p, "text", "") or "")) + 64 for p in content)
        for call in getattr(m, "tool_calls", None) or []:
            total += len(call.function.arguments or "") + len(call.function.name)
    return total


def hf_logprob_spec(params: SamplingParams) -> LogprobSpec:
    """What ``hf:`` records for a request: tempered logprobs; greedy reads the plain softmax, so
    greedy turns record ``temperature=1.0, top_p=1.0``."""
    if params.temperature == 0:
        return LogprobSpec(mode="tempered", temperature=1.0, top_p=1.0, backend="hf")
    return LogprobSpec(mode="tempered", temperature=params.temperature, top_p=params.top_p, backend="hf")


@dataclass
class _Request:
    messages: list[_Message]
    tools: list[dict[str, Any]] | None
    params: SamplingParams
    tool_choice: ToolChoice | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    on_delta: Callable[[str], None] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    # Encoded before the request reaches the decode worker (on the tokenizer pool).
    encoded: tuple[list[int], dict[str, Any] | None, list[MediaRef]] | None = None
    max_new: int = 0
    #: Set (on the caller's loop) when the caller gave up; the decode loop then drops the row.
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Row:
    """Decoding state of one request inside a batch."""

    req: _Request
    prompt_ids: list[int]
    max_new: int
    generator: Any
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""  # decoded so far (incrementally), for stop strings and streaming
    prefix_offset: int = 0
    read_offset: int = 0
    finish: str | None = None
    extras: dict[str, Any] | None = None  # model inputs beside the ids (a VLM's pixel_values ...)
    media: list[MediaRef] = field(default_factory=list)
    error: BaseException | None = None


def _live_rows(batch: DecodeBatch) -> list[int]:
    """Indices of the rows still decoding (finished ones may stay in the batch for a while)."""
    return [i for i, r in enumerate(batch.rows) if r.finish is None]


class HFClient(ModelClient):
    """A transformers causal LM behind the :class:`ModelClient` interface.

    The model's train/eval mode is the caller's: the client does not switch it (see the module
    docstring). ``paused()`` / ``weights_lock`` keep generation out while the caller updates
    the weights.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "", max_batch_size: int = 16,
                 batch_wait_ms: float = 5.0, batch_gap_ms: float | None = None, prompt_cache_tokens: int = 0):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if batch_wait_ms < 0:
            raise ValueError("batch_wait_ms must be >= 0")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ModelError(f"tokenizer of {name or 'the model'} has no chat template; hf: needs a chat model")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(getattr(model, "config", None), "name_or_path", "") or "hf-model"
        self.spec = f"hf:{self.name}"
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        #: With a gap, an idle decoder stops gathering as soon as no request arrived for this long
        #: (a burst, such as a rollout batch, is over) instead of waiting all of ``batch_wait_ms``.
        self.batch_gap_s = None if batch_gap_ms is None else batch_gap_ms / 1000.0
        if batch_gap_ms is not None and batch_gap_ms < 0:
            raise ValueError("batch_gap_ms must be >= 0")
        #: How many requests each prefill admitted, in order: a group that arrives together (a GRPO
        #: group, concurrent clients) is prefilled together and then decodes beside whatever runs.
        self.batch_sizes: list[int] = []
        #: Decode forward passes so far, and the rows they carried (mean rows per step = their ratio).
        self.decode_steps = 0
        self.decode_rows = 0
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()
        #: Held by the worker while any row is decoding; take it through :meth:`paused`, which also
        #: stops new rows from joining so that the running ones can drain.
        self.weights_lock: threading.RLock = threading.RLock()
        self._pausing = 0
        self._pausing_lock = threading.Condition(threading.Lock())
        self._warned_training = False
        #: Rows whose caller went away mid-decode and were dropped (e.g. a disconnected stream).
        self.cancelled_rows = 0
        # A cancellation stamps a fresh number here; the worker scans its rows for cancelled
        # callers only when the stamp changed (a per-row check every step cost ~3% of decoding).
        self._cancel_ticks = itertools.count(1)
        self._cancel_stamp = 0
        self._cancel_seen = 0
        # Tokenisation runs here, off the decode worker: a huge prompt must not stall every batch.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                                     thread_name_prefix="closedloop-hf-tokenize")
        self._prompt_lock = threading.RLock()  # re-entrant: a done job runs its callback at once
        self._prompts_in_flight: dict[str, concurrent.futures.Future] = {}
        self._recent_prompts: OrderedDict[str, tuple[list[int], dict[str, Any] | None, list[MediaRef]]] = \
            OrderedDict()
        # Byte-level BPE vocab entries hold one character per byte, so none decodes to more characters.
        # x4: headroom for normalisers that fold several input characters into one (NFKC combining marks).
        self._max_token_chars = 4 * (max((len(t) for t in tokenizer.get_vocab()), default=1) or 1)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._eos_ids = self._stop_token_ids()
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad_id = pad if pad is not None else min(self._eos_ids)
        self._end_markers = tuple(self.decode([i]) for i in sorted(self._eos_ids))
        #: Repeated prompts join from their cached prefill state (see :mod:`closedloop.models.prompt_cache`);
        #: ``None`` when ``prompt_cache_tokens`` is 0 or the model's cache cannot be merged.
        if prompt_cache_tokens < 0:
            raise ValueError("prompt_cache_tokens must be >= 0")
        self.prompt_cache = PromptCache(prompt_cache_tokens) \
            if prompt_cache_tokens and DecodeBatch.can_merge(model) else None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: Any = "auto", max_batch_size: int = 16,
                        batch_wait_ms: float = 5.0, prompt_cache_tokens: int = 0,
                        **model_kwargs: Any) -> "HFClient":
        """Load a checkpoint directory (or a hub id, through transformers' own cache).

        ``dtype``: ``"auto"`` (the checkpoint's), a ``torch.dtype`` or its name (``"bfloat16"``).
        """
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(dtype, str) and dtype != "auto":
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'auto'")
            dtype = getattr(torch, dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **model_kwargs)
        model = model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to): typeshed's _Wrapped binds no self
        model.eval()
        return cls(model, tokenizer, name=str(path), max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms,
                   prompt_cache_tokens=prompt_cache_tokens)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, *, name: str = "", max_batch_size: int = 16,
                   batch_wait_ms: float = 5.0, batch_gap_ms: float | None = None,
                   prompt_cache_tokens: int = 0) -> "HFClient":
        """Wrap an already-loaded model (e.g. a trainer's live policy): no copy, no reload, so
        generations always use the current weights."""
        return cls(model, tokenizer, name=name, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms,
                   batch_gap_ms=batch_gap_ms, prompt_cache_tokens=prompt_cache_tokens)

    def _stop_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.tokenizer, "eos_token_id", None),
                       getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[t] for t in END_MARKERS if t in vocab)
        if not ids:
            raise ModelError("the tokenizer defines no end-of-sequence token")
        return ids

    # ------------------------------------------------------------------ prompts

    def encode_prompt(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                      tool_choice: ToolChoice | None = None) -> list[int]:
        """The exact prompt token ids the model will see (chat template, tools, generation prompt)."""
        return encode_prompt(self.tokenizer, messages, tools, tool_choice)

    def _encode_request(self, req: _Request) -> tuple[list[int], dict[str, Any] | None, list[MediaRef]]:
        """Prompt ids, extra model inputs and media references of one request. A text model has
        no extras and refuses media parts with a clear error (multimodal clients override this)."""
        require_text_only(req.messages, self.spec)
        return self.encode_prompt(req.messages, req.tools, req.tool_choice), None, []

    #: Decode steps pass the 4D attention mask they would otherwise have transformers build from
    #: the 2D one (cheaper per step; see :mod:`closedloop.models.decode_batch`).
    _step_mask_4d = True

    def _prefill_inputs(self, rows: list[_Row], device: Any) -> dict[str, Any]:
        """Extra keyword inputs of the batch's first forward pass (none for a text model)."""
        return {}

    def decode(self, ids: list[int]) -> str:
        """Token ids to text with special tokens kept, the inverse the turn record relies on."""
        return decode_ids(self.tokenizer, ids)

    # ------------------------------------------------------------------ public API

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        return await self._submit(messages, tools, params, tool_choice)

    async def stream(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                     params: SamplingParams | None = None,
                     tool_choice: ToolChoice | None = None) -> AsyncGenerator[StreamEvent, None]:
        """Raw completion text as it is decoded (markup included); the deltas join to exactly
        ``turn.completion_text`` of the final :class:`TurnDone`."""
        deltas: asyncio.Queue[str] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(self._submit(messages, tools, params, tool_choice,
                                                  on_delta=lambda s: loop.call_soon_threadsafe(deltas.put_nowait, s)))
        sent = ""
        getter: asyncio.Future | None = None
        try:
            while not task.done():
                getter = asyncio.ensure_future(deltas.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    sent += getter.result()
                    yield TextDelta(getter.result())
                else:
                    getter.cancel()
            turn = task.result()
            # Deltas posted just before the result may still sit in the queue (same loop order).
            while not deltas.empty():
                d = deltas.get_nowait()
                sent += d
                yield TextDelta(d)
            final = turn.completion_text or ""
            if final.startswith(sent) and len(final) > len(sent):
                yield TextDelta(final[len(sent):])
            yield TurnDone(turn)
        finally:
            if getter is not None and not getter.done():
                getter.cancel()
            if not task.done():
                task.cancel()  # the caller went away: the row leaves its batch at the next step

    async def batch(self, requests: list[GenerateRequest]) -> list[Turn]:
        return list(await asyncio.gather(*(self._submit(r.messages, r.tools, r.params, r.tool_choice)
                                           for r in requests)))

    async def generate_many(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                            params: SamplingParams | None = None, n: int = 1,
                            tool_choice: ToolChoice | None = None) -> list[Turn]:
        """``n`` samples for one prompt (OpenAI's ``n``), batched together. With a seed, sample
        ``i`` uses ``seed + i`` so the samples differ but the set is reproducible."""
        if n < 1:
            raise ValueError("n must be >= 1")
        params = params or SamplingParams()
        reqs = [GenerateRequest(messages, tools,
                                params if params.seed is None else params.model_copy(update={"seed": params.seed + i}),
                                tool_choice) for i in range(n)]
        return await self.batch(reqs)

    def batch_stats(self) -> dict[str, Any]:
        sizes = self.batch_sizes
        return {"batches": len(sizes), "requests": sum(sizes), "max_batch": max(sizes, default=0),
                "histogram": dict(sorted(Counter(sizes).items())), "cancelled_rows": self.cancelled_rows,
                "decode_steps": self.decode_steps,
                "mean_rows_per_step": self.decode_rows / self.decode_steps if self.decode_steps else 0.0,
                "prompt_cache": self.prompt_cache.stats() if self.prompt_cache is not None else None}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No generation runs on the model inside this block (hold it around an optimizer step).

        Waits for the rows decoding now to finish (none joins them once a pause is waiting);
        requests submitted inside the block run after it, on the updated weights. Re-entrant (a ``threading.RLock``). Do not await a generation
        of this client inside the block: it cannot run until the block exits.
        """
        with self._pausing_lock:
            self._pausing += 1
        try:
            with self.weights_lock:
                # the weights may change in here, and not always visibly to version counters (``.data``)
                self._clear_prompt_cache()
                try:
                    yield
                finally:
                    self._clear_prompt_cache()
        finally:
            with self._pausing_lock:
                self._pausing -= 1
                self._pausing_lock.notify_all()

    def _clear_prompt_cache(self) -> None:
        if self.prompt_cache is not None:
            self.prompt_cache.clear()

    def _acquire_unpaused(self) -> bool:
        """Take ``weights_lock`` for a new batch, but never ahead of a waiting :meth:`paused`;
        returns whether it had to wait.

        ``threading`` locks are not fair: a worker that just released the lock could take it
        again at once and start a new batch while a trainer waits; so it yields until no pause
        is pending.
        """
        waited = False
        while True:
            acquired = self.weights_lock.acquire(blocking=False)
            if not acquired:
                waited = True
                self.weights_lock.acquire()
            if not self._pausing:
                return waited
            waited = True
            self.weights_lock.release()
            with self._pausing_lock:
                self._pausing_lock.wait_for(lambda: not self._pausing)

    async def aclose(self) -> None:
        """Let queued and running requests finish, then stop the worker."""
        worker = self._worker
        if worker is not None and worker.is_alive():
            self._queue.put(None)
            await asyncio.get_running_loop().run_in_executor(None, worker.join, 30.0)
        self._worker = None
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ queue and worker

    async def _encode_off_worker(self, req: _Request) -> tuple[list[int], dict[str, Any] | None, list[MediaRef]]:
        """``_encode_request(req)`` never on the decode worker: short text prompts on the caller's
        loop, others on the tokenizer pool. Identical prompts in flight together (a GRPO group)
        share one encoding, so they still reach the queue together and land in one batch."""
        key = None
        chars = _prompt_chars(req.messages)
        if chars <= _SHARE_PROMPT_CHARS:
            key = json.dumps([[m.model_dump_json() for m in req.messages], req.tools, req.tool_choice], default=str)
        if key is not None and chars <= _INLINE_PROMPT_CHARS and type(self)._encode_request is HFClient._encode_request:
            # A short text prompt costs about a millisecond to render: done here, it reaches the
            # queue at once instead of after the loop's other ready tasks (a rollout starting 32
            # episodes queued nothing for ~50 ms). Recent ones are kept (a GRPO group's twins).
            hit = self._recent_prompts.get(key)
            if hit is None:
                hit = self._encode_request(req)
                self._recent_prompts[key] = hit
                if len(self._recent_prompts) > _RECENT_PROMPTS:
                    self._recent_prompts.pop(next(iter(self._recent_prompts)))
            else:
                self._recent_prompts.move_to_end(key)
            ids, extras, media = hit
            return list(ids), extras, list(media)
        with self._prompt_lock:
            job = self._prompts_in_flight.get(key) if key is not None else None
            if job is None:
                job = self._tokenizer_pool.submit(self._encode_request, req)
                if key is not None:
                    self._prompts_in_flight[key] = job

                    def forget(_: concurrent.futures.Future, key: str = key) -> None:
                        with self._prompt_lock:
                            self._prompts_in_flight.pop(key, None)

                    job.add_done_callback(forget)
        # shield: one caller giving up must not cancel the encoding its twins wait for
        ids, extras, media = await asyncio.shield(asyncio.wrap_future(job))
        return list(ids), extras, list(media)

    async def _submit(self, messages, tools, params, tool_choice, on_delta=None) -> Turn:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = _Request(list(messages), tools, safe_params(params or SamplingParams()), tool_choice, loop, fut,
                       on_delta)
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        chars = _prompt_chars(req.messages)
        if limit and chars > limit * self._max_token_chars:
            # Certain to overflow (no token covers more characters than the longest vocabulary entry):
            # refuse before spending a minute and hundreds of MB tokenising megabytes of text.
            raise ContextLengthExceededError(
                f"prompt of {chars} characters is at least {chars // self._max_token_chars} tokens, more than the "
                f"model's {limit}-token context", prompt_tokens=chars // self._max_token_chars, limit=limit)
        req.encoded = await self._encode_off_worker(req)
        prompt = req.encoded[0]
        req.max_new = req.params.max_tokens
        if limit:
            req.max_new = min(req.max_new, limit - len(prompt))
            if req.max_new < 1:
                req.encoded = None  # an error's traceback keeps this frame: do not keep the ids with it
                raise ContextLengthExceededError(
                    f"prompt of {len(prompt)} tokens leaves no room in the model's {limit}-token context",
                    prompt_tokens=len(prompt), limit=limit)
        fut.add_done_callback(lambda f: self._mark_cancelled(req) if f.cancelled() else None)
        self._put(req)
        return await fut

    def _mark_cancelled(self, req: _Request) -> None:
        req.cancelled.set()
        # after the flag: a worker that sees the new stamp also sees the flag (each stamp is unique,
        # so no assignment, in whatever order threads make them, can equal the one last seen)
        self._cancel_stamp = next(self._cancel_ticks)

    @staticmethod
    def _resolve(req: _Request, result: Turn | None = None, error: BaseException | None = None) -> None:
        settle(req.loop, req.future, result, error)

    # ------------------------------------------------------------------ continuous batching

    def _put(self, req: _Request) -> None:
        self._queue.put(req)
        with self._worker_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="closedloop-hf-decoder", daemon=True)
                self._worker.start()

    def _gather(self, first: _Request, room: int) -> tuple[list[_Request], bool]:
        """``first`` plus what arrives within ``batch_wait_ms`` (up to ``room`` requests): requests
        sent together (a GRPO group) start together. Also returns whether the stop sentinel came."""
        more, stop = self._take(room - 1, time.perf_counter() + self.batch_wait_s)
        return [first, *more], stop

    def _drain(self, room: int) -> tuple[list[_Request], bool]:
        """What is queued now (up to ``room`` requests), without waiting."""
        return self._take(room, None)

    def _take(self, room: int, deadline: float | None) -> tuple[list[_Request], bool]:
        """Up to ``room`` queued requests, waiting until ``deadline`` (``None``: not at all; with
        ``batch_gap_s``, no longer than that between arrivals), and whether the stop sentinel came."""
        batch: list[_Request] = []
        while len(batch) < room:
            remaining = 0.0 if deadline is None else deadline - time.perf_counter()
            if self.batch_gap_s is not None:
                remaining = min(remaining, self.batch_gap_s)
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _work(self) -> None:
        """The decode worker: admit queued requests into the running batch between steps, decode
        one token for every row, hand each finished row to its caller at once.

        ``weights_lock`` is held from the first admitted row until the batch is empty, so no row
        ever decodes across a weight update; while someone waits in :meth:`paused`, no new row is
        admitted and the running ones drain.

        Prefill and decode run under ``torch.inference_mode`` rather than ``no_grad``: no tensor
        made here (KV cache, logits, masks) ever meets autograd, and skipping version counters and
        view tracking made 32-client decoding of the tiny model about 15% faster (measured). Only
        token ids and float logprobs leave the worker, so a trainer's later backward never sees them.
        """
        import torch

        active: DecodeBatch | None = None
        holding = stopping = False
        first_wait: int | None = None  # the decode step at which a queued request was first seen
        try:
            while True:
                if active is None:
                    if holding:
                        self.weights_lock.release()
                        holding = False
                    if stopping:
                        return
                    first = self._queue.get()
                    if first is None:
                        return
                    reqs, stopping = self._gather(first, self.max_batch_size)
                    if self._acquire_unpaused() and not stopping:
                        # what queued up during a pause (a trainer's next rollout) starts as one batch
                        more, stopping = self._drain(self.max_batch_size - len(reqs))
                        reqs += more
                    holding = True
                    with torch.inference_mode():
                        active = self._admit(reqs, None)
                elif not stopping and not self._pausing and active.mergeable() \
                        and (running := len(_live_rows(active))) < self.max_batch_size:
                    waiting = self._queue.qsize()
                    if waiting and first_wait is None:
                        first_wait = self.decode_steps
                    # Each admission costs a prefill pass, about one decode step: a busy batch lets
                    # newcomers gather for up to _ADMIT_AFTER_STEPS steps (or until enough wait).
                    if waiting and (waiting >= max(1, running // _ADMIT_WAITING_RATIO)
                                    or self.decode_steps - (first_wait or 0) >= _ADMIT_AFTER_STEPS):
                        first_wait = None
                        reqs, stopping = self._drain(self.max_batch_size - running)
                        if reqs:
                            with torch.inference_mode():
                                active = self._admit(reqs, active)
                if active is not None:
                    with torch.inference_mode():
                        active = self._step(active)
        finally:
            if holding:
                self.weights_lock.release()

    def _admit(self, reqs: list[_Request], active: DecodeBatch | None) -> DecodeBatch | None:
        """Prefill the requests still wanted and join them to ``active`` (or start a batch)."""
        import torch

        rows: list[_Row] = []
        for req in reqs:
            if req.future.cancelled() or req.cancelled.is_set():
                continue
            try:
                assert req.encoded is not None, "requests are encoded before they are queued"
                prompt, extras, media = req.encoded
                seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
                # torch takes seeds in [-2**63, 2**64); a negative one as its 64-bit two's complement
                generator = torch.Generator().manual_seed(seed % (1 << 64))
                rows.append(_Row(req, list(prompt), req.max_new, generator, extras=extras, media=media))
            except Exception as e:  # a bad request fails alone, not its batch-mates
                self._resolve(req, error=e)
        if not rows:
            return active
        self.batch_sizes.append(len(rows))
        if getattr(self.model, "training", False) and not self._warned_training:
            self._warned_training = True  # the caller's choice (see the module docstring); said once
            log.warning("%s: generating while the model is in train mode: dropout, if the model has any, "
                        "is active in sampling and in the recorded logprobs", self.spec)
        try:
            fresh = self._prefill(rows, next(self.model.parameters()).device)
            if active is None:
                return fresh
            live = _live_rows(active)
            if len(live) < len(active):
                active.keep(live)  # finished rows leave before the copy a merge makes anyway
            active.merge(fresh)
            return active
        except Exception as e:  # the newcomers fail; rows already decoding go on
            for row in rows:
                self._resolve(row.req, error=ModelError(f"generation failed: {type(e).__name__}: {e}"))
            return active

    def _prefill(self, rows: list[_Row], device: Any) -> DecodeBatch:
        """A batch of ``rows`` ready to sample: a prefill pass over the prompts the prompt cache does
        not hold (each distinct prompt once), the others from their cached states."""
        cache = self.prompt_cache
        if cache is None or getattr(self.model, "training", False):
            return DecodeBatch.prefill(self.model, rows, pad=self._pad_id, cache_kw=self._cache_kw, device=device,
                                       extra_inputs=self._prefill_inputs(rows, device))
        cache.validate(weights_signature(self.model))
        misses: list[_Row] = []
        first_miss: dict[tuple[int, ...], int] = {}  # prompt -> its row among the misses
        reused: list[tuple[_Row, tuple[int, ...], PromptState | None]] = []  # None: the state comes from this prefill
        for row in rows:
            if row.extras is not None or row.media:  # the state depends on more than the token ids
                misses.append(row)
                continue
            key = tuple(row.prompt_ids)
            if key in first_miss:
                cache.count_reuse()
                reused.append((row, key, None))
            elif (state := cache.get(key)) is not None:
                reused.append((row, key, state))
            else:
                first_miss[key] = len(misses)
                misses.append(row)
        batch = None
        if misses:
            batch = DecodeBatch.prefill(self.model, misses, pad=self._pad_id, cache_kw=self._cache_kw, device=device,
                                        extra_inputs=self._prefill_inputs(misses, device))
            new = {key: batch.row_state(i) for key, i in first_miss.items()}
            for key, state in new.items():
                cache.put(key, state)
        if reused:
            states = [state if state is not None else new[key] for _, key, state in reused]
            joined = DecodeBatch.from_states(self.model, [row for row, _, _ in reused], states, device=device)
            if batch is None:
                return joined
            batch.merge(joined)
        assert batch is not None
        return batch

    def _step(self, batch: DecodeBatch) -> DecodeBatch | None:
        """Draw one token for every row, finish the rows that ended, feed the rest one step."""
        import torch

        try:
            gone: list[int] = []
            if self._cancel_stamp != self._cancel_seen:
                self._cancel_seen = self._cancel_stamp
                gone = [i for i, r in enumerate(batch.rows) if r.finish is None and r.req.cancelled.is_set()]
            if gone:  # callers that went away: their rows leave the batch (and its KV cache) now
                self.cancelled_rows += len(gone)
                batch.keep([i for i in range(len(batch)) if i not in set(gone)])
                if not len(batch):
                    return None
            tokens, ended = self._sample(batch)
            if ended:
                settle_many([self._outcome(batch.rows[i]) for i in ended])
            live = _live_rows(batch)
            if not live:
                return None
            # A finished row stays in the batch (decoding into nothing) until a quarter of the batch
            # is finished or rows join: each cut copies the whole KV cache, about a decode step.
            if len(live) < len(batch) and (4 * (len(batch) - len(live)) >= len(batch) or not batch.mergeable()):
                batch.keep(live)
                tokens = tokens[torch.tensor(live, dtype=torch.long)]
            self.decode_steps += 1
            self.decode_rows += len(live)
            batch.forward(self.model, tokens, self._cache_kw, mask_4d=self._step_mask_4d)
            return batch
        except Exception as e:
            for row in batch.rows:
                self._resolve(row.req, error=ModelError(f"generation failed: {type(e).__name__}: {e}"))
            return None

    def _sample(self, batch: DecodeBatch) -> tuple[Any, list[int]]:
        """One token per row from ``batch.last``; returns the tokens and the rows that ended.

        Vectorised over the batch (one tempered ``log_softmax``, one top-p mask, one inverse-CDF
        draw); the randomness stays per row: row ``i``'s ``t``-th token reads its own ``t``-th
        uniform, so a seeded request samples the same alone or beside others. Text is decoded per
        token only for rows that stream or have stop strings; the others are decoded once, at the end.
        """
        import torch

        logits = batch.last.float().cpu()
        logp = torch.log_softmax(logits / batch.temps, dim=-1)
        broken = torch.isnan(logp).any(-1)
        if bool(broken.any()):  # a row whose logits are not finite fails alone; its batch-mates go on
            logp = torch.where(broken[:, None], torch.zeros_like(logp), logp)
        if bool(batch.greedy.all()):
            tokens = logits.argmax(-1)
        else:
            col = batch.step.clamp(max=batch.uniforms.shape[1] - 1)[:, None]
            top_p = batch.top_p if bool((batch.top_p < 1.0).any()) else None
            tokens = self._draw(logp, top_p, batch.uniforms.gather(1, col)[:, 0])
            if bool(batch.greedy.any()):
                tokens = torch.where(batch.greedy, logits.argmax(-1), tokens)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        batch.step += 1
        ended: list[int] = []
        for i, (r, token, lp, bad) in enumerate(zip(batch.rows, tokens.tolist(), chosen.tolist(), broken.tolist())):
            if r.finish is not None:  # finished at an earlier step, not yet cut out of the batch
                continue
            if bad:
                r.error = ModelError(f"the model produced non-finite logits at step {len(r.ids)} of this request")
                r.finish = "error"
                ended.append(i)
                continue
            r.ids.append(token)
            r.logprobs.append(lp)
            if token in self._eos_ids:
                r.finish = "stop"
            elif (r.req.on_delta is not None or r.req.params.stop) and self._text_step(r):
                r.finish = "stop"
            elif len(r.ids) >= r.max_new:
                r.finish = "length"
            else:
                continue
            ended.append(i)
        return tokens, ended

    def _outcome(self, row: _Row) -> tuple[asyncio.AbstractEventLoop, asyncio.Future, Turn | None,
                                           BaseException | None]:
        """What to settle the row's future with: its turn, or the error that ended it."""
        if row.error is not None:
            return row.req.loop, row.req.future, None, row.error
        try:
            return row.req.loop, row.req.future, self._finish_turn(row), None
        except Exception as e:
            return row.req.loop, row.req.future, None, e

    @staticmethod
    def _draw(logp, top_p, u):
        """One token per row from ``exp(logp)`` (optionally top-p truncated) by inverse CDF at the
        row's uniform ``u`` (float64 cumulative sums; a zero-probability token is never chosen)."""
        import torch

        probs = logp.exp().double()
        if top_p is not None:
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            keep = (torch.cumsum(sorted_p, -1) - sorted_p) < top_p.double()  # smallest set reaching top_p
            keep[:, 0] = True  # the most likely token always stays (as vLLM): a tiny top_p is greedy
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
        cdf = torch.cumsum(probs, -1)
        x = u[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, x, right=True)[:, 0]
        over = tokens >= probs.shape[-1]
        if bool(over.any()):  # u * total rounded up to the total: the last token that can be drawn
            last = (probs > 0).long().cumsum(-1).argmax(-1)
            tokens = torch.where(over, last, tokens)
        return tokens

    def _text_step(self, r: _Row) -> bool:
        """Streaming / stop strings for one row after it drew a (non-end) token: emit the new
        complete text; True when a stop string has appeared."""
        delta = self._advance_text(r)
        if delta and r.req.on_delta is not None:
            r.req.on_delta(delta)
        p = r.req.params
        if p.stop and delta:
            window = r.text[-(max(len(s) for s in p.stop) + len(delta)):]
            return any(s in window for s in p.stop)
        return False

    def _advance_text(self, r: _Row) -> str:
        """Incremental detokenisation (as in TGI/vLLM): only text that is complete, never half of
        a multi-byte character, so deltas concatenate to the full decode."""
        prefix = self.decode(r.ids[r.prefix_offset:r.read_offset])
        full = self.decode(r.ids[r.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            r.prefix_offset, r.read_offset = r.read_offset, len(r.ids)
            r.text += delta
            return delta
        return ""

    def _finish_turn(self, r: _Row) -> Turn:
        text = self.decode(r.ids)
        content_text = text
        if r.finish == "stop" and r.req.params.stop and r.ids[-1] not in self._eos_ids:
            cut = min((i for i in (text.find(s) for s in r.req.params.stop) if i != -1), default=-1)
            if cut != -1:
                content_text = text[:cut]  # OpenAI semantics: the stop string is not part of the reply
        message = parse_completion(content_text, end_markers=self._end_markers)
        finish = r.finish or "length"
        if message.tool_calls and finish == "stop":
            finish = "tool_calls"
        return Turn(message=message, model=self.name, prompt_ids=list(r.prompt_ids), completion_ids=list(r.ids),
                    logprobs=list(r.logprobs), loss_mask=[0] * len(r.prompt_ids) + [1] * len(r.ids),
                    logprob_spec=hf_logprob_spec(r.req.params), completion_text=text, finish_reason=finish,
                    media=list(r.media),
                    usage=Usage(prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.ids)),
                    latency_s=time.perf_counter() - r.req.submitted)
