"""JSON schemas as GBNF grammars: llama-cpp-python's ``SchemaConverter``, with what it gets
wrong for the schemas clients send put right before or as it writes each rule.

The converter of the pinned llama-cpp-python (0.3.36) is an older port of llama.cpp's; a
review against llama-server found where it fails (each has a test in
tests/test_schema_grammar.py):

- a long ``maxLength``/``maxItems`` became ``(x (x (...)?)?)?`` nested once per item, which
  llama.cpp's grammar parser reads recursively: 20,000 crashed the process, 1,500 was
  refused. Here they are GBNF's ``x{m,n}`` (past 2,000 llama.cpp reads no bound, as
  llama-server's converter does);
- a ``type`` list (OpenAI's nullable field, ``["string", "null"]``) kept the types and
  dropped every other keyword (``enum``, ``properties``, ``items``, ``maxLength``);
- ``items: {}`` (pydantic's ``list[Any]``) was an error, and ``{}`` an object, not any value;
- a backslash in an ``enum``/``const`` value or a property name was left unescaped: the
  text it allowed was not JSON, or the grammar did not parse;
- a pattern's ``\\d``, ``\\w``, ``\\s`` and escaped punctuation (``\\.``) were refused;
- ``minimum``/``maximum`` of an integer were ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, SchemaConverter

# what a schema may use to say what it allows; a schema with none of them allows any value
_STRUCTURAL = {"type", "$ref", "anyOf", "oneOf", "allOf", "const", "enum", "properties", "additionalProperties",
               "items", "prefixItems", "pattern", "format", "minLength", "maxLength", "minItems", "maxItems",
               "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_ANY = {"description": "any JSON value"}     # what ``{}`` and ``true`` become where a dict is read
# the most a pattern's quantifier may count: the converter nests its optional repeats
_PATTERN_COUNT = 1000
_CLASS_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\x0B\\x0C"}
_NEGATED = {"D": "d", "W": "w", "S": "s"}
_KEPT_ESCAPES = set("ntrfvux0123456789")      # GBNF reads these as the regex does (\n, \u00e9 ...)


class SchemaGrammar(SchemaConverter):
    """``SchemaConverter`` with the fixes in this module's docstring."""

    def __init__(self, prop_order: dict[str, int] | None = None) -> None:
        super().__init__(prop_order=prop_order or {}, allow_fetch=False, dotall=False, raw_pattern=False)

    def _format_literal(self, literal: str) -> str:
        out = literal.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n")
        return f'"{out}"'

    def visit(self, schema: Any, name: str) -> str:
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        if schema is True or (isinstance(schema, dict) and not _STRUCTURAL & schema.keys()):
            return self._add_rule(rule_name, self._add_primitive("value", PRIMITIVE_RULES["value"]))
        if not isinstance(schema, dict):
            raise ValueError(f"a schema must be an object or true, got {schema!r}")
        types = schema.get("type")
        if isinstance(types, list) and not {"anyOf", "oneOf", "$ref"} & schema.keys():
            if "const" in schema or "enum" in schema:      # the values say it all
                return super().visit({k: v for k, v in schema.items() if k != "type"}, name)
            rest = {k: v for k, v in schema.items() if k != "type"}
            return super().visit({"anyOf": [{**rest, "type": t} for t in types]}, name)
        if schema.get("items") in ({}, True):
            schema = {**schema, "items": _ANY}
        if isinstance(schema.get("pattern"), str):
            schema = {**schema, "pattern": plain_pattern(schema["pattern"])}
        if types == "integer" and ({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & schema.keys()):
            lo, hi = _int_bounds(schema)
            return self._add_rule(rule_name, f"({integer_range(lo, hi)}) space")
        if types in (None, "array") and isinstance(schema.get("items"), dict) and "prefixItems" not in schema \
                and ("minItems" in schema or "maxItems" in schema):
            item = self.visit(schema["items"], f"{name}{'-' if name else ''}item")
            body = separated(item, '"," space', schema.get("minItems", 0), schema.get("maxItems"))
            return self._add_rule(rule_name, f'"[" space {body} "]" space')
        if types == "string" and ("minLength" in schema or "maxLength" in schema) \
                and not {"pattern", "format"} & schema.keys():
            char = self._add_primitive("char", PRIMITIVE_RULES["char"])
            body = repeated(char, schema.get("minLength", 0), schema.get("maxLength"))
            return self._add_rule(rule_name, f'"\\"" {body} "\\"" space')
        return super().visit(schema, name)


def repeated(item: str, low: int, high: int | None) -> str:
    """``item`` from ``low`` to ``high`` times (None: no bound), in GBNF's counts."""
    _count(low, high)
    if high is None:
        return f"({item}){{{low},}}" if low else f"({item})*"
    if high == 0:
        return ""
    return f"({item}){{{low},{high}}}" if low != high else f"({item}){{{low}}}"


def separated(item: str, sep: str, low: int, high: int | None) -> str:
    """``item`` from ``low`` to ``high`` times with ``sep`` between them."""
    _count(low, high)
    if high == 0:
        return ""
    rest = repeated(f"{sep} {item}", max(low - 1, 0), None if high is None else high - 1)
    return f"{item} {rest}" if low else f"({item} {rest})?"


def _count(low: Any, high: Any) -> None:
    for v in (low, high):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"a count (minItems, maxItems, minLength, maxLength) must be an integer >= 0, got {v!r}")
    if high is not None and high < low:
        raise ValueError(f"a maximum count ({high}) below its minimum ({low}) allows nothing")


