"""A model call reported as LangChain reports a chat model's: to the run's callbacks, in chunks.

LangGraph's ``stream_mode="messages"`` is one such callback (LangGraph adds its handler to the
run's callbacks when the caller asks for that mode), and so are tracers (LangSmith) and a
caller's own handlers. A node therefore needs no knowledge of stream modes: when the run has
callbacks, the call is reported to them as a chat-model run (start, token chunks, the final
``AIMessage`` carrying the turn); when it has none, nothing is reported and the model is called
directly (:func:`has_callbacks`).
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

from langchain_core.callbacks.manager import AsyncCallbackManager
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, LLMResult
from langchain_core.runnables import RunnableConfig

from closedloop.messages import Turn, _Message
from closedloop.models.base import ModelClient, SamplingParams, TextDelta, TurnDone
from closedloop.runtime.convert import ai_message, to_langchain


class TextGate:
    """Which streamed text to show as message content: everything up to the first ``<`` (where
    tool-call or reasoning markup may start), the rest once the parsed message is known. A
    streamed prefix is therefore always a prefix of the final message text."""

    def __init__(self) -> None:
        self.sent = ""
        self.closed = False

    def feed(self, text: str) -> str:
        if self.closed:
            return ""
        cut = text.find("<")
        if cut >= 0:
            self.closed, text = True, text[:cut]
        self.sent += text
        return text

    def finish(self, final: str) -> str:
        return final[len(self.sent):] if final.startswith(self.sent) else ""


def has_callbacks(config: RunnableConfig | None) -> bool:
    """Whether the run has callback handlers (LangGraph's messages stream, a tracer, the caller's own)."""
    callbacks = (config or {}).get("callbacks")
    if callbacks is None:
        return False
    handlers = callbacks if isinstance(callbacks, list) else getattr(callbacks, "handlers", None)
    return bool(handlers)


async def stream_turn_with_callbacks(client: ModelClient, messages: list[_Message], schemas: Any,
                                     params: SamplingParams | None, config: RunnableConfig | None,
                                     on_text: Callable[[str], None] | None = None) -> tuple[Turn, AIMessage]:
    """One model call reported to the run's callbacks as a chat-model run (token chunks, then the
    final ``AIMessage`` carrying the turn); ``on_text`` also sees every raw text delta."""
    config = config or {}
    manager = AsyncCallbackManager.configure(inheritable_callbacks=config.get("callbacks"),
                                             inheritable_tags=config.get("tags"),
                                             inheritable_metadata=config.get("metadata"))
    run_id = uuid.uuid4()
    [run] = await manager.on_chat_model_start({"name": "ClosedloopChatModel"}, [[to_langchain(m) for m in messages]],
                                              run_id=run_id, name="ClosedloopChatModel",
                                              invocation_params={"model": client.spec})
    message_id = f"lc_run--{run_id}"
    gate, turn = TextGate(), None
    try:
        async for event in client.stream(messages, schemas, params):
            if isinstance(event, TextDelta):
                if on_text:
                    on_text(event.text)
                text = gate.feed(event.text)
                if text:
                    await run.on_llm_new_token(text, chunk=ChatGenerationChunk(
                        message=AIMessageChunk(content=text, id=message_id)))
            elif isinstance(event, TurnDone):
                turn = event.turn
        if turn is None:
            raise RuntimeError(f"{client.spec}: stream ended without a final turn")
    except BaseException as e:
        await run.on_llm_error(e)
        raise
    rest = gate.finish(turn.message.text)
    if rest:
        await run.on_llm_new_token(rest, chunk=ChatGenerationChunk(message=AIMessageChunk(content=rest, id=message_id)))
    ai = ai_message(turn.message, turn)
    ai.id = message_id
    await run.on_llm_end(LLMResult(generations=[[ChatGeneration(message=ai)]]))
    return turn, ai


__all__ = ["TextGate", "has_callbacks", "stream_turn_with_callbacks"]
