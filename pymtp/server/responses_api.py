"""OpenAI's Responses API, ``POST /v1/responses``, as llama-server serves it: stateless, a
request read into the chat route's request, its reply handed back as output items.
Clients that speak only this API (agents built on OpenAI's SDKs, coding CLIs) chat with
the served model.

The request (``to_chat``): ``instructions`` (a system message first, joined by the
input's opening system and developer items), ``input`` (a string, or items: messages
of ``input_text``/``output_text`` parts, ``function_call`` items, which join the
assistant turn before them, ``function_call_output`` items as tool messages,
``reasoning`` items as the next assistant turn's ``reasoning_content``; a last assistant
message is continued and the answer is only what follows it), ``tools``
(``function`` tools; others, such as ``web_search``, are left out, as llama-server leaves
them, since no server tool runs here), ``tool_choice``, ``parallel_tool_calls``,
``max_output_tokens``, ``text.format`` (``json_schema`` or ``json_object``: the chat's
``response_format``; beside tools, the text reply's: under "auto" the reply is calls or
the format, as the chat route takes them), and the chat route's own fields as they are; a 400 names the body's field, not
the chat's. Refused with a 400:
``previous_response_id`` and ``conversation`` (nothing is stored), ``background``, image
and file parts (a text model), item references.

The answer: a ``response`` whose ``output`` holds a ``reasoning`` item (the reply's
thinking), a ``message`` item with one ``output_text`` part, and a ``function_call`` item
per call; ``status`` "completed", or "incomplete" with ``incomplete_details.reason``
"max_output_tokens" (and the item the limit cut "incomplete" too); ``usage`` with ``input_tokens_details.cached_tokens``. A stream is the
API's events (``response.created``, ``response.output_item.added``, the text, reasoning
and arguments deltas and their ``.done`` events, ``response.completed`` or
``response.incomplete``), each with its ``sequence_number``, one item open at a time.

Logprobs: with ``include: ["message.output_text.logprobs"]`` (``top_logprobs`` for the
alternatives) each ``output_text`` holds its tokens' (and each text delta its own), as
``chat_reply`` places them: the thinking's, its tags' and a call's are left out. Without
it they are empty lists, as OpenAI's are.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..chat_messages import kind_of
from ..generate import Model

from ..results import Chunk
from .errors import CLIENT_CLOSED, APIError, invalid, unsupported
from .chat_reply import StreamedReply, parts as reply_parts, text_logprobs, whole_deltas
from .responses import Envelope
from .runs import canceller, collected, framed, started
from .body_fields import logprob_count, own_limit
from .schemas import GenerationRequest, parse_chat, parse_json
from .service import Run, Service, reasoning_tokens
from .sse import SSEResponse, named_event

# the body's fields that to_chat translates; the others go to the chat route as they are
_OWN = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning", "include",
        "store", "metadata", "previous_response_id", "conversation", "background", "truncation", "user",
        "service_tier", "prompt_cache_key", "safety_identifier", "stream_options", "messages", "max_tokens", "n",
        "max_completion_tokens", "top_logprobs", "logprobs"}
# the chat route's names for what a Responses body says otherwise (its 400s name the body's)
_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
          "continue_final_message": "input", "add_generation_prompt": "input", "reasoning_effort": "reasoning.effort"}
# what ``include`` may name (OpenAI's list); only the text's logprobs concern a text model
_INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
               "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
               "computer_call_output.output.image_url", "code_interpreter_call.outputs")
_REFUSED = {"previous_response_id": "nothing is stored here: send the whole conversation as input items",
            "prompt": "no prompt templates are stored here: send their instructions and input themselves",
            "conversation": "nothing is stored here: send the whole conversation as input items",
            "background": "a response is made while the request waits"}


def install_responses(app: FastAPI, service: Service, generating: list, guarded: list) -> None:
    """Add ``/v1/responses`` (and llama-server's other name, ``/responses``) behind
    ``generating``, and ``/v1/responses/input_tokens`` (OpenAI's count of a request's
    input tokens) behind ``guarded``."""

    @app.post("/v1/responses/input_tokens", dependencies=guarded)
    @app.post("/responses/input_tokens", dependencies=guarded)
    async def input_tokens(request: Request) -> dict:
        req = await asyncio.to_thread(to_chat, parse_json(await request.body()))
        return {"object": "response.input_tokens", "input_tokens": await service.count_chat_tokens(req)}

    @app.post("/v1/responses", dependencies=generating)
    @app.post("/responses", dependencies=generating)
    async def responses(request: Request) -> Response:
        body = parse_json(await request.body())
        req = await asyncio.to_thread(to_chat, body)
        try:
            runs = await started(service, request, [req])
        except APIError as exc:        # a prompt the context cannot hold named "messages"
            raise _renamed(exc, _function_at(body.get("tools"))) from None
        if runs is None:
            return Response(status_code=CLIENT_CLOSED)
        run = runs[0]
        env = Envelope("chat", service.model_id, id=f"resp_{uuid.uuid4().hex}")
        echo = _echo(body, req)
        if req.stream:
            items = _Items()      # the failure's response.failed carries what was streamed
            return SSEResponse(framed(_events(StreamedReply(env, run), env, echo, service.model, items),
                                      service.metrics, frame=_numbered(),
                                      failure=lambda exc: _failed(exc, env, echo, items)),
                               on_close=canceller(runs))
        chunks = (await collected(request, runs))[0]
        deltas, finish = whole_deltas(env, run, chunks)
        usage = _usage(run, chunks, service.model)
        output = output_items(reply_parts(deltas), finish, text_logprobs(deltas) if req.logprobs is not None else None)
        return JSONResponse(response(env, echo, output, finish, usage))


# ----------------------------------------------------------------------------- the request


def to_chat(body: dict) -> GenerationRequest:
    """The chat route's request for a Responses body."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False, ""):
            raise unsupported(name, body[name], f"is not supported: {why}")
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _OWN}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid(f"instructions must be a string, got {kind_of(instructions)}", "instructions", "invalid_type")
    chat["messages"] = _system_first(instructions, _input(body.get("input")))
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise invalid(f'reasoning must be an object such as {{"effort": "low"}}, got {kind_of(reasoning)}',
                      "reasoning", "invalid_type")
    if reasoning and reasoning.get("effort") is not None:     # the chat route's reasoning_effort
        chat["reasoning_effort"] = reasoning["effort"]
    if body.get("max_output_tokens") is not None:
        own_limit(body, "max_output_tokens")
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for name in ("text", "metadata"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise invalid(f"{name} must be an object, got {kind_of(body[name])}", name, "invalid_type")
    for key, value in (body.get("metadata") or {}).items():     # echoed back: OpenAI's strings only
        if not isinstance(value, str):
            raise invalid(f"metadata.{key} must be a string, got {kind_of(value)}", f"metadata.{key}", "invalid_type")
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    top = logprob_count(body, "top_logprobs")
    if "message.output_text.logprobs" in _include(body.get("include")):
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    try:
        req = parse_chat(chat)
    except APIError as exc:
        raise _renamed(exc, _function_at(body.get("tools"))) from None
    # the library's refusal of max_tokens names the field the body used (Service.start)
    return replace(req, n=1, max_tokens_field="max_output_tokens", format_field="text.format")


def _include(include: Any) -> list[str]:
    """``include``: OpenAI's names of what a response adds; those of tools and images that
    pymtp has none of add nothing. Without "message.output_text.logprobs" the text's
    logprobs are empty lists, as OpenAI's are, ``top_logprobs`` or not."""
    if include is None:
        return []
    if not isinstance(include, list):
        raise invalid(f"include must be a list of strings, got {kind_of(include)}", "include", "invalid_type")
    for i, name in enumerate(include):
        if name not in _INCLUDABLE:
            raise invalid(f"include[{i}] must be one of {', '.join(_INCLUDABLE)}, got {name!r}", f"include[{i}]",
                          "invalid_value")
    return include


def _renamed(exc: APIError, function_at: list[int]) -> APIError:
    """``exc`` naming the Responses body's field where the chat route's name differs;
    ``function_at[i]`` is the body's index of the chat's tools[i] (_function_at)."""
    if exc.param is None:
        return exc
    if exc.param.startswith("tool_choice.allowed_tools"):       # the body's are flat: tool_choice.tools[i]
        exc.param = exc.param.replace("tool_choice.allowed_tools", "tool_choice", 1)
        exc.message = exc.message.replace("tool_choice.allowed_tools", "tool_choice")
        return exc
    if exc.param == "tools":        # the chat's tools[i].function.name is the body's tools[i].name
        def body_tool(m: re.Match) -> str:
            i = int(m[1])
            return f"tools[{function_at[i] if i < len(function_at) else i}]{'.' if m[2] else ''}"
        exc.message = re.sub(r"\btools\[(\d+)\](\.function\.)?", body_tool, exc.message)
        return exc
    head = exc.param.partition("[")[0]
    name = _NAMES.get(head)
    if name is None:
        return exc
    if head == "messages" and exc.code == "context_length_exceeded":
        pass                      # said of the prompt, not of a message
    elif head == "messages":        # the chat's messages are numbered otherwise than the items
        exc.message = f"input, as chat messages: {exc.message}"
    elif head in exc.message:
        exc.message = exc.message.replace(head, name, 1)
    exc.param = name
    return exc


def _system_first(instructions: str | None, messages: list[dict]) -> list[dict]:
    """``instructions`` and the system and developer items that open the input, as one
    system message (joined by a blank line): Qwen3.5's template refuses a system message
    after the first, and clients such as Codex send instructions, then a developer item."""
    lead = [] if instructions is None else [instructions]
    n = 0
    while n < len(messages) and messages[n]["role"] in ("system", "developer"):
        lead.append("".join(p["text"] for p in messages[n]["content"]))
        n += 1
    if instructions is None and n <= 1:
        return messages
    return [{"role": "system", "content": "\n\n".join(lead)}, *messages[n:]]


def _input(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input must be a string or a non-empty list of items", "input",
                      "missing_required_parameter" if items is None else "invalid_type")
    out: list[dict] = []
    called: set[str] = set()          # the call_ids of the function_call items so far
    pending: dict[str, int] = {}      # those without their output yet: the item's index
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object, got {kind_of(item)}", where, "invalid_type")
        kind = item.get("type", "message")
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "message" and pending:     # as OpenAI's: "No tool output found for function call"
            _unanswered(pending)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                              f"{where}.role")
            parts = _parts(item.get("content"), f"{where}.content")
            if role == "assistant" and last is not None and not last.get("tool_calls"):
                last["content"] += parts          # after its reasoning item
            else:
                out.append({"role": role, "content": parts})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            called.add(call["id"])
            pending[call["id"]] = i
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": [], "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else "".join(p["text"] for p in _parts(output, f"{where}.output"))
            call_id = _string(item, "call_id", where)
            if call_id not in called:     # as OpenAI's: clients that trim a history count on the 400
                raise invalid(f"{where}.call_id {call_id!r}: no function_call item before it has that call_id; "
                              "send the function_call (call_id, name, arguments) before its output",
                              f"{where}.call_id", "invalid_value")
            pending.pop(call_id, None)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            texts = []
            for key in ("content", "summary"):      # the text, else its summary
                parts = item.get(key)
                if parts is not None and (not isinstance(parts, list) or not all(
                        isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts)):
                    raise invalid(f"{where}.{key} must be a list of parts with their text, got {kind_of(parts)}",
                                  f"{where}.{key}", "invalid_type")
                texts = texts or [p["text"] for p in parts or ()]
            if last is not None and not last["content"] and not last.get("tool_calls"):
                last["reasoning_content"] = "\n".join(filter(None, (last.get("reasoning_content"), *texts)))
            else:
                out.append({"role": "assistant", "content": [], "reasoning_content": "\n".join(texts)})
        else:
            raise unsupported(f"{where}.type", kind, "is not supported: pymtp takes message, function_call, "
                              "function_call_output and reasoning items")
    if pending:
        _unanswered(pending)
    return out


