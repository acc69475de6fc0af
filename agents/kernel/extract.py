"""Code out of model replies, and the reference problem out of a user message.

KernelBench's own harness takes the first fenced block of the reply. Replies often show a draft
or a usage snippet too, so we take the first ``python`` block *that defines* ``ModelNew``
(``which="last"`` takes the last such block, for models that revise as they go). A reply
without a usable block is not an evaluation: it gets a :class:`CodeExtractionError` whose text
tells the model what to send instead.
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = ["CodeExtractionError", "extract_code", "extract_problem", "defines_class"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
_PY_LANGS = {"", "python", "py", "python3"}


class CodeExtractionError(ValueError):
    """The reply holds no candidate the evaluator could run; ``str(e)`` is written for the model."""


def defines_class(source: str, name: str) -> bool:
    """Whether ``source`` has a top-level ``class <name>`` (a regex, so code with syntax errors
    still counts: the evaluator, not the extractor, reports those with the compiler's message)."""
    return re.search(rf"^class\s+{re.escape(name)}\b", source, re.M) is not None


def _python_blocks(text: str) -> list[str]:
    return [body for lang, body in _FENCE.findall(text) if lang.lower() in _PY_LANGS]


def extract_code(text: str, *, which: Literal["first", "last"] = "first", class_name: str = "ModelNew") -> str:
    """The candidate module in a reply: a fenced python block defining ``class ModelNew``.

    A reply with no fences at all that still defines the class at top level is taken whole.
    Raises :class:`CodeExtractionError` with an instruction for the model otherwise.
    """
    if which not in ("first", "last"):
        raise ValueError(f"which must be 'first' or 'last', got {which!r}")
    text = text or ""
    blocks = _python_blocks(text)
    found = [b for b in blocks if defines_class(b, class_name)]
    if found:
        return (found[0] if which == "first" else found[-1]).strip("\n") + "\n"
    if "```" not in text and defines_class(text, class_name):
        return text.strip("\n") + "\n"
    opened = len(re.findall(r"```[ \t]*(?:python|py)\b", text, re.I))
    if opened > len(blocks) or text.count("```") % 2:
        raise CodeExtractionError("your code block is not closed (was the reply cut off?). Reply with the complete "
                                  f"module defining `class {class_name}` in one ```python block, and keep it shorter.")
    if blocks:
        raise CodeExtractionError(f"none of your ```python blocks defines `class {class_name}(nn.Module)`. Reply with "
                                  f"the complete module (imports, kernel source, `class {class_name}`) in one block.")
    raise CodeExtractionError(f"your reply has no ```python code block. Reply with the complete module defining "
                              f"`class {class_name}(nn.Module)` in one ```python block.")


def extract_problem(text: str) -> str:
    """The reference architecture (``class Model`` plus ``get_inputs``/``get_init_inputs``) in a
    user message: a fenced python block defining ``Model``, or the whole text if it defines it."""
    for block in _python_blocks(text or ""):
        if defines_class(block, "Model"):
            return block.strip("\n") + "\n"
    if defines_class(text or "", "Model"):
        return text.strip("\n") + "\n"
    raise ValueError("no reference architecture found: the input must contain the problem's source "
                     "(a module defining `class Model`, `get_inputs` and `get_init_inputs`)")
