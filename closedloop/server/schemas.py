"""The wire format of ``/v1/chat/completions``: what a request may hold and what a response holds.

Requests are validated here, at the boundary, so a malformed body becomes a 400 naming the
offending field instead of an exception deep in a backend. Unknown top-level fields are ignored
(as vLLM does) so newer clients keep working; the penalties are validated but have no effect
(see the server module's list of limits).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from closedloop.messages import AssistantMessage, ToolMessage, _Message, parse_messages

# Keys OpenAI clients put on messages that carry nothing for generation; dropped before validation.
_HARMLESS_MESSAGE_KEYS = {"refusal", "audio", "annotations", "function_call"}

MAX_N = 16
MAX_TOP_LOGPROBS = 20
#: OpenAI's rule for function names (its API rejects others with a 400).
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_NAME = re.compile(TOOL_NAME_PATTERN)
#: Longest stop string accepted (closedloop's bound; OpenAI documents none). Stop strings are held
#: back while a stream may be inside one, and checked by the backend at every token.
MAX_STOP_CHARS = 1024
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class FunctionDef(BaseModel):
    """A function tool as OpenAI validates it: a name of letters, digits, ``_`` and ``-`` (at most
    64), and ``parameters``, when given, a valid JSON Schema of ``"type": "object"``."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if v.get("type", "object") != "object":
            raise ValueError(f"parameters must be a JSON Schema of type 'object', got type {v.get('type')!r}")
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(v)
        except SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
            raise ValueError(f"parameters is not a valid JSON Schema at {where}: {e.message}") from None
        return v


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(BaseModel):
    """A chat completion request in OpenAI's format, plus vLLM's ``return_token_ids``."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str]] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # as vLLM: a 64-bit integer
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"stop sequences may be at most {MAX_STOP_CHARS} characters long; one has {longest}")
        return stops or None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        seen: set[str] = set()
        for t in v or []:
            if t.function.name in seen:
                raise ValueError(f"tool names must be unique; {t.function.name!r} is given more than once")
            seen.add(t.function.name)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice is set but no tools were given")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, "
                                 f"which is not among the tools given")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"response_format {self.response_format.type!r} is not supported by this server")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def typed_messages(self) -> list[_Message]:
        """The messages as our typed models; raises pydantic's ValidationError when the shape is
        wrong and :class:`ConversationError` when the conversation is not one OpenAI accepts.

        OpenAI's newer ``developer`` role is the old ``system`` role under another name.
        """
        cleaned = []
        for i, m in enumerate(self.messages):
            name = m.get("name")
            if name is not None and not (isinstance(name, str) and _NAME.match(name)):
                raise ConversationError(f"messages.{i}.name", _bad_name("name", name))
            m = {k: v for k, v in m.items() if not (k in _HARMLESS_MESSAGE_KEYS or v is None and k != "content")}
            if m.get("role") == "developer":
                m["role"] = "system"
            if m.get("role") in ("system", "assistant"):
                m.pop("name", None)  # OpenAI allows a participant name here; it does not reach the model
            cleaned.append(m)
        messages = parse_messages(cleaned)
        check_conversation(messages)
        return messages

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self) -> Any:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice


class ConversationError(ValueError):
    """A request whose messages are well-formed one by one but not as a conversation (a 400
    naming ``param``, as OpenAI answers)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _bad_name(what: str, name: Any) -> str:
    shown = repr(name[:40]) + ("..." if len(name) > 40 else "") if isinstance(name, str) else type(name).__name__
    return f"{what} {shown} does not match the pattern {TOOL_NAME_PATTERN} (letters, digits, '_' and '-'; 1 to 64)"


def check_conversation(messages: list[_Message]) -> None:
    """OpenAI's rules for the tool turns of a history: a ``tool`` message answers a call of the
    assistant message before it (only other tool messages between), by that call's id, and a
    call's name is a tool name (so ``<|im_start|>system`` is not one). Raises :class:`ConversationError`."""
    open_calls: set[str] | None = None  # ids of the calls the last assistant message made, while tools answer
    for i, m in enumerate(messages):
        if isinstance(m, AssistantMessage):
            for k, call in enumerate(m.tool_calls or []):
                if not _NAME.match(call.function.name):
                    raise ConversationError(f"messages.{i}.tool_calls.{k}.function.name",
                                            _bad_name("a tool call's name", call.function.name))
            open_calls = {c.id for c in m.tool_calls or []} or None
        elif isinstance(m, ToolMessage):
            if open_calls is None:
                raise ConversationError(f"messages.{i}.role", "messages with role 'tool' must be a response to a "
                                                             "preceding message with 'tool_calls'")
            if m.tool_call_id not in open_calls:
                shown = m.tool_call_id[:40] + ("..." if len(m.tool_call_id) > 40 else "")
                raise ConversationError(f"messages.{i}.tool_call_id",
                                        f"tool_call_id {shown!r} is not among the 'tool_calls' of the preceding "
                                        "assistant message")
        else:
            open_calls = None


# --------------------------------------------------------------------------- responses


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None  # vLLM's name for chain-of-thought split off the content


class DiscardedAttempt(BaseModel):
    """closedloop-specific: a reply the server generated for a choice and then discarded (a
    re-ask: it did not call the tool that ``tool_choice`` required). Reported so the model calls a
    response cost are all visible; a client records them as not for training."""

    finish_reason: str
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
    completion_tokens: int
    token_ids: list[int] | None = None  # with return_token_ids
    logprobs: ChoiceLogprobs | None = None  # with logprobs


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # vLLM, with return_token_ids
    # closedloop-specific, only present when the server re-asked for this choice, oldest first.
    closedloop_discarded: list[DiscardedAttempt] | None = None


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown of ``completion_tokens``; closedloop adds the re-asks' discarded tokens
    (counted in ``completion_tokens``, as OpenAI counts reasoning tokens the reply does not show)."""

    closedloop_discarded_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None  # only present after re-asks


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids

    def to_wire(self) -> dict[str, Any]:
        """The JSON body: OpenAI's fields always (``null`` included, as OpenAI sends them);
        closedloop's re-ask fields only where a re-ask happened."""
        body = self.model_dump(exclude_none=False)
        for choice in body["choices"]:
            if choice.get("closedloop_discarded") is None:
                choice.pop("closedloop_discarded", None)
        if body["usage"].get("completion_tokens_details") is None:
            body["usage"].pop("completion_tokens_details", None)
        return body


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "closedloop"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# --------------------------------------------------------------------------- admin: weight updates


class LoadWeightsRequest(BaseModel):
    """``POST /closedloop/v1/load_weights``: reload the served model's weights from a Hugging Face
    directory on the server's filesystem (``step`` is the trainer's, echoed in the status)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    step: int | None = Field(None, ge=0)


class WeightsStatus(BaseModel):
    """What ``GET /closedloop/v1/weights`` and a successful load report."""

    object: Literal["closedloop.weights"] = "closedloop.weights"
    weight_updates: bool  # whether the server was started with --allow-weight-updates
    backend: str
    loads: int = 0  # successful loads since the server started
    step: int | None = None  # of the last load
    path: str | None = None  # of the last load
    tensors: int | None = None  # loaded by the last load
    load_s: float | None = None  # how long the last load took
