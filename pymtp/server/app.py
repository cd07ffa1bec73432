"""The HTTP routes: OpenAI-compatible completions and chat, models, health and metrics
(the chat page and its stats: page.py).

Routes only translate: a body becomes a ``GenerationRequest`` (schemas), the service runs
it on a slot, and the chunks become OpenAI objects (responses) sent whole or as SSE.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..generate import Model, Session
from .drain import shutting_down
from .errors import CLIENT_CLOSED, APIError, CatchAll, error_body, install_handlers, unauthorized
from .limits import BodyLimits
from .metrics import RequestMetrics
from .origins import OriginWriter, wants_origins
from .responses import ChunkWriter, Envelope, full_response
from .schemas import GenerationRequest, parse_chat, parse_completion, parse_json
from .service import Run, Service
from .settings import ServerSettings
from .sse import DONE, SSEResponse, event
from .page import install_webui

log = logging.getLogger("pymtp.server")


def create_app(model: Model, settings: ServerSettings | None = None, *,
               sessions: list[Session] | None = None) -> FastAPI:
    """An app serving ``model``; ``sessions`` replaces the ``settings.parallel`` it would make."""
    service = Service(model, settings or ServerSettings(), sessions)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        service.close()

    app = FastAPI(title="pymtp", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    install_handlers(app, service.metrics.count_error)
    s = service.settings
    app.add_middleware(BodyLimits, max_bytes=s.max_body_size, timeout=s.body_timeout,
                       on_error=service.metrics.count_error)
    app.add_middleware(CatchAll, on_error=service.metrics.count_error)
    app.add_middleware(RequestMetrics, metrics=service.metrics)   # outermost: sees every status

    key = service.settings.api_key

    async def authorize(request: Request) -> None:
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
            raise unauthorized()

    async def accepting() -> None:
        # Draining for shutdown (drain.py): refuse before reading the body.
        if service.pool.refusing:
            raise shutting_down(service.settings.retry_after)

    guarded = [Depends(authorize)]
    generating = [Depends(authorize), Depends(accepting)]

    # HEAD too: load balancers and uptime checkers probe with it
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if service.pool.refusing:     # a load balancer stops sending work here
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": str(service.settings.retry_after)})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    @app.get("/v1/models", dependencies=guarded)
    async def list_models() -> dict:
        return {"object": "list", "data": [service.card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def get_model(model_id: str) -> dict:
        service.check_model(model_id)
        return service.card()

    @app.post("/v1/completions", dependencies=generating)
    async def completions(request: Request) -> Response:
        body = parse_json(await request.body())
        req = parse_completion(body)
        return await _generate(service, request, req, wants_origins(body, req.stream))

    @app.post("/v1/chat/completions", dependencies=generating)
    async def chat_completions(request: Request) -> Response:
        body = parse_json(await request.body())
        req = parse_chat(body)
        return await _generate(service, request, req, wants_origins(body, req.stream))

    install_webui(app, service, guarded)     # GET / (the chat page), /pymtp/stats
    return app


async def _generate(service: Service, request: Request, req: GenerationRequest,
                    origins: bool = False) -> Response:
    # Nothing reads from the client while its request waits for a slot, so nothing would
    # notice that it left: watch for that, or an abandoned request keeps its queue place
    # (pushing live clients to 503) and later generates for nobody.
    starting = asyncio.ensure_future(service.start(req))
    watcher = asyncio.create_task(_on_disconnect(request, starting.cancel))
    try:
        run = await starting
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling() or not watcher.done():
            raise                     # we were cancelled, not the client gone
        return Response(status_code=CLIENT_CLOSED)
    finally:
        watcher.cancel()
    env = Envelope(req.kind, service.model_id)
    if req.stream:    # from here the SSE response watches the client itself
        tracer = OriginWriter(lambda t: service.model.token_bytes(t, special=False)) if origins else None
        return SSEResponse(_events(run, ChunkWriter(env, req.include_usage, run.extras, run.tools), service, tracer),
                           on_close=run.gen.cancel)
    watcher = asyncio.create_task(_on_disconnect(request, run.gen.cancel))
    try:
        chunks = [run.first] if run.first is not None else []
        async for chunk in run.gen:    # ends once the slot is free and the stats are in
            chunks.append(chunk)
    finally:
        watcher.cancel()
        run.gen.cancel()    # a no-op after a normal end; stops the worker if we failed
    finish = next((c.finish_reason for c in reversed(chunks) if c.finish_reason), "length")
    return JSONResponse(full_response(env, chunks, finish, run.prompt_tokens, run.stats, run.extras, run.tools))


async def _events(run: Run, writer: ChunkWriter, service: Service, tracer: OriginWriter | None = None):
    """The SSE body: opening, one delta per chunk with text, closing, usage, [DONE].
    With ``tracer`` every chunk makes a delta, carrying its tokens' origins (origins.py)."""
    for obj in writer.opening():
        yield event(obj)
    try:
        chunk = run.first
        while chunk is not None:
            if tracer is not None:
                yield event({**writer.delta(chunk), "pymtp": tracer.of(chunk)})
            elif writer.wants(chunk):
                yield event(writer.delta(chunk))
            run.finish_reason = chunk.finish_reason or run.finish_reason
            chunk = await anext(run.gen, None)
    except APIError as exc:     # ended by the server (a shutdown): say so in-band, as OpenAI does
        service.metrics.count_error(exc.type)
        yield event(exc.body())
        yield DONE
        return
    except Exception as exc:    # the status line is sent: report the failure in-band
        log.exception("generation failed mid-stream")
        service.metrics.count_error("server_error")
        yield event(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error",
                               code="internal_error"))
        yield DONE
        return
    for obj in writer.closing(run.finish_reason or "length", run.prompt_tokens, run.stats):
        yield event(obj)
    yield DONE


async def _on_disconnect(request: Request, action: Callable[[], object]) -> None:
    """Call ``action`` once the client has gone (the request's body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            action()
            return
