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
- a pattern's ``\\d``, ``\\w``, ``\\s`` and escaped punctuation (``\\.``) were refused, and a
  pattern was written into the JSON string as it is: its ``.``, negated classes, ``\\n``
  and quotes let through raw quotes, backslashes and control characters (not JSON). Here
  a pattern is the JSON text of the strings it matches (``plain_pattern``);
- ``minimum``/``maximum`` of an integer were ignored;
- arrays: ``prefixItems`` beside ``items`` dropped the tuple, counts without ``items``
  were ignored, and a tuple's count (or a string's length beside an unknown ``format``)
  took the nested form above;
- a pattern's top-level ``|`` split the string's quotes between its branches (``^yes|no$``
  wrote ``"yes`` or ``no"``), and its branches' anchors became characters;
- ``allOf`` was read as an object of its parts' properties (pydantic v1's enum fields
  became ``{}``), and keywords beside ``anyOf`` were dropped (``required`` among them);
- a ``number``'s ``minimum``/``maximum`` (and their exclusive forms, draft 4's boolean
  ones too) were ignored, as llama-server's converter ignores them. Here a bounded
  number is written without an exponent, its digits checked against the bounds';
- a string's length beside a pattern was dropped: beside one character repeated
  (``^[a-z]+$``) it cuts the count now (``counted_pattern``);
- keywords beside a ``$ref`` were dropped (``{"$ref": ..., "maxLength": 3}``): they hold
  as well as the target, as an ``allOf`` of the two;
- a second review: an optional property beside ``additionalProperties`` let the other keys
  follow without a comma (``{"a": 1"x": 2}``, ``format_grammar``); merged schemas kept the
  later one's bounds, not the stricter (``merge_schemas``); a strict bound let through a
  decimal that reads as the bound itself as a float (``_inside``); nested counts in a
  pattern stalled llama.cpp's grammar for minutes (``_nested_count``); pydantic v1's
  recursive models were a RecursionError;
