"""Between our typed messages and the text a local chat model reads and writes.

Local backends (``hf:``, ``vllm:``) render a conversation with the checkpoint's own Jinja chat
template and get back raw completion text. Rendering turns our messages into the dicts those
templates expect (tool-call arguments as dicts, since templates ``tojson`` them). Parsing reads the
Hermes/Qwen convention: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks and an
optional ``<think>...</think>`` preamble. Parsing never raises: a model's output is data, and a
malformed call must reach the tool layer so the error can be reported back to the model.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Collection

from closedloop.messages import (AssistantMessage, SystemMessage, ToolCall, ToolMessage, UserMessage, _Message,
                                 content_text)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
#: End-of-turn markers of the chat formats we read (ChatML/Qwen, GPT-style, Llama 3): the one list
#: the backends stop on and the parser cuts at (a tokenizer's own EOS is added by each backend).
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_THINK_BLOCK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*(.*)', re.DOTALL)


# --------------------------------------------------------------------------- rendering


def _arguments_for_template(raw: str) -> Any:
    """Templates ``tojson`` the arguments, so they need the object, not its JSON text.

    Malformed arguments (which the model produced and the tool rejected) stay as the raw string so
    the conversation shows the model what it actually wrote.
    """
    try:
        return json.loads(raw or "{}")
    except json.JSONDecodeError:
        return raw


def message_to_template_dict(message: _Message) -> dict[str, Any]:
    """One typed message as the dict HF chat templates take (text only; reasoning dropped, as
    Qwen's own template drops earlier turns' thinking)."""
    if isinstance(message, (SystemMessage, UserMessage)):
        return {"role": message.role, "content": content_text(message.content)}
    if isinstance(message, AssistantMessage):
        out: dict[str, Any] = {"role": "assistant", "content": content_text(message.content)}
        if message.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments_for_template(c.function.arguments)}}
                                 for c in message.tool_calls]
        return out
    if isinstance(message, ToolMessage):
        out = {"role": "tool", "content": content_text(message.content), "tool_call_id": message.tool_call_id}
        if message.name:
            out["name"] = message.name
        return out
    raise TypeError(f"cannot render message of type {type(message).__name__}")


def render_messages(messages: list[_Message]) -> list[dict[str, Any]]:
    return [message_to_template_dict(m) for m in messages]


def select_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools to show the model under an OpenAI ``tool_choice``.

    A local template cannot force a call, so ``"required"`` only shows the tools; a named function
    shows just that one; ``"none"`` hides them all.
    """
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        chosen = [t for t in tools if (t.get("function") or t).get("name") == name]
        if not chosen:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools given")
        return chosen
    return tools


# --------------------------------------------------------------------------- parsing


