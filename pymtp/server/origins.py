"""The ``pymtp`` extension of streamed chunks: how every token came, when a request asks.

A streamed completion or chat request with ``"pymtp": {"origins": true}`` gets, in every
chunk that carries generated tokens, a field OpenAI's chunks do not have::

    "pymtp": {"drafted": 3, "accepted": 2,            # the verify round behind the tokens
              "tokens": [1234, 56, 789],               # their ids
              "origins": ["d1", "d2", "recovered"],    # pymtp/origins.py names them
              "pieces": [["def", "d1"], [" f", "d2"], ["(", "recovered"]]}

``pieces`` splits the chunk's text by the token each character came from: the text as
the model wrote it, so a chat reply's thinking is in it too (the delta splits it off as
``reasoning_content``). It may hold text of an earlier chunk's tokens that the stream
held back (a possible stop string, half a character). Every round of the generation gets its
chunk, text or not, so summing ``drafted`` and ``accepted`` over the rounds with drafts
gives the response's ``timings.draft_n`` and ``draft_n_accepted``. Without the field,
nothing changes: an OpenAI client never sees it unless it asked.
"""

from __future__ import annotations

from typing import Any, Callable

from ..results import Chunk
from ..origins import TextOrigins, token_origins
from .errors import invalid

OPTIONS = ("origins",)


def wants_origins(body: dict, stream: bool) -> bool:
    """Whether the request body asks for the extension; a malformed ask is a 400 naming it."""
    ask: Any = body.get("pymtp")
    if ask is None:
        return False
    if not isinstance(ask, dict):
        raise invalid('pymtp must be an object such as {"origins": true}', "pymtp", "invalid_type")
    unknown = sorted(set(ask) - set(OPTIONS))
    if unknown:
        raise invalid(f"pymtp.{unknown[0]} is not a pymtp option; the options are: {', '.join(OPTIONS)}",
                      f"pymtp.{unknown[0]}")
    origins = ask.get("origins")
    if origins is None:
        return False
    if not isinstance(origins, bool):
        raise invalid("pymtp.origins must be a boolean", "pymtp.origins", "invalid_type")
    if origins and not stream:
        raise invalid("pymtp.origins is sent with the chunks of a stream; set stream: true",
                      "pymtp.origins")
    return origins


class OriginWriter:
    """The ``pymtp`` field of each chunk of one stream."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self.text = TextOrigins(token_bytes)

    def of(self, chunk: Chunk) -> dict:
        origins = token_origins(chunk.drafted, chunk.accepted, len(chunk.tokens), chunk.predicted)
        self.text.feed(chunk.tokens, origins, final=chunk.finish_reason is not None)
        return {"drafted": chunk.drafted, "accepted": chunk.accepted, "predicted": chunk.predicted,
                "tokens": list(chunk.tokens), "origins": origins, "pieces": self.text.split(chunk.text)}