- a fourth: merged schemas (``allOf``'s parts, a ref's siblings, the keywords beside
  ``anyOf``) took the later one's type, enum, items, anyOf and shared property schemas: an
  integer property with bounds in another part took decimals, an enum of two parts took the
  values of either. Each keyword of both is now the two intersected (``merge_schemas``);
  two patterns or formats, which one grammar cannot write, are refused. A malformed
  pattern (``^(a$``, ``a{2,1}``) was written as some other one; it is refused too;
- a fifth: a ``required`` name that ``properties`` leaves out was dropped (objects without
  it passed), ``"required": "ab"`` required "a" and "b", a list of properties was an
  AttributeError, 1,000 optional properties a RecursionError (``_build_object_rule``); a
  number bounded on one side only let a model write digits until ``max_tokens``
  (``_DIGITS``).

Still as the base converter reads them (documented in the README): a string's length
beside any other pattern; ``uniqueItems``, ``multipleOf``, ``minProperties``/
``maxProperties``, ``not``, ``patternProperties``, a length beside a ``format``; ``oneOf``
as ``anyOf``; other keys (``additionalProperties``) may repeat a declared name (one whose
schema is ``false`` too: left out of the properties, it may still come as another key); a bound
past 1e20 is none; ``\\u`` escapes of lone surrogates pass as string characters. A branch of
``anyOf`` that no value satisfies is dropped (the schema is refused when all are). An
``enum``/``const`` keeps the values the keywords beside it allow. llama.cpp's
grammar reads a token of bytes that are not UTF-8 as characters, so such a token can pass
a class that names what it leaves out (and a string's count of characters).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Iterator, Optional

from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, SchemaConverter

# what a schema may use to say what it allows; a schema with none of them allows any value
_STRUCTURAL = {"type", "$ref", "anyOf", "oneOf", "allOf", "const", "enum", "properties", "additionalProperties",
               "items", "prefixItems", "pattern", "format", "minLength", "maxLength", "minItems", "maxItems",
               "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
# a schema without a type whose keywords name one (every keyword of one kind only)
_KIND_OF = {"string": {"minLength", "maxLength", "pattern"}, "array": {"items", "prefixItems", "minItems", "maxItems"},
            "number": _BOUNDS}
_BRANCHED = {"$ref", "anyOf", "oneOf", "allOf", "const", "enum"}     # the base converter's own
_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}   # ... and these
# an integer bound past this many is none (a float's 1e308 would write 309 alternatives)
_FAR = 10 ** 20
# a number's bound nearer zero than this is refused (1e-300 would be 300 nested digits)
_NEAR = Decimal("1e-30")
# the most digits a bounded number's open side writes before (and after) its point, as the
# base converter's and llama.cpp's integral and decimal parts: without a cap ``minimum: 0``
# let a model write digits until max_tokens
_DIGITS = 16
# the most a pattern's quantifier may count: the converter nests its optional repeats
_PATTERN_COUNT = 1000
# ... and the most counts nested in counted groups may multiply to: (a{0,20}){0,20} took
# llama.cpp's grammar 19-59 s for one full-vocabulary mask (a review), (a{0,10}){0,10} 0.3 s
_NESTED_COUNT = 64
# Python's words for a pattern that is malformed in ECMAScript's regexes too
_MALFORMED = ("missing )", "unbalanced parenthesis", "min repeat greater than max repeat", "multiple repeat",
              "nothing to repeat", "unterminated character set")


class NoValue(ValueError):
    """A schema no JSON value satisfies (bounds past each other, an enum of nothing that
    fits, ``false``): refused alone, dropped as one branch of several."""


class SchemaGrammar(SchemaConverter):
    """``SchemaConverter`` with the fixes in this module's docstring: ``visit`` reads what
    it must, the base class the rest."""

    def __init__(self, prop_order: dict[str, int] | None = None) -> None:
        super().__init__(prop_order=prop_order or {}, allow_fetch=False, dotall=False, raw_pattern=False)
        self._inlining: set[str] = set()      # the refs whose targets are being merged into a schema

    def _generate_union_rule(self, name: str, alt_schemas: list) -> str:
        """anyOf/oneOf (and a list of types): the branches some value satisfies, as pydantic's
        optional fields of a type with impossible bounds say; none of them: ``NoValue``."""
        rules, first = [], None
        for i, alt in enumerate(alt_schemas):
            try:
                rules.append(self.visit(alt, f"{name}{'-' if name else 'alternative-'}{i}"))
            except NoValue as exc:
                first = first or exc
        if not rules:
            raise first or NoValue("an empty anyOf allows nothing")
        return " | ".join(rules)

    def _build_object_rule(self, properties: list, required: set, name: str, additional_properties: Any) -> str:
        """An object's rule: its required properties in order, then any of its optional ones
        (and other keys, where ``additionalProperties`` allows them) in order, each after a
        comma. The base class's rule put the other keys after an optional property without
        a comma (``{"a": 1"x": 2}`` passed), dropped a required name that ``properties``
        does not define, and built the optional chain recursively (a RecursionError at
        1,000 optional properties, 2 s at 900); this one builds it from the end.

        A property whose schema is ``false`` (pydantic's excluded field, a client's "never
        send this") is one the object must leave out. A required name ``properties`` leaves
        undefined takes ``additionalProperties``' schema (any value where it is absent)."""
        defined = {k for k, _ in properties}
        extra = True if additional_properties is None else additional_properties
        for key in sorted(set(required) - defined):
            if extra is False:
                raise NoValue(f"property {key!r} is required, but properties does not define it and "
                              "additionalProperties is false")
            properties = [*properties, (key, extra)]
        banned = sorted(k for k, v in properties if v is False and k in required)
        if banned:
            raise NoValue(f"property {banned[0]!r} is required, but its schema is false (no value)")
        order = self._prop_order
        kept = sorted(((i, k, v) for i, (k, v) in enumerate(properties) if v is not False),
                      key=lambda ikv: (order.get(ikv[1], len(order)), ikv[0]))
        head = f"{name}-" if name else ""
        kvs = {}
        for _, key, schema in kept:
            value = self.visit(schema, f"{head}{key}")
            kvs[key] = self._add_rule(f"{head}{key}-kv",
                                      f'{self._format_literal(json.dumps(key))} space ":" space {value}')
        needed = [kvs[k] for _, k, _ in kept if k in required]
        optional = [(k, kvs[k]) for _, k, _ in kept if k not in required]
        if additional_properties is True or isinstance(additional_properties, dict):
            value = self.visit({} if additional_properties is True else additional_properties, f"{head}additional-value")
            kv = self._add_rule(f"{head}additional-kv", f'{self._add_primitive("string", PRIMITIVE_RULES["string"])} '
                                f'":" space {value}')
            optional.append(("*", self._add_rule(f"{head}additional-kvs", f'{kv} ( "," space {kv} )*')))
        # after the i-th optional item: each later one or none, in order, after a comma
        tails: list[str] = [""] * len(optional)
        for i in range(len(optional) - 2, -1, -1):
            later = f'( "," space {optional[i + 1][1]} )?' + (f" {tails[i + 1]}" if tails[i + 1] else "")
            tails[i] = self._add_rule(f"{head}{optional[i][0]}-rest", later)
        firsts = " | ".join(f"{rule} {tail}".rstrip() for (_, rule), tail in zip(optional, tails))
        parts = ['"{" space', ' "," space '.join(needed)]
        if firsts:
            parts.append(f'( "," space ( {firsts} ) )?' if needed else f"( {firsts} )?")
        return " ".join(p for p in [*parts, '"}" space'] if p)

    def _format_literal(self, literal: str) -> str:
        """A GBNF literal of ``literal``'s text, backslashes and quotes escaped. The base
        class hands enum/const values and property names over as ``json.dumps`` wrote them,
        non-ASCII as ``\\uXXXX``: they are the UTF-8 text itself here (as llama-server's
        converter writes them), not escapes the model must spell six characters at a time."""
        literal = _utf8_json(literal)
        out = literal.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n")
        return f'"{out}"'

    def visit(self, schema: Any, name: str) -> str:
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        if is_any(schema):
            return self._add_rule(rule_name, self._add_primitive("value", PRIMITIVE_RULES["value"]))
        if not isinstance(schema, dict):
            raise (NoValue if schema is False else ValueError)(f"a schema must be an object or true, got {schema!r}")
        _object_words(schema)
        if schema.get("type") == "object" and "required" in schema and not {"properties", "additionalProperties"} \
                & schema.keys() and not _BRANCHED & schema.keys():
            # any object holding the names: the rule below, other keys allowed
            return self.visit({**schema, "properties": {}, "additionalProperties": True}, name)
        if isinstance(schema.get("$ref"), str) and (_STRUCTURAL - {"$ref"}) & schema.keys():
            # keywords beside a ref hold as well as its target (draft 2019-09 on; pydantic writes them)
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return self.visit({**rest, "allOf": [{"$ref": schema["$ref"]}, *rest.get("allOf", [])]}, name)
        if ("const" in schema or "enum" in schema) and not {"anyOf", "oneOf", "allOf", "$ref"} & schema.keys():
            return super().visit({"enum": _values(schema)}, name)     # the values the keywords beside allow
        types = schema.get("type")
        if isinstance(types, list) and not {"anyOf", "oneOf", "$ref"} & schema.keys():
            rest = {k: v for k, v in schema.items() if k != "type"}
            return super().visit({"anyOf": [{**rest, "type": t} for t in types]}, name)
        if types is None and not (_BRANCHED | {"properties", "additionalProperties"}) & schema.keys():
            kinds = [k for k, words in _KIND_OF.items() if words & schema.keys()]
            if len(kinds) == 1:
                schema, types = {**schema, "type": kinds[0]}, kinds[0]
        if isinstance(schema.get("allOf"), list):      # every part holds: one schema of them all
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            refs = [part["$ref"] for part in schema["allOf"] if _ref_only(part)]
            if len(schema["allOf"]) == 1 and refs and not _STRUCTURAL & merged.keys() \
                    or set(refs) & self._inlining:
                # pydantic v1's described field of a model, or a ref inside its own target:
                # the ref itself, which the base class resolves, recursion and all
                return self.visit({"$ref": refs[0]}, name)
            for part in schema["allOf"]:
                merged = merge_schemas(merged, self._refs.get(part["$ref"], part) if _ref_only(part) else part)
            self._inlining |= set(refs)
            try:
                return self.visit(merged, name)
            finally:
                self._inlining -= set(refs)
        alts = "anyOf" if "anyOf" in schema else "oneOf" if "oneOf" in schema else None
        sides = {k: v for k, v in schema.items() if k in _STRUCTURAL | {"required"} and k != alts}
        if alts and sides and isinstance(schema[alts], list):   # the keywords beside apply to each branch
            return super().visit({alts: [_both_or_false(sides, b) for b in schema[alts]]}, name)
        if _BRANCHED & schema.keys():
            return super().visit(schema, name)
        if types == "integer" and _BOUNDS & schema.keys():
            lo, hi = _int_bounds(schema)
            return self._add_rule(rule_name, f"({integer_range(lo, hi)}) space")
        if types == "number" and _BOUNDS & schema.keys():
            return self._add_rule(rule_name, f"({number_range(*_number_bounds(schema))}) space")
        if types == "array":
            return self._add_rule(rule_name, self._array(schema, name))
        if types == "string" and isinstance(schema.get("pattern"), str):
            pattern = counted_pattern(schema["pattern"], schema.get("minLength", 0), schema.get("maxLength"))
            return super().visit({**schema, "pattern": plain_pattern(pattern)}, name)
        if types == "string" and ("minLength" in schema or "maxLength" in schema) \
                and schema.get("format") not in _FORMATS:
            char = self._add_primitive("char", PRIMITIVE_RULES["char"])
            body = repeated(char, schema.get("minLength", 0), schema.get("maxLength"))
            return self._add_rule(rule_name, f'"\\"" {body} "\\"" space')
        return super().visit(schema, name)

    def _array(self, schema: dict, name: str) -> str:
        """An array's rule: its ``prefixItems`` in order, then ``items`` (any value where
        there is none; nothing more where it is false or, beside a tuple, absent), as
        many as ``minItems``/``maxItems`` allow."""
        prefix, items = schema.get("prefixItems") or [], schema.get("items")
        if isinstance(items, list):           # the older tuple form, extra ones in additionalItems
            prefix, items = items, schema.get("additionalItems")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        _count(low, high)
        head = name + "-" if name else ""
        tuple_ = [self.visit(p, f"{head}tuple-{i}") for i, p in enumerate(prefix)]
        more = items is not False and (items is not None or not prefix)
        if high is not None and high < len(tuple_):
            tuple_ = tuple_[:high]
        if not more and low > len(tuple_):
            raise NoValue(f"minItems {low} asks for more items than the array allows ({len(tuple_)})")
        sep = '"," space'
        body = f" {sep} ".join(tuple_)
        if more:
            item = self.visit(True if items is None else items, f"{head}item")
            if tuple_:
                rest = repeated(f"{sep} {item}", max(low - len(tuple_), 0), None if high is None else high - len(tuple_))
                body = f"{body} {rest}"
            else:
                body = separated(item, sep, low, high)
        return f'"[" space {body} "]" space'


def _utf8_json(text: str) -> str:
    """JSON text that ``json.dumps`` wrote with its non-ASCII escaped, written as UTF-8 (a
    lone surrogate, which UTF-8 cannot hold, keeps its escape); any other text as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if json.dumps(value) != text:
        return text
    plain = json.dumps(value, ensure_ascii=False)
    return text if any(0xD800 <= ord(c) <= 0xDFFF for c in plain) else plain


def _values(schema: dict) -> list:
    """An ``enum``/``const``'s values that the keywords beside it allow (its type, a
    string's length and pattern, a number's bounds), in order; none is an error."""
    values = [schema["const"]] if "const" in schema else schema["enum"]
    if not isinstance(values, list):
        raise ValueError(f"enum must be a list of values, got {values!r}")
    if "const" in schema and "enum" in schema:
        values = [v for v in values if v in schema["enum"]]
    kept = [v for v in values if _fits(v, schema)]
    if not kept:
        raise NoValue(f"no value of {values!r} fits the keywords beside it")
    return kept


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "object": (dict,), "array": (list,)}


def _is_type(value: Any, name: str) -> bool:
    """Whether a JSON value is of a schema's type (a bool is no number; 2.0 is an integer)."""
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, _JSON_TYPES.get(name, ()))


