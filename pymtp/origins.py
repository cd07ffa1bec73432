"""How each generated token came to be, and which characters of the text each one made.

A verify round that checked k drafts and accepted a of them emits the accepted drafts
d_1..d_a, then one token the target chose itself (acceptance.py's vocabulary):

- ``"d1"``, ``"d2"``, ...: an accepted draft, by its position in the round's draft;
- ``"predicted"``: an accepted draft that came from the request's prediction (OpenAI's
  Predicted Outputs, pymtp/prediction.py), not from the MTP head;
- ``"recovered"``: the target's token at the first rejected draft (a < k);
- ``"bonus"``: the target's token after all k drafts were accepted (a == k > 0);
- ``"decoded"``: a round without drafts (plain decoding, a depth of 0 under
  ``draft_max="auto"``, and the first token, which comes from the prompt's last row).

The stop rules may cut a round's tokens short (an end-of-generation token, max_tokens, a
stop string); what remains is a prefix, so the names still hold position by position.

Text is not token-aligned: a character may span two tokens, and a stream holds text back
while it could still be a stop string. ``TextOrigins`` decodes the tokens as the stream
does and splits each released piece of text by the token that completed each character.
"""

from __future__ import annotations

import codecs
from collections import deque
from typing import Callable, Sequence

DECODED, RECOVERED, BONUS, PREDICTED = "decoded", "recovered", "bonus", "predicted"


def draft_origin(position: int) -> str:
    """The name of an accepted draft at 1-based ``position`` in its round."""
    return f"d{position}"


def token_origins(drafted: int, accepted: int, n_tokens: int, predicted: bool = False) -> list[str]:
    """The origin of each of the ``n_tokens`` a round emitted after the stop rules
    (``predicted``: its drafts were the request's prediction's)."""
    if not 0 <= accepted <= drafted:
        raise ValueError(f"a round accepts 0 to {drafted} drafts, got accepted={accepted}")
    if n_tokens > accepted + 1:
        raise ValueError(f"a round that accepted {accepted} drafts emits at most {accepted + 1} tokens, "
                         f"got {n_tokens}")
    last = DECODED if drafted == 0 else BONUS if accepted == drafted else RECOVERED
    if predicted:
        return [PREDICTED if i < accepted else last for i in range(n_tokens)]
    return [draft_origin(i + 1) if i < accepted else last for i in range(n_tokens)]


class TextOrigins:
    """Splits a stream's text by the origin of the token each character came from.

    Feed every chunk's tokens (``feed``), then split that chunk's text (``split``); the
    text of a stream is a prefix of its tokens' decoded bytes, which is all this needs.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending: deque[list[str]] = deque()      # [text, origin], oldest first
        self._last = DECODED

    def feed(self, tokens: Sequence[int], origins: Sequence[str], final: bool = False) -> None:
        """Decode ``tokens`` (``final``: the stream's last; flush an unfinished character)."""
        for token, origin in zip(tokens, origins, strict=True):
            self._add(self._decoder.decode(self._token_bytes(token)), origin)
        if final:
            self._add(self._decoder.decode(b"", final=True), self._last)

    def _add(self, text: str, origin: str) -> None:
        self._last = origin
        if text:
            self._pending.append([text, origin])

    def split(self, text: str) -> list[list[str]]:
        """``text`` (the next text the stream released) as ``[piece, origin]`` pairs, one
        per token it touches, in order; the pieces join to ``text``."""
        out, rest = [], text
        while rest:
            if not self._pending:
                raise ValueError(f"the stream released {rest!r}, which its tokens did not decode to")
            piece, origin = self._pending[0]
            if not rest.startswith(piece[: len(rest)]):
                raise ValueError(f"the stream released {rest!r} where its tokens decode to {piece!r}")
            n = min(len(piece), len(rest))
            out.append([piece[:n], origin])
            rest = rest[n:]
            if n == len(piece):
                self._pending.popleft()
            else:
                self._pending[0][0] = piece[n:]
        return out
