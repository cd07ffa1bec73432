"""A reply's tool calls read back into OpenAI's ``tool_calls``: the ``<tool_call>`` blocks
of Qwen's (and Hermes') JSON form or the XML form of Qwen3.5's templates, found in a
whole reply (``parse_tool_calls``) or as it streams (``ToolCallStream``), each call's
arguments read against its function's schema (tools.py makes the prompt and grammar)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .schema_refs import pointed
from .stops import held_suffix

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is past a double's range")
    return value


def json_value(text: str) -> Any:
    """``text`` read as JSON proper: Python's reader also takes NaN, Infinity and 1e400
    (infinite), which it would write back into a call's arguments, where a client's JSON
    parser (JavaScript's) throws. Raises ``ValueError``."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def parse_call(body: str, schemas: dict[str, dict] | None = None) -> dict | None:
    """One ``<tool_call>`` block's body as an OpenAI tool call, or None when it is neither
    {"name", "arguments"} JSON nor the XML form, or (given the request's ``schemas``, its
    functions' parameters by name) calls a function the request does not offer: OpenAI's
    API answers calls of the request's functions only.

    The XML form's values are text, read by each parameter's schema (``_xml_value``): a
    string parameter keeps "10001" and "3.10" as written, a nullable one reads null as
    null, a number or an object is read as JSON."""
    body = body.strip()
    name, args = None, None
    try:
        value = json_value(body)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        name, args = value["name"], value.get("arguments", {})
    else:
        m = re.fullmatch(r"<function=([^>\s]+)>(.*?)</function>", body, re.S)
        if m is None:
            return None
        name, args = m.group(1), {}
        root = (schemas or {}).get(name, {})
        props = root.get("properties") if isinstance(root, dict) else None
        # a value ends at a </parameter> before the next parameter or the end, as the
        # grammar's does (at "\n</parameter>\n"): one inside it is the value's text
        for p in re.finditer(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>\s*(?=<parameter=|\Z)", m.group(2), re.S):
            key, raw = p.group(1), p.group(2)
            args[key] = _xml_value(raw, value_types(props.get(key), root) if isinstance(props, dict) else None)
    if schemas is not None and name not in schemas:
        return None
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"),
               (list, "array"), (dict, "object"))


def _json_type(value: Any) -> str:
    return next(name for kind, name in _JSON_TYPES if isinstance(value, kind))


def value_types(schema: Any, root: dict, depth: int = 0) -> set[str] | None:
    """The JSON types a parameter's schema allows (``type``, ``enum``, ``const``, the
    branches of ``anyOf``/``oneOf``, what ``allOf`` agrees on, local ``$ref``s followed
    in the function's ``root``), or None where it does not say."""
    if not isinstance(schema, dict) or depth > 32:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        return value_types(pointed(root, ref), root, depth + 1)      # MISSING says nothing, as None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)} or None
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return {_json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {_json_type(schema["const"])}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            branches = [value_types(b, root, depth + 1) for b in schema[key]]
            return None if None in branches else set().union(*branches)
    if isinstance(schema.get("allOf"), list):
        known = [t for t in (value_types(b, root, depth + 1) for b in schema["allOf"]) if t is not None]
        return set.intersection(*known) if known else None
    return None


def _xml_value(raw: str, types: set[str] | None) -> Any:
    """A value of Qwen3.5's XML call form (always text) as its parameter's schema reads it:
    JSON where it parses to a type the schema allows, else the text where it allows a
    string; without a schema, JSON where it parses."""
    try:
        value, parsed = json_value(raw), True
    except ValueError:
        value, parsed = raw, False
    if types is None:
        return value
    if parsed:
        kind = _json_type(value)
        if kind == "integer" and "number" in types or kind == "number" and "integer" in types and value.is_integer():
            return value
        if kind in types and kind != "string":
            return value
    return raw if "string" in types or not parsed else value


def parse_tool_calls(text: str, calls_lead: bool = False,
                     schemas: dict[str, dict] | None = None) -> tuple[str, list[dict]]:
    """A reply split into its text outside the ``<tool_call>`` blocks (stripped) and the
    calls they hold; a block that does not parse (or, given ``schemas``, calls another
    function) stays in the text. With ``calls_lead`` a reply that does not start with a
    block holds none (``ToolPlan.calls_lead``).

    Stripped as a stream hands the text out (``ChunkWriter._trimmed``): its end always,
    its start where a call comes first; the white space before text that comes first
    went out before any call was known."""
    stream = ToolCallStream(calls_lead, schemas)
    content, calls = stream.feed(text)
    more, last = stream.finish()
    content += more
    at = stream.first_call_at
    text_first = at is not None and bool(text[:at].strip())
    return (content.rstrip() if text_first else content.strip()), calls + last


class ToolCallStream:
    """Splits streamed text into content and tool calls as it comes: text that may be the
    start of ``<tool_call>`` is held back until it is known, a block until it closes.

    ``spans``: where the last ``feed``'s (or ``finish``'s) content came from, as (start,
    end) offsets into all the text fed, a span per piece (a call between two makes two),
    for placing the tokens that made it."""

    def __init__(self, calls_lead: bool = False, schemas: dict[str, dict] | None = None) -> None:
        self.schemas = schemas  # the request's functions (parse_call)
        self.held = ""          # text not yet handed out
        self.inside = False     # ``held`` is a block's body
        self.lead = calls_lead  # the reply's start says whether it is calls (ToolPlan.calls_lead)
        self.plain = False      # it said no: all of it is text
        self.fed = 0            # characters fed so far (``held`` is always their end)
        self.first_call_at: int | None = None     # where the first call's block starts in them
        self.spans: list[tuple[int, int]] = []
        self.dropped = 0        # characters at the end that ``finish(cut=True)`` left out

    def _out(self, out: list[str], piece: str, start: int) -> None:
        """Hand out ``piece``, the text fed from ``start`` (an offset into all of it)."""
        if piece:
            self.spans.append((start, start + len(piece)))
            out.append(piece)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.spans = []
        self.fed += len(text)
        if self.plain:
            if text:
                self.spans.append((self.fed - len(text), self.fed))
            return text, []
        self.held += text
        if self.lead:
            head = self.held.lstrip()
            if not head or CALL_OPEN.startswith(head):
                return "", []           # not known yet
            self.lead = False
            if not head.startswith(CALL_OPEN):
                self.spans.append((self.fed - len(self.held), self.fed))
                self.plain, out, self.held = True, self.held, ""
                return out, []
        out, calls = [], []
        while True:
            at = self.fed - len(self.held)          # where ``held`` starts in all the text fed
            if self.inside:
                end = self.held.find(CALL_CLOSE)
                while end >= 0 and in_value(self.held[:end]):     # an argument's text, not the end
                    end = self.held.find(CALL_CLOSE, end + 1)
                if end < 0:
                    break
                body, self.held, self.inside = self.held[:end], self.held[end + len(CALL_CLOSE):], False
                call = parse_call(body, self.schemas)
                if call is None:
                    self._out(out, CALL_OPEN + body + CALL_CLOSE, at - len(CALL_OPEN))
                else:
                    calls.append(call)
                    if self.first_call_at is None:
                        self.first_call_at = at - len(CALL_OPEN)
                continue
            start = self.held.find(CALL_OPEN)
            if start >= 0:
                self._out(out, self.held[:start], at)
                self.held, self.inside = self.held[start + len(CALL_OPEN):], True
                continue
            keep = held_suffix(self.held, (CALL_OPEN,))
            self._out(out, self.held[: len(self.held) - keep], at)
            self.held = self.held[len(self.held) - keep:]
            break
        return "".join(out), calls

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """What is left at the end: an unclosed block is parsed if it can be (a reply cut
        by max_tokens is not), else handed out as text, or, ``cut`` (the reply ended at
        max_tokens), left out with what may begin one, as llama-server drops a call it
        could not finish (its markup in the content was shown to users)."""
        held, inside = self.held, self.inside
        self.held, self.inside, self.spans = "", False, []
        at = self.fed - len(held)
        call = parse_call(held, self.schemas) if inside else None
        if call is not None:
            if self.first_call_at is None:
                self.first_call_at = at - len(CALL_OPEN)
            return "", [call]
        if cut and (inside or held):
            self.dropped = len(held) + (len(CALL_OPEN) if inside else 0)
            return "", []
        if inside:
            self.spans.append((at - len(CALL_OPEN), self.fed))
            return CALL_OPEN + held, []
        if held:
            self.spans.append((at, self.fed))
        return held, []


def in_value(body: str) -> bool:
    """Whether a call block's text so far ends inside an argument: in a JSON string, or
    (the XML form) before its function's ``</function>``. A ``</tool_call>`` there is the
    argument's text (the grammar allows it), not the block's end."""
    head = body.lstrip()
    if head.startswith("<function="):
        return not head.rstrip().endswith("</function>")
    inside = escaped = False
    for c in head:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = inside
        elif c == '"':
            inside = not inside
    return inside
