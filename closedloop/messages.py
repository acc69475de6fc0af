"""Chat messages, model turns and trajectories: the one vocabulary every layer speaks.

Messages follow the OpenAI chat format exactly (content is text or a list of content parts), so a
VLM behind vLLM or GPT-4o receives them unchanged. A :class:`Turn` is what a model call produced,
kept token-exactly when the backend can give token ids: trainers consume the same record that
evaluation stored, instead of re-tokenising the final messages (which is known to break PPO;
see verl's LangGraph recipe). A :class:`Trajectory` is turns plus rewards, and round-trips JSON
losslessly.
"""

from __future__ import annotations

import base64
import json
import mimetypes
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

# --------------------------------------------------------------------------- content parts


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(BaseModel):
    data: str  # base64
    format: str  # "wav", "mp3", ...


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ImagePart(BaseModel):
    """An image as the OpenAI ``image_url`` part; local files and bytes become data URLs."""

    type: Literal["image_url"] = "image_url"
    image_url: ImageURL

    @classmethod
    def from_url(cls, url: str, detail: str | None = None) -> "ImagePart":
        return cls(image_url=ImageURL(url=url, detail=detail))

    @classmethod
    def from_bytes(cls, data: bytes, mime: str = "image/png") -> "ImagePart":
        return cls.from_url(f"data:{mime};base64,{base64.b64encode(data).decode()}")

    @classmethod
    def from_path(cls, path: str | Path) -> "ImagePart":
        path = Path(path)
        mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return cls.from_bytes(path.read_bytes(), mime)


class AudioPart(BaseModel):
    """Audio as the OpenAI ``input_audio`` part (base64 data plus format)."""

    type: Literal["input_audio"] = "input_audio"
    input_audio: InputAudio

    @classmethod
    def from_bytes(cls, data: bytes, format: str = "wav") -> "AudioPart":
        return cls(input_audio=InputAudio(data=base64.b64encode(data).decode(), format=format))

    @classmethod
    def from_path(cls, path: str | Path) -> "AudioPart":
        path = Path(path)
        return cls.from_bytes(path.read_bytes(), path.suffix.lstrip(".") or "wav")

    @classmethod
    def from_url(cls, url: str) -> "AudioPart":
        """Audio referenced by URL is fetched by the caller's server, never by us; keep it as text."""
        raise ValueError("OpenAI's input_audio part takes data, not a URL; download it and use from_bytes")


ContentPart = Annotated[Union[TextPart, ImagePart, AudioPart], Field(discriminator="type")]
Content = Union[str, list[ContentPart]]


def content_text(content: Content | None) -> str:
    """The text of a message's content, parts other than text left out."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, TextPart))


# --------------------------------------------------------------------------- tool calls


class FunctionCall(BaseModel):
    name: str
    # Kept as the raw string the model emitted: malformed JSON must survive to be reported back.
    arguments: str = "{}"


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def make(cls, name: str, arguments: dict[str, Any] | str, id: str | None = None) -> "ToolCall":
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return cls(function=FunctionCall(name=name, arguments=args), **({"id": id} if id else {}))

    @property
    def name(self) -> str:
        return self.function.name

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict; raises ``json.JSONDecodeError``/``TypeError`` when malformed."""
        value = json.loads(self.function.arguments or "{}")
        if not isinstance(value, dict):
            raise TypeError(f"tool arguments must be a JSON object, got {type(value).__name__}")
        return value


# --------------------------------------------------------------------------- messages