def _parse_call(body: str) -> ToolCall | None:
    """A ToolCall from the text inside one ``<tool_call>`` block, or None when no name is found."""
    body = body.strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall.make(obj["name"], args if isinstance(args, (dict, str)) else json.dumps(args))
    # Malformed JSON: salvage the name and keep the arguments text raw, so the tool layer can tell
    # the model exactly what was wrong.
    name = _NAME_RE.search(body)
    if not name:
        return None
    try:
        fn_name = json.loads(f'"{name.group(1)}"')
    except json.JSONDecodeError:
        fn_name = name.group(1)
    args_match = _ARGS_RE.search(body)
    raw_args = args_match.group(1).strip() if args_match else body
    if raw_args.endswith("}") and raw_args.count("}") > raw_args.count("{"):
        raw_args = raw_args[:-1].rstrip()  # the closing brace of the outer object
    return ToolCall.make(fn_name, raw_args)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, visible)``: the one rule for chain-of-thought markup, used by every backend and
    by the τ-bench orchestrator.

    Every ``<think>…</think>`` block is reasoning; a ``</think>`` before any ``<think>`` means the
    template opened the block in the prompt (Qwen3-style), so everything before it is reasoning; an
    unclosed ``<think>`` makes the rest reasoning (generation stopped mid-thought); a stray
    ``</think>`` left after that makes everything before it reasoning.
    """
    reasoning: list[str] = []
    visible = text
    close, open_ = visible.find(THINK_CLOSE), visible.find(THINK_OPEN)
    if close != -1 and (open_ == -1 or close < open_):
        reasoning.append(visible[:close])
        visible = visible[close + len(THINK_CLOSE):]
    while True:
        m = _THINK_BLOCK_RE.search(visible)
        if m is None:
            break
        reasoning.append(m.group(1))
        visible = visible[:m.start()] + visible[m.end():]
    if THINK_CLOSE in visible:
        head, visible = visible.rsplit(THINK_CLOSE, 1)
        reasoning.append(head)
    if THINK_OPEN in visible:
        visible, tail = visible.split(THINK_OPEN, 1)
        reasoning.append(tail)
    joined = "\n".join(r.strip() for r in reasoning if r.strip())
    return joined or None, visible


def strip_reasoning(text: str | None) -> str:
    """The visible text of a reply (:func:`split_reasoning`'s second half), stripped."""
    return split_reasoning(text or "")[1].strip()


def parse_completion(text: str, end_markers: tuple[str, ...] = END_MARKERS,
                     tool_names: Collection[str] | None = None) -> AssistantMessage:
    """Raw completion text (markup included) -> an :class:`AssistantMessage`; never raises.

    ``tool_names``: when given, only calls naming one of these become tool calls; a block naming
    any other tool stays in the content as the text the model wrote (the server's rule: a reply
    may only call a tool the request offered)."""
    for marker in end_markers:
        idx = text.find(marker)
        if idx != -1:
            text = text[:idx]
    reasoning, rest = split_reasoning(text)
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(rest):
        call = _parse_call(m.group(1))
        if call is None or (tool_names is not None and call.function.name not in tool_names):
            continue  # no name at all, or a tool not offered: leave the block in the content as text
        kept.append(rest[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(rest[pos:])
    content = "".join(kept).strip()
    return AssistantMessage(content=content or None, tool_calls=calls or None, reasoning=reasoning)


# --------------------------------------------------------------------------- prompts: content is text, never control


def control_strings(tokenizer: Any) -> tuple[str, ...]:
    """Every string the tokenizer turns into one control token: its added tokens (special or not:
    ``<|im_end|>``, ``<|im_start|>``, and Qwen's ``<tool_call>``/``<tool_response>``, which are
    added but not "special") and its special tokens. Longest first, so a regex prefers the longest."""
    cached = getattr(tokenizer, "_closedloop_control_strings", None)
    if cached is not None:
        return cached
    found: set[str] = set()
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tok in decoder.values():
        found.add(str(getattr(tok, "content", tok)))
    found.update(str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or []))
    strings = tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))
    try:
        tokenizer._closedloop_control_strings = strings
    except Exception:  # noqa: BLE001 - a tokenizer that refuses attributes just recomputes
        pass
    return strings


