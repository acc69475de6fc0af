"""The controller's control-token grammar (LLM Orchestration, paper 4).

The controller writes only control tokens, one action after another; routing is therefore
explicit and auditable, and anything else is rejected (the controller is re-prompted with the
reason). The grammar::

    program  := ws action (ws action)* ws
    action   := call | speak | listen | interrupt
    call     := '<call expert="' NAME '"' [' source="' SOURCE '"'] '>' QUERY '</call>'
    speak    := '<speak>' TEXT '</speak>'
    listen   := '<listen/>'
    interrupt:= '<interrupt/>'
    SOURCE   := ('image' | 'audio' | 'video') ':' INDEX        # the INDEX-th input of that kind

Semantics: ``call`` runs an expert (in the order written: the sequence is the order); its output
comes back as a memory record and the controller continues. ``speak`` says TEXT to the user (text
and speech) and ends the controller's turn; ``listen`` yields the turn without speaking;
``interrupt`` stops what the system is saying (used when the user barges in). A program ends
with at most one of speak/listen/interrupt, which must be its last action.

Validation (:func:`parse_program`) checks the tokens, that every expert is configured, that a
source exists and has the expert's modality, and the ordering rule; an error says exactly what is
wrong, which is what the re-prompt shows the controller.
"""

from __future__ import annotations

import re
from typing import Literal, Union

from pydantic import BaseModel

__all__ = ["Call", "Speak", "Listen", "Interrupt", "Action", "GrammarError", "parse_program", "GRAMMAR_HELP"]


class Call(BaseModel):
    kind: Literal["call"] = "call"
    expert: str
    source: str | None = None
    query: str


class Speak(BaseModel):
    kind: Literal["speak"] = "speak"
    text: str


class Listen(BaseModel):
    kind: Literal["listen"] = "listen"


class Interrupt(BaseModel):
    kind: Literal["interrupt"] = "interrupt"


Action = Union[Call, Speak, Listen, Interrupt]


class GrammarError(ValueError):
    """The controller's output is not a valid program; the message is the re-prompt's reason."""


GRAMMAR_HELP = ('Reply only with control tokens: <call expert="NAME" source="image:0">question</call> to ask an '
                'expert (source optional), then finish with <speak>answer</speak>, or <listen/>, or <interrupt/>.')

_TOKEN = re.compile(
    r'<call\s+expert="(?P<expert>[A-Za-z0-9_\-]+)"(?:\s+source="(?P<source>[a-z]+:\d+)")?\s*>(?P<query>.*?)</call>'
    r'|<speak>(?P<speak>.*?)</speak>'
    r'|<listen\s*/>|<interrupt\s*/>', re.DOTALL)


def parse_program(text: str, experts: dict[str, str], sources: dict[str, int]) -> list[Action]:
    """Parse and validate a controller output.

    ``experts``: configured expert name -> the modality it reads ("image", "audio", "video" or
    "text"); ``sources``: how many inputs of each modality the turn has.
    """
    actions: list[Action] = []
    pos = 0
    text = text or ""
    for m in _TOKEN.finditer(text):
        gap = text[pos:m.start()]
        if gap.strip():
            raise GrammarError(f"text outside control tokens: {gap.strip()[:60]!r}. {GRAMMAR_HELP}")
        pos = m.end()
        tok = m.group(0)
        if m.group("expert") is not None:
            name, source, query = m.group("expert"), m.group("source"), m.group("query").strip()
            if name not in experts:
                raise GrammarError(f"unknown expert {name!r}; configured: {', '.join(sorted(experts))}")
            if not query:
                raise GrammarError(f"<call expert=\"{name}\"> has an empty query")
            want = experts[name]
            if source is not None:
                kind, idx = source.split(":")
                if sources.get(kind, 0) <= int(idx):
                    raise GrammarError(f"source {source!r} does not exist; this turn has "
                                       f"{', '.join(f'{v} {k}' for k, v in sources.items() if v) or 'no media'}")
                if want != "text" and kind != want:
                    raise GrammarError(f"expert {name!r} reads {want}, not {kind} ({source})")
            elif want in ("image", "audio", "video"):
                raise GrammarError(f"expert {name!r} reads {want}: give source=\"{want}:N\"")
            actions.append(Call(expert=name, source=source, query=query))
        elif m.group("speak") is not None:
            if not m.group("speak").strip():
                raise GrammarError("<speak> is empty")
            actions.append(Speak(text=m.group("speak").strip()))
        elif tok.startswith("<listen"):
            actions.append(Listen())
        else:
            actions.append(Interrupt())
    if text[pos:].strip():
        raise GrammarError(f"text outside control tokens: {text[pos:].strip()[:60]!r}. {GRAMMAR_HELP}")
    if not actions:
        raise GrammarError(f"no control tokens. {GRAMMAR_HELP}")
    for a in actions[:-1]:
        if not isinstance(a, Call):
            raise GrammarError(f"<{a.kind}> must be the last action of a reply")
    return actions
