"""Anthropic's Messages API, ``POST /v1/messages`` and ``/v1/messages/count_tokens``, as
llama-server serves it: clients written for Anthropic's API (its SDKs, agents that speak
only it) chat with the served model.

A request is read into the chat route's request (``to_chat``: system text, messages
whose blocks become OpenAI messages, tools and tool_choice), so it is checked, templated,
constrained and decoded as a chat is (structured outputs, ``output_config.format``, are
its response_format); the answer is the chat's message in Anthropic's shape:

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
``thinking`` blocks its ``reasoning_content``; the system's text blocks are a system
message's parts (Claude Code's billing header with its per-request ``cch`` value written
as llama-server writes it, so the prompt cache holds across turns). A last assistant turn
is continued, and the answer is only what follows it. ``thinking: {"type": "enabled"}``
or ``"disabled"`` sets the template's ``enable_thinking`` (Qwen3.5's templates read it),
and an enabled one's ``budget_tokens`` (10000 where absent, as llama-server's) is the
reply's reasoning budget (reasoning_budget.py); other kinds leave the template's default. ``stop_sequences`` take up to
``body_fields.MANY_STOPS``. Refused with a 400 naming the field: images and documents (a
text model), server tools (a tool with a ``type``), ``mcp_servers`` and ``container``,
``tool_choice`` types Anthropic does not have, a ``tool_use`` the next message leaves
unanswered, a prefill under a constraint (``output_config.format``, a forced
``tool_choice``, a grammar: it would start over after the prefill). Consecutive messages
of one role are one turn, as Anthropic joins them. Every refusal on these routes, the API
key's and a full queue's included, is in Anthropic's shape (errors.anthropic_body); a
full queue is its 529.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..chat_messages import kind_of
from ..results import Chunk
from .body_fields import many_stops, own_limit
from .chat_reply import StreamedReply, whole_parts
from .errors import CLIENT_CLOSED, APIError, anthropic_body, invalid, unsupported
from .responses import Envelope
from .runs import canceller, collected, framed, started
from .schemas import GenerationRequest, parse_chat, parse_json
from .service import Run, Service
from .sse import SSEResponse, named_event

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
BILLING_HEADER = "x-anthropic-billing-header:"
# the body's fields that to_chat translates (the others go to the chat route as they are;
# "stop" and "n" too, which Anthropic's API does not have, so that they are not mixed in)
_ANTHROPIC_OWN = {"messages", "system", "tools", "tool_choice", "thinking", "stop_sequences", "stop", "n",
                  "metadata", "service_tier", "container", "mcp_servers", "output_config", "output_format"}

# what Anthropic's servers run beside the model: refused, as server tools are (dropped, the
# client would believe the model had those tools)
_SERVER_SIDE = {"mcp_servers": "MCP servers are connected by Anthropic's servers; pass their tools as tools "
                               "the client runs", "container": "no code-execution containers run here"}


def install_anthropic(app: FastAPI, service: Service, generating: list, guarded: list) -> None:
    """Add ``/v1/messages`` (behind ``generating``) and ``/v1/messages/count_tokens``."""

    @app.post("/v1/messages", dependencies=generating)
    async def messages(request: Request) -> Response:
        req, stops = await asyncio.to_thread(to_chat, parse_json(await request.body()))
        runs = await started(service, request, [req])
        if runs is None:
            return Response(status_code=CLIENT_CLOSED)
        run = runs[0]
        env = Envelope("chat", service.model_id, id=f"msg_{uuid.uuid4().hex}")
        if req.stream:
            return SSEResponse(framed(_events(StreamedReply(env, run), env, stops), service.metrics,
                                      frame=named_event, failure=anthropic_body),
                               on_close=canceller(runs))
        chunks = (await collected(request, runs))[0]
        parts, finish = whole_parts(env, run, chunks)
        return JSONResponse(message(env, parts, finish, _stop_word(chunks, stops), _usage(run)))

    @app.post("/v1/messages/count_tokens", dependencies=guarded)
    async def count_tokens(request: Request) -> Response:
        req, _ = await asyncio.to_thread(to_chat, parse_json(await request.body()))
        return JSONResponse({"input_tokens": await service.count_chat_tokens(req)})


# ----------------------------------------------------------------------------- the request


def to_chat(body: dict) -> tuple[GenerationRequest, tuple[str, ...]]:
    """The chat route's request for an Anthropic body, and its stop_sequences."""
    # the fields both APIs share, and the chat route's own (pymtp's and llama-server's
    # extensions: grammar, seed, min_p, spec, draft_max ...) as they are
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _ANTHROPIC_OWN}
    for name, what in _SERVER_SIDE.items():
        if body.get(name) not in (None, [], ""):
            raise unsupported(name, body[name], f"is not supported: {what}")
    own_limit(body, "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages must be a non-empty list of {\"role\", \"content\"}", "messages",
                      "missing_required_parameter" if msgs is None else "invalid_type")
    chat["messages"] = _system(body.get("system")) + _turns(msgs)
    # a last assistant turn is a prefill: the reply continues it, never a turn after it
    last = len(msgs) - 1
    prefill = msgs[last]["role"] == "assistant" and "continue_final_message" not in body
    if prefill:
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"], chat.get("tools") or []))
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if thinking is not None and not isinstance(kind, str):
        raise invalid(f'thinking must be an object such as {{"type": "enabled", "budget_tokens": N}}, got {thinking!r}',
                      "thinking", "invalid_type")
    if kind in ("enabled", "disabled"):      # other kinds ("adaptive" ...) leave the template's default
        kwargs = body.get("chat_template_kwargs")
        chat["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}),
                                        "enable_thinking": kind == "enabled"}
    if kind == "enabled" and body.get("thinking_budget_tokens") is None:
        # the thinking's budget, as llama-server reads it (10000 where the body gives none)
        budget = thinking.get("budget_tokens", 10000)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise invalid(f"thinking.budget_tokens must be an integer >= 0 (the most tokens of thinking), "
                          f"got {budget!r}", "thinking.budget_tokens")
        chat["thinking_budget_tokens"] = budget
    fmt, where = _output_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    stops = many_stops(body, "stop_sequences")
    try:
        req = parse_chat(chat)
    except APIError as exc:
        if exc.param == "response_format":       # the body's name for it
            exc.param = where
        if exc.param == "continue_final_message" and prefill:
            exc.param = f"messages[{last}]"
            if "combined" in exc.message:       # the chat's words for a constraint after it
                what = where if fmt is not None else "tool_choice" if "tool_choice" in body else "grammar"
                exc.message = (f"{what} constrains the reply from its start, which would start over after the "
                               "prefill: drop the prefill or the constraint")
            exc.message = f"messages[{last}] (assistant) is a prefill, which the reply continues: {exc.message}"
        if exc.param == "tools":                 # the chat's tools[i].function.parameters, in the body's words
            exc.message = re.sub(r"\btools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema", exc.message)
            exc.message = re.sub(r"\btools\[(\d+)\]\.function\.", r"tools[\1].", exc.message)
        raise
    return replace(req, stop=stops, format_field=where), stops