def _fits(value: Any, schema: dict) -> bool:
    """Whether an enum's value meets the keywords beside it that can be read from it alone."""
    types = schema.get("type")
    if types is not None and not any(_is_type(value, t) for t in (types if isinstance(types, list) else [types])):
        return False
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            return False
        if isinstance(schema.get("pattern"), str) and not re.search(schema["pattern"], value):
            return False
    if _is_number(value) and math.isfinite(value):
        x = _decimal(value)
        lo, hi = _bounds(schema)
        if lo is not None and (x < lo.value or (x == lo.value and lo.strict)):
            return False
        if hi is not None and (x > hi.value or (x == hi.value and hi.strict)):
            return False
    return True


# keywords two merged schemas may both set: both hold where the stricter does
_STRICTER = {"minimum": max, "exclusiveMinimum": max, "maximum": min, "exclusiveMaximum": min,
             "minLength": max, "maxLength": min, "minItems": max, "maxItems": min}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _decimal(v: int | float) -> Decimal:
    """A JSON number exactly as written: a float from its shortest repr (0.1 as 0.1)."""
    return Decimal(v if isinstance(v, int) else repr(v))


def _ref_only(part: Any) -> bool:
    return isinstance(part, dict) and set(part) == {"$ref"}


def merge_schemas(a: Any, b: Any) -> Any:
    """Two schemas that must both hold, as one the converter can write. Each keyword both
    set is the two intersected: their types, their enum/const values, the stricter bounds
    and counts, ``required`` joined, a property's (or ``items``') two schemas merged in turn
    (a property one part leaves to ``additionalProperties`` takes that), ``anyOf`` branches
    paired, refs and ``allOf`` kept side by side. A keyword they set apart that none of this
    combines (two patterns, two formats) is a ``ValueError`` naming it: dropping one let
    through what it forbids. Keys that say nothing of the value (a description) take ``b``'s."""
    a, b = _schema_part(a), _schema_part(b)
    out = {**a, **b}
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if key in _STRICTER and _is_number(x) and _is_number(y):
            out[key] = _STRICTER[key](x, y)
        elif _same(x, y) or key not in _STRUCTURAL | {"required"}:
            continue
        elif key == "type":
            out["type"] = _both_types(x, y)
        elif key == "required":
            out["required"] = sorted(set(x) | set(y))
        elif key == "allOf":
            out["allOf"] = [*x, *y]
        elif key == "$ref":
            del out["$ref"]
            out["allOf"] = [*out.get("allOf", []), {"$ref": x}, {"$ref": y}]
        elif key == "items" and not isinstance(x, list) and not isinstance(y, list):
            out["items"] = _both_or_false(x, y)
        elif key not in ("enum", "const", "pattern", "properties", "additionalProperties", "anyOf", "oneOf"):
            raise ValueError(f"two schemas that must both hold set {key} to {json.dumps(x)} and {json.dumps(y)}, "
                             f"which one grammar cannot write; give one {key}")
    _merge_values(a, b, out)
    _merge_objects(a, b, out)
    branches_a, branches_b = a.get("anyOf", a.get("oneOf")), b.get("anyOf", b.get("oneOf"))
    if isinstance(branches_a, list) and isinstance(branches_b, list) and not _same(branches_a, branches_b):
        out.pop("oneOf", None)
        pairs = []
        for x in branches_a:
            for y in branches_b:
                try:
                    pairs.append(merge_schemas(x, y))
                except NoValue:
                    continue
        if not pairs:
            raise NoValue("no branch of one anyOf meets a branch of the other")
        out["anyOf"] = pairs
    return out


