"""The HTTP routes: OpenAI-compatible completions and chat, models, health and metrics
(the chat page and its stats: page.py; llama-server's /tokenize, /detokenize,
/apply-template and /props: llama_routes.py; its /completion: llama_completion.py;
Anthropic's /v1/messages: anthropic.py; OpenAI's /v1/responses: responses_api.py).

Routes only translate: a body becomes a ``GenerationRequest`` (schemas), the service runs
it on a slot, and the chunks become OpenAI objects (responses) sent whole or as SSE.
"""

from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..config import ParamError
from ..generate import Model
from ..session import Session
from ..infill import InfillUnsupported
from .drain import shutting_down
from .errors import CLIENT_CLOSED, CatchAll, from_value_error, install_handlers, invalid, unauthorized, unavailable
from .head import HeadAsGet
from .limits import BodyLimits
from .metrics import RequestMetrics
from .origins import OriginWriter, wants_origins
from .responses import Choice, ChunkWriter, Envelope, full_response
from .schemas import GenerationRequest, generations, parse_chat, parse_completion, parse_json
from .service import Run, Service, reasoning_tokens
from .settings import LOCALHOST_ORIGIN, ServerSettings
from .runs import canceller, collected, first_turn, framed, in_turns, merged, stream_turns
from .sse import DONE, SSEResponse
from .anthropic import install_anthropic
from .responses_api import install_responses
from .llama_completion import install_llama_completion, resolve_prompts
from .llama_routes import install_llama_routes
from .page import install_webui


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
    app.add_middleware(HeadAsGet)        # innermost: the metrics and CORS see the HEAD
    app.add_middleware(BodyLimits, max_bytes=s.max_body_size, timeout=s.body_timeout,
                       on_error=service.metrics.count_error)
    app.add_middleware(CatchAll, on_error=service.metrics.count_error)
    if s.cors_origins:
        # browser pages of other origins (a web UI served elsewhere, a local HTML file), as
        # llama-server allows them: its preflight answer and headers on every reply
        local = "localhost" in s.cors_origins
        app.add_middleware(CORSMiddleware, allow_origins=[o for o in s.cors_origins if o != "localhost"],
                           allow_origin_regex=LOCALHOST_ORIGIN if local else None,
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"])
    app.add_middleware(RequestMetrics, metrics=service.metrics)   # outermost: sees every status

    keys = [k.encode() for k in service.settings.api_keys]

    async def authorize(request: Request) -> None:
        if not keys:
            return
        # "Bearer KEY", or the bare key as llama-server takes it; Anthropic's clients send x-api-key
        given = [v.strip() for v in (request.headers.get("authorization"), request.headers.get("x-api-key")) if v]
        given += [v[len("bearer "):].strip() for v in given if v[:len("bearer ")].lower() == "bearer "]
        # every pair compared, so that the time taken says nothing of which key came near
        # a header is bytes, which the ASGI server hands on as latin-1 text: its bytes again
        if not sum(secrets.compare_digest(g.encode("latin-1"), k) for g in given for k in keys):
            raise unauthorized()

    async def accepting() -> None:
        # Draining for shutdown (drain.py): refuse before reading the body.
        if service.pool.refusing:
            raise shutting_down(service.settings.retry_after)

    guarded = [Depends(authorize)]
    generating = [Depends(authorize), Depends(accepting)]

    # HEAD too: load balancers and uptime checkers probe with it
    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/v1/health", methods=["GET", "HEAD"])     # llama-server's second name
    async def health() -> Response:
        if service.pool.refusing:     # a load balancer stops sending work here
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": str(service.settings.retry_after)})
        if (broken := service.broken) is not None:      # a lost RPC worker and no fail-over
            return JSONResponse({"status": "error", "error": unavailable(broken).message}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=service.metrics.content_type,
                        headers={"Process-Start-Time-Unix": str(service.started)})   # a restart, for scrapers

    @app.get("/v1/models", dependencies=guarded)
    @app.get("/models", dependencies=guarded)                 # llama-server answers both
    async def list_models() -> dict:
        # llama-server's list has Ollama's "models" beside OpenAI's "data" (clients of either read it)
        return {"models": [service.listed()], "object": "list", "data": [service.card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def get_model(model_id: str) -> dict:
        service.check_model(model_id)
        return service.card()

    @app.post("/v1/completions", dependencies=generating)
    async def completions(request: Request) -> Response:
        body = parse_json(await request.body())
        req = await _ids_of_mixed(service, parse_completion(body))
        if req.suffix is not None:
            req = await _with_suffix(service, req)
        return await _generate(service, request, req, wants_origins(body, req.stream))

    @app.post("/v1/chat/completions", dependencies=generating)
    @app.post("/chat/completions", dependencies=generating)   # llama-server answers both
    async def chat_completions(request: Request) -> Response:
        body = parse_json(await request.body())
        req = await asyncio.to_thread(parse_chat, body)     # a forced tool's grammar may take seconds
        return await _generate(service, request, req, wants_origins(body, req.stream))

    @app.post("/v1/chat/completions/input_tokens", dependencies=guarded)
    @app.post("/chat/completions/input_tokens", dependencies=guarded)
    async def chat_input_tokens(request: Request) -> dict:
        """llama-server's count of a chat request's prompt tokens (OpenAI's Responses count's shape)."""
        req = await asyncio.to_thread(parse_chat, parse_json(await request.body()))
        return {"object": "response.input_tokens", "input_tokens": await service.count_chat_tokens(req)}

    install_webui(app, service, guarded)     # GET / (the chat page), /pymtp/stats
    install_llama_routes(app, service, guarded)     # /tokenize, /detokenize, /apply-template, /props
    install_llama_completion(app, service, generating)     # /completion, /completions
    install_anthropic(app, service, generating, guarded)      # /v1/messages, /v1/messages/count_tokens
    install_responses(app, service, generating, guarded)      # /v1/responses, /v1/responses/input_tokens
    return app


async def _ids_of_mixed(service: Service, req: GenerationRequest) -> GenerationRequest:
    """A prompt of token ids with strings among them as ids (llama-server's tokenize_mixed,
    which its /v1/completions reads too), tokenized off the event loop as /completion's are."""
    prompts = list(req.prompts or (req.prompt,))
    if not any(isinstance(p, list) and any(isinstance(x, str) for x in p) for p in prompts):
        return req
    prompts = await asyncio.to_thread(resolve_prompts, service.model, prompts)
    return replace(req, prompt=prompts[0], prompts=tuple(prompts) if len(prompts) > 1 else ())


async def _with_suffix(service: Service, req: GenerationRequest) -> GenerationRequest:
    """A completion with OpenAI's ``suffix``: each prompt a fill-in-the-middle one around
    its suffix (``Model.infill_prompt``, as /infill lays it out), on a model with FIM tokens."""
    def build(prompt: str | list[int]) -> list[int]:     # whole: the client sized its texts
        return service.model.infill_prompt(prompt, req.suffix, trim=False)
    try:
        prompts = await asyncio.to_thread(lambda: [build(p) for p in (req.prompts or (req.prompt,))])
    except InfillUnsupported as exc:
        raise invalid(f"suffix needs a model trained for fill-in-the-middle: {exc}", "suffix",
                      "unsupported_parameter") from exc
    except ParamError as exc:
        raise from_value_error(exc, {}) from exc
    return replace(req, prompt=prompts[0], prompts=tuple(prompts) if len(prompts) > 1 else ())


async def _generate(service: Service, request: Request, req: GenerationRequest,
                    origins: bool = False) -> Response:
    reqs = generations(req, service.settings.decode.seed)
    env = Envelope(req.kind, service.model_id)
    if not req.stream:
        async def answer(first: int, part: list[GenerationRequest], runs: list[Run]) -> list:
            return list(zip(await collected(request, runs), runs))

        done = await in_turns(service, request, reqs, answer)
        if done is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = [Choice(c, run.stats, run.extras, run.tools, run.reasoning, run.preamble) for c, run in done]
        thought = [reasoning_tokens(service.model, run, (t for chunk in c for t in chunk.tokens)) for c, run in done]
        return JSONResponse(full_response(env, choices, _prompts([run for _, run in done], req.n), thought))
    first = await first_turn(service, request, reqs)
    if first is None:
        return Response(status_code=CLIENT_CLOSED)
    # from here the SSE response watches the client itself
    live = list(first)

    def writers(i: int, run: Run) -> tuple[ChunkWriter, OriginWriter | None]:
        tracer = OriginWriter(lambda t: service.model.token_bytes(t, special=False)) if origins else None
        return ChunkWriter(env, req.include_usage, run.extras, run.tools, index=i, reasoning=run.reasoning,
                           prefill=run.preamble), tracer
    return SSEResponse(_events(stream_turns(service, reqs, first, live), writers, service, len(reqs), req.n),
                       on_close=canceller(live))


def _prompts(runs: list[Run], n: int) -> tuple[int, int]:
    """Usage's prompt tokens and those the prompt cache held: each prompt's once, however
    many choices it has."""
    firsts = runs[::n]
    return (sum(run.prompt_tokens for run in firsts),
            sum(run.stats.cached_tokens for run in firsts if run.stats is not None))


def _events(turns: AsyncIterator[tuple[int, list[Run]]],
            writers: Callable[[int, Run], tuple[ChunkWriter, OriginWriter | None]], service: Service,
            total: int, n: int = 1) -> AsyncIterator[bytes]:
    """The SSE body: each choice's opening, deltas and closing (several: interleaved as
    their chunks come, a turn of the slots at a time: runs.stream_turns), then the usage
    of all (``n`` choices a prompt), then [DONE]."""
    async def objects():
        runs: list[Run] = []
        made: list[list[int]] = []          # each choice's tokens, for usage's reasoning_tokens
        writer = None
        async for start, turn in turns:
            made += [[] for _ in turn]
            streams = []
            for i, run in enumerate(turn, start):
                writer, tracer = writers(i, run)
                streams.append(_choice_events(run, writer, tracer, total == 1, made[i]))
            runs += turn
            async for obj in streams[0] if len(streams) == 1 else merged(streams):
                yield obj
        if writer is not None and writer.include_usage:
            thought = [reasoning_tokens(service.model, run, tokens) for run, tokens in zip(runs, made)]
            for obj in writer.usage(_prompts(runs, n), [run.stats for run in runs], thought):
                yield obj
    return framed(objects(), service.metrics, DONE)


async def _choice_events(run: Run, writer: ChunkWriter, tracer: OriginWriter | None = None, alone: bool = True,
                         made: list[int] | None = None):
    """One choice's objects: opening, one delta per chunk with text, closing (with
    llama-server's ``timings`` when it is the only one). With ``tracer`` every chunk
    makes a delta, carrying its tokens' origins (origins.py) and how the reply's thinking
    is split: null (it is not), "opened" (the prompt opened the block) or "written" (the
    reply may open one). ``made`` gets the choice's tokens."""
    for obj in writer.opening():
        yield obj
    # how the reply's thinking is split, so that a client drawing the pieces splits them alike
    thinking = None if run.reasoning is None else ("opened" if run.reasoning else "written")
    chunk = run.first
    while chunk is not None:
        if tracer is not None:
            yield {**writer.delta(chunk), "pymtp": {**tracer.of(chunk), "thinking": thinking}}
        elif writer.wants(chunk):
            yield writer.delta(chunk)
        run.finish_reason = chunk.finish_reason or run.finish_reason
        if made is not None:
            made += chunk.tokens
        chunk = await anext(run.gen, None)
    for obj in writer.closing(run.finish_reason or "length", run.stats, with_timings=alone):
        yield obj
