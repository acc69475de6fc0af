"""``vllm:`` backend: vLLM's offline engine in-process, token-exact like ``hf:``.

Prompts are rendered and tokenised here with the checkpoint's chat template and handed to vLLM as
token ids, so ``Turn.prompt_ids`` is exactly what the engine saw. As for ``hf:``, text inside the
conversation is tokenised as plain text (:func:`closedloop.models.chat_format.encode_prompt`): a
``<|im_end|>`` typed by a user or returned by a tool never becomes a control token; tokenising
runs on a thread, off the event loop. A request whose caller goes away before its batch starts is
dropped; one already inside vLLM's ``generate`` call runs to its end (the offline engine has no
per-request abort). The completion text is decoded
here from the returned ids (special tokens kept), so ``decode(completion_ids) == completion_text``
as for ``hf:``. Requests arriving within ``batch_wait_ms`` go to the engine in one ``generate``
call, where vLLM batches them continuously; the engine is not thread-safe, so one worker thread
owns it.

Logprobs (``Turn.logprob_spec``): vLLM's engine-wide ``logprobs_mode`` decides what its sampled
token logprobs are. In current vLLM (v1 sampler, ``vllm/v1/sample/sampler.py``):

- ``raw_logprobs`` (vLLM's default): ``log_softmax(logits)`` before any processing (no
  temperature, penalties or truncation);
- ``raw_logits``: the unprocessed logits themselves;
- ``processed_logits``: the logits after penalties, temperature, min-p and top-k/top-p masking;
- ``processed_logprobs``: ``log_softmax`` of those processed logits, i.e. after temperature *and*
  after top-k/top-p truncation, renormalised over the kept tokens. For all-greedy batches it is
  ``log_softmax`` of the unscaled logits.

closedloop asks for ``processed_logprobs``. We never send penalties, logit bias, min-p or top-k,
so with ``top_p == 1`` it is exactly ``log_softmax(logits / temperature)`` over the full
vocabulary, the ``"tempered"`` mode that ``hf:`` records and the trainers recompute; greedy
requests (temperature 0; vLLM then also resets top-p to 1) give the unscaled softmax, recorded as
tempered at ``temperature=1.0`` as ``hf:`` does. With ``top_p < 1`` no vLLM mode yields the tempered
value (the kept tokens' mass is not returned), so those turns record mode ``"processed"`` with
their ``temperature`` and ``top_p``: each value is the tempered one minus ``log`` of the kept mass.
Sample with ``top_p=1`` for rollouts whose logprobs a trainer uses as old logprobs. A vLLM too old
for ``logprobs_mode`` reports raw logprobs; turns then record ``"raw"`` (tempered only when
``temperature`` is 0 or 1 with ``top_p == 1``) and :attr:`VLLMClient.info` says so.

Weight updates (a trainer's rollout engine, :mod:`closedloop.trainers.weight_sync`):
:meth:`VLLMClient.load_weights` loads named tensors into the engine's model the way TRL's
``GRPOTrainer`` does in vLLM colocate mode
(``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])``,
one tensor at a time, then ``llm.reset_prefix_cache()`` so no cached KV block computed with the
old weights is reused). That path reaches the model object only when vLLM's engine core runs in
this process: TRL gets that from ``distributed_executor_backend="external_launcher"``; here
``weight_updates=True`` builds the engine with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine
core in-process, vLLM's "v0 compatibility" ``llm_engine.model_executor``). The update runs under
:meth:`VLLMClient.paused`, so no batch decodes across it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from closedloop.messages import LogprobSpec, Turn, Usage, _Message
from closedloop.models.base import GenerateRequest, ModelClient, ModelError, SamplingParams, ToolChoice
from closedloop.models.batching import MicroBatcher, settle
from closedloop.models.chat_format import END_MARKERS, decode_ids, encode_prompt, parse_completion

INSTALL_HINT = "the vllm: backend needs vLLM and a GPU: pip install closedloop[vllm]"


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ModelError(INSTALL_HINT) from e
    return vllm


def vllm_logprob_spec(engine_mode: str, params: SamplingParams) -> LogprobSpec:
    """What a turn's logprobs are, given the engine's ``logprobs_mode`` and the request's sampling.

    Normalised so that whenever the values equal ``log_softmax(logits / T)`` at the sampled token
    the spec says ``"tempered"`` (as ``hf:`` would for the same request), and otherwise names the
    quantity vLLM returned.
    """
    greedy = params.temperature == 0
    temperature = 1.0 if greedy else params.temperature
    top_p = 1.0 if greedy else params.top_p  # vLLM resets top_p for greedy requests
    if engine_mode == "processed_logprobs":
        mode = "tempered" if top_p >= 1.0 else "processed"
    elif engine_mode == "raw_logprobs":
        mode = "tempered" if temperature == 1.0 and top_p >= 1.0 else "raw"
    else:
        raise ModelError(f"logprobs_mode {engine_mode!r} does not give logprobs; use 'processed_logprobs'")
    return LogprobSpec(mode=mode, temperature=temperature, top_p=top_p, backend="vllm")


@contextlib.contextmanager
def _inprocess_engine(enabled: bool) -> Iterator[None]:
    """``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while the engine is built (vLLM reads it then), so its
    engine core, and the model, live in this process; the previous value is restored after."""
    if not enabled:
        yield
        return
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    old = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    submitted: float = field(default_factory=time.perf_counter)
    multi_modal_data: dict[str, Any] | None = None  # vLLM's {"image": [...], "audio": [(array, rate)]}
    media: list[Any] = field(default_factory=list)


class VLLMClient(ModelClient):
    """A vLLM ``LLM`` engine behind the :class:`ModelClient` interface."""

    def __init__(self, model: str, *, dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.85, batch_wait_ms: float = 5.0, weight_updates: bool = False,
                 **engine_kwargs: Any):
        """``weight_updates=True``: run vLLM's engine core in this process so that
        :meth:`load_weights` can reach the model (see the module docstring)."""
        vllm = _import_vllm()
        self._vllm = vllm
        kwargs: dict[str, Any] = {"model": model, "dtype": dtype, "gpu_memory_utilization": gpu_memory_utilization,
                                  **engine_kwargs}
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.info: dict[str, Any] = {"logprobs_mode": "processed_logprobs", "weight_updates": weight_updates}
        with _inprocess_engine(weight_updates):
            try:
                self.llm = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs)
            except TypeError:  # vLLM before logprobs_mode existed: raw logprobs only
                self.llm = vllm.LLM(**kwargs)
                self.info["logprobs_mode"] = "raw_logprobs"
        self.tokenizer = self.llm.get_tokenizer()
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ModelError(f"{model} has no chat template; the vllm: backend needs a chat model")
        self.name = model
        self.spec = f"vllm:{model}"
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.batch_sizes: list[int] = []
        self._batcher: MicroBatcher[_Pending] = MicroBatcher(self._run_batch, wait_s=self.batch_wait_s,
                                                             name="closedloop-vllm")
        vocab = self.tokenizer.get_vocab()
        self._end_markers = tuple(t for t in (*END_MARKERS, self.tokenizer.eos_token)
                                  if t and t in vocab)

    # ------------------------------------------------------------------ helpers

    def encode_prompt(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                      tool_choice: ToolChoice | None = None) -> list[int]:
        """The exact prompt token ids the model will see (chat template, tools, generation prompt)."""
        return encode_prompt(self.tokenizer, messages, tools, tool_choice)

    def decode(self, ids: list[int]) -> str:
        """Token ids to text with special tokens kept, the inverse the turn record relies on."""
        return decode_ids(self.tokenizer, ids)

    def _sampling_params(self, p: SamplingParams):
        return self._vllm.SamplingParams(temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens,
                                         stop=p.stop or None, seed=p.seed, logprobs=0 if p.logprobs else None,
                                         include_stop_str_in_output=True, skip_special_tokens=False)

    def _to_turn(self, pending: _Pending, output: Any) -> Turn:
        comp = output.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        logprobs = None
        if comp.logprobs is not None:
            logprobs = [float(step[t].logprob) for t, step in zip(ids, comp.logprobs)]
        text = self.decode(ids)
        content_text = text
        stop = pending.params.stop
        if comp.finish_reason == "stop" and stop:
            cut = min((i for i in (text.find(s) for s in stop) if i != -1), default=-1)
            if cut != -1:
                content_text = text[:cut]
        message = parse_completion(content_text, end_markers=self._end_markers)
        finish = comp.finish_reason or "length"
        if message.tool_calls and finish == "stop":
            finish = "tool_calls"
        prompt = list(output.prompt_token_ids or pending.prompt_ids)
        spec = vllm_logprob_spec(self.info["logprobs_mode"], pending.params) if logprobs is not None else None
        return Turn(message=message, model=self.name, prompt_ids=prompt, completion_ids=ids, logprobs=logprobs,
                    loss_mask=[0] * len(prompt) + [1] * len(ids), logprob_spec=spec,
                    unavailable={} if logprobs is not None else {"logprobs": "the request set logprobs=False"},
                    completion_text=text, finish_reason=finish, media=list(pending.media),
                    usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(ids)),
                    latency_s=time.perf_counter() - pending.submitted)

    # ------------------------------------------------------------------ API

    def _processor(self) -> Any:
        """The checkpoint's multimodal processor (None for a text model), loaded once."""
        if not hasattr(self, "_mm_processor"):
            from closedloop.models.hf_vision import is_vision_checkpoint

            self._mm_processor = None
            if is_vision_checkpoint(self.name):
                from transformers import AutoProcessor

                self._mm_processor = AutoProcessor.from_pretrained(self.name)
        return self._mm_processor

    def encode_multimodal(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                          tool_choice: ToolChoice | None = None) -> tuple[list[int], dict[str, Any]]:
        """Prompt ids with one placeholder per media part (vLLM's processor expands them; the turn
        records the expanded ids vLLM reports) and vLLM's ``multi_modal_data``."""
        from closedloop.models.asr import SAMPLE_RATE, load_audio
        from closedloop.models.chat_format import encode_rendered, select_tools
        from closedloop.models.multimodal import part_bytes, render_for_processor, require_text_only

        processor = self._processor()
        if processor is None:
            require_text_only(messages, self.spec)
        rendered, images, audio = render_for_processor(messages)
        # Content is tokenised as plain text (never control tokens), placeholders by the template.
        ids = encode_rendered(self.tokenizer, rendered, select_tools(tools, tool_choice),
                              chat_template=getattr(processor, "chat_template", None))
        data: dict[str, Any] = {}
        if images:
            data["image"] = images
        if audio:
            data["audio"] = [(load_audio(part_bytes(a)[0]), SAMPLE_RATE) for a in audio]
        return ids, data

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        from closedloop.models.multimodal import has_media, media_refs

        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if has_media(messages):
            prompt, data = await asyncio.to_thread(self.encode_multimodal, messages, tools, tool_choice)
            self._batcher.put(_Pending(prompt, params or SamplingParams(), loop, fut, multi_modal_data=data,
                                       media=media_refs(messages)))
            return await fut
        # Tokenised on a thread: a huge prompt must not stall the event loop (or the engine's worker).
        prompt = await asyncio.to_thread(self.encode_prompt, messages, tools, tool_choice)
        self._batcher.put(_Pending(prompt, params or SamplingParams(), loop, fut))
        return await fut

    async def batch(self, requests: list[GenerateRequest]) -> list[Turn]:
        return list(await asyncio.gather(*(self.generate(r.messages, r.tools, r.params, r.tool_choice)
                                           for r in requests)))

    async def generate_many(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                            params: SamplingParams | None = None, n: int = 1,
                            tool_choice: ToolChoice | None = None) -> list[Turn]:
        """``n`` samples of one prompt; with a seed, sample ``i`` uses ``seed + i`` (as ``hf:``)."""
        if n < 1:
            raise ValueError("n must be >= 1")
        params = params or SamplingParams()
        return await self.batch([GenerateRequest(messages, tools, params if params.seed is None else
                                                 params.model_copy(update={"seed": params.seed + i}), tool_choice)
                                 for i in range(n)])

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No ``generate`` call reaches the engine inside this block (hold it while loading new
        weights into the engine); requests submitted meanwhile run after it. As ``HFClient.paused``."""
        with self._batcher.paused():
            yield

    def engine_model(self) -> Any:
        """The engine's ``torch.nn.Module`` when vLLM's engine core runs in this process (as in
        TRL's colocate mode), else ``None``."""
        try:
            return self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        except AttributeError:
            return None

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Load ``(name, tensor)`` pairs (Hugging Face parameter names, LoRA already merged) into
        the engine's model in place; returns how many tensors were loaded.

        As TRL's colocate sync: each tensor through the model's own ``load_weights`` (which maps
        HF names onto vLLM's fused layers, e.g. q/k/v into ``qkv_proj``), then the prefix cache is
        reset. Runs under :meth:`paused`: a batch in progress finishes on the old weights, later
        ones see the new weights, none sees a mixture.
        """
        model = self.engine_model()
        if model is None:
            raise ModelError("this vLLM engine runs its model in another process, where load_weights cannot reach "
                             "it; build the client with VLLMClient(..., weight_updates=True) (engine core "
                             "in-process, as TRL's colocate mode) or serve the model with `trl vllm-serve` and sync "
                             "over NCCL")
        count = 0
        with self.paused():
            for name, tensor in named_tensors:
                model.load_weights([(name, tensor)])
                count += 1
            self.llm.reset_prefix_cache()
        return count

    async def aclose(self) -> None:
        await self._batcher.close()

    # ------------------------------------------------------------------ worker

    def _run_batch(self, batch: list[_Pending]) -> None:
        self.batch_sizes.append(len(batch))
        try:
            prompts = [{"prompt_token_ids": b.prompt_ids} | ({"multi_modal_data": b.multi_modal_data}
                                                              if b.multi_modal_data else {}) for b in batch]
            outputs = self.llm.generate(prompts,
                                        sampling_params=[self._sampling_params(b.params) for b in batch],
                                        use_tqdm=False)
            results: list[Any] = [self._to_turn(b, o) for b, o in zip(batch, outputs)]
        except Exception as e:
            results = [ModelError(f"vLLM generation failed: {type(e).__name__}: {e}")] * len(batch)
        for b, r in zip(batch, results):
            if isinstance(r, BaseException):
                settle(b.loop, b.future, error=r)
            else:
                settle(b.loop, b.future, r)