def _schema_part(schema: Any) -> dict:
    """A schema as a dict to merge: true is ``{}``; false allows nothing."""
    if schema is True:
        return {}
    if schema is False:
        raise NoValue("a part of allOf is false")
    if not isinstance(schema, dict):
        raise ValueError(f"a schema in allOf/anyOf must be an object or true, got {schema!r}")
    return _object_words(schema)


def _object_words(schema: dict) -> dict:
    """``schema``, its ``properties`` and ``required`` checked: read as they came, a list of
    properties was an AttributeError and ``"required": "ab"`` required "a" and "b"."""
    props, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(props, dict):
        raise ValueError(f"properties must be an object of each property's schema by its name, got "
                         f"{json.dumps(props)[:80]}")
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ValueError(f"required must be a list of property names, got {json.dumps(required)[:80]}")
    return schema


def _both_or_false(x: Any, y: Any) -> Any:
    """Two schemas of one place (a property, the items) merged; none meets both: ``false``,
    the place left empty (a property out of the object) rather than the schema refused."""
    if x is True and y is True:
        return True
    try:
        return merge_schemas(x, y)
    except NoValue:
        return False


def _same(x: Any, y: Any) -> bool:
    """JSON's equality: 1 and 1.0 are one number, true is no number."""
    if _is_number(x) and _is_number(y):
        return x == y
    if type(x) is not type(y):
        return False
    if isinstance(x, list):
        return len(x) == len(y) and all(map(_same, x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


def _both_types(x: Any, y: Any) -> Any:
    """The types two ``type`` keywords share (an integer is a number); none is ``NoValue``."""
    xs, ys = (x if isinstance(x, list) else [x]), (y if isinstance(y, list) else [y])
    kept = [t for t in xs if t in ys or (t == "integer" and "number" in ys)]
    kept += ["integer" for t in xs if t == "number" and "integer" in ys and "integer" not in kept]
    if not kept:
        raise NoValue(f"types {json.dumps(x)} and {json.dumps(y)} share none")
    return kept[0] if len(kept) == 1 else kept


def _merge_values(a: dict, b: dict, out: dict) -> None:
    """enum/const of both: the values in both; two patterns beside values: the values both
    match (the grammar writes values, not the patterns); two patterns alone: an error."""
    values = [v for v in (_values_of(a), _values_of(b)) if v is not None]
    if len(values) == 2:
        out.pop("const", None)
        out["enum"] = [v for v in values[0] if any(_same(v, w) for w in values[1])]
        if not out["enum"]:
            raise NoValue(f"enums {json.dumps(values[0])} and {json.dumps(values[1])} share no value")
    patterns = [p.get("pattern") for p in (a, b)]
    if all(isinstance(p, str) for p in patterns) and patterns[0] != patterns[1]:
        if "enum" not in out and "const" not in out:
            raise ValueError(f"two schemas that must both hold set pattern to {json.dumps(patterns[0])} and "
                             f"{json.dumps(patterns[1])}, which one grammar cannot write; give one pattern")
        values = _values_of(out) or []
        kept = [v for v in values if not isinstance(v, str) or all(re.search(p, v) for p in patterns)]
        if not kept:
            raise NoValue(f"no value of {json.dumps(values)} matches both patterns")
        out.pop("const", None)
        out["enum"] = kept


def _values_of(schema: dict) -> list | None:
    if "const" in schema:
        return [v for v in [schema["const"]] if "enum" not in schema or any(_same(v, w) for w in schema["enum"])]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def _merge_objects(a: dict, b: dict, out: dict) -> None:
    """Properties of both: each name's two schemas merged, a part without the name giving
    its ``additionalProperties`` (``false`` there leaves the name out of the object)."""
    props_a, props_b = a.get("properties", {}), b.get("properties", {})
    more_a, more_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
    if not isinstance(props_a, dict) or not isinstance(props_b, dict):
        raise ValueError("properties must be an object of schemas")
    if props_a or props_b:
        out["properties"] = {k: _both_or_false(props_a.get(k, more_a), props_b.get(k, more_b))
                             for k in [*props_a, *(k for k in props_b if k not in props_a)]}
    if "additionalProperties" in a and "additionalProperties" in b:
        out["additionalProperties"] = _both_or_false(more_a, more_b)


def is_any(schema: Any) -> bool:
    """Whether a schema allows any JSON value: ``true``, or an object with nothing that
    says what it allows (``{}``, a description)."""
    return schema is True or (isinstance(schema, dict) and not _STRUCTURAL & schema.keys())


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
        raise NoValue(f"a maximum count ({high}) below its minimum ({low}) allows nothing")


@dataclass(frozen=True)
class Bound:
    """One side of a number's range: its value, and whether the value itself is out."""

    value: Decimal
    strict: bool


def _bounds(schema: dict) -> tuple[Bound | None, Bound | None]:
    """A number's lower and upper bounds (None: unbounded), exact as the schema wrote them
    (a float bound read from its shortest repr, 0.1 as 0.1). Draft 4's boolean
    ``exclusiveMinimum``/``exclusiveMaximum`` make ``minimum``/``maximum`` strict."""
    lo = hi = None
    for key, up, strict in (("minimum", False, False), ("exclusiveMinimum", False, True),
                            ("maximum", True, False), ("exclusiveMaximum", True, True)):
        v = schema.get(key)
        if v is None or isinstance(v, bool):
            continue
        if not _is_number(v) or not math.isfinite(v):
            raise ValueError(f"{key} must be a finite number, got {v!r}")
        b = Bound(_decimal(v), strict or schema.get(
            "exclusiveMaximum" if up else "exclusiveMinimum") is True)
        if up and (hi is None or b.value < hi.value or (b.value == hi.value and b.strict)):
            hi = b
        if not up and (lo is None or b.value > lo.value or (b.value == lo.value and b.strict)):
            lo = b
    return lo, hi


def _int_bounds(schema: dict) -> tuple[int | None, int | None]:
    """An integer schema's inclusive bounds (None: unbounded)."""
    low, high = _bounds(schema)
    lo = None if low is None else math.ceil(low.value) + (low.strict and low.value == math.ceil(low.value))
    hi = None if high is None else math.floor(high.value) - (high.strict and high.value == math.floor(high.value))
    if (lo is not None and lo > _FAR) or (hi is not None and hi < -_FAR):
        raise ValueError(f"integer bounds past {_FAR:.0e} are not supported")
    lo = None if lo is not None and lo < -_FAR else lo       # past the digits written: no bound
    hi = None if hi is not None and hi > _FAR else hi
    if lo is not None and hi is not None and lo > hi:
        raise NoValue(f"no integer lies between the bounds {lo} and {hi}")
    return lo, hi


def _number_bounds(schema: dict) -> tuple[Bound | None, Bound | None]:
    """A number schema's bounds, checked: some number lies between them, and they can be
    written in a few digits (past 1e20 a bound is none, as an integer's)."""
    lo, hi = _bounds(schema)
    for b in (lo, hi):
        if b is not None and b.value != 0 and abs(b.value) < _NEAR:
            raise ValueError(f"number bounds nearer zero than {_NEAR:.0e} are not supported")
    if (lo is not None and lo.value > _FAR) or (hi is not None and hi.value < -_FAR):
        raise ValueError(f"number bounds past {_FAR:.0e} are not supported")
    lo = None if lo is not None and lo.value < -_FAR else lo
    hi = None if hi is not None and hi.value > _FAR else hi
    if lo is not None and hi is not None and (lo.value > hi.value or (lo.value == hi.value and (lo.strict or hi.strict))):
        raise NoValue(f"no number lies between the bounds {lo.value} and {hi.value}")
    return _inside(lo, up=False), _inside(hi, up=True)


def _inside(b: Bound | None, up: bool) -> Bound | None:
    """A strict bound as the nearest float inside it, inclusive. Clients read a number as
    a float: 0.99999999999999999 lies below 1 but reads as 1.0, which ``< 1`` refuses. An
    inclusive bound is safe as it is (rounding keeps a decimal on its side of a float).
    Next to zero the float inside is ``_NEAR``: a bound of 5e-324 would be 324 digits."""
    if b is None or not b.strict:
        return b
    inside = math.nextafter(float(b.value), -math.inf if up else math.inf)
    if abs(inside) < _NEAR:
        inside = float(-_NEAR if up else _NEAR)
    return Bound(Decimal(repr(inside)), False)


def number_range(lo: Bound | None, hi: Bound | None) -> str:
    """A GBNF expression of the JSON numbers between ``lo`` and ``hi`` (None: unbounded),
    written without an exponent: every number in the range has such a form. Negative ones
    are a minus sign before the positive range mirrored; zero is written unsigned."""
    alts = []
    if lo is None or lo.value < 0:
        up = None if lo is None else Bound(-lo.value, lo.strict)
        down = Bound(Decimal(0), True) if hi is None or hi.value >= 0 else Bound(-hi.value, hi.strict)
        if (body := _unsigned(down, up)) is not None:
            alts.append(f'"-" ({body})')
    if hi is None or hi.value >= 0:
        if (body := _unsigned(lo if lo is not None and lo.value >= 0 else Bound(Decimal(0), False), hi)) is not None:
            alts.append(body)
    if not alts:
        raise NoValue("no number lies between the bounds")
    return " | ".join(alts)


def _split(b: Bound) -> tuple[int, str]:
    """A bound >= 0 as its integer part and its fraction's digits (no trailing zeros)."""
    whole, _, frac = format(b.value, "f").partition(".")
    return int(whole), frac.rstrip("0")


def _unsigned(lo: Bound, hi: Bound | None) -> str | None:
    """The numbers >= 0 between ``lo`` and ``hi`` as integer part, then a fraction; None
    when there are none."""
    lo_int, lo_frac = _split(lo)
    low = (lo_frac, lo.strict)
    if hi is None:
        parts = [(str(lo_int), low, None), (_naturals(lo_int + 1, None), None, None)]
    else:
        hi_int, hi_frac = _split(hi)
        high = (hi_frac, hi.strict)
        if lo_int == hi_int:
            parts = [(str(lo_int), low, high)]
        else:
            parts = [(str(lo_int), low, None), (str(hi_int), None, high)]
            if lo_int + 1 <= hi_int - 1:
                parts.insert(1, (_naturals(lo_int + 1, hi_int - 1), None, None))
    alts = []
    for whole, low_, high_ in parts:
        digits, bare = _fraction(low_, high_)
        whole = f'"{whole}"' if whole.isdigit() else f"({whole})"
        if digits is not None:
            dot = f'"." ({digits})'
            alts.append(f"{whole} ({dot})?" if bare else f"{whole} {dot}")
        elif bare:
            alts.append(whole)
    return " | ".join(alts) or None


# A fraction's bound: its digits (no trailing zeros; "" is 0) and whether it is strict;
# None is none (a fraction's value lies in [0, 1) anyway).
FracBound = Optional[tuple[str, bool]]


def _fraction(lo: FracBound, hi: FracBound) -> tuple[str | None, bool]:
    """The fractions 0.d between ``lo`` and ``hi``: a GBNF expression of the digit strings
    d (one or more digits; None: none), and whether no fraction at all (0) is between."""
    lo = None if lo == ("", False) else lo            # >= 0 holds for every fraction
    bare = (lo is None) and (hi is None or hi[0] != "" or not hi[1])
    if hi is not None and hi == ("", True):           # < 0: none
        return None, False
    if lo is None and hi is None:
        return f"[0-9]{{1,{_DIGITS}}}", True
    if hi == ("", False):                             # <= 0: zeros, and only with no lower bound
        return (f'"0"{{1,{_DIGITS}}}', True) if lo is None else (None, False)
    if lo == ("", True) and hi is None:               # > 0: a digit other than 0 somewhere
        return f'"0"{{0,{_DIGITS - 1}}} [1-9] [0-9]{{0,{_DIGITS - 1}}}', False
    alts = []
    for first, last, low, high in _digit_steps(lo, hi):
        rest, empty = _fraction(low, high)
        cls = f"[{first}-{last}]" if first != last else f'"{first}"'
        if rest is not None:
            alts.append(f"{cls} ({rest})?" if empty else f"{cls} ({rest})")
        elif empty:
            alts.append(cls)
    return (" | ".join(alts) or None), bare


def _digit_steps(lo: FracBound, hi: FracBound) -> list[tuple[int, int, FracBound, FracBound]]:
    """A fraction's first digit, in runs of digits that leave the rest the same bounds:
    (first digit, last digit, the rest's lower bound, the rest's upper bound)."""
    runs: list[tuple[int, int, FracBound, FracBound]] = []
    for c in range(10):
        if lo is None:
            low = None
        elif lo[0] == "":                              # > 0: strict, what remains of it
            low = None if c > 0 else lo
        elif c != int(lo[0][0]):
            low = None if c > int(lo[0][0]) else "out"
        else:
            low = (lo[0][1:], lo[1])
        if hi is None:
            high = None
        elif c != int(hi[0][0]):
            high = None if c < int(hi[0][0]) else "out"
        else:
            high = (hi[0][1:], hi[1])
        if "out" in (low, high):
            continue
        if runs and runs[-1][1] == c - 1 and runs[-1][2:] == (low, high):
            runs[-1] = (runs[-1][0], c, low, high)
        else:
            runs.append((c, c, low, high))
    return runs


def integer_range(lo: int | None, hi: int | None) -> str:
    """A GBNF expression of the integers from ``lo`` to ``hi`` (None: unbounded), written
    as JSON writes them (no leading zeros, "-0" not among them)."""
    if lo is not None and hi is not None and hi < 0:
        return f'"-" ({integer_range(-hi, -lo)})'
    if lo is not None and lo < 0:
        neg = f'"-" ({_naturals(1, -lo)})'
        return neg if hi is not None and hi < 0 else f"{neg} | {integer_range(0, hi)}"
    if lo is None:
        neg = f'"-" [1-9] [0-9]{{0,{_DIGITS - 1}}}'
        return f"{neg} | {_naturals(0, hi)}" if hi is None or hi >= 0 else f'"-" ({_naturals(-hi, None)})'
    return _naturals(lo, hi)


def _naturals(lo: int, hi: int | None) -> str:
    """Integers from ``lo`` >= 0 to ``hi`` (None: up to ``_DIGITS`` digits, or as many as
    ``lo`` has), without leading zeros."""
    if hi is None:
        n = len(str(lo))
        same = _naturals(lo, 10 ** n - 1)
        return same if n >= _DIGITS else f"{same} | [1-9] [0-9]{{{n},{_DIGITS - 1}}}"
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


# what a JSON string holds only escaped: its quote, its backslash, control characters
_UNSAFE = {0x22, 0x5C} | set(range(0x20))
_SAFE_NOT = '"\\\\\\x00-\\x1F'        # those, as members of a negated class
_SHORT = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)], "s": [(0x20, 0x20)]}
# what a negated shorthand leaves out beyond its ASCII class: Unicode's white space for \\S
# (ECMA-262's and Python's), everything past ASCII for \\D and \\W (Python's reading
# counts other scripts' digits and letters)
_OUTSIDE = {"S": [(0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                  (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)],
            "D": [(0x80, 0x10FFFF)], "W": [(0x80, 0x10FFFF)]}
_CONTROL_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
_JSON_SHORT = {0x0A: "n", 0x09: "t", 0x0D: "r", 0x0C: "f", 0x08: "b", 0x22: '"', 0x5C: "\\\\"}


# a pattern of one character, repeated: ^[a-z]+$, ^\d{2,}$, ^.*?$ (a class, an escape, any
# character or a plain one; then its count)
_ONE_REPEATED = re.compile(r"\^(\[(?:\\.|[^\]\\])*\]|\\(?:u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|.)|[^\\^$|()\[\]{}*+?])"
                           r"(?:([*+?])|\{(\d+)(,(\d*))?\})?\??\$")


def counted_pattern(pattern: str, low: Any, high: Any) -> str:
    """A pattern of one character repeated, its count cut to ``minLength``/``maxLength``
    (what a grammar cannot do beside any other pattern); any other pattern as it is."""
    _count(low, high)
    m = _ONE_REPEATED.fullmatch(pattern)
    if m is None or (low == 0 and high is None):
        return pattern
    atom, sign, m_low, comma, m_high = m.groups()
    if sign:
        least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[sign]
    elif m_low is not None:
        least, most = _repeats(m_low, comma, m_high)
    else:
        least, most = 1, 1
    least = max(least, low)
    most = high if most is None else most if high is None else min(most, high)
    if most is not None and least > most:
        raise NoValue(f"no string of pattern {pattern!r} has a length from {low} to {high}")
    if most is not None and most > _PATTERN_COUNT:
        return pattern        # a count the pattern's converter would nest: the length goes unenforced
    return f"^{atom}{{{least},{'' if most is None else most}}}$"


def plain_pattern(pattern: str) -> str:
    """A JSON schema ``pattern`` in the regex forms the base converter copies into the
    grammar, as the JSON text of the strings it matches: a quote, a backslash or a control
    character (``\\n``, ``\\u0022``) as its JSON escape, ``.`` and negated classes without
    them, ``\\d``, ``\\w`` and ``\\s`` (a space: the one white space written bare) as
    classes; class members only JSON escapes could write are left out (the class allows
    less, never text that is not the pattern's). A quantifier counts to ``_PATTERN_COUNT``."""
    escaped_end = (len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))) % 2 == 1     # "\\$" is no anchor
    try:        # what no regex dialect reads: the converter wrote "^(a$" as "a", "a{2,1}" as "aa"
        re.compile(pattern)
    except re.error as exc:
        if any(word in exc.msg for word in _MALFORMED):
            raise ValueError(f"pattern {pattern!r} is not a regular expression ({exc.msg} at position {exc.pos}); "
                             f"correct it") from None
    nested = _nested_count(pattern)
    if nested > _NESTED_COUNT:
        raise ValueError(f"pattern {pattern!r} nests counted repeats that multiply to {nested}: llama.cpp's "
                         f"grammar follows every way to split the text among them, which stalled a request "
                         f"for minutes; keep nested counts to {_NESTED_COUNT} in all, or use + and *")
    if (empty := _empty_loop(pattern)) is not None:
        raise ValueError(f"pattern {pattern!r} repeats {empty!r}, which can match the empty string: llama.cpp's "
                         f"grammar follows every way to split the text among its repeats, which held the server "
                         f"for minutes; make each repeated group match at least one character")
    if not (pattern.startswith("^") and pattern.endswith("$")) or escaped_end:
        raise ValueError(f"pattern {pattern!r} must start with ^ and end with $ (a pattern of the whole string)")
    out, i, n = [], 1, len(pattern) - 1
    while i < n:
        c = pattern[i]
        if c == "[":
            members, negated, i = _read_class(pattern, i)
            out.append(_class(members, negated, pattern))
            continue
        if c in "^$":     # an anchor: at a branch's end, it says nothing more there
            at_start = c == "^" and (i == 1 or pattern[i - 1] in "|(")
            at_end = c == "$" and (i == n - 1 or pattern[i + 1] in "|)")
            if not (at_start or at_end):
                raise ValueError(f"pattern {pattern!r}: an anchor ({c}) inside a branch is not supported")
            i += 1
            continue
        if c == "?" and out and out[-1] in ("*", "+", "?", "}") and pattern[i - 1] in "*+?}":
            i += 1        # lazy: the same strings
            continue
        if c == "{":
            j = pattern.find("}", i)
            if j > 0 and re.fullmatch(r"\s*\d*\s*(,\s*\d*\s*)?", pattern[i + 1:j]) and \
                    any(int(x) > _PATTERN_COUNT for x in re.findall(r"\d+", pattern[i + 1:j])):
                raise ValueError(f"pattern {pattern!r} counts past {_PATTERN_COUNT} in {pattern[i:j + 1]}; "
                                 "use maxLength for a long string")
        if c == ".":
            out.append(f"[^{_SAFE_NOT}]")
            i += 1
        elif c == "\\" and i + 1 < n:
            code, shorthand, i = _read_escape(pattern, i)
            if shorthand is not None:
                if shorthand.isupper():     # JSON schema's regexes are ECMA-262's: ASCII \\d, \\w
                    out.append(_class(_SHORT[shorthand.lower()] + _OUTSIDE[shorthand], True, pattern))
                else:
                    out.append(_class(_SHORT[shorthand], False, pattern))
            else:
                out.append(_char(code))
        elif ord(c) in _UNSAFE:
            out.append(_char(ord(c)))
            i += 1
        else:
            out.append(c)
            i += 1
    # one group: the base converter writes a top-level "|" between the string's quotes
    return "^(" + "".join(out) + ")$"


