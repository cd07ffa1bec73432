"""OpenAI's chat messages, read as pymtp hands them to a chat template, for the server's
requests and Python callers alike.

A message has a role (OpenAI's ``developer`` is read as ``system``, as llama-server reads
it) and its text: a string, or text parts, kept apart for the template to join
(chat.ChatTemplate.text_of). An assistant message may carry its calls (``tool_calls``,
OpenAI's shape) and its thinking (``reasoning_content``); a tool result its
``tool_call_id``. Every message but an assistant's needs its content (null reads as no
text, as llama-server reads it), and an assistant's its content or its calls. Anything
else is a ``ParamError`` naming the message's field and what it takes: a template given a
part it cannot read renders garbage, or fails deep inside.
"""

from __future__ import annotations

from typing import Any

from .config import ParamError, check_unicode

ROLES = ("system", "developer", "user", "assistant", "tool")


def kind_of(v: Any) -> str:
    """A JSON value's kind, as an error message names it."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def read_messages(messages: Any) -> list[dict]:
    """A conversation's messages, each read by ``read_message``."""
    if messages is None:
        raise ParamError("messages", "messages is required", "missing_required_parameter")
    if not isinstance(messages, (list, tuple)):
        raise ParamError("messages", f"messages must be a list of messages, got {kind_of(messages)}", "invalid_type")
    if not messages:
        raise ParamError("messages", "messages must not be empty", "empty_messages")
    read = [read_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    check_unicode(read, "messages")
    return read


def read_message(m: Any, where: str) -> dict:
    """One message as the template gets it (``where`` names it in errors)."""
    if not isinstance(m, dict):
        raise ParamError(where, f'{where} must be an object {{"role": ..., "content": ...}}, got {kind_of(m)}',
                         "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise ParamError(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    if "content" not in m and role != "assistant":
        raise ParamError(f"{where}.content", f"{where} ({role}) needs its content: only an assistant's may be "
                         "left out", "missing_required_parameter")
    if role == "assistant" and "content" not in m and not m.get("tool_calls"):
        raise ParamError(f"{where}.content", f"{where} (assistant) needs its content or its tool_calls",
                         "missing_required_parameter")
    out = {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)}
    if m.get("name") is not None:
        out["name"] = _string(m, "name", where)
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    if role == "assistant" and m.get("reasoning_content") is not None:    # a reply's thinking, sent back
        out["reasoning_content"] = _string(m, "reasoning_content", where)
    if role == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = _string(m, "tool_call_id", where)
    return out


def _string(m: dict, key: str, where: str) -> str:
    if not isinstance(m[key], str):
        raise ParamError(f"{where}.{key}", f"{where}.{key} must be a string, got {kind_of(m[key])}", "invalid_type")
    return m[key]


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's calls, as OpenAI sends them back: {"id", "type": "function",
    "function": {"name", "arguments"}} with the arguments as JSON text."""
    if not isinstance(calls, list):
        raise ParamError(where, f"{where} must be a list, got {kind_of(calls)}", "invalid_type")
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        # a call without its arguments rendered as broken JSON ("arguments": }); an id
        # of null or an object as "None" or a Python repr; another type as a function's
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), (str, dict)) \
                or c.get("type", "function") != "function" or not isinstance(c.get("id", ""), (str, type(None))):
            raise ParamError(f"{where}[{i}]", f'{where}[{i}] must be {{"id": "...", "type": "function", "function": '
                             f'{{"name": ..., "arguments": "<JSON text>"}}}}, got {_shown(c)}', "invalid_type")
        out.append({"id": c.get("id") or "", "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _shown(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _content(c: Any, where: str) -> str | list[str]:
    """A message's text, or its text parts as a list: the chat template decides how they
    join (chat.ChatTemplate.text_of)."""
    if c is None or isinstance(c, str):
        return c or ""
    if not isinstance(c, list):
        raise ParamError(f"{where}.content", f"{where}.content must be a string or a list of parts, got {kind_of(c)}",
                         "invalid_type")
    texts = []
    for j, part in enumerate(c):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ParamError(f"{where}.content[{j}].text", f"{where}.content[{j}].text must be a string, got "
                             f"{kind_of(part.get('text'))}", "invalid_type")
        if kind != "text":
            raise ParamError(f"{where}.content[{j}].type", f"{where}.content[{j}].type={kind!r} is not supported: "
                             'only text parts ({"type": "text", "text": ...}) are', "unsupported_parameter")
        texts.append(part["text"])
    return texts
