"""HEAD on every GET route, as llama-server answers it (cpp-httplib serves HEAD with the
GET handler): uptime checkers and load balancers probe /v1/models or /props with it, and
FastAPI's routes answer HEAD with 405 unless told route by route."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    """Route a HEAD request as its GET and send the GET's status and headers (its
    Content-Length included, as HTTP asks) without the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