_COUNT = re.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")


def _repeats(low: str, comma: str | None, high: str | None) -> tuple[int, int | None]:
    """A quantifier ``{low}``, ``{low,}`` or ``{low,high}`` as (least, most; None: no bound)."""
    least = int(low or 0)
    return least, least if comma is None else int(high) if high else None


def _expanded(m: re.Match) -> int:
    """How many copies of its item a ``_COUNT`` match makes the grammar write: its bound,
    or its least where it has none (the rest is a loop)."""
    least, most = _repeats(*m.groups())
    return least if most is None else most


def _marks(pattern: str) -> Iterator[tuple[str, int, re.Match | None]]:
    """A pattern's group openings ``("(", i, None)``, closings with the count right after
    them ``(")", i, count or None)`` and other counts ``("{", i, count)``, escapes and
    classes passed over."""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
        elif c == "[":
            i = _read_class(pattern, i)[2]
        elif c == "(":
            yield "(", i, None
            i += 1
        elif c == ")":
            m = _COUNT.match(pattern, i + 1)
            yield ")", i, m
            i = m.end() if m else i + 1
        elif c == "{" and (m := _COUNT.match(pattern, i)):
            yield "{", i, m
            i = m.end()
        else:
            i += 1


def _empty_loop(pattern: str) -> str | None:
    """The first group repeated (``*``, ``+``, ``{n,}``, ``{n,m}`` with m > 1) that can match
    the empty string, with its quantifier (``(.*.*.*.*)*``: one token's mask over 8,192 ids
    took 50 s; ``{0,20}``: 1.6 s), or None. A repeat of a group that takes a character each
    time is cheap (``(\\w+\\s*)*``: under a millisecond)."""
    opened = []
    for kind, i, m in _marks(pattern):
        if kind == "(":
            opened.append(i)
        elif kind == ")" and opened:
            start = opened.pop()
            most = None if pattern[i + 1:i + 2] in ("*", "+") else 1 if m is None else _repeats(*m.groups())[1]
            body = pattern[start + 1:i]
            body = body[2:] if body.startswith("?:") else body
            try:
                empty = (most is None or most > 1) and re.fullmatch(body, "") is not None
            except re.error:
                empty = False
            if empty:
                return pattern[start:i + 1] + (m.group(0) if m is not None else pattern[i + 1])
    return None


