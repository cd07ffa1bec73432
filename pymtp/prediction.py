"""OpenAI's Predicted Outputs: drafts read from a text the caller expects the reply to repeat.

A request may carry a prediction (``DecodeParams.prediction``; a chat completion's
``prediction`` field): the file being edited, say, when most of the reply is that file
again. Where the reply runs along the prediction, its next tokens are drafts at least as
good as the MTP head's, and they cost no drafter decode; where the reply leaves it, the
head drafts again, until the reply's last few tokens are found in the prediction once
more and the drafts follow it from there.

Pure policy, no llama.cpp: which drafts, from the tokens a sequence emitted. Lossless
as every draft is: a verify round keeps a draft only where the target would have made it
(greedy: its argmax; sampling: rejection sampling with q the point mass on the draft,
acceptance.rejection_accept).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# tokens of the reply's tail looked for in the prediction once the reply has left it:
# the longest match wins; a single token (a newline, a space) would match almost anywhere.
# Each re-sync the reply leaves at once asks one token more of the next (up to RESYNC_MAX):
# a prediction whose short matches lead nowhere (repeated lines that go on differently)
# would otherwise take every round from the MTP head for a draft that is rejected.
RESYNC_MAX = 4
RESYNC_MIN = 2


class Prediction:
    """Where one sequence's reply stands in its predicted tokens.

    ``cursor`` is the index of the token the reply should emit next if it keeps to the
    prediction (0 before the first token: a reply is expected to start where the
    prediction does), or None once it left and was not found again."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int32)
        self._ids = self.tokens.tolist()          # for the per-token walk (no numpy scalars)
        self.cursor: int | None = 0 if self._ids else None
        self.tail: list[int] = []                 # the reply's last RESYNC_MAX tokens
        self.left_at = 0                          # where the reply last left the prediction
        self.misses = 0                           # re-syncs in a row the reply left at once
        self._fresh = False                       # the cursor comes from a re-sync, untested

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` drafts: the prediction's tokens from the cursor (none when off it)."""
        if self.cursor is None or k <= 0:
            return []
        return self._ids[self.cursor: self.cursor + k]

    def advance(self, emitted: Sequence[int]) -> None:
        """The sequence emitted these tokens: follow them along the prediction, or, where
        they leave it, look for the reply's tail in it (``resync``)."""
        ids, c = self._ids, self.cursor
        for t in emitted:
            if c is not None and c < len(ids) and ids[c] == t:
                c += 1
                self.misses, self._fresh = 0, False
            elif c is not None:
                if self._fresh:
                    self.misses += 1
                self.left_at, c, self._fresh = c, None, False
        self.tail = (self.tail + [int(t) for t in emitted])[-RESYNC_MAX:]
        if c is None:
            c = self.resync()
            self._fresh = c is not None
        self.cursor = c

    def resync(self) -> int | None:
        """Where the prediction goes on after the reply's tail: the longest of its last
        RESYNC_MAX..RESYNC_MIN (+ misses) tokens found there; among equal matches the first
        at or after where the reply left (an edit replaces or inserts, then the text goes
        on), else the last before it. None where no such match exists."""
        tail, tokens = self.tail, self.tokens
        least = min(RESYNC_MIN + self.misses, RESYNC_MAX)
        if len(tail) < least or tokens.size < least:
            return None
        # ends[j]: the match of the tail's last token ends at index ends[j] (exclusive)
        ends = np.flatnonzero(tokens == tail[-1]) + 1
        best = None
        for n in range(2, min(RESYNC_MAX, len(tail)) + 1):
            ends = ends[ends >= n]
            ends = ends[tokens[ends - n] == tail[-n]]
            if ends.size == 0:
                break
            if n >= least:
                best = ends
        if best is not None:      # a match at the very end leaves nothing to draft
            best = best[best < tokens.size]
        if best is None or best.size == 0:
            return None
        later = best[best - 1 >= self.left_at]       # the match's last token at or after the exit
        return int(later[0]) if later.size else int(best[-1])