class MessageBase(BaseModel):
    """What every chat message is (:class:`SystemMessage`, :class:`UserMessage`,
    :class:`AssistantMessage`, :class:`ToolMessage`): annotate with it, or test ``isinstance``
    against it. :data:`Message` is the same four as a pydantic discriminated union, for parsing."""

    model_config = ConfigDict(extra="forbid")

    if TYPE_CHECKING:
        # Every concrete message declares both as fields (``role`` a single Literal). Declared
        # here for type checkers only: as runtime fields they would move ``content`` ahead of
        # ToolMessage's ``tool_call_id`` and so change every serialised tool message's key order.
        role: Literal["system", "user", "assistant", "tool"]
        content: Content | None

    def to_openai(self) -> dict[str, Any]:
        """The message as the OpenAI API expects it (no ``None`` fields)."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"reasoning"})

    @property
    def text(self) -> str:
        return content_text(getattr(self, "content", None))


class SystemMessage(MessageBase):
    role: Literal["system"] = "system"
    content: Content


class UserMessage(MessageBase):
    role: Literal["user"] = "user"
    content: Content
    name: str | None = None


class AssistantMessage(MessageBase):
    role: Literal["assistant"] = "assistant"
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    # Chain-of-thought the model emitted (e.g. inside <think>); kept, but never sent to other parties.
    reasoning: str | None = None

    @model_validator(mode="after")
    def _empty_tool_calls_are_none(self) -> "AssistantMessage":
        if self.tool_calls == []:
            self.tool_calls = None
        return self


class ToolMessage(MessageBase):
    role: Literal["tool"] = "tool"
    tool_call_id: str
    content: Content
    name: str | None = None
    # Set when the tool failed; the content then holds the error text the model sees.
    error: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True, exclude={"error"})


Message = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]

#: The former private name of :class:`MessageBase`, kept so existing imports keep working.
_Message = MessageBase


class _MessageList(BaseModel):
    messages: list[Message]


def parse_messages(raw: Sequence[dict[str, Any] | MessageBase]) -> list[MessageBase]:
    """Validate OpenAI-format message dicts (or messages) into typed messages."""
    return list(_MessageList(messages=[m if isinstance(m, MessageBase) else m for m in raw]).messages)


def to_openai_messages(messages: Sequence[MessageBase]) -> list[dict[str, Any]]:
    return [m.to_openai() for m in messages]


# --------------------------------------------------------------------------- turns and trajectories


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: "Usage") -> "Usage":
        cost = None if self.cost_usd is None and other.cost_usd is None else (self.cost_usd or 0) + (other.cost_usd or 0)
        return Usage(prompt_tokens=self.prompt_tokens + other.prompt_tokens,
                     completion_tokens=self.completion_tokens + other.completion_tokens, cost_usd=cost)


LogprobMode = Literal["tempered", "processed", "raw", "server"]


class LogprobSpec(BaseModel):
    """How a turn's ``logprobs`` were computed, so a trainer knows whether its recomputation is
    comparable (an importance ratio between different quantities is silently wrong).

    Modes:
    - ``tempered`` (the default of ``hf:`` and ``vllm:``, and what closedloop's trainers recompute):
      ``log_softmax(logits / temperature)`` over the full vocabulary at the sampled token; top-p
      changes which tokens can be drawn, not the recorded value. At temperature 0 the unscaled
      logits (``temperature`` is then recorded as 1.0 would be: greedy reads the plain softmax).
    - ``processed``: after temperature *and* top-p/top-k truncation and renormalisation (vLLM's
      ``processed_logprobs`` when ``top_p < 1``).
    - ``raw``: ``log_softmax(logits)`` before temperature (vLLM's ``raw_logprobs``).
    - ``server``: whatever a remote OpenAI-compatible server returned; not comparable unless the
      server documents it.
    """

    mode: LogprobMode = "tempered"
    temperature: float = 1.0
    top_p: float = 1.0
    backend: str = ""

    def comparable_to_tempered(self) -> bool:
        """True when the values equal ``log_softmax(logits / temperature)`` at the sampled token."""
        return self.mode == "tempered" or (self.mode == "processed" and self.top_p >= 1.0) or \
            (self.mode == "raw" and self.temperature == 1.0 and self.top_p >= 1.0)


class MediaRef(BaseModel):
    """A content address for one image or audio part of a turn's prompt (see
    :mod:`closedloop.models.multimodal`): with the messages, it pins exactly what the model saw."""

    kind: Literal["image", "audio"]
    sha256: str
    mime: str | None = None
    size: int = 0
    message: int  # index in the prompt's message list
    part: int  # index in that message's content parts


class Turn(BaseModel):
    """One model call: the assistant message it produced plus, when known, its exact tokens.

    ``loss_mask`` is aligned with ``prompt_ids + completion_ids``: 1 on tokens the model generated,
    0 on system/user/tool/template tokens. ``logprobs[i]`` is the log-probability of
    ``completion_ids[i]`` as described by ``logprob_spec`` (by default under the tempered
    sampling distribution, see :class:`LogprobSpec`).

    ``trainable`` is False for model calls a graph makes that are not the policy's action (a
    helper call such as the clarifier's candidate-goal proposal, a server's re-ask): they are
    recorded for audit but trainers skip them. ``purpose`` names the call ("policy",
    "propose_goals", "reask", ...). ``unavailable`` says what the backend could not give
    (``{"token_ids": "the server does not return them"}``), so a trainer refuses the turn with
    that reason instead of failing later.
    """

    message: AssistantMessage
    model: str = ""
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    logprob_spec: LogprobSpec | None = None
    completion_text: str | None = None  # the raw decoded completion, tool-call markup included
    finish_reason: str | None = None
    usage: Usage = Field(default_factory=Usage)
    latency_s: float | None = None
    trainable: bool = True
    purpose: str = "policy"
    unavailable: dict[str, str] = Field(default_factory=dict)
    media: list[MediaRef] = Field(default_factory=list)  # the prompt's images/audio, in order

    @property
    def has_tokens(self) -> bool:
        return self.prompt_ids is not None and self.completion_ids is not None

    @model_validator(mode="after")
    def _check_lengths(self) -> "Turn":
        if self.completion_ids is not None:
            if self.logprobs is not None and len(self.logprobs) != len(self.completion_ids):
                raise ValueError("logprobs must have one entry per completion token")
            if self.loss_mask is None and self.prompt_ids is not None:
                self.loss_mask = [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)
            if self.loss_mask is not None and self.prompt_ids is not None and \
                    len(self.loss_mask) != len(self.prompt_ids) + len(self.completion_ids):
                raise ValueError("loss_mask must cover prompt_ids + completion_ids")
        return self


class MissingTokensError(ValueError):
    """A trajectory cannot be turned into training tokens (no ids, or no logprobs when asked to refuse)."""


class TokenView(BaseModel):
    """A whole multi-turn episode (or the part of it with continuous context) as one token
    sequence for training.

    ``loss_mask[i]`` is 1 where token ``i`` was generated by the policy and is trained on.
    ``logprobs[i]`` is the recorded sampling logprob of token ``i``; it is meaningful only where
    ``logprob_mask[i]`` is 1 (generated tokens whose backend returned a logprob). Never read a
    ``logprobs`` entry where ``logprob_mask`` is 0: it is a placeholder 0.0, not probability 1.
    ``turn_index[i]`` is the index (in ``Trajectory.turns``) of the turn that generated token
    ``i``, -1 for context tokens, so per-turn rewards can be placed on their own tokens.
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    logprob_mask: list[int]
    turn_index: list[int]
    logprob_spec: LogprobSpec | None = None


