"""FactGuard prompts and the answer format ``<think>…</think><answer>real|fake</answer>``."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel

Label = Literal["real", "fake"]

STAGE1_SYSTEM_PROMPT = (
    "You check short videos for misinformation. You get the video's frames, its speech transcript and its "
    "metadata. Think step by step inside <think></think>. If the evidence is ambiguous, call a tool: "
    "factprobe searches for outside evidence about a claim; clipscout shows four frames of one time span "
    "(it works once per video). When you are sure, answer with <answer>real</answer> or <answer>fake</answer>.")

STAGE2_INSTRUCTION = ("Now reason over the tool results inside <think></think> and give your final answer as "
                      "<answer>real</answer> or <answer>fake</answer>.")

_ANSWER = re.compile(r"<answer>\s*(real|fake)\s*</answer>", re.IGNORECASE)
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


class Verdict(BaseModel):
    """What an answer says: the label (None when there is no valid ``<answer>``) and whether the
    whole format holds (a ``<think>`` block before exactly one ``<answer>``, as R_format requires)."""

    label: Label | None
    well_formed: bool
    reasoning: str | None = None


def parse_verdict(text: str | None, reasoning: str | None = None) -> Verdict:
    """Read an answer. ``reasoning``: a ``<think>`` block the backend already split off the content
    (local backends do), which counts as the think part of the format."""
    text = text or ""
    answers = list(_ANSWER.finditer(text))
    label = answers[-1].group(1).lower() if answers else None
    think = _THINK.search(text)
    if reasoning and reasoning.strip():
        think_ok = True  # the backend split the <think> block off the content
    else:
        think_ok = bool(think and think.group(1).strip() and answers and think.end() <= answers[0].start())
    return Verdict(label=label, well_formed=think_ok and len(answers) == 1,
                   reasoning=(think.group(1).strip() if think else None) or reasoning)


def sample_prompt(metadata: str, transcript: str | None) -> str:
    """The user turn's text (frames go beside it as images when the model reads images)."""
    parts = [f"Video metadata: {metadata.strip() or '(none)'}",
             f"Speech transcript: {(transcript or '').strip() or '(no speech)'}",
             "Is this video real or fake?"]
    return "\n".join(parts)
