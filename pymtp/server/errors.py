"""Errors in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is an ``APIError`` with a 4xx status; the handlers here
turn it, Starlette's own HTTP errors and anything unexpected into that shape, so an
OpenAI client always finds a message it can show.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config import ParamError

log = logging.getLogger("pymtp.server")

CLIENT_CLOSED = 499    # nginx's status for "the client went away first"; nobody receives it


class APIError(Exception):
    """A request the server refuses, with the status and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, details: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.details = details or {}      # more fields of the error object (ParamError.details)

    def body(self) -> dict:
        body = error_body(self.message, self.type, self.param, self.code)
        body["error"].update(self.details)
        return body


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, value, why: str = "is not supported yet") -> APIError:
    return APIError(400, f"{param}={value!r} {why}", param=param, code="unsupported_parameter")


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist; this server serves {served!r}",
                    param="model", code="model_not_found")


ANTHROPIC_OVERLOADED = 529


def overloaded(retry_after: int) -> APIError:
    return APIError(503, "All generation slots are busy and the wait queue is full; retry later",
                    type="overloaded_error", code="server_overloaded",
                    headers={"Retry-After": str(retry_after)})


def worker_lost(exc: Exception) -> APIError:
    """An RPC worker holding part of the model failed (pymtp/rpc.py): a gateway's error."""
    return APIError(502, str(exc), type="server_error", code="rpc_worker_lost")


def unavailable(exc: Exception) -> APIError:
    """The model lost an RPC worker and could not fail over: nothing here can decode, a
    503 (no Retry-After: waiting mends nothing) that a balancer passes to another replica
    (a 502 it returned to the client, and counted no failure against this one)."""
    return APIError(503, f"{exc}; this server cannot decode until it is restarted", type="server_error",
                    code="rpc_worker_lost")


def unauthorized() -> APIError:
    return APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def too_large(limit: int) -> APIError:
    # Connection: close, because the rest of the body is never read
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                    "(--max-body-size)", code="request_too_large", headers={"Connection": "close"})


def unsupported_encoding(coding: str) -> APIError:
    # the body is never read: Connection close, as too_large
    return APIError(415, f"The request body's Content-Encoding {coding!r} is not read by this server; "
                    "send the JSON uncompressed", code="unsupported_content_encoding",
                    headers={"Connection": "close"})


def body_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {seconds:g} s (--body-timeout); "
                    "is its Content-Length right?", code="request_timeout",
                    headers={"Connection": "close"})


def from_value_error(exc: ValueError, fields: Mapping[str, str]) -> APIError:
    """A library refusal of a request's value, as a 400.

    A ``ParamError`` names the parameter as the Python API spells it; ``fields`` maps that
    to the request's own field where they differ (``prompt`` -> ``messages`` for chat).
    """
    if isinstance(exc, ParamError):
        return APIError(400, str(exc), param=fields.get(exc.param, exc.param), code=exc.code, details=exc.details)
    return invalid(str(exc), code="invalid_value")


# Anthropic's Messages API (anthropic.py) answers its errors in its own shape
ANTHROPIC_ROUTES = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_body(exc: APIError) -> dict:
    """``exc`` as Anthropic's API says an error: ``{"type": "error", "error": {"type", "message"}}``,
    the message naming the field where it does not already."""
    kind = _ANTHROPIC_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    message = exc.message if exc.param is None or exc.param in exc.message else f"{exc.param}: {exc.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def shaped(path: str, exc: APIError) -> dict:
    """``exc``'s body in the shape of the API ``path`` belongs to: Anthropic's on its
    routes (every refusal there, unknown paths and methods, bad JSON, a crash), else OpenAI's."""
    return anthropic_body(exc) if path.startswith(ANTHROPIC_ROUTES) else exc.body()


def status_for(path: str, exc: APIError) -> int:
    """``exc``'s HTTP status; a full queue on Anthropic's routes is its 529 (its SDK's
    OverloadedError, which clients back off on; 503 is its ServiceUnavailableError)."""
    if exc.type == "overloaded_error" and path.startswith(ANTHROPIC_ROUTES):
        return ANTHROPIC_OVERLOADED
    return exc.status


def install_handlers(app: FastAPI, on_error: Callable[[str], None]) -> None:
    """Send APIError and Starlette's HTTP errors in the OpenAI shape (Anthropic's on its
    routes); ``on_error(type)`` counts them."""

    def reply(request: Request, exc: APIError) -> JSONResponse:
        on_error(exc.type)
        return JSONResponse(shaped(request.url.path, exc), status_code=status_for(request.url.path, exc),
                            headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return reply(request, APIError(exc.status_code, str(exc.detail), type=kind,
                                       headers=getattr(exc, "headers", None)))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client left while sending its body: nobody to answer, and nothing went wrong
        # here, so no traceback and no server error counted; the 499 shows in the metrics.
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return reply(request, invalid(str(exc)))


class CatchAll:
    """ASGI middleware: an unexpected exception becomes a 500 in the OpenAI shape.

    Starlette's own catch-all re-raises after answering, which makes test clients and the
    server log treat it as a crash; here it is logged once and counted.
    """

    def __init__(self, app: ASGIApp, on_error: Callable[[str], None]) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            self.on_error("server_error")
            if started:       # the status line is gone; all we can do is end the response
                return
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                             code="internal_error")
            await JSONResponse(shaped(scope.get("path", ""), error), status_code=500)(scope, receive, send)