class Trajectory(BaseModel):
    """An episode: the final message list, every model turn, and rewards.

    ``rewards`` holds named scalar rewards for the whole episode; ``step_rewards`` optional
    per-turn rewards (index = turn index), for trainers that mix turn-level and final credit.
    """

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    messages: list[Message] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    rewards: dict[str, float] = Field(default_factory=dict)
    step_rewards: list[float | None] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> "Trajectory":
        return cls.model_validate_json(text)

    @property
    def usage(self) -> Usage:
        total = Usage()
        for t in self.turns:
            total = total + t.usage
        return total

    def token_view(self, missing_logprobs: Literal["mask", "refuse"] = "mask",
                   include_untrainable: bool = False) -> list[TokenView]:
        """Merge turns into as few token sequences as token continuity allows.

        A turn continues the current sequence when its prompt starts with everything so far
        (prompt + completion of the previous turn); the new prompt tokens between (tool results,
        user text, template) take the turn's own ``loss_mask`` (0 unless a caller set otherwise).
        When a prompt does not extend the previous sequence (the context was rewritten, e.g. old
        reasoning dropped), a new sequence starts, so masks stay exact instead of silently training
        on re-tokenised text. Each turn's ``loss_mask`` is honoured as recorded.

        ``missing_logprobs``: where a backend returned no logprobs, ``"mask"`` sets
        ``logprob_mask`` to 0 on those tokens (a trainer leaves them out of any importance ratio),
        ``"refuse"`` raises :class:`MissingTokensError`. A logprob is never invented.
        Turns marked ``trainable=False`` (helper calls) are skipped unless ``include_untrainable``.
        """
        views: list[TokenView] = []
        for index, turn in enumerate(self.turns):
            if not turn.trainable and not include_untrainable:
                continue
            if turn.prompt_ids is None or turn.completion_ids is None:  # not turn.has_tokens
                why = turn.unavailable.get("token_ids", "the backend did not return them")
                raise MissingTokensError(f"turn {index} has no token ids: {why}")
            prompt, completion = list(turn.prompt_ids), list(turn.completion_ids)
            mask = list(turn.loss_mask) if turn.loss_mask is not None else [0] * len(prompt) + [1] * len(completion)
            if turn.logprobs is None:
                if missing_logprobs == "refuse":
                    why = turn.unavailable.get("logprobs", "the backend did not return them")
                    raise MissingTokensError(f"turn {index} has no logprobs: {why}")
                lps, lp_mask = [0.0] * len(completion), [0] * len(completion)
            else:
                lps = list(turn.logprobs)
                lp_mask = list(mask[len(prompt):])
            gen_index = [index if m else -1 for m in mask[len(prompt):]]
            cur = views[-1] if views else None
            if cur is not None and cur.logprob_spec != turn.logprob_spec and turn.logprobs is not None:
                cur = None  # one sequence, one logprob definition
            if cur is not None and len(prompt) >= len(cur.input_ids) and prompt[: len(cur.input_ids)] == cur.input_ids:
                start = len(cur.input_ids)
                extra = prompt[start:]
                cur.input_ids += extra + completion
                cur.loss_mask += mask[start:]
                cur.logprobs += [0.0] * len(extra) + lps
                cur.logprob_mask += [0] * len(extra) + lp_mask
                cur.turn_index += [index if m else -1 for m in mask[start:len(prompt)]] + gen_index
            else:
                views.append(TokenView(input_ids=prompt + completion, loss_mask=mask,
                                       logprobs=[0.0] * len(prompt) + lps, logprob_mask=[0] * len(prompt) + lp_mask,
                                       turn_index=[index if m else -1 for m in mask[:len(prompt)]] + gen_index,
                                       logprob_spec=turn.logprob_spec))
        return views
