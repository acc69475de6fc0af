"""``ClosedloopChatModel``: any closedloop model spec as a LangChain chat model.

A LangGraph/LangChain user keeps their own graph (``create_agent``, ``create_react_agent``,
``ToolNode``, ``tools_condition``, ``stream_mode="messages"``) and gets our backends underneath.
Each ``AIMessage`` it returns carries the model call's :class:`~closedloop.messages.Turn` (prompt
and completion token ids, logprobs with their spec, loss mask) in
``response_metadata["closedloop_turn"]``, so a conversation recorded through LangChain is as
trainable as one recorded by our own model node: :func:`trajectory_from_messages` collects the
turns back.

    from closedloop.langchain_chat import ClosedloopChatModel
    llm = ClosedloopChatModel(model="hf:/path/to/model", temperature=0.0).bind_tools([add])
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterator, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

from closedloop.messages import Trajectory, Turn
from closedloop.models.base import ModelClient, SamplingParams, TextDelta, ToolChoice, TurnDone
from closedloop.run_sync import run_sync
from closedloop.runtime.context import client_for
from closedloop.runtime.convert import TURN_KEY, ai_message, as_closedloop, turn_of
from closedloop.runtime.stream import TextGate
from closedloop.tool import Tool


class ClosedloopChatModel(BaseChatModel):
    """A LangChain chat model over a closedloop :class:`~closedloop.models.base.ModelClient`.

    Give ``model`` (a spec: ``hf:<path>``, ``openai:<model>[@<url>]``, ``vllm:<path>``), or an
    existing ``client`` (e.g. an ``HFClient`` over live training weights). Sampling settings are
    the OpenAI names; ``stop`` passed at call time is added to them.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model: str = Field("", description="closedloop model spec; ignored when client is given")
    client: Any = Field(None, exclude=True, description="a ModelClient to use instead of building one from model")
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: list[str] | None = None
    _resolved: ModelClient | None = PrivateAttr(None)

    @classmethod
    def from_client(cls, client: ModelClient, params: SamplingParams | None = None) -> "ClosedloopChatModel":
        p = params or SamplingParams(temperature=0.0)
        return cls(model=client.spec, client=client, temperature=p.temperature, top_p=p.top_p,
                   max_tokens=p.max_tokens, seed=p.seed, stop=p.stop)

    @property
    def _llm_type(self) -> str:
        return "closedloop"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model or getattr(self.client, "spec", ""), "temperature": self.temperature,
                "top_p": self.top_p, "max_tokens": self.max_tokens, "seed": self.seed}

    def model_client(self) -> ModelClient:
        if self.client is not None:
            return self.client
        if self._resolved is None:
            if not self.model:
                raise ValueError("ClosedloopChatModel needs model= (a closedloop model spec) or client=")
            self._resolved = client_for(self.model)  # one client per spec per process
        return self._resolved

    def _params(self, stop: list[str] | None) -> SamplingParams:
        stops = list(self.stop or []) + list(stop or [])
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=self.seed, stop=stops or None)

    # ------------------------------------------------------------------ tools

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict | bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind LangChain tools, our ``@tool``s, functions, pydantic models or OpenAI tool dicts."""
        formatted = [t.schema if isinstance(t, Tool) else convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=formatted, tool_choice=_tool_choice(tool_choice), **kwargs)

    # ------------------------------------------------------------------ calls

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        turn = await self.model_client().generate(as_closedloop(messages), kwargs.get("tools") or None,
                                                  self._params(stop), kwargs.get("tool_choice"))
        return ChatResult(generations=[ChatGeneration(message=ai_message(turn.message, turn))])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """Token chunks, then one chunk with the tool calls and the turn; the chunks add up to the
        same message ``ainvoke`` returns (text that may be markup is held back until parsed)."""
        gate, turn = TextGate(), None
        async for event in self.model_client().stream(as_closedloop(messages), kwargs.get("tools") or None,
                                                      self._params(stop), kwargs.get("tool_choice")):
            if isinstance(event, TextDelta):
                text = gate.feed(event.text)
                if text:
                    chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
                    if run_manager:
                        await run_manager.on_llm_new_token(text, chunk=chunk)
                    yield chunk
            elif isinstance(event, TurnDone):
                turn = event.turn
        if turn is None:
            raise RuntimeError(f"{self.model_client().spec}: stream ended without a final turn")
        final = ai_message(turn.message, turn)
        rest = gate.finish(turn.message.text)
        if rest and run_manager:
            await run_manager.on_llm_new_token(rest, chunk=ChatGenerationChunk(message=AIMessageChunk(content=rest)))
        calls = [(c["name"], c["id"]) for c in final.tool_calls] + [(c["name"], c["id"]) for c in final.invalid_tool_calls]
        yield ChatGenerationChunk(message=AIMessageChunk(
            content=rest, tool_call_chunks=[{"name": name, "args": _args_text(turn, call_id), "id": call_id,
                                             "index": i, "type": "tool_call_chunk"}
                                            for i, (name, call_id) in enumerate(calls)],
            additional_kwargs=final.additional_kwargs, response_metadata=final.response_metadata,
            usage_metadata=final.usage_metadata, chunk_position="last"))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return run_sync(lambda: self._agenerate(messages, stop, None, **kwargs))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        async def collect() -> list[ChatGenerationChunk]:
            return [c async for c in self._astream(messages, stop, None, **kwargs)]

        for chunk in run_sync(collect):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


def _args_text(turn: Turn, call_id: str | None) -> str:
    for call in turn.message.tool_calls or []:
        if call.id == call_id:
            return call.function.arguments
    return ""


def _tool_choice(choice: str | dict | bool | None) -> ToolChoice | None:
    """LangChain's tool_choice values in OpenAI's terms ("any"/True → "required", a name → that function)."""
    if choice is None or choice is False:
        return None
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, str) and choice not in {"auto", "none", "required"}:
        return {"type": "function", "function": {"name": choice}}
    return choice  # type: ignore[return-value]


def turns_from_messages(messages: Sequence[Any]) -> list[Turn]:
    """The turns carried by the ``AIMessage``s of a LangChain conversation, in order."""
    return [t for t in (turn_of(m) for m in messages) if t is not None]


def trajectory_from_messages(messages: Sequence[Any], **fields: Any) -> Trajectory:
    """A trainable :class:`Trajectory` from a conversation recorded through ``ClosedloopChatModel``."""
    return Trajectory(messages=as_closedloop(list(messages)), turns=turns_from_messages(messages), **fields)


def chat_model_tools(tools: Any) -> list[BaseTool]:
    """A :class:`~closedloop.tool.ToolRegistry` (or list of our tools) as LangChain tools, for ``bind_tools``."""
    from closedloop.langchain_tools import to_langchain_tool

    return [to_langchain_tool(t) for t in tools]


__all__ = ["ClosedloopChatModel", "turns_from_messages", "trajectory_from_messages",
           "chat_model_tools", "TURN_KEY"]
