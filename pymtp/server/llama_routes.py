"""llama-server's own routes that clients written for it call: ``/tokenize``,
``/detokenize``, ``/apply-template``, ``/props``, ``/slots``; and the route names it
answers besides OpenAI's (``/chat/completions``, ``/models``, ``/v1/health``; app.py serves
those).

The shapes are llama-server's (tools/server of the pinned llama.cpp): ``/tokenize`` takes
``content`` (a string, or strings and token ids mixed), ``add_special`` (off),
``parse_special`` (on) and ``with_pieces``, and answers ``{"tokens": [...]}``, each token
``{"id", "piece"}`` with pieces (a piece that is not whole UTF-8 as its bytes);
``/detokenize`` answers ``{"content"}`` with special tokens as their text;
``/apply-template`` answers ``{"prompt"}``, the chat request's prompt as the chat route
renders it; ``/slots`` each slot's state (slot_board.py), with ``?fail_on_no_slot=1`` a 503
when every slot is busy, as load balancers ask it; ``POST /slots/{id}`` (llama-server's slot
files) a 501, as are its embedding and reranking routes (pymtp only generates),
``/tools`` and ``/cors-proxy`` (llama-server's agent tools and MCP proxy, off by
default) its 403 ``feature_disabled``, ``GET /lora-adapters`` an empty list, and
``POST /lora-adapters`` (llama-server's scales
of its loaded adapters) ``{"success": true}`` for a list that enables none. Where
llama-server would crash or silently do
something else (a token id outside the vocabulary, a field of the wrong type) these answer
a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request, Response

from .. import __version__
from .errors import APIError, invalid
from .llama_params import task_params
from .schemas import parse_chat, parse_json, parse_json_value
from .service import Service


def install_llama_routes(app: FastAPI, service: Service, guarded: list) -> None:
    """Add the routes above to ``app``, behind ``guarded`` (the API key, where set)."""

    # Their work runs off the event loop, the answer's JSON text included: a 16 MiB body
    # holds millions of tokens, seconds of work that would stall every other request.
    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> Response:
        body = parse_json(await request.body())
        return await asyncio.to_thread(lambda: _json(tokenize_body(service, body)))

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> Response:
        body = parse_json(await request.body())
        return await asyncio.to_thread(lambda: _json(detokenize_body(service, body)))

    @app.post("/apply-template", dependencies=guarded)
    async def apply_template(request: Request) -> dict:
        req = await asyncio.to_thread(parse_chat, parse_json(await request.body()))
        return {"prompt": await asyncio.to_thread(service.render_chat, req)}

    @app.get("/props", dependencies=guarded)
    async def props() -> dict:
        return props_of(service)

    @app.post("/props", dependencies=guarded)
    async def set_props() -> dict:
        # llama-server changes its global properties here only when started with --props,
        # and answers this 501 otherwise; pymtp's settings are its command line's
        raise APIError(501, "pymtp does not change its global properties at run time: restart it with "
                       "other options (llama-server's --props has no pymtp equivalent)", type="not_supported_error")

    @app.get("/slots", dependencies=guarded)
    async def slots(request: Request) -> list:
        if not service.settings.slots_endpoint:
            raise APIError(501, "This server does not serve /slots: start it without --no-slots",
                           type="not_supported_error")
        # a load balancer's question: can this server start a request now?
        # (the pool's count: a request holds its slot before the engine says which it is)
        if request.query_params.get("fail_on_no_slot") and service.pool.busy >= service.pool.size:
            raise APIError(503, "no slot available", type="unavailable_error")
        return service.board.view()

    # what llama-server answers unless started as an embedding or reranking server: pymtp
    # only generates, so a client learns that here rather than from a 404
    for what, flag, paths in _OTHER_KINDS:
        handler = _refused(501, "not_supported_error", f"pymtp serves text generation only: it has no {what} "
                           f"route (llama-server serves {what} when started with {flag})")
        for path in paths:
            app.post(path, dependencies=guarded, include_in_schema=False)(handler)

    # llama-server's built-in agent tools and its MCP CORS proxy: off unless started with
    # their flag, when they answer this 403, which llama.cpp's web page reads as "off" (any
    # other error it logs, and asks again before every turn)
    for path, feature, flag in _DISABLED:
        handler = _refused(403, "feature_disabled",
                           f"this feature is disabled: pymtp has no {feature} (llama-server's {flag})")
        app.get(path, dependencies=guarded, include_in_schema=False)(handler)
        app.post(path, dependencies=guarded, include_in_schema=False)(handler)

    @app.get("/lora-adapters", dependencies=guarded)
    async def lora_adapters() -> list:
        return []       # pymtp loads no LoRA adapter: the model is served as loaded

    @app.post("/lora-adapters", dependencies=guarded)
    async def set_lora_adapters(request: Request) -> dict:
        body = parse_json_value(await request.body())
        if not isinstance(body, list):
            raise invalid("Request body must be an array of {\"id\": N, \"scale\": S} entries", "body")
        for i, entry in enumerate(body):
            if not isinstance(entry, dict):
                raise invalid(f"entry {i} must be an object such as {{\"id\": 0, \"scale\": 0.5}}", f"[{i}]")
            scale = entry.get("scale")     # null or left out: 0, as llama-server reads it
            if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
                raise invalid(f"entry {i}'s scale must be a number", f"[{i}].scale")
            if scale:      # llama-server ignores ids it has no adapter for; enabling one is a mistake
                what = f"LoRA adapter {entry['id']!r}" if "id" in entry else f"LoRA adapter for entry {i} (it has no id)"
                raise invalid(f"there is no {what} to scale by {scale}: pymtp serves the model as loaded "
                              "(GET /lora-adapters lists none)", f"[{i}].id")
        return {"success": True}

    @app.post("/slots/{id_slot}", dependencies=guarded)
    async def slot_action(id_slot: str) -> None:
        raise APIError(501, "pymtp does not save, restore or erase slots (llama-server's --slot-save-path): "
                            "its prompt cache keeps the recent prompts of every slot by itself",
                       type="not_supported_error")


# llama-server's routes of other server kinds: what they serve, its flag, their names
_OTHER_KINDS = (
    ("embeddings", "--embeddings", ("/embedding", "/embeddings", "/v1/embeddings")),
    ("reranking", "--reranking", ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")),
)


# llama-server's experimental features that are off by default: route, what, its flag
_DISABLED = (
    ("/tools", "built-in tools for agents", "--tools"),
    ("/cors-proxy", "MCP CORS proxy", "--webui-mcp-proxy"),
)


def _refused(status: int, kind: str, message: str):
    """A route that answers every request with this error."""
    async def refused() -> None:
        raise APIError(status, message, type=kind)
    return refused


def tokenize_body(service: Service, body: dict) -> dict:
    """``/tokenize``'s answer to ``body``."""
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    content = body.get("content")
    model = service.model
    if content is None:
        ids: list[int] = []
    elif isinstance(content, str):
        ids = model.tokenize(content, special=parse_special, add_special=add_special)
    elif isinstance(content, list):
        # llama-server's tokenize_mixed: ids as they are, the first string alone with BOS
        ids = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                ids += model.tokenize(part, special=parse_special, add_special=add_special and i == 0)
            else:
                ids += _token_ids([part], model.n_vocab, f"content[{i}]")
    else:
        raise invalid("content must be a string, or a list of strings and token ids", "content", "invalid_type")
    if not with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(model.token_bytes(t, special=True))} for t in ids]}


