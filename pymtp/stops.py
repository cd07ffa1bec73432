"""Stop-sequence matching on streamed text, usable without HTTP.

Text is held back only while it could still be the start of a stop string, so a client
never sees part of a stop string, and text before a stop is never delayed longer than
that.
"""

from __future__ import annotations


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

    def __init__(self, stops: list[str] | tuple[str, ...] | None) -> None:
        stops = tuple(s for s in (stops or ()) if s)
        self.stops = stops
        self.buffer = ""
        self.matched: str | None = None     # the stop string that ended the text, once one has

    def feed(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        self.buffer += piece
        hits = [(i, s) for i, s in ((self.buffer.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])    # the first found; a tie: the first listed
            out = self.buffer[:at]
            self.buffer = ""
            return out, True
        keep = _held_suffix(self.buffer, self.stops)
        out = self.buffer[: len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return out, False

    def flush(self) -> str:
        """At the end of generation, what was held back is ordinary text."""
        out, self.buffer = self.buffer, ""
        return out
