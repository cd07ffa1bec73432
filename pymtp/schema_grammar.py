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
  a pattern is the JSON text of the strings it matches (``schema_patterns.plain_pattern``);
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
  (``^[a-z]+$``) it cuts the count now (``schema_patterns.counted_pattern``);
- keywords beside a ``$ref`` were dropped (``{"$ref": ..., "maxLength": 3}``): they hold
  as well as the target, as an ``allOf`` of the two;
- a second review: an optional property beside ``additionalProperties`` let the other keys
  follow without a comma (``{"a": 1"x": 2}``, ``format_grammar``); merged schemas kept the
  later one's bounds, not the stricter (``merge_schemas``); a strict bound let through a
  decimal that reads as the bound itself as a float (``schema_numbers._inside``); nested counts in a
  pattern stalled llama.cpp's grammar for minutes (``schema_patterns._nested_count``); pydantic v1's
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
  (``schema_numbers._DIGITS``).

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
from typing import Any, Callable

from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, SchemaConverter

from .grammar_counts import NoValue, check_count, repeated, separated
from .schema_numbers import bounds, exact_decimal, int_bounds, integer_range, is_number, number_bounds, number_range
from .schema_patterns import counted_pattern, plain_pattern
from .schema_refs import check_refs, pointer_step, user_pointer

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


class SchemaGrammar(SchemaConverter):
    """``SchemaConverter`` with the fixes in this module's docstring: ``visit`` reads what
    it must, the base class the rest."""

    def __init__(self, prop_order: dict[str, int] | None = None) -> None:
        super().__init__(prop_order=prop_order or {}, allow_fetch=False, dotall=False, raw_pattern=False)
        self._inlining: set[str] = set()      # the refs whose targets are being merged into a schema
        self._where: dict[int, str] = {}      # id of each of the schema's own objects -> its JSON pointer

    def locate(self, schema: Any, at: str = "") -> None:
        """File where each object of ``schema`` sits, so that a refusal can name it
        (``schema_at``): a schema of a hundred properties refused for one of them said
        only what was wrong, not where."""
        if isinstance(schema, dict):
            self._where[id(schema)] = at
            for key, value in schema.items():
                self.locate(value, pointer_step(at, key))
        elif isinstance(schema, list):
            for i, value in enumerate(schema):
                self.locate(value, pointer_step(at, i))

    def visit(self, schema: Any, name: str) -> str:
        try:
            return self._visit(schema, name)
        except Exception as exc:
            # the innermost part of the user's schema that holds the refusal names it
            if getattr(exc, "schema_at", None) is None and id(schema) in self._where:
                exc.schema_at = self._where[id(schema)]
            raise

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

    def _visit(self, schema: Any, name: str) -> str:
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        if is_any(schema):
            return self._add_rule(rule_name, self._add_primitive("value", PRIMITIVE_RULES["value"]))
        if not isinstance(schema, dict):
            raise (NoValue if schema is False else ValueError)(f"a schema must be an object or true, got {schema!r}")
        _checked_words(schema)
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
            lo, hi = int_bounds(schema)
            return self._add_rule(rule_name, f"({integer_range(lo, hi)}) space")
        if types == "number" and _BOUNDS & schema.keys():
            return self._add_rule(rule_name, f"({number_range(*number_bounds(schema))}) space")
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
        check_count(low, high)
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
    if is_number(value) and math.isfinite(value):
        x = exact_decimal(value)
        lo, hi = bounds(schema)
        if lo is not None and (x < lo.value or (x == lo.value and lo.strict)):
            return False
        if hi is not None and (x > hi.value or (x == hi.value and hi.strict)):
            return False
    return True


# keywords two merged schemas may both set: both hold where the stricter does
_STRICTER = {"minimum": max, "exclusiveMinimum": max, "maximum": min, "exclusiveMaximum": min,
             "minLength": max, "maxLength": min, "minItems": max, "maxItems": min}


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
        if key in _STRICTER and is_number(x) and is_number(y):
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
    return _checked_words(schema)


_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
# keywords whose value the converter reads without a check, and the shape it must have
# (read as they came: a pattern of 5 was an AttributeError's text, an anyOf
# of one schema refused its first key as a schema, a typo in type "Unrecognized schema")
_SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "type": (lambda v: v in _TYPES or isinstance(v, list) and bool(v) and all(t in _TYPES for t in v),
             f"one of {', '.join(_TYPES)}, or a list of them"),
    "anyOf": (lambda v: isinstance(v, list), "a list of schemas"),
    "oneOf": (lambda v: isinstance(v, list), "a list of schemas"),
    "allOf": (lambda v: isinstance(v, list), "a list of schemas"),
    "pattern": (lambda v: isinstance(v, str), "a string (a regular expression)"),
    "format": (lambda v: isinstance(v, str), "a string"),
    "properties": (lambda v: isinstance(v, dict), "an object of each property's schema by its name"),
    "required": (lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v), "a list of property names"),
}


def _checked_words(schema: dict) -> dict:
    """``schema``, the keywords of ``_SHAPES`` it holds checked: a refusal that says which
    keyword and what it takes, rather than what the converter tripped on."""
    for word, (fits, shape) in _SHAPES.items():
        if word in schema and not fits(schema[word]):
            raise ValueError(f"{word} must be {shape}, got {json.dumps(schema[word])[:80]}")
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
    if is_number(x) and is_number(y):
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


def refusal_place(exc: Exception, within: str = "", origins: dict[str, str] | None = None) -> str:
    """Where in the schema the converter refused it, for the refusal's message: " at" a
    JSON pointer (``SchemaGrammar.locate``; a ref's target where the user's schema holds
    it, by flat_refs' ``origins``) and ``within``; nothing where the whole schema was
    refused."""
    where = getattr(exc, "schema_at", None)
    if where and origins:
        where = user_pointer(where, origins)
    return f" at {where}{within}" if where else ""


def schema_gbnf(schema: Any, prop_order: dict[str, int] | None = None) -> str:
    """The GBNF grammar of a JSON schema (a dict, ``true``); its local refs must be
    ``#/$defs/NAME`` (schema_refs.flat_refs), the root not a ref."""
    conv = SchemaGrammar(prop_order)
    if isinstance(schema, dict) and is_any(schema):
        # {} at the root is "some JSON object", as llama-server's converter reads it (clients
        # send it for JSON mode); inside a schema it stays any value, as JSON Schema says
        schema = {**schema, "type": "object"}
    if isinstance(schema, dict):
        check_refs(schema)
        schema = conv.resolve_refs(json.loads(json.dumps(schema)), "")
        conv.locate(schema)
    conv.visit(schema, "")
    return conv.format_grammar()