def detokenize_body(service: Service, body: dict) -> dict:
    """``/detokenize``'s answer to ``body``: special tokens as their text, as llama-server's."""
    tokens = _token_ids(body.get("tokens", []), service.model.n_vocab, "tokens")
    data = b"".join(service.model.token_bytes(t, special=True) for t in tokens)
    return {"content": data.decode("utf-8", errors="replace")}


def props_of(service: Service) -> dict[str, Any]:
    """``/props``: what llama-server's says of this server, as far as pymtp has it."""
    m, s, d = service.model, service.settings, service.settings.decode
    return {
        "default_generation_settings": {
            "n_ctx": m.n_ctx,
            # what a request that names no setting runs with, as /slots tells a request's
            "params": task_params(asdict(d), n_predict=-1, stop=(), stream=False, n_probs=0, full=False),
        },
        "total_slots": s.parallel,
        "endpoint_slots": s.slots_endpoint, "endpoint_props": False, "endpoint_metrics": True,
        "model_alias": service.model_id,
        "model_path": str(m.path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "chat_template": service.template.text,
        "bos_token": m.bos_token,
        "eos_token": m.eos_token,
        "build_info": f"pymtp {__version__}",
        "is_sleeping": False,
    }


def _json(obj: dict) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False, separators=(",", ":")), media_type="application/json")


def _flag(body: dict, name: str, default: bool) -> bool:
    """A boolean field; null is its default, as llama-server reads it."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{name} must be a boolean, got {type(v).__name__}", name, "invalid_type")
    return v


def _token_ids(v: Any, n_vocab: int, param: str) -> list[int]:
    if not isinstance(v, list):
        raise invalid(f"{param} must be a list of token ids", param, "invalid_type")
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
            raise invalid(f"{param} must hold token ids from 0 to {n_vocab - 1} (this model's vocabulary), "
                          f"got {t!r}", param, "invalid_value")
    return v


def _piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (llama-server's form)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