def _nested_count(pattern: str) -> int:
    """The most a group's count times the counts inside it multiply to (``(a{0,20}){0,20}``:
    400); 1 where no counted repeat sits inside a counted group."""
    inside, most = [1], 1      # per open group: the largest count in it so far
    for kind, _, m in _marks(pattern):
        if kind == "(":
            inside.append(1)
        elif kind == ")" and len(inside) > 1:
            inner = inside.pop()
            times = 1 if m is None else _expanded(m)
            if inner > 1 and times > 1:
                most = max(most, inner * times)
            inside[-1] = max(inside[-1], inner * max(times, 1))
        elif kind == "{":
            inside[-1] = max(inside[-1], _expanded(m))
    return most


def _read_escape(pattern: str, i: int) -> tuple[int | None, str | None, int]:
    """The escape at ``pattern[i]`` (a backslash): (its character's code, None) or (None,
    a shorthand class letter), and where it ends."""
    e = pattern[i + 1]
    if e in "dDwWsS":
        return None, e, i + 2
    if e in _CONTROL_ESCAPES:
        return _CONTROL_ESCAPES[e], None, i + 2
    if e in "ux":
        width = 4 if e == "u" else 2
        digits = pattern[i + 2:i + 2 + width]
        if len(digits) != width or not all(ch in "0123456789abcdefABCDEF" for ch in digits):
            raise ValueError(f"pattern {pattern!r}: \\{e} needs {width} hex digits")
        return int(digits, 16), None, i + 2 + width
    if e.isalnum():
        raise ValueError(f"pattern {pattern!r}: \\{e} is not supported (word boundaries, backreferences)")
    return ord(e), None, i + 2


