"""The records the ``hf:`` client passes between its caller, its queue and its decode worker, and
the sampling settings as sampled (see :mod:`closedloop.models.hf`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from closedloop.messages import LogprobSpec, MediaRef, MessageBase
from closedloop.models.base import SamplingParams, ToolChoice
from closedloop.models.decode_batch import DecodeBatch

log = logging.getLogger("closedloop.models.hf")


#: The smallest non-zero temperature sampled with (vLLM's ``_MAX_TEMP``); smaller ones are raised to it.
MIN_TEMPERATURE = 1e-2
def safe_params(params: SamplingParams) -> SamplingParams:
    """``params`` as sampled: a temperature in ``(0, MIN_TEMPERATURE)`` raised to ``MIN_TEMPERATURE``
    (as vLLM's ``SamplingParams``), so one request's 1e-300 cannot overflow the batch's logits."""
    if 0 < params.temperature < MIN_TEMPERATURE:
        log.info("temperature %g raised to %g (smaller values overflow the logits)", params.temperature,
                 MIN_TEMPERATURE)
        return params.model_copy(update={"temperature": MIN_TEMPERATURE})
    return params


def _prompt_chars(messages: list[MessageBase]) -> int:
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
    messages: list[MessageBase]
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
