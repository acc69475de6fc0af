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
import inspect
import itertools
import json
import queue
import threading
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, AsyncGenerator

from closedloop.messages import MediaRef, Turn, MessageBase
from closedloop.models.base import (ContextLengthExceededError, GenerateRequest, ModelClient, ModelError, SamplingParams,
                                    StreamEvent, TextDelta, ToolChoice, TurnDone)
from closedloop.models.chat_format import END_MARKERS, decode_ids, encode_prompt
from closedloop.models.decode_batch import DecodeBatch
from closedloop.models.hf_admission import HFAdmission
from closedloop.models.hf_decode import HFDecode
from closedloop.models.hf_requests import (MIN_TEMPERATURE, _prompt_chars, _Request, _Row, hf_logprob_spec,
                                           safe_params)
from closedloop.models.multimodal import require_text_only
from closedloop.models.prompt_cache import PromptCache

# Split by concern: the records and sampling settings (``hf_requests``), the queue, pause and
# admission (``hf_admission``), the decode step (``hf_decode``); the client API is here.
__all__ = ["HFClient", "MIN_TEMPERATURE", "hf_logprob_spec", "safe_params", "_Request", "_Row"]

#: Prompts whose text is at most this many characters are keyed for sharing one tokenisation.
_SHARE_PROMPT_CHARS = 1 << 16
#: Text prompts of at most this many characters are rendered on the caller's loop (see
#: ``HFClient._encode_off_worker``); the last ``_RECENT_PROMPTS`` renderings are kept.
_INLINE_PROMPT_CHARS = 1 << 13
_RECENT_PROMPTS = 256

class HFClient(HFAdmission, HFDecode, ModelClient):
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

    def encode_prompt(self, messages: list[MessageBase], tools: list[dict[str, Any]] | None = None,
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

    async def generate(self, messages: list[MessageBase], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        return await self._submit(messages, tools, params, tool_choice)

    async def stream(self, messages: list[MessageBase], tools: list[dict[str, Any]] | None = None,
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

    async def generate_many(self, messages: list[MessageBase], tools: list[dict[str, Any]] | None = None,
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

    async def aclose(self) -> None:
        """Let queued and running requests finish, then stop the worker."""
        worker = self._worker
        if worker is not None and worker.is_alive():
            self._queue.put(None)
            await asyncio.get_running_loop().run_in_executor(None, worker.join, 30.0)
        self._worker = None
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ prompts off the worker

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
