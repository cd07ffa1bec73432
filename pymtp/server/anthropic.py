"""Anthropic's Messages API, ``POST /v1/messages`` and ``/v1/messages/count_tokens``, as
llama-server serves it: clients written for Anthropic's API (its SDKs, agents that speak
only it) chat with the served model.

A request is read into the chat route's request (``to_chat``: system text, messages
whose blocks become OpenAI messages, tools and tool_choice), so it is checked, templated,
constrained and decoded as a chat is; the answer is the chat's message in Anthropic's
shape:

- content blocks in order: ``thinking`` (the reply's ``reasoning_content``, signature
  ""), ``text``, then a ``tool_use`` block per call (its arguments parsed as ``input``);
- ``stop_reason``: "tool_use" for a reply with calls, "stop_sequence" (and
  ``stop_sequence``) for one of the request's ``stop_sequences``, "max_tokens" at the
  limit, else "end_turn";
- ``usage``: ``input_tokens`` (the prompt less what the prompt cache held),
  ``cache_read_input_tokens``, ``output_tokens``.

A stream is Anthropic's events (``event: NAME`` frames): ``message_start``, each block's
``content_block_start``, deltas (``thinking_delta``, ``text_delta``,
``input_json_delta`` with a call's whole arguments) and ``content_block_stop``, one block
open at a time, then ``message_delta`` (stop reason, output tokens) and ``message_stop``.
Errors are ``{"type": "error", "error": {"type", "message"}}`` with the HTTP status.

Blocks map to the chat's messages: ``tool_use`` blocks of an assistant turn become its
tool calls, a user turn's ``tool_result`` blocks become tool messages (before its text),
``thinking`` blocks its ``reasoning_content``. ``thinking: {"type": "enabled"}`` or
``"disabled"`` sets the template's ``enable_thinking`` (Qwen3.5's templates read it).
Refused with a 400 naming the field: images and documents (a text model), server tools
(a tool with a ``type``), ``tool_choice`` types Anthropic does not have.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..generate import Chunk
from ..config import ParamError
from .errors import CLIENT_CLOSED, APIError, from_value_error, invalid, unsupported
from .responses import Choice, ChunkWriter, Envelope, full_response
from .runs import canceller, collected, started
from .schemas import GenerationRequest, _kind, parse_chat, parse_json
from .service import Run, Service
from .sse import SSEResponse

# Anthropic's error types by HTTP status (its API's error shapes)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# the body's fields that to_chat translates (the others go to the chat route as they are;
# "stop" and "n" too, which Anthropic's API does not have, so that they are not mixed in)
_ANTHROPIC_OWN = {"messages", "system", "tools", "tool_choice", "thinking", "stop_sequences", "stop", "n",
                  "metadata", "service_tier", "container", "mcp_servers"}


def install_anthropic(app: FastAPI, service: Service, generating: list, guarded: list) -> None:
    """Add ``/v1/messages`` (behind ``generating``) and ``/v1/messages/count_tokens``."""

    @app.post("/v1/messages", dependencies=generating)
    async def messages(request: Request) -> Response:
        try:
            req, stops = to_chat(parse_json(await request.body()))
            runs = await started(service, request, [req])
        except APIError as exc:
            return refused(exc)
        if runs is None:
            return Response(status_code=CLIENT_CLOSED)
        run = runs[0]
        env = Envelope("chat", service.model_id, id=f"msg_{uuid.uuid4().hex}")
        if req.stream:
            writer = ChunkWriter(env, False, run.extras, run.tools, reasoning=run.reasoning, prefill=run.prefill)
            return SSEResponse(_framed(_events(run, writer, env, stops)), on_close=canceller(runs))
        chunks = (await collected(request, runs))[0]
        choice = full_response(env, [Choice(chunks, run.stats, run.extras, run.tools, run.reasoning, run.prefill)],
                               run.prompt_tokens)["choices"][0]
        return JSONResponse(message(env, choice["message"], choice["finish_reason"], _stop_word(chunks, stops),
                                    _usage(run)))

    @app.post("/v1/messages/count_tokens", dependencies=guarded)
    async def count_tokens(request: Request) -> Response:
        try:
            req, _ = to_chat(parse_json(await request.body()))
            ids = await _prompt_ids(service, req)
        except APIError as exc:
            return refused(exc)
        return JSONResponse({"input_tokens": len(ids)})

    def refused(exc: APIError) -> JSONResponse:
        service.metrics.count_error(exc.type)
        return error_response(exc)


async def _prompt_ids(service: Service, req: GenerationRequest) -> list[int]:
    try:
        return (await asyncio.to_thread(service._chat_ids, req))[0]
    except ParamError as exc:        # a prompt past the context
        raise from_value_error(exc, {"prompt": "messages"}) from exc


def error_response(exc: APIError) -> JSONResponse:
    """An APIError in Anthropic's error shape."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    message = exc.message if exc.param is None or exc.param in exc.message else f"{exc.param}: {exc.message}"
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=exc.status,
                        headers=exc.headers)


