"""The streamed-text matcher (closedloop.server.stream_text): the same visible text as the direct
rule, for any chunking, and work linear in the text whatever the markers (issue 26: one stream
with long stop strings held the event loop for 15-42 s)."""

from __future__ import annotations

import random

import pytest

from closedloop.server.stream_text import MarkerAutomaton, VisibleText

MARKERS = ("<tool_call>", "<think>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def direct_visible(raw: str, markers: tuple[str, ...]) -> str:
    """The rule stated directly (the server's former per-token code, quadratic): text before the
    first marker, a possible partial marker at the end held back, stripped."""
    cut = min((i for i in (raw.find(m) for m in markers) if i != -1), default=len(raw))
    text = raw[:cut]
    if cut == len(raw):
        hold = max((k for m in markers for k in range(1, min(len(m) - 1, len(text)) + 1) if text.endswith(m[:k])),
                   default=0)
        text = text[:len(text) - hold]
    return text.strip()


def _chunks(rng: random.Random, text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 7, 20])
        out.append(text[i:i + n])
        i += n
    return out


def _no_marker_inside_another(markers: tuple[str, ...]) -> bool:
    return not any(a != b and a in b for a in markers for b in markers)


@pytest.mark.parametrize("seed", range(40))
def test_same_text_as_the_direct_rule_for_any_chunking(seed):
    rng = random.Random(seed)
    alphabet = "ab< |>\n_"
    while True:  # overlapping prefixes on purpose; the rules agree unless one marker lies inside another
        stops = tuple(dict.fromkeys("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
                                    for _ in range(rng.randint(0, 4))))
        markers = tuple(dict.fromkeys(MARKERS + stops))
        if _no_marker_inside_another(markers):
            break
    pieces = [rng.choice(["a", "b", " ", "\n", "<", "|", ">", "_", "<tool_ca", "<|im_", "<think", *stops])
              for _ in range(rng.randint(0, 60))]
    raw = "".join(pieces)
    visible = VisibleText(markers)
    seen = ""
    for chunk in _chunks(rng, raw):
        seen += chunk
        visible.feed(chunk)
        assert visible.sent() == direct_visible(seen, markers), (markers, seen)


def test_text_is_sent_as_it_becomes_certain():
    visible = VisibleText(MARKERS + ("STOP",))
    assert visible.feed("  Hello") == "Hello"  # leading space never reaches content
    assert visible.feed(" wor") == " wor"
    assert visible.feed("ld ST") == "ld"  # "ST" may start STOP; the space may end the content
    assert visible.feed("ar ") == " STar"
    assert visible.feed("<tool_") == ""
    assert visible.feed("call>{}") == ""
    assert visible.done and visible.sent() == "Hello world STar"
    assert visible.feed("more") == ""


def test_the_marker_that_completes_first_ends_the_text():
    """"bc" lies inside "abcd": the stream stops at "bc", as the backend stops generating there."""
    visible = VisibleText(("abcd", "bc"))
    assert visible.feed("xabcd") == "xa" and visible.done


def test_automaton_reports_the_longest_marker_ending_at_each_state():
    auto = MarkerAutomaton(("he", "she", "his", "hers"))
    state, found = 0, []
    for ch in "ushers":
        while state and ch not in auto.goto[state]:
            state = auto.fail[state]
        state = auto.goto[state].get(ch, 0)
        found.append(auto.ends[state])
    assert found == [0, 0, 0, 3, 0, 4]  # "she" (and "he") at the 4th character, "hers" at the last


HOSTILE = [
    # a stop string the text keeps almost completing: the old code sliced it ~1000 times per token
    (("a" * 1023 + "b",), lambda n: "a" * n),
    # a long stop string nothing matches: every partial check failed only at its last character
    (("x" * 1024,), lambda n: "y" * n),
    # four stop strings of the longest length, sharing long prefixes, against text that follows them
    (tuple("ab" * 511 + c for c in "cdef"), lambda n: ("ab" * (n // 2 + 1))[:n]),
    # whitespace only: held back from the end of the content, never sent
    (("\n\nUser:",), lambda n: " " * n),
]


@pytest.mark.parametrize("stops,text", HOSTILE, ids=["near-miss", "no-match", "shared-prefixes", "whitespace"])
def test_work_is_linear_in_the_text_whatever_the_stop_strings(stops, text):
    """Each character costs at most: one transition plus one failure link (amortised), one copy
    into the buffer, one whitespace scan, one copy out, one move when the buffer is compacted; so
    at most 6 steps per character, whatever the markers. Fed a token at a time, as a backend
    streams: the former code did O(text x stop length) per token here."""
    markers = tuple(dict.fromkeys(MARKERS + stops))
    for n in (4_000, 40_000):
        visible = VisibleText(markers)
        raw = text(n)
        for i in range(0, n, 3):
            visible.feed(raw[i:i + 3])
        assert visible.work <= 6 * n, (visible.work, n)
        assert visible.sent() == direct_visible(raw, markers)
