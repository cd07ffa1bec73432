"""What a client may send: a body of at most ``max_bytes``, all of it within ``timeout``,
in no Content-Encoding (gzip and the like are not read: a 415, as llama-server answers).

Uvicorn bounds neither: it buffers whatever body arrives (a 50 MB body once took 43 s and
5.6 GB before the JSON parser refused it), and waits forever for a body shorter than its
Content-Length (its keep-alive timeout only runs between requests).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import body_timeout, shaped, too_large, unsupported_encoding


class BodyLimits:
    """ASGI middleware: a 413 for a body past ``max_bytes``, a 408 for one not in by ``timeout``.

    A declared Content-Length past the limit is refused before any of the body is read.
    A chunked body is counted as it arrives; a limit crossed while the route reads it
    raises the ``APIError`` there, so the usual handler answers in the OpenAI shape.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float,
                 on_error: Callable[[str], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        coding = _header(scope, b"content-encoding")
        if coding is not None and coding.strip().lower() not in (b"", b"identity"):
            exc = unsupported_encoding(coding.decode("latin-1"))
            self.on_error(exc.type)
            await JSONResponse(shaped(scope.get("path", ""), exc), exc.status, exc.headers)(scope, receive, send)
            return
        if declared is not None and declared > self.max_bytes:
            exc = too_large(self.max_bytes)
            self.on_error(exc.type)
            await JSONResponse(shaped(scope.get("path", ""), exc), exc.status, exc.headers)(scope, receive, send)
            return

        deadline = asyncio.get_running_loop().time() + self.timeout   # the headers are in
        received = 0
        body_done = False

        async def limited() -> Message:
            nonlocal received, body_done
            if body_done:          # later reads only wait for the disconnect: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise body_timeout(self.timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, limited, send)


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    return next((value for name, value in scope["headers"] if name == wanted), None)


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:     # the HTTP server refuses it before we are called
        return None