# ----------------------------------------------------------------------------- the request


def to_chat(body: dict) -> tuple[GenerationRequest, tuple[str, ...]]:
    """The chat route's request for an Anthropic body, and its stop_sequences."""
    # the fields both APIs share, and the chat route's own (pymtp's and llama-server's
    # extensions: grammar, seed, min_p, spec, draft_max ...) as they are
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _ANTHROPIC_OWN}
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages must be a non-empty list of {\"role\", \"content\"}", "messages",
                      "missing_required_parameter" if msgs is None else "invalid_type")
    chat["messages"] = _system(body.get("system")) + [m for i, msg in enumerate(msgs) for m in _turn(msg, i)]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise invalid(f'thinking must be {{"type": "enabled", "budget_tokens": N}} or {{"type": "disabled"}}, '
                          f"got {thinking!r}", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid(f"stop_sequences must be a list of strings, got {_kind(stops)}", "stop_sequences",
                      "invalid_type")
    req = parse_chat(chat)
    return replace(req, stop=tuple(s for s in stops if s)), tuple(stops)


def _system(system: Any) -> list[dict]:
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": "\n".join(_text_block(b, f"system[{i}]") for i, b in enumerate(system))}]
    raise invalid(f"system must be a string or a list of text blocks, got {_kind(system)}", "system", "invalid_type")


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise invalid(f'{where} must be a text block {{"type": "text", "text": ...}}', where, "invalid_type")
    return block["text"]


def _turn(msg: Any, i: int) -> list[dict]:
    """One Anthropic message as the chat's messages."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise invalid(f'{where} must be {{"role": "user" or "assistant", "content": ...}}', f"{where}.role")
    role, content = msg["role"], msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks, got {_kind(content)}",
                      f"{where}.content", "invalid_type")
    texts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _result_text(block.get("content"), at)})
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        else:
            raise unsupported(f"{at}.type", kind, f"is not supported in a{'n assistant' if role == 'assistant' else ' user'} "
                              "message: pymtp serves text, tool_use, tool_result and thinking blocks")
    out = list(results)
    if role == "user":
        if texts or not results:
            out.append({"role": "user", "content": [{"type": "text", "text": t} for t in texts]})
        return out
    turn: dict[str, Any] = {"role": "assistant", "content": [{"type": "text", "text": t} for t in texts]}
    if calls:
        turn["tool_calls"] = calls
    if thinking:
        turn["reasoning_content"] = "\n".join(thinking)
    return [turn]


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(_text_block(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    raise invalid(f"{where}.content must be a string or a list of text blocks", f"{where}.content", "invalid_type")


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise invalid(f"tools must be a list, got {_kind(tools)}", "tools", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise invalid(f'tools[{i}] must be {{"name": ..., "input_schema": {{...}}}}', f"tools[{i}]", "invalid_type")
        if t.get("type") not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", t["type"], "is a server tool, which pymtp does not run: "
                              "send client tools (a name, a description and an input_schema)")
        fn = {"name": t["name"]}         # in OpenAI's order: the template shows the tools as JSON
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema", {"type": "object"})
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> dict:
    kind = choice.get("type") if isinstance(choice, dict) else None
    out: dict[str, Any] = {}
    if kind in _TOOL_CHOICES:
        out["tool_choice"] = _TOOL_CHOICES[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise invalid(f'tool_choice must be {{"type": "auto"}}, {{"type": "any"}}, {{"type": "none"}} or '
                      f'{{"type": "tool", "name": ...}}, got {choice!r}', "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


# ----------------------------------------------------------------------------- the answer


def message(env: Envelope, msg: dict, finish_reason: str, stop_word: str | None, usage: dict) -> dict:
    """The chat's message as an Anthropic message."""
    blocks: list[dict] = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    blocks += [_tool_use(c) for c in msg.get("tool_calls") or ()]
    return {"id": env.id, "type": "message", "role": "assistant", "model": env.model, "content": blocks,
            "stop_reason": stop_reason(finish_reason, stop_word), "stop_sequence": stop_word, "usage": usage}


def stop_reason(finish_reason: str, stop_word: str | None) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_word else "end_turn"


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {}}


