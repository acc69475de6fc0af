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
"""

from __future__ import annotations

import asyncio
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
from closedloop.models.chat_format import decode_ids, encode_prompt, parse_completion
from closedloop.models.multimodal import require_text_only

log = logging.getLogger("closedloop.models.hf")


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
        ids.update(vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") if t in vocab)
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
            if not task.done():
                task.cancel()

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
                "histogram": dict(sorted(Counter(sizes).items()))}

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

    # ------------------------------------------------------------------ queue and worker

    def _submit(self, messages, tools, params, tool_choice, on_delta=None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        # Prompts are encoded in the worker, so concurrent callers enqueue at once and land in
        # the same batch instead of trickling in behind each other's tokenisation.
        self._batcher.put(_Request(list(messages), tools, params or SamplingParams(), tool_choice, loop, fut, on_delta))
        return fut

    @staticmethod
    def _resolve(req: _Request, result: Turn | None = None, error: BaseException | None = None) -> None:
        settle(req.loop, req.future, result, error)

    def _run_batch(self, reqs: list[_Request]) -> None:
        import torch

        rows: list[_Row] = []
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        # A GRPO group sends one prompt G times: render it once.
        prompts: dict[str, tuple[list[int], dict[str, Any] | None, list[MediaRef]]] = {}
        for req in reqs:
            try:
                key = json.dumps([[m.model_dump_json() for m in req.messages], req.tools, req.tool_choice],
                                 default=str)
                if key not in prompts:
                    prompts[key] = self._encode_request(req)
                prompt, extras, media = list(prompts[key][0]), prompts[key][1], prompts[key][2]
                max_new = req.params.max_tokens
                if limit:
                    max_new = min(max_new, limit - len(prompt))
                    if max_new < 1:
                        raise ContextLengthExceededError(
                            f"prompt of {len(prompt)} tokens leaves no room in the model's {limit}-token context",
                            prompt_tokens=len(prompt), limit=limit)
                seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
                rows.append(_Row(req, prompt, max_new, torch.Generator().manual_seed(seed), extras=extras,
                                 media=media))
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
        top_p = torch.tensor([[1.0 if p.temperature == 0 else float(p.top_p)] for p in params])
        any_top_p = bool((top_p < 1.0).any())
        any_greedy, all_greedy = bool(greedy.any()), bool(greedy.all())
        uniforms = torch.stack([torch.zeros(steps, dtype=torch.float64) if p.temperature == 0 else
                                torch.rand(steps, generator=r.generator, dtype=torch.float64)
                                for p, r in zip(params, rows)])
        max_new = torch.tensor([r.max_new for r in rows])
        eos = torch.tensor(sorted(self._eos_ids))
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
        for t in range(steps):
            logits = out.logits[:, -1, :].float().cpu()
            logp = torch.log_softmax(logits / temps, dim=-1)
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