def _char(code: int) -> str:
    """One character of the string as pattern text the base converter copies whole: its
    JSON escape where JSON needs one (a group, so that a quantifier takes all of it)."""
    if code in _UNSAFE:
        esc = _JSON_SHORT.get(code, f"u{code:04x}")
        return f"(\\\\{esc})" if code != 0x22 else '(\\\\")'
    return f"[{_code(code)}]" if code > 0x7F or chr(code) in "|.()[]{}*+?^$-/" else chr(code)


def _code(c: int) -> str:
    """A character as GBNF's escape of its code."""
    return f"\\u{c:04X}" if c <= 0xFFFF else f"\\U{c:08X}"


def _read_class(pattern: str, i: int) -> tuple[list[tuple[int, int]], bool, int]:
    """The class at ``pattern[i]`` ("["): its members as code ranges, whether it is
    negated, and where it ends."""
    j, n = i + 1, len(pattern)
    negated = j < n and pattern[j] == "^"
    j += negated
    members: list[tuple[int, int]] = []
    while j < n and pattern[j] != "]":
        if pattern[j] == "\\" and j + 1 < n:
            code, shorthand, j = _read_escape(pattern, j)
            if shorthand is not None:
                if shorthand.isupper():
                    raise ValueError(f"pattern {pattern!r}: \\{shorthand} inside [...] is not supported; "
                                     "write the class out")
                members += _SHORT[shorthand]
                continue
        else:
            code, j = ord(pattern[j]), j + 1
        if j + 1 < n and pattern[j] == "-" and pattern[j + 1] != "]":
            if pattern[j + 1] == "\\":
                end, shorthand, j = _read_escape(pattern, j + 1)
                if shorthand is not None:
                    raise ValueError(f"pattern {pattern!r}: a range cannot end in \\{shorthand}")
            else:
                end, j = ord(pattern[j + 1]), j + 2
            if end < code:
                raise ValueError(f"pattern {pattern!r}: the range {chr(code)}-{chr(end)} is backwards")
            members.append((code, end))
        else:
            members.append((code, code))
    if j >= n:
        raise ValueError(f"pattern {pattern!r}: a [ without its ]")
    return members, negated, j + 1