def control_ids(tokenizer: Any) -> set[int]:
    """The ids of :func:`control_strings` (what content must never tokenise to)."""
    ids = {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}
    ids.update(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
    return ids


class _Escaper:
    """Replaces control strings found in content by placeholders that no caller can type (a random
    nonce per prompt), so the chat template renders them as ordinary text positions; the
    placeholders are tokenised afterwards as plain text (:func:`plain_text_ids`)."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.nonce = secrets.token_hex(8)
        self.pattern = re.compile("|".join(re.escape(m) for m in markers)) if markers else None
        self.found: list[str] = []

    def text(self, s: str) -> str:
        if self.pattern is None or self.pattern.search(s) is None:
            return s

        def sub(m: re.Match) -> str:
            self.found.append(m.group(0))
            return f"CLESC{self.nonce}N{len(self.found) - 1}Z"

        return self.pattern.sub(sub, s)

    def value(self, v: Any, key: str | None = None) -> Any:
        if isinstance(v, str):
            return v if key == "role" else self.text(v)  # roles are our fixed literals
        if isinstance(v, dict):
            return {(self.text(k) if isinstance(k, str) else k): self.value(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [self.value(x) for x in v]
        return v

    def split(self, rendered: str) -> list[tuple[bool, str]]:
        """``(is_content_marker, text)`` pieces of the rendered prompt, in order."""
        pieces: list[tuple[bool, str]] = []
        pos = 0
        for m in re.finditer(rf"CLESC{self.nonce}N(\d+)Z", rendered):
            if m.start() > pos:
                pieces.append((False, rendered[pos:m.start()]))
            pieces.append((True, self.found[int(m.group(1))]))
            pos = m.end()
        if pos < len(rendered):
            pieces.append((False, rendered[pos:]))
        return pieces


def plain_text_ids(tokenizer: Any, text: str, forbidden: set[int] | None = None) -> list[int]:
    """``text`` tokenised as plain text: no id in ``forbidden`` (default: :func:`control_ids`).

    ``split_special_tokens`` stops special tokens from matching but not the tokenizer's other added
    tokens (Qwen's ``<tool_call>``), so a piece that still yields one is split in two and each half
    tokenised alone, down to single characters.
    """
    forbidden = control_ids(tokenizer) if forbidden is None else forbidden
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)]
    if len(text) <= 1 or not any(i in forbidden for i in ids):
        return ids
    mid = len(text) // 2
    return plain_text_ids(tokenizer, text[:mid], forbidden) + plain_text_ids(tokenizer, text[mid:], forbidden)


def encode_prompt(tokenizer: Any, messages: list, tools: list[dict[str, Any]] | None = None,
                  tool_choice: Any = None) -> list[int]:
    """The exact prompt token ids a local model sees (chat template, shown tools, generation prompt).

    Text that the caller, a user or a tool wrote (message content, tool results, tool-call names
    and arguments, tool schemas) is always tokenised as plain text: a ``<|im_end|>`` or
    ``<|im_start|>system`` typed into it can never become a control token and forge a turn. Only the
    template's own markup gives control tokens. Prompts without such text are tokenised exactly as
    ``apply_chat_template(tokenize=True)`` does; with it, the template is rendered with a placeholder
    at each occurrence, the markup around is tokenised normally and each occurrence as plain text
    (what mistral-common and tiktoken's ``disallowed_special`` do by construction).
    """
    return encode_rendered(tokenizer, render_messages(messages), select_tools(tools, tool_choice))


def encode_rendered(tokenizer: Any, rendered: list[dict[str, Any]], shown: list[dict[str, Any]] | None = None, *,
                    chat_template: str | None = None) -> list[int]:
    """:func:`encode_prompt` for messages already rendered as template dicts (a multimodal prompt's
    parts included), with an optional chat template other than the tokenizer's (a processor's)."""
    kw = {"chat_template": chat_template} if chat_template else {}
    escaper = _Escaper(control_strings(tokenizer))
    rendered = escaper.value(rendered)
    shown = escaper.value(shown) if shown is not None else None
    if not escaper.found:
        ids = tokenizer.apply_chat_template(rendered, tools=shown, add_generation_prompt=True, tokenize=True, **kw)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = tokenizer.apply_chat_template(rendered, tools=shown, add_generation_prompt=True, tokenize=False, **kw)
    forbidden = control_ids(tokenizer)
    out: list[int] = []
    for is_content, piece in escaper.split(text):
        if is_content:
            out.extend(plain_text_ids(tokenizer, piece, forbidden))
        else:
            out.extend(int(i) for i in tokenizer.encode(piece, add_special_tokens=False))
    return out


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    """Token ids to text with special tokens kept: the inverse the token-exact turn record relies on."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
