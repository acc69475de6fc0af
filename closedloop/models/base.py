"""The one model interface every backend implements.

A backend turns (messages, tool schemas, sampling params) into a :class:`~closedloop.messages.Turn`:
an assistant message plus, where the backend can give them, exact token ids, logprobs and a loss
mask. Streaming yields text deltas and then the finished turn, so a caller that streams gets the
same record as one that does not.
"""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, AsyncGenerator, ContextManager, Iterable, Literal, Protocol, Union, runtime_checkable

from pydantic import BaseModel, Field

from closedloop.messages import Turn, _Message

ToolChoice = Union[Literal["auto", "none", "required"], dict[str, Any]]


class SamplingParams(BaseModel):
    """Sampling settings shared by all backends (OpenAI names)."""

    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)  # an infinite temperature is not a setting
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int = Field(256, ge=1)
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: bool = True


class ModelError(RuntimeError):
    """A model call failed for a reason the caller cannot fix by retrying the same request."""


class ModelUnavailableError(ModelError):
    """The model server cannot be reached (dead, wrong address, still starting)."""


class UnsupportedInputError(ModelError, ValueError):
    """The request holds something this model cannot take (an image for a text-only model, an
    undecodable or remote media part). A ``ValueError`` too: the caller's to fix (a server answers
    400), never retried, never silently dropped."""


class ContextLengthExceededError(ModelError):
    """The prompt (plus the tokens asked for) does not fit the model's context window.

    Its own type, end to end (``hf:``, an ``openai:`` server's 4xx, ``closedloop serve``), because
    callers treat it differently from every other failure: a benchmark scores it (tau2's
    ``context_window_exceeded`` termination) instead of re-running it as an infrastructure error.
    """

    def __init__(self, message: str, *, prompt_tokens: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    def __reduce__(self) -> tuple:
        """Pickled whole (an engine process sends it to the server): the keyword fields too."""
        return functools.partial(type(self), prompt_tokens=self.prompt_tokens, limit=self.limit), (str(self),)


@dataclass
class TextDelta:
    text: str


@dataclass
class TurnDone:
    turn: Turn


StreamEvent = Union[TextDelta, TurnDone]


@dataclass
class GenerateRequest:
    messages: list[_Message]
    tools: list[dict[str, Any]] | None = None
    params: SamplingParams | None = None
    tool_choice: ToolChoice | None = None


class ModelClient(ABC):
    """Async model client. Subclasses implement :meth:`generate`; streaming and batching have
    defaults that backends with native support override."""

    spec: str = ""

    @abstractmethod
    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        ...

    async def stream(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                     params: SamplingParams | None = None,
                     tool_choice: ToolChoice | None = None) -> AsyncGenerator[StreamEvent, None]:
        turn = await self.generate(messages, tools, params, tool_choice)
        if turn.message.text:
            yield TextDelta(turn.message.text)
        yield TurnDone(turn)

    async def batch(self, requests: list[GenerateRequest]) -> list[Turn]:
        """Generate many turns concurrently; backends batch them on the device."""
        return list(await asyncio.gather(*(self.generate(r.messages, r.tools, r.params, r.tool_choice)
                                           for r in requests)))

    async def aclose(self) -> None:
        return None


# --------------------------------------------------------------------------- capabilities
# What some clients can do beyond ModelClient, declared as runtime-checkable Protocols: a caller
# asks ``isinstance(client, Pausable)`` (and a type checker then knows the method's signature)
# instead of probing for attribute names.


@runtime_checkable
class Pausable(Protocol):
    """The model's weights live in this process: ``with client.paused():`` holds generation off
    them while they change (an optimizer step, a weight load, a snapshot)."""

    def paused(self) -> ContextManager[None]: ...


@runtime_checkable
class ReportsBatches(Protocol):
    """The backend batches requests and keeps a record of it (``/health`` shows it)."""

    def batch_stats(self) -> dict[str, Any] | None: ...


@runtime_checkable
class LoadsWeights(Protocol):
    """The backend loads new weights in place (Hugging Face names to tensors)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int: ...


@runtime_checkable
class LocalTokenizer(Protocol):
    """Token ids are decoded here, with this tokenizer (``None`` where it could not be loaded)."""

    tokenizer: Any


@runtime_checkable
class EndMarkers(Protocol):
    """The texts of the model's own end-of-turn tokens (its chat template's, beside the usual ones)."""

    _end_markers: tuple[str, ...]