def _int_bounds(schema: dict) -> tuple[int | None, int | None]:
    """An integer schema's inclusive bounds (None: unbounded)."""
    import math

    lo = hi = None
    for key, up, strict in (("minimum", False, False), ("exclusiveMinimum", False, True),
                            ("maximum", True, False), ("exclusiveMaximum", True, True)):
        v = schema.get(key)
        if v is None or isinstance(v, bool):
            continue
        if not isinstance(v, (int, float)):
            raise ValueError(f"{key} must be a number, got {v!r}")
        if up:
            b = math.floor(v) - (1 if strict and v == math.floor(v) else 0)
            hi = b if hi is None else min(hi, b)
        else:
            b = math.ceil(v) + (1 if strict and v == math.ceil(v) else 0)
            lo = b if lo is None else max(lo, b)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"no integer lies between the bounds {lo} and {hi}")
    return lo, hi


def integer_range(lo: int | None, hi: int | None) -> str:
    """A GBNF expression of the integers from ``lo`` to ``hi`` (None: unbounded), written
    as JSON writes them (no leading zeros, "-0" not among them)."""
    if lo is not None and hi is not None and hi < 0:
        return f'"-" ({integer_range(-hi, -lo)})'
    if lo is not None and lo < 0:
        neg = f'"-" ({_naturals(1, -lo)})'
        return neg if hi is not None and hi < 0 else f"{neg} | {integer_range(0, hi)}"
    if lo is None:
        neg = '"-" [1-9] [0-9]*'
        return f"{neg} | {_naturals(0, hi)}" if hi is None or hi >= 0 else f'"-" ({_naturals(-hi, None)})'
    return _naturals(lo, hi)


def _naturals(lo: int, hi: int | None) -> str:
    """Integers from ``lo`` >= 0 to ``hi`` (None: unbounded), without leading zeros."""
    if hi is None:
        n = len(str(lo))
        longer = f"[1-9] [0-9]{{{n},}}"
        return f"{_naturals(lo, 10 ** n - 1)} | {longer}"
    alts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10 ** n - 1)
        if a <= b:
            alts += _same_length(str(a), str(b))
    return " | ".join(alts)


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives for the numbers from ``a`` to ``b``, two digit strings of one length."""
    if not a:
        return ['""']
    if a[0] == b[0]:
        inner = " | ".join(_same_length(a[1:], b[1:]))
        return [f'"{a[0]}"' if inner == '""' else f'"{a[0]}" ({inner})']
    n = len(a) - 1
    out = []
    first_full = a[1:] == "0" * n
    last_full = b[1:] == "9" * n
    lo_digit = int(a[0]) + (0 if first_full else 1)
    hi_digit = int(b[0]) - (0 if last_full else 1)
    if not first_full:
        out.append(f'"{a[0]}" ({" | ".join(_same_length(a[1:], "9" * n))})')
    if lo_digit <= hi_digit:
        digits = f"[{lo_digit}-{hi_digit}]" if lo_digit != hi_digit else f'"{lo_digit}"'
        out.append(f"{digits} [0-9]{{{n}}}" if n else digits)
    if not last_full:
        out.append(f'"{b[0]}" ({" | ".join(_same_length("0" * n, b[1:]))})')
    return out


def plain_pattern(pattern: str) -> str:
    """A JSON schema ``pattern`` in the regex forms the converter reads: ``\\d``, ``\\w`` and
    ``\\s`` (and their negations outside a class) as character classes, an escaped mark
    (``\\.``) as a class of that character by its code. Escapes GBNF reads as the regex
    does (``\\n``, ``\\uXXXX``) stay. A quantifier may count to ``_PATTERN_COUNT``."""
    out, i, n, depth = [], 0, len(pattern), False     # depth: inside [...]
    while i < n:
        c = pattern[i]
        if c == "[":
            depth = True
        elif c == "]":
            depth = False
        if c == "{" and not depth:
            j = pattern.find("}", i)
            if j > 0 and re.fullmatch(r"\s*\d*\s*(,\s*\d*\s*)?", pattern[i + 1:j]):
                if any(int(x) > _PATTERN_COUNT for x in re.findall(r"\d+", pattern[i + 1:j])):
                    raise ValueError(f"pattern {pattern!r} counts past {_PATTERN_COUNT} in {pattern[i:j + 1]}; "
                                     "use maxLength for a long string")
        if c != "\\" or i + 1 >= n:
            out.append(c)
            i += 1
            continue
        e = pattern[i + 1]
        i += 2
        if e in _CLASS_ESCAPES:
            out.append(_CLASS_ESCAPES[e] if depth else f"[{_CLASS_ESCAPES[e]}]")
        elif e in _NEGATED:
            if depth:
                raise ValueError(f"pattern {pattern!r}: \\{e} inside [...] is not supported; write the class out")
            out.append(f"[^{_CLASS_ESCAPES[_NEGATED[e]]}]")
        elif e in _KEPT_ESCAPES or e == "\\":
            out.append("\\" + e)
        elif e.isalnum():
            raise ValueError(f"pattern {pattern!r}: \\{e} is not supported (word boundaries, backreferences)")
        else:       # an escaped mark: itself, by its code
            code = f"\\x{ord(e):02X}" if ord(e) < 0x100 else f"\\u{ord(e):04X}"
            out.append(code if depth else f"[{code}]")
    return "".join(out)


def schema_gbnf(schema: Any, prop_order: dict[str, int] | None = None) -> str:
    """The GBNF grammar of a JSON schema (a dict, ``true``); its local refs must be
    ``#/$defs/NAME`` (schema_refs.flat_refs), the root not a ref."""
    conv = SchemaGrammar(prop_order)
    if isinstance(schema, dict):
        schema = conv.resolve_refs(json.loads(json.dumps(schema)), "")
    conv.visit(schema, "")
    return conv.format_grammar()
