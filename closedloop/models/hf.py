"""``hf:`` backend: a local transformers model, micro-batched and token-exact.

Why a hand-written decode loop instead of ``model.generate``: every request in a batch needs its
own seed (a per-row ``torch.Generator``), so a seeded sample is the same whether the request ran
alone or next to others, and trainers need the exact ids and the logprobs of the distribution that
was sampled from. Requests from any event loop go onto one thread-safe queue; a worker thread
gathers what arrives within ``batch_wait_ms`` (up to ``max_batch_size``) into one left-padded batch
and decodes it with a KV cache. The queue lives in a thread rather than in one event loop so a
client can be shared across loops (tests, notebooks, a server).

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
import json
import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

from closedloop.messages import LogprobSpec, MediaRef, Turn, Usage, _Message
from closedloop.models.base import (ContextLengthExceededError, GenerateRequest, ModelClient, ModelError, SamplingParams,
                                    StreamEvent,
                                    TextDelta, ToolChoice, TurnDone)
from closedloop.models.batching import MicroBatcher, settle
from closedloop.models.chat_format import END_MARKERS, decode_ids, encode_prompt, parse_completion
from closedloop.models.multimodal import require_text_only

log = logging.getLogger("closedloop.models.hf")


#: The smallest non-zero temperature sampled with (vLLM's ``_MAX_TEMP``); smaller ones are raised to it.
MIN_TEMPERATURE = 1e-2
#: Prompts whose text is at most this many characters are keyed for sharing one tokenisation.
_SHARE_PROMPT_CHARS = 1 << 16


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


class HFClient(ModelClient):
    """A transformers causal LM behind the :class:`ModelClient` interface.

    The model's train/eval mode is the caller's: the client does not switch it (see the module
    docstring). ``paused()`` / ``weights_lock`` keep generation out while the caller updates
    the weights.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "", max_batch_size: int = 16,
                 batch_wait_ms: float = 5.0):
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
        #: How many requests each device batch held, in order; the micro-batcher's observable effect.
        self.batch_sizes: list[int] = []
        self._batcher: MicroBatcher[_Request] = MicroBatcher(self._run_batch, max_batch_size=max_batch_size,
                                                             wait_s=self.batch_wait_s, name="closedloop-hf-batcher")
        #: Held for the whole of every device batch; a trainer holds it while it changes the weights.
        self.weights_lock: threading.RLock = self._batcher.lock
        self._warned_training = False
        #: Rows whose caller went away mid-decode and were dropped (e.g. a disconnected stream).
        self.cancelled_rows = 0
        # Tokenisation runs here, off the decode worker: a huge prompt must not stall every batch.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                                     thread_name_prefix="closedloop-hf-tokenize")
        self._prompt_lock = threading.RLock()  # re-entrant: a done job runs its callback at once
        self._prompts_in_flight: dict[str, concurrent.futures.Future] = {}
        # Byte-level BPE vocab entries hold one character per byte, so none decodes to more characters.
        # x4: headroom for normalisers that fold several input characters into one (NFKC combining marks).
        self._max_token_chars = 4 * (max((len(t) for t in tokenizer.get_vocab()), default=1) or 1)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._eos_ids = self._stop_token_ids()
        self._end_markers = tuple(self.decode([i]) for i in sorted(self._eos_ids))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: Any = "auto", max_batch_size: int = 16,
                        batch_wait_ms: float = 5.0, **model_kwargs: Any) -> "HFClient":
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
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **model_kwargs).to(device)
        model.eval()
        return cls(model, tokenizer, name=str(path), max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, *, name: str = "", max_batch_size: int = 16,
                   batch_wait_ms: float = 5.0) -> "HFClient":
        """Wrap an already-loaded model (e.g. a trainer's live policy): no copy, no reload, so
        generations always use the current weights."""
        return cls(model, tokenizer, name=name, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms)

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
                     tool_choice: ToolChoice | None = None) -> AsyncIterator[StreamEvent]:
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
                "histogram": dict(sorted(Counter(sizes).items())), "cancelled_rows": self.cancelled_rows}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No generation runs on the model inside this block (hold it around an optimizer step).

        Waits for the batch in progress to finish; requests submitted inside the block run after
        it, on the updated weights. Re-entrant (a ``threading.RLock``). Do not await a generation
        of this client inside the block: it cannot run until the block exits.
        """
        with self.weights_lock:
            yield

    async def aclose(self) -> None:
        await self._batcher.close()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ queue and worker

    async def _encode_off_worker(self, req: _Request) -> tuple[list[int], dict[str, Any] | None, list[MediaRef]]:
        """``_encode_request(req)`` on the tokenizer pool, never on the decode worker. Identical
        small prompts in flight together (a GRPO group) share one encoding, so they still reach
        the queue together and land in one batch."""
        key = None
        if _prompt_chars(req.messages) <= _SHARE_PROMPT_CHARS:
            key = json.dumps([[m.model_dump_json() for m in req.messages], req.tools, req.tool_choice], default=str)
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
        fut.add_done_callback(lambda f: req.cancelled.set() if f.cancelled() else None)
        self._batcher.put(req)
        return await fut

    @staticmethod
    def _resolve(req: _Request, result: Turn | None = None, error: BaseException | None = None) -> None:
        settle(req.loop, req.future, result, error)

    def _run_batch(self, reqs: list[_Request]) -> None:
        import torch

        rows: list[_Row] = []
        for req in reqs:
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
            return
        self.batch_sizes.append(len(rows))
        if getattr(self.model, "training", False) and not self._warned_training:
            self._warned_training = True  # the caller's choice (see the module docstring); said once
            log.warning("%s: generating while the model is in train mode: dropout, if the model has any, "
                        "is active in sampling and in the recorded logprobs", self.spec)
        try:
            # The batcher holds weights_lock around this call: no weight update mid-batch.
            with torch.no_grad():
                self._decode(rows)
        except Exception as e:
            for row in rows:
                self._resolve(row.req, error=ModelError(f"generation failed: {type(e).__name__}: {e}"))
            return
        for row in rows:
            if row.finish == "cancelled":
                continue  # nobody is waiting
            if row.error is not None:
                self._resolve(row.req, error=row.error)
                continue
            try:
                self._resolve(row.req, self._finish_turn(row))
            except Exception as e:
                self._resolve(row.req, error=e)

    def _decode(self, rows: list[_Row]) -> None:
        """Prefill, then one forward pass per token for the whole batch.

        Sampling is vectorised over the batch (one tempered ``log_softmax``, one top-p mask, one
        inverse-CDF draw for all rows); the randomness stays per row: each row's uniforms come from
        its own seeded generator, drawn up front (``u[t]`` picks the row's ``t``-th token), so a
        seeded request samples the same alone or in a batch. Text is decoded per token only for
        rows that stream or have stop strings; the others are decoded once, at the end.
        """
        import torch

        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = min(self._eos_ids)
        width = max(len(r.prompt_ids) for r in rows)
        n = len(rows)
        input_ids = torch.full((n, width), pad, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding keeps every row's last token in the last column
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attn[i, width - len(r.prompt_ids):] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        steps = max(r.max_new for r in rows)
        # Per-row sampling settings as columns; greedy rows read the plain softmax (temperature 1).
        params = [r.req.params for r in rows]
        greedy = torch.tensor([p.temperature == 0 for p in params])
        temps = torch.tensor([[1.0 if p.temperature == 0 else float(p.temperature)] for p in params])
        # float64: a top_p of 1e-300 is 0 in float32 (an empty nucleus); the draw keeps the top token
        top_p = torch.tensor([[1.0 if p.temperature == 0 else float(p.top_p)] for p in params], dtype=torch.float64)
        any_top_p = bool((top_p < 1.0).any())
        any_greedy, all_greedy = bool(greedy.any()), bool(greedy.all())
        uniforms = torch.stack([torch.zeros(steps, dtype=torch.float64) if p.temperature == 0 else
                                torch.rand(steps, generator=r.generator, dtype=torch.float64)
                                for p, r in zip(params, rows)])
        max_new = torch.tensor([r.max_new for r in rows])
        eos = torch.tensor(sorted(self._eos_ids), dtype=torch.long)
        texty = [i for i, r in enumerate(rows) if r.req.on_delta is not None or r.req.params.stop]
        out_ids = torch.full((n, steps), pad, dtype=torch.long)
        out_lp = torch.zeros((n, steps), dtype=torch.float32)
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.zeros(n, dtype=torch.long)
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            cache = DynamicCache()
        input_ids, attn, positions = input_ids.to(device), attn.to(device), positions.to(device)
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **self._prefill_inputs(rows, device), **{self._cache_kw: cache})
        next_pos = positions[:, -1:] + 1
        ones = torch.ones((n, 1), dtype=attn.dtype, device=device)
        last = out.logits[:, -1, :]
        for t in range(steps):
            gone = [i for i, r in enumerate(rows) if r.req.cancelled.is_set() and not bool(done[i])]
            if gone:  # callers that went away: their rows leave the batch (and its KV cache) now
                for i in gone:
                    rows[i].finish = "cancelled"
                    self.cancelled_rows += 1
                keep_list = [i for i in range(len(rows)) if i not in set(gone)]
                if not keep_list:
                    break
                keep = torch.tensor(keep_list, dtype=torch.long)
                rows = [rows[i] for i in keep_list]
                greedy, temps, top_p, uniforms, max_new = greedy[keep], temps[keep], top_p[keep], uniforms[keep], \
                    max_new[keep]
                out_ids, out_lp, done, lengths = out_ids[keep], out_lp[keep], done[keep], lengths[keep]
                on_device = keep.to(device)
                cache.batch_select_indices(on_device)
                last, attn, next_pos, ones = last[on_device], attn[on_device], next_pos[on_device], ones[on_device]
                texty = [i for i, r in enumerate(rows) if r.req.on_delta is not None or r.req.params.stop]
            if bool(done.all()):
                break
            logits = last.float().cpu()
            logp = torch.log_softmax(logits / temps, dim=-1)
            # A row whose logits are not finite fails alone; its batch-mates go on.
            broken = ~done & torch.isnan(logp).any(-1)
            if bool(broken.any()):
                for i in broken.nonzero()[:, 0].tolist():
                    rows[i].error = ModelError(f"the model produced non-finite logits at step {t} of this request")
                    rows[i].finish = "error"
                done = done | broken
                logp = torch.where(broken[:, None], torch.zeros_like(logp), logp)
            if all_greedy:
                tokens = logits.argmax(-1)
            else:
                tokens = self._draw(logp, top_p if any_top_p else None, uniforms[:, t])
                if any_greedy:
                    tokens = torch.where(greedy, logits.argmax(-1), tokens)
            tokens = torch.where(done, pad, tokens)
            active = ~done
            out_ids[:, t] = tokens
            out_lp[:, t] = logp.gather(1, tokens[:, None])[:, 0]
            lengths += active.long()
            stopped = active & torch.isin(tokens, eos)
            finished_len = active & ~stopped & (lengths >= max_new)
            for i in texty:
                if bool(active[i]) and not bool(stopped[i]) and self._text_step(rows[i], out_ids[i, :t + 1].tolist()):
                    stopped[i] = True
                    finished_len[i] = False
            for i in (stopped | finished_len).nonzero()[:, 0].tolist():
                rows[i].finish = "stop" if bool(stopped[i]) else "length"
            done = done | stopped | finished_len
            if bool(done.all()):
                break
            attn = torch.cat([attn, ones], dim=1)
            out = self.model(input_ids=tokens.to(device).unsqueeze(1), attention_mask=attn, position_ids=next_pos,
                             use_cache=True, **{self._cache_kw: cache})
            last = out.logits[:, -1, :]
            next_pos = next_pos + 1
        ids_list, lp_list, len_list = out_ids.tolist(), out_lp.tolist(), lengths.tolist()
        for i, r in enumerate(rows):
            r.ids = ids_list[i][:len_list[i]]
            r.logprobs = lp_list[i][:len_list[i]]

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

    def _text_step(self, r: _Row, ids: list[int]) -> bool:
        """Streaming / stop strings for one row after it drew a (non-end) token: emit the new
        complete text; True when a stop string has appeared."""
        r.ids = ids
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
