"""Which part of a streamed completion a client may see yet, in time linear in the text.

A backend streams the raw completion: markup (``<tool_call>``, ``<think>``, end-of-turn tokens)
and the request's stop strings included. The final ``content`` ends before the first of them and
is stripped, so a streamed delta may only carry text that is certain to be in it: text before
any marker, minus a possible start of one at the end (``"<tool_ca"``) and minus surrounding
whitespace.

Recomputing that from the whole text at every token costs O(text x markers) per token, and
finding which partial marker the text ends with by slicing each marker costs O(marker length²):
with 1 MB stop strings one request held the event loop for tens of seconds. Here one Aho–Corasick
automaton over all markers reads each character once; its state is the longest suffix of the text
that is a prefix of some marker, which is exactly what must be held back. Work per character is
O(1) amortised (at most one failure link per character read), whatever the markers' lengths.

Hand-written rather than taken from ``pyahocorasick``: that library reports matches in a finished
string but exposes neither a resumable state nor its depth, which is what streaming needs, and it
would be a compiled dependency for ~60 lines.

When two markers overlap, the one that *completes* first ends the visible text (a backend stops
generating at the first stop string it sees); the two rules differ only when one marker is a
substring of another.
"""

from __future__ import annotations

import functools
import re
from collections import deque


class MarkerAutomaton:
    """Aho–Corasick over a fixed set of marker strings (immutable; shared between streams)."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        for marker in markers:
            state = 0
            for ch in marker:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto.append({})
                    depth.append(depth[state] + 1)
                    goto[state][ch] = nxt
                state = nxt
        ends = [0] * len(goto)  # length of the longest marker that ends at this state (0: none)
        for marker in markers:
            state = 0
            for ch in marker:
                state = goto[state][ch]
            ends[state] = len(marker)
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:  # breadth first: a state's failure link is shallower, so already final
            state = queue.popleft()
            for ch, nxt in goto[state].items():
                queue.append(nxt)
                back = fail[state]
                while back and ch not in goto[back]:
                    back = fail[back]
                fail[nxt] = goto[back].get(ch, 0) if state else 0
                ends[nxt] = ends[nxt] or ends[fail[nxt]]
        self.goto, self.fail, self.depth, self.ends = goto, fail, depth, ends
        # Outside any partial marker, only these characters can start one: the rest is skipped in C.
        firsts = "".join(sorted(goto[0]))
        self.first_char = re.compile(f"[{re.escape(firsts)}]") if firsts else None


@functools.lru_cache(maxsize=64)
def automaton(markers: tuple[str, ...]) -> MarkerAutomaton:
    """One automaton per marker set: agents repeat the same stop strings request after request."""
    return MarkerAutomaton(markers)


class VisibleText:
    """One streamed choice: :meth:`feed` the backend's raw text deltas and get back the deltas a
    client may be sent. Their concatenation is always the part of the final content known so far.

    ``work`` counts the elementary steps taken (automaton transitions and characters copied or
    scanned), so a test can check that the cost is linear in the text fed, not in wall time.
    """

    def __init__(self, markers: tuple[str, ...]) -> None:
        self._auto = automaton(markers)
        self._state = 0
        self._pos = 0  # characters fed
        self._buf: list[str] = []  # characters from _base on: neither sent nor dropped yet
        self._base = 0
        self._sent_to = 0  # text before this position is sent or dropped (leading whitespace)
        self._checked_to = 0  # text before this position is final and scanned for whitespace
        self._solid_to = 0  # end of the last non-whitespace character among the checked ones
        self._started = False  # a non-whitespace character was sent (leading whitespace is dropped)
        self._sent: list[str] = []
        self.done = False  # a marker appeared: nothing after it will ever be visible
        self.work = 0

    def feed(self, text: str) -> str:
        """The newly visible text after ``text`` (often empty: held back or after a marker)."""
        if self.done or not text:
            return ""
        auto, state, i, n = self._auto, self._state, 0, len(text)
        goto, fail, ends = auto.goto, auto.fail, auto.ends
        final_to = None
        while i < n:
            if state == 0 and auto.first_char is not None:
                m = auto.first_char.search(text, i)
                skip_to = n if m is None else m.start()
                self.work += skip_to - i
                i = skip_to
                if i == n:
                    break
            elif state == 0:
                self.work += n - i
                i = n
                break
            ch = text[i]
            while state and ch not in goto[state]:
                state = fail[state]
                self.work += 1
            state = goto[state].get(ch, 0)
            self.work += 1
            i += 1
            if ends[state]:
                final_to = self._pos + i - ends[state]  # the visible text ends where the marker starts
                break
        self._buf.extend(text[:i])
        self.work += i
        self._pos += i
        self._state = state
        if final_to is not None:
            self.done = True
            self._check(final_to)
        else:
            self._check(self._pos - auto.depth[state])
        return self._send()

    def sent(self) -> str:
        """Everything returned by :meth:`feed` so far, joined."""
        return "".join(self._sent)

    def _check(self, final_to: int) -> None:
        """Text before ``final_to`` can no longer turn into a marker: note its last non-space."""
        if final_to <= self._checked_to:
            return
        piece = "".join(self._buf[self._checked_to - self._base:final_to - self._base])
        self.work += len(piece)
        solid = len(piece.rstrip())
        if solid:
            self._solid_to = self._checked_to + solid
        self._checked_to = final_to

    def _send(self) -> str:
        if self._solid_to <= self._sent_to:
            return ""
        start = self._sent_to - self._base
        delta = "".join(self._buf[start:self._solid_to - self._base])
        self.work += len(delta)
        if not self._started:
            delta = delta.lstrip()
            self._started = True
        self._sent_to = self._solid_to
        dropped = self._sent_to - self._base
        if dropped > len(self._buf) // 2:  # compact now and then: amortised O(1) per character
            del self._buf[:dropped]
            self.work += len(self._buf)
            self._base = self._sent_to
        self._sent.append(delta)
        return delta


__all__ = ["MarkerAutomaton", "VisibleText", "automaton"]
