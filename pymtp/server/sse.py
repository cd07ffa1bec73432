"""Server-sent events: ``data: {json}\\n\\n`` frames and a response that always cleans up."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def named_event(obj: dict) -> bytes:
    """``event: TYPE`` then the data: the frame of Anthropic's and OpenAI's Responses streams,
    whose objects name their own type."""
    return f"event: {obj['type']}\n".encode() + event(obj)


class SSEResponse(StreamingResponse):
    """A stream of events that calls ``on_close`` however it ends.

    When a client disconnects, Starlette cancels the task that drives the body iterator
    but does not close the iterator, so cleanup placed inside it may never run;
    ``on_close`` runs here instead, as soon as the response is over.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