def _output_format(body: dict) -> tuple[dict | None, str]:
    """Structured outputs: ``output_config.format`` (or the beta's ``output_format``, read
    where the first is absent), ``{"type": "json_schema", "schema": {...}}``, as the chat's
    response_format (the reply's text follows the schema; ``effort`` and other settings
    have no meaning here), and the name the body gave it."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise invalid(f"output_config must be an object, got {kind_of(config)}", "output_config", "invalid_type")
    where, fmt = ("output_config.format", config.get("format")) if config and config.get("format") is not None \
        else ("output_format", body.get("output_format"))
    if fmt is None:
        return None, "response_format"
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise invalid(f'{where} must be {{"type": "json_schema", "schema": {{...}}}} with the schema as an object, '
                      f"got {fmt!r}", where)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}, where


def _system(system: Any) -> list[dict]:
    """The system prompt as a system message: its text blocks as the message's text parts
    (the template joins them)."""
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        texts = [system]
    elif isinstance(system, list):
        texts = [_text_block(b, f"system[{i}]") for i, b in enumerate(system)]
    else:
        raise invalid(f"system must be a string or a list of text blocks, got {kind_of(system)}", "system",
                      "invalid_type")
    return [{"role": "system", "content": [{"type": "text", "text": billing_header_fixed(t)} for t in texts]}]


def billing_header_fixed(text: str) -> str:
    """Claude Code's first system text is a header whose 5-character ``cch=`` value changes
    with every request; in the prompt it would make the prompt cache miss every turn, so it
    is written as "fffff", as llama-server writes it."""
    if not text.startswith(BILLING_HEADER):
        return text
    at = text.find("cch=", len(BILLING_HEADER)) + len("cch=")
    if at < len("cch=") or text[at + 5:at + 6] != ";":
        return text
    return text[:at] + "fffff" + text[at + 5:]


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else None
        raise invalid(f'{where} must be a text block {{"type": "text", "text": ...}}, got '
                      f'{"a " + repr(kind) + " block" if isinstance(kind, str) else kind_of(block)}: pymtp serves text '
                      "models", where, "invalid_type")
    return block["text"]


# the string field of the blocks that carry one, and where the tool blocks belong
_TEXT_FIELDS = {"text": "text", "thinking": "thinking"}
_BLOCK_ROLES = {"tool_use": "an assistant", "thinking": "an assistant", "redacted_thinking": "an assistant",
                "tool_result": "a user"}


def _turns(msgs: list) -> list[dict]:
    """The Anthropic messages as the chat's. Consecutive messages of one role are one turn,
    as Anthropic's API joins them; each tool_result answers a tool_use of the assistant
    turn just before its own, as that API holds them (clients that trim a history count on
    its 400), and no tool_use is left unanswered at the end."""
    out: list[dict] = []
    called: set[str] = set()           # the tool_use ids of the last assistant turn
    answered: set[str] = set()         # those the user turn after it has answered so far
    starts: list[int] = []             # where each turn's first message is
    for i, msg in enumerate(msgs):
        turn = _turn(msg, i, called)
        role = msg["role"]
        if starts and msgs[starts[-1]]["role"] == role:
            _join(out, turn)
        else:
            if role == "assistant":
                _check_answered(called - answered, starts, i)
                called, answered = set(), set()
            starts.append(i)
            out += turn
        if role == "assistant":
            called |= {c["id"] for c in turn[0].get("tool_calls", ())}
        else:
            answered |= {m["tool_call_id"] for m in turn if m["role"] == "tool"}
    if msgs[starts[-1]]["role"] == "assistant" and called:
        raise invalid(f"messages[{len(msgs) - 1}] (assistant) has tool_use blocks that nothing answers: send their "
                      "results in a user message after it, as tool_result blocks with their tool_use_id",
                      f"messages[{len(msgs) - 1}].content")
    _check_answered(called - answered, starts, len(msgs))
    return out


def _check_answered(missing: set[str], starts: list[int], end: int) -> None:
    """Refuse the user turn that ends before ``end`` (messages starts[-1] onwards) where it
    leaves ``missing`` tool_use ids of the assistant turn before it unanswered."""
    if not missing:
        return
    first, last = starts[-1], end - 1
    user = f"messages[{first}]" if first == last else f"messages[{first}..{last}]"
    raise invalid(f"messages[{first - 1}] (assistant) has tool_use blocks that {user} does not answer "
                  f"({', '.join(sorted(missing))}): send their results there, as tool_result blocks with "
                  "their tool_use_id", f"messages[{first}].content")


def _join(out: list[dict], turn: list[dict]) -> None:
    """Add one message's chat messages to the turn of the same role that ``out`` ends with:
    an assistant's text, calls and thinking to its, a user's tool results after the turn's
    results and its text after the turn's text."""
    last = out[-1]
    if last["role"] == "assistant":
        now = turn[0]
        last["content"] = _parts(last["content"]) + _parts(now["content"])
        if now.get("tool_calls"):
            last["tool_calls"] = last.get("tool_calls", []) + now["tool_calls"]
        thought = [t for t in (last.get("reasoning_content"), now.get("reasoning_content")) if t]
        if thought:
            last["reasoning_content"] = "\n".join(thought)
        return
    start = len(out)
    while start and out[start - 1]["role"] in ("user", "tool"):
        start -= 1
    group = out[start:] + turn
    del out[start:]
    texts = [part for m in group if m["role"] == "user" for part in _parts(m["content"])]
    results = [m for m in group if m["role"] == "tool"]
    out += results
    if texts or not results:
        out.append({"role": "user", "content": texts})