def _class(members: list[tuple[int, int]], negated: bool, pattern: str) -> str:
    """A class of the characters a JSON string may hold bare: a negated one leaves out
    the unsafe ones too; a positive one drops them from its ranges."""
    if negated:
        return "[^" + "".join(_code(a) if a == b else f"{_code(a)}-{_code(b)}" for a, b in members) + _SAFE_NOT + "]"
    parts = []
    for a, b in members:
        for lo, hi in _split_safe(a, b):
            parts.append(_code(lo) if lo == hi else f"{_code(lo)}-{_code(hi)}")
    if not parts:
        raise ValueError(f"pattern {pattern!r}: a class of only characters JSON writes escaped (quotes, "
                         "backslashes, control characters) is not supported")
    return "[" + "".join(parts) + "]"


def _split_safe(a: int, b: int) -> list[tuple[int, int]]:
    """The range a..b without the unsafe codes."""
    out, lo = [], a
    for u in sorted(x for x in _UNSAFE if a <= x <= b) + [b + 1]:
        if lo < u:
            out.append((lo, u - 1))
        lo = max(lo, u + 1)
    return out


def schema_gbnf(schema: Any, prop_order: dict[str, int] | None = None) -> str:
    """The GBNF grammar of a JSON schema (a dict, ``true``); its local refs must be
    ``#/$defs/NAME`` (schema_refs.flat_refs), the root not a ref."""
    conv = SchemaGrammar(prop_order)
    if isinstance(schema, dict) and is_any(schema):
        # {} at the root is "some JSON object", as llama-server's converter reads it (clients
        # send it for JSON mode); inside a schema it stays any value, as JSON Schema says
        schema = {**schema, "type": "object"}
    if isinstance(schema, dict):
        schema = conv.resolve_refs(json.loads(json.dumps(schema)), "")
    conv.visit(schema, "")
    return conv.format_grammar()