def _unanswered(pending: dict[str, int]) -> None:
    """Refuse the first function_call whose output did not come before the next message
    or the end: the model would see a call without its result."""
    call_id, i = min(pending.items(), key=lambda kv: kv[1])
    raise invalid(f"input[{i}] is a function_call (call_id {call_id!r}) that nothing answers: send its result "
                  "after it, as a function_call_output item with its call_id", f"input[{i}]", "invalid_value")


def _parts(content: Any, where: str) -> list[dict]:
    """A message's text as chat text parts (the template joins them)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of parts, got {kind_of(content)}", where, "invalid_type")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append({"type": "text", "text": part["refusal"]})
        else:
            raise unsupported(f"{where}[{j}].type", kind, "is not supported: pymtp serves text models "
                              "(input_text and output_text parts)")
    return out


def _string(item: dict, name: str, where: str) -> str:
    v = item.get(name)
    if not isinstance(v, str):
        raise invalid(f"{where}.{name} must be a string, got {kind_of(v)}", f"{where}.{name}", "invalid_type")
    return v


def _function_at(tools: Any) -> list[int]:
    """Each function tool's index among the body's ``tools``: the chat's tools[i] is the
    body's tools[_function_at(tools)[i]] once _tools has dropped the server tools."""
    if not isinstance(tools, list):
        return []
    return [i for i, t in enumerate(tools) if isinstance(t, dict) and t.get("type") == "function"]


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise invalid(f"tools must be a list, got {kind_of(tools)}", "tools", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise invalid(f"tools[{i}] must be an object, got {kind_of(t)}", f"tools[{i}]", "invalid_type")
        if t.get("type") != "function":     # a server tool (web_search ...): none runs here
            continue
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    """The chat's tool_choice for a Responses one (its functions named flat)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind == "allowed_tools":      # the chat route checks the rest; server tools run nowhere here
        tools = choice.get("tools")
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": [
            {"type": "function", "function": {"name": t.get("name")}} if isinstance(t, dict) and t.get("type") ==
            "function" else t for t in tools] if isinstance(tools, list) else tools}}
    if choice in ("auto", "none", "required"):
        return choice
    raise invalid(f'tool_choice must be "auto", "none", "required", {{"type": "function", "name": ...}} or '
                  f'{{"type": "allowed_tools", "mode": ..., "tools": [...]}}, got {choice!r}', "tool_choice")


def _format(text: Any) -> dict | None:
    """``text.format`` as the chat's ``response_format``."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid('text.format {"type": "json_schema"} needs "name": ... and "schema": {...} beside the type, '
                          f"with the schema as an object, got {fmt!r}", "text.format", "missing_required_parameter")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "reply"), "schema": fmt["schema"]}}
    raise invalid(f'text.format must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": "json_schema", '
                  f'"name": ..., "schema": {{...}}}}, got {fmt!r}', "text.format")


