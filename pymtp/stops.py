"""Stop-sequence matching on streamed text, usable without HTTP.

Text is held back only while it could still be the start of a stop string, so a client
never sees part of a stop string, and text before a stop is never delayed longer than
that.

A request with tools matches its stop strings in the reply's text only, not inside a
tool call's block (``Stops.outside``): a stop string that is also JSON's or markup's
(``"``, a newline, a key) would cut the call, leaving neither a call nor readable text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stops:
    """Stop strings that do not match between ``outside``'s two markers (a tool call's
    ``<tool_call>`` and ``</tool_call>``); a stop string that starts before an opening
    marker still ends the text there."""

    strings: tuple[str, ...]
    outside: tuple[str, str]


def _held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopMatcher:
    """Feed text pieces; get back the text safe to emit and whether a stop string was hit."""

    def __init__(self, stops: Stops | list[str] | tuple[str, ...] | None) -> None:
        self.outside = stops.outside if isinstance(stops, Stops) else None
        stops = stops.strings if isinstance(stops, Stops) else stops
        self.stops = tuple(s for s in (stops or ()) if s)
        self.buffer = ""
        self.inside = False                 # between ``outside``'s markers, where no stop matches
        self.matched: str | None = None     # the stop string that ended the text, once one has

    def feed(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        self.buffer += piece
        out = []
        while True:
            if self.inside:        # out to the closing marker, holding what may begin it
                end = self.buffer.find(self.outside[1])
                if end < 0:
                    out.append(self._release((self.outside[1],)))
                    return "".join(out), False
                self.inside = False
                out.append(self._take(end + len(self.outside[1])))
                continue
            hits = [(i, s) for i, s in ((self.buffer.find(s), s) for s in self.stops) if i >= 0]
            opened = self.buffer.find(self.outside[0]) if self.outside else -1
            if opened >= 0 and not any(i < opened for i, _ in hits):
                self.inside = True
                out.append(self._take(opened + len(self.outside[0])))
                continue
            if self.outside and opened < 0:     # a stop inside what may yet open a block waits for it
                maybe = len(self.buffer) - _held_suffix(self.buffer, self.outside[:1])
                hits = [(i, s) for i, s in hits if i < maybe]
            if hits:
                at, self.matched = min(hits, key=lambda hit: hit[0])    # the first found; a tie: the first listed
                out.append(self.buffer[:at])
                self.buffer = ""
                return "".join(out), True
            out.append(self._release(self.stops + (self.outside[:1] if self.outside else ())))
            return "".join(out), False

    def _take(self, n: int) -> str:
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def _release(self, held: tuple[str, ...]) -> str:
        """The buffer but its longest end that may begin one of ``held``."""
        return self._take(len(self.buffer) - _held_suffix(self.buffer, held))

    def flush(self) -> str:
        """At the end of generation, what was held back is ordinary text."""
        out, self.buffer = self.buffer, ""
        return out