def _stop_word(chunks: list[Chunk], stops: tuple[str, ...]) -> str | None:
    """The request's stop sequence that ended the reply (a template's own end text is not one)."""
    last = next((c for c in reversed(chunks) if c.finish_reason), None)
    word = last.stop_word if last is not None else None
    return word if word in stops else None


def _usage(run: Run) -> dict:
    s = run.stats
    cached = s.cached_tokens if s is not None else 0
    return {"input_tokens": run.prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": s.generated_tokens if s is not None else 0}


class _Blocks:
    """The stream's content blocks, one open at a time, from the chat's deltas."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None        # "thinking", "text" or None

    def feed(self, delta: dict) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if delta.get("reasoning_content"):
            out += self._start("thinking", {"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            out += self._start("tool_use", {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                            "input": {}}, always=True)
            out.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":     # Anthropic's thinking blocks end with their signature
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, kind: str, block: dict, always: bool = False) -> list[tuple[str, dict]]:
        if self.open == kind and not always:
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


async def _events(run: Run, writer: ChunkWriter, env: Envelope, stops: tuple[str, ...]) -> AsyncIterator[tuple[str, dict]]:
    start = {"id": env.id, "type": "message", "role": "assistant", "model": env.model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    blocks = _Blocks()
    for obj in writer.opening():
        for ev in blocks.feed(obj["choices"][0]["delta"]):
            yield ev
    chunks: list[Chunk] = []
    chunk = run.first
    while chunk is not None:
        chunks.append(chunk)
        if writer.wants(chunk):
            for ev in blocks.feed(writer.delta(chunk)["choices"][0]["delta"]):
                yield ev
        run.finish_reason = chunk.finish_reason or run.finish_reason
        chunk = await anext(run.gen, None)
    finish = run.finish_reason or "length"
    for obj in writer.closing(finish, None):
        choice = obj["choices"][0]
        for ev in blocks.feed(choice["delta"]):
            yield ev
        finish = choice["finish_reason"] or finish
    for ev in blocks.close():
        yield ev
    word = _stop_word(chunks, stops)
    usage = _usage(run)
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": stop_reason(finish, word), "stop_sequence": word},
                            "usage": {"output_tokens": usage["output_tokens"]}}
    yield "message_stop", {"type": "message_stop"}


async def _framed(events: AsyncIterator[tuple[str, dict]]) -> AsyncIterator[bytes]:
    """Anthropic's SSE frames: ``event: NAME`` then its data; a failure after the status
    line is an ``error`` event."""
    try:
        async for name, data in events:
            yield _frame(name, data)
    except APIError as exc:
        yield _frame("error", json.loads(error_response(exc).body))
    except Exception as exc:
        yield _frame("error", {"type": "error", "error": {"type": "api_error",
                                                          "message": f"internal error: {type(exc).__name__}: {exc}"}})


def _frame(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"