# ----------------------------------------------------------------------------- the answer


def output_items(parts: list[tuple[str, Any]], finish_reason: str,
                 logprobs: list[list[dict]] | None = None) -> list[dict]:
    """The chat's reply (``chat_reply.parts``) as output items, an item a part, as the
    stream makes them (``_Items``): a reply with none is an empty message, and the item
    the token limit cut (not a call) is "incomplete", as OpenAI marks it. ``logprobs``:
    a list per text part (``chat_reply.text_logprobs``), when asked."""
    texts = iter(logprobs or ())
    items = [_reasoning_item(v) if kind == "thinking" else _message_item(v, lps=next(texts, [])) if kind == "text"
             else _call_item(v, v["function"]["arguments"]) for kind, v in parts] or [_message_item("")]
    if finish_reason == "length" and items[-1]["type"] != "function_call":
        items[-1]["status"] = "incomplete"
    return items


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str | None, status: str = "completed", lps: list[dict] | None = None) -> dict:
    content = [] if text is None else [_text_part(text, lps)]
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str, lps: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": lps or []}


def _call_item(call: dict, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": arguments, "status": status}


def _echo(body: dict, req: GenerationRequest) -> dict:
    """The request's settings a response repeats."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    parallel = body.get("parallel_tool_calls")
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": True if parallel is None else parallel, "temperature": req.temperature,
            "top_p": req.top_p, "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": {**text, "format": text.get("format") or {"type": "text"}}, "metadata": body.get("metadata") or {},
            "store": False, "truncation": "disabled", "top_logprobs": body.get("top_logprobs"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}}


def response(env: Envelope, echo: dict, output: list[dict], finish_reason: str | None, usage: dict | None,
             status: str | None = None) -> dict:
    """The response object: ``status`` from the finish unless given (a stream's start)."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    return {"id": env.id, "object": "response", "created_at": env.created, "status": status,
            "model": env.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage, **echo}


def _usage(run: Run, chunks: list[Chunk], model: Model) -> dict:
    s = run.stats
    out = s.generated_tokens if s is not None else 0
    thinking = reasoning_tokens(model, run, (t for c in chunks for t in c.tokens)) or 0
    return {"input_tokens": run.prompt_tokens,
            "input_tokens_details": {"cached_tokens": s.cached_tokens if s is not None else 0, "cache_write_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": thinking},
            "total_tokens": run.prompt_tokens + out}


class _Items:
    """The stream's output items, one open at a time, from the chat's deltas."""

    def __init__(self) -> None:
        self.items: list[dict] = []       # as they will be in the response, done ones whole
        self.open: str | None = None      # "reasoning", "message" or None
        self.pieces: list[str] = []       # the open item's text so far
        self.lps: list[dict] = []         # the open message's text's logprobs so far (when asked)

    def feed(self, delta: dict) -> list[dict]:
        out: list[dict] = []
        if delta.get("reasoning_content"):
            out += self._start("reasoning")
            out.append(self._text_delta("response.reasoning_text.delta", delta["reasoning_content"]))
        if delta.get("content"):
            out += self._start("message")
            out.append(self._text_delta("response.output_text.delta", delta["content"], delta.get("logprobs")))
        for call in delta.get("tool_calls") or ():
            out += self.close()
            args = call["function"]["arguments"]
            item = _call_item(call, "", "in_progress")
            self.items.append(item)
            at = len(self.items) - 1
            done = {**item, "arguments": args, "status": "completed"}
            out += [{"type": "response.output_item.added", "output_index": at, "item": item},
                    {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": at,
                     "delta": args},
                    {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": at,
                     "name": item["name"], "arguments": args},
                    {"type": "response.output_item.done", "output_index": at, "item": done}]
            self.items[at] = done
        return out

    def close(self, status: str = "completed") -> list[dict]:
        if self.open is None:
            return []
        at, item, text, lps = len(self.items) - 1, self.items[-1], "".join(self.pieces), self.lps
        self.open, self.pieces, self.lps = None, [], []
        if item["type"] == "reasoning":
            done = {**item, "content": [{"type": "reasoning_text", "text": text}], "status": status}
            events = [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": at,
                       "content_index": 0, "text": text}]
        else:
            done = {**item, "content": [_text_part(text, lps)], "status": status}
            events = [{"type": "response.output_text.done", "item_id": item["id"], "output_index": at,
                       "content_index": 0, "text": text, "logprobs": lps},
                      {"type": "response.content_part.done", "item_id": item["id"], "output_index": at,
                       "content_index": 0, "part": _text_part(text, lps)}]
        self.items[at] = done
        return events + [{"type": "response.output_item.done", "output_index": at, "item": done}]

    def finish(self, finish_reason: str) -> list[dict]:
        """The last events of the items: a reply with no item at all gets an empty message;
        the text the token limit cut is "incomplete"."""
        status = "incomplete" if finish_reason == "length" else "completed"
        if not self.items:
            return self._start("message") + self.close(status)
        return self.close(status)

    def _start(self, kind: str) -> list[dict]:
        if self.open == kind:
            return []
        out = self.close()
        item = _reasoning_item("", "in_progress") if kind == "reasoning" else _message_item(None, "in_progress")
        if kind == "reasoning":
            item["content"] = []
        self.items.append(item)
        self.open = kind
        at = len(self.items) - 1
        out.append({"type": "response.output_item.added", "output_index": at, "item": item})
        if kind == "message":
            out.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": at,
                        "content_index": 0, "part": _text_part("")})
        return out

    def _text_delta(self, kind: str, text: str, lps: list[dict] | None = None) -> dict:
        self.pieces.append(text)
        self.lps += lps or []
        item = self.items[-1]
        extra = {"logprobs": lps or []} if kind == "response.output_text.delta" else {}
        return {"type": kind, "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0,
                "delta": text, **extra}