def _parts(content: Any) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _turn(msg: Any, i: int, called: set[str]) -> list[dict]:
    """One Anthropic message as the chat's messages; ``called``: the tool_use ids of the
    message before it."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise invalid(f'{where} must be {{"role": "user" or "assistant", "content": ...}}', f"{where}.role")
    role, content = msg["role"], msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks, got {kind_of(content)}",
                      f"{where}.content", "invalid_type")
    texts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):       # a list here was looked up in the tables below: a 500
            raise invalid(f'{at} must be a block {{"type": "text", ...}}, got '
                          f'{kind_of(block) if kind is None else "a type that is " + kind_of(kind)}', f"{at}.type",
                          "invalid_type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            for key, kinds, what in (("id", str, "a string"), ("name", str, "a string"), ("input", dict, "an object")):
                if not isinstance(block.get(key), kinds) or block[key] == "":
                    raise invalid(f"{at}.{key} must be {what}, got {kind_of(block.get(key))}", f"{at}.{key}",
                                  "invalid_type")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       # as llama-server writes it: what the model wrote, so the cache holds
                                       "arguments": json.dumps(block["input"], ensure_ascii=False,
                                                               separators=(",", ":"))}})
        elif kind == "tool_result" and role == "user":
            use_id = block.get("tool_use_id")
            if not isinstance(use_id, str) or use_id not in called:
                raise invalid(f"{at}.tool_use_id {use_id!r}: no tool_use block of the message before it has that id; "
                              "each tool_result answers a tool_use of the assistant message just before it",
                              f"{at}.tool_use_id", "invalid_value")
            results.append({"role": "tool", "tool_call_id": use_id, "content": _result_text(block.get("content"), at)})
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind in _TEXT_FIELDS and (kind == "text" or role == "assistant"):
            field = _TEXT_FIELDS[kind]
            raise invalid(f"{at}.{field} must be a string, got {kind_of(block.get(field))}", f"{at}.{field}",
                          "invalid_type")
        elif kind in _BLOCK_ROLES:
            raise invalid(f"{at}.type={kind!r}: a {kind} block belongs in {_BLOCK_ROLES[kind]} message, and "
                          f"messages[{i}] is the {role}'s", f"{at}.type")
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
        raise invalid(f"tools must be a list, got {kind_of(tools)}", "tools", "invalid_type")
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


def _tool_choice(choice: Any, tools: list[dict]) -> dict:
    """The chat's tool_choice, checked against ``tools`` (the chat's) in Anthropic's words."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    kind = kind if isinstance(kind, str) else None
    names = [t["function"]["name"] for t in tools]
    out: dict[str, Any] = {}
    if kind in _TOOL_CHOICES:
        out["tool_choice"] = _TOOL_CHOICES[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        if choice["name"] not in names:
            raise invalid(f"tool_choice names tool {choice['name']!r}, which tools does not hold (tools has: "
                          f"{', '.join(map(repr, names)) or 'none'}); name one of those or add it to tools",
                          "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise invalid(f'tool_choice must be {{"type": "auto"}}, {{"type": "any"}}, {{"type": "none"}} or '
                      f'{{"type": "tool", "name": ...}}, got {choice!r}', "tool_choice")
    if kind == "any" and not names:
        raise invalid('tool_choice {"type": "any"} needs tools; give the tools in tools', "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


# ----------------------------------------------------------------------------- the answer


def message(env: Envelope, parts: list[tuple[str, Any]], finish_reason: str, stop_word: str | None,
            usage: dict) -> dict:
    """The chat's reply (``chat_reply.parts``) as an Anthropic message: a block a part, as
    the stream opens them."""
    blocks = [{"type": "thinking", "thinking": v, "signature": ""} if kind == "thinking" else
              {"type": "text", "text": v} if kind == "text" else _tool_use(v) for kind, v in parts]
    return {"id": env.id, "type": "message", "role": "assistant", "model": env.model, "content": blocks,
            **ending(finish_reason, stop_word), "usage": usage}


def ending(finish_reason: str, stop_word: str | None) -> dict:
    """stop_reason, and stop_sequence only where that is the reason: a call that ended at
    a stop sequence is "tool_use", with no stop_sequence, as Anthropic answers."""
    reason = stop_reason(finish_reason, stop_word)
    return {"stop_reason": reason, "stop_sequence": stop_word if reason == "stop_sequence" else None}


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


def _usage(run: Run, opening: bool = False) -> dict:
    """Anthropic's usage: ``input_tokens`` leave out the cache's reads. ``opening``: a
    stream's message_start, before any output, whose input counts are the final ones
    (the run is past its first chunk, which knows what the cache held)."""
    s = None if opening else run.stats
    cached = s.cached_tokens if s is not None else run.first.cached_tokens if run.first is not None else 0
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
            # the input as the whole answer has it: arguments that are no JSON object are {}
            out.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(_tool_use(call)["input"])}))
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


async def _events(reply: StreamedReply, env: Envelope, stops: tuple[str, ...]) -> AsyncIterator[dict]:
    run = reply.run
    start = {"id": env.id, "type": "message", "role": "assistant", "model": env.model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": _usage(run, opening=True)}
    yield {"type": "message_start", "message": start}
    blocks = _Blocks()
    async for delta in reply.deltas():
        for _, data in blocks.feed(delta):
            yield data
    for _, data in blocks.close():
        yield data
    word = _stop_word(reply.chunks, stops)
    yield {"type": "message_delta",
           "delta": ending(reply.finish_reason, word),
           "usage": _usage(run)}      # the cache's share is known once the prompt is in
    yield {"type": "message_stop"}
