"""Stop-sequence matching on streamed text, usable without HTTP.

Text is held back only while it could still be the start of a stop string, so a client
never sees part of a stop string, and text before a stop is never delayed longer than
that.

A request with tools matches its stop strings in the reply's text only, not inside a
tool call's block (``Stops.outside``): a stop string that is also JSON's or markup's
(``"``, a newline, a key) would cut the call, leaving neither a call nor readable text.
A reply whose thinking is split off (``Stops.thinking``) has no calls in its leading
``<think>`` block, where stops match as in any text: a ``<tool_call>`` the model writes of
while thinking opens no block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _no_value(body: str) -> bool:
    return False


@dataclass(frozen=True)
class Stops:
    """Stop strings that do not match between ``outside``'s two markers (a tool call's
    ``<tool_call>`` and ``</tool_call>``), the markers included; a stop string that starts
    before an opening marker still ends the text there. ``in_value(body)``: whether a
    block's text so far ends inside a value, where a closing marker is the value's text
    (tool_reply.in_value: a JSON string, an XML form's argument)."""

    strings: tuple[str, ...]
    outside: tuple[str, str]
    in_value: Callable[[str], bool] = _no_value
    # the text starts inside a <think> block (True), may start with one (False), or holds
    # none that is read apart (None: every marker counts): reasoning.reply_split's answer
    thinking: bool | None = None


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"     # a reasoning model's block (reasoning.py)
# where the text is with regard to its leading think block: may it open one, in one, past it
_MAYBE, _THINKING, _PAST = "maybe", "thinking", "past"


def held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopMatcher:
    """Feed text pieces; get back the text safe to emit and whether a stop string was hit.
    The text and the hit do not depend on how the text is cut into pieces."""

    def __init__(self, stops: Stops | list[str] | tuple[str, ...] | None) -> None:
        self.outside = stops.outside if isinstance(stops, Stops) else None
        self.in_value = stops.in_value if isinstance(stops, Stops) else _no_value
        thinking = stops.thinking if isinstance(stops, Stops) else None
        self.think = _PAST if thinking is None else _THINKING if thinking else _MAYBE
        stops = stops.strings if isinstance(stops, Stops) else stops
        self.stops = tuple(s for s in (stops or ()) if s)
        self.buffer = ""
        self.inside = False                 # between ``outside``'s markers, where no stop matches
        self.block = ""                     # the open block's text handed out so far
        self.matched: str | None = None     # the stop string that ended the text, once one has

    def feed(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        self.buffer += piece
        return self._scan(final=False)

    def end(self) -> tuple[str, bool]:
        """At the end of generation, what was held back, cut at a stop string it holds
        (one that waited for a marker that never came); the rest is ordinary text."""
        if not self.stops:
            return "", False
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str, bool]:
        """The buffer's text up to where the next piece could change what it is: a stop, a
        block's marker, or either's start (none once ``final``)."""
        out = []
        while True:
            n = len(self.buffer)
            if self.think == _MAYBE:      # a block at the start, after white space, or none
                head = self.buffer.lstrip()
                if head.startswith(THINK_OPEN):
                    self.think = _THINKING
                elif not final and THINK_OPEN.startswith(head):
                    return "".join(out), False
                else:
                    self.think = _PAST
                continue
            if self.think == _THINKING:
                text, hit, past = self._thinking(final)
                out.append(text)
                if past:
                    continue
                return "".join(out), hit
            if self.inside:        # out to the closing marker, holding what may begin it
                close = self.outside[1]
                end = self.buffer.find(close)
                while end >= 0 and self.in_value(self.block + self.buffer[:end]):
                    end = self.buffer.find(close, end + 1)
                if end < 0:
                    text = self._take(n if final else n - held_suffix(self.buffer, (close,)))
                    self.block += text
                    out.append(text)
                    return "".join(out), False
                self.inside = False
                out.append(self._take(end + len(close)))
                continue
            hits = sorted((i, k, s) for k, s in enumerate(self.stops) if (i := self.buffer.find(s)) >= 0)
            stop_at = hits[0][0] if hits else n       # the first found; a tie: the first listed
            opened = self.buffer.find(self.outside[0]) if self.outside else -1
            may_stop = n if final else n - held_suffix(self.buffer, self.stops)
            may_open = n if final or not self.outside else n - held_suffix(self.buffer, self.outside[:1])
            if 0 <= opened <= stop_at:          # a block first (a tie: its marker) ...
                if may_stop >= opened:          # ... unless a stop begun before it may yet end
                    self.inside, self.block = True, ""
                    out.append(self._take(opened + len(self.outside[0])))
                    continue
            elif hits and may_stop >= stop_at and may_open > stop_at:
                self.matched = hits[0][2]
                out.append(self.buffer[:stop_at])
                self.buffer = ""
                return "".join(out), True
            # a stop or a marker may yet begin first: wait for the next piece
            out.append(self._take(min(may_stop, may_open)))
            return "".join(out), False

    def _thinking(self, final: bool) -> tuple[str, bool, bool]:
        """Inside the leading think block, where stops match and no marker opens a call:
        the text up to its end tag, or to a stop, or to what may yet begin either; whether
        a stop ended it; whether the block ended."""
        n = len(self.buffer)
        hits = sorted((i, k, s) for k, s in enumerate(self.stops) if (i := self.buffer.find(s)) >= 0)
        stop_at = hits[0][0] if hits else n
        may_stop = n if final else n - held_suffix(self.buffer, self.stops)
        close = self.buffer.find(THINK_CLOSE)
        end = close + len(THINK_CLOSE) if close >= 0 else -1
        if close >= 0 and stop_at >= end and may_stop >= end:     # no stop begins inside the block
            self.think = _PAST
            return self._take(end), False, True
        if hits and may_stop >= stop_at:
            self.matched = hits[0][2]
            text, self.buffer = self.buffer[:stop_at], ""
            return text, True, False
        may_close = close if close >= 0 else n if final else n - held_suffix(self.buffer, (THINK_CLOSE,))
        return self._take(min(may_stop, may_close)), False, False

    def _take(self, n: int) -> str:
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out