async def _events(reply: StreamedReply, env: Envelope, echo: dict, model: Model, items: _Items) -> AsyncIterator[dict]:
    yield {"type": "response.created", "response": response(env, echo, [], None, None, "in_progress")}
    yield {"type": "response.in_progress", "response": response(env, echo, [], None, None, "in_progress")}
    async for delta in reply.deltas():
        for ev in items.feed(delta):
            yield ev
    for ev in items.finish(reply.finish_reason):
        yield ev
    done = response(env, echo, items.items, reply.finish_reason, _usage(reply.run, reply.chunks, model))
    yield {"type": f"response.{done['status']}", "response": done}


def _numbered() -> Callable[[dict], bytes]:
    """The API's frames: each event with its sequence number, from 0."""
    numbers = itertools.count()
    return lambda obj: named_event({**obj, "sequence_number": next(numbers)})


def _failed(exc: APIError, env: Envelope, echo: dict, items: _Items) -> list[dict]:
    """A stream's end after a failure: the open item closed "incomplete", the error event,
    then ``response.failed`` with the items streamed so far, the terminal event a client
    waits for (Codex reads a stream closed without one as a dropped connection, and
    retries; the SDK's snapshot is rebuilt from it)."""
    closing = items.close("incomplete")
    failed = {**response(env, echo, items.items, None, None, status="failed"),
              "error": {"code": _failed_code(exc.status), "message": exc.message}}
    return [*closing, {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param},
            {"type": "response.failed", "response": failed}]


def _failed_code(status: int) -> str:
    """A failed response's error.code, one of the API's own (the error event keeps ours)."""
    return "rate_limit_exceeded" if status == 429 else "server_error" if status >= 500 else "invalid_prompt"
