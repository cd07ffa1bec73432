"""The JSON schema converter (pymtp/schema_grammar.py) where llama-cpp-python's failed: each
schema a review sent that crashed the server, was refused, or let through text the schema
does not allow, now constrains a real generation (the dense fixture, greedy and seeded)
to JSON that validates; and its helpers, checked against Python's own reading."""

from __future__ import annotations

import itertools
import json
import re
from decimal import Decimal

import pytest

from pymtp.config import ParamError
from pymtp.constraint import json_schema_grammar
from pymtp.schema_numbers import integer_range, number_bounds, number_range
from pymtp.schema_patterns import plain_pattern

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test extra: pip install -e '.[test]'")

NULLABLE = {"type": "object", "properties": {
    "o": {"type": ["object", "null"], "properties": {"x": {"type": "boolean"}}, "required": ["x"],
          "additionalProperties": False},
    "c": {"type": ["string", "null"], "enum": ["red", "green", None]},
    "xs": {"type": ["array", "null"], "items": {"type": "integer", "enum": [5]}, "minItems": 1, "maxItems": 3},
    "s": {"type": ["string", "null"], "maxLength": 3}}, "required": ["o", "c", "xs", "s"], "additionalProperties": False}
SCHEMAS = {
    # nested 20,000 deep, llama.cpp's grammar parser overflowed its stack (SIGSEGV)
    "long string": {"type": "string", "maxLength": 20000},
    "long array": {"type": "array", "items": {"type": "integer"}, "maxItems": 20000},
    # a type list dropped the other keywords
    "nullable": NULLABLE,
    # backslashes and quotes in values and names were not escaped
    "escapes": {"type": "object", "properties": {"q": {"enum": ["c\\d", 'a"b']}, 'k"\\': {"const": "v\\w"}},
                "required": ["q", 'k"\\'], "additionalProperties": False},
    # items {} (pydantic's list[Any]) was a KeyError; {} was an object
    "any items": {"type": "object", "properties": {"xs": {"type": "array", "items": {}, "maxItems": 2},
                                                    "d": {"description": "anything"}},
                  "required": ["xs", "d"], "additionalProperties": False},
    # a root that is a ref to a definition holding refs was a KeyError
    "root ref": {"$ref": "#/definitions/A", "definitions": {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/definitions/B"}}, "required": ["b"],
              "additionalProperties": False},
        "B": {"type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"],
              "additionalProperties": False}}},
    # bounds of an integer were ignored
    "integer range": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5},
                                                        "m": {"type": "integer", "exclusiveMinimum": -3,
                                                              "exclusiveMaximum": 120}},
                      "required": ["n", "m"], "additionalProperties": False},
    # \d, \w and \. were refused
    "pattern escapes": {"type": "object", "properties": {
        "host": {"type": "string", "pattern": "^[a-z]{1,6}\\.com$"},
        "code": {"type": "string", "pattern": "^[a-z]{3}-\\d{2}$"},
        "word": {"type": "string", "pattern": "^\\w{1,5}$"}}, "required": ["host", "code", "word"],
        "additionalProperties": False},
    # a second review: what the first fixes left on the old converter's paths, or broke
    "long with a format": {"type": "string", "format": "email", "maxLength": 20000},
    "long tuple": {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "integer"},
                   "maxItems": 20000},
    "values beside bounds": {"type": "object", "properties": {
        "c": {"type": "string", "maxLength": 10, "enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 1000, "enum": [1, 2]},
        "k": {"type": "integer", "minimum": 0, "const": 3},
        "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "enum": [[1], [2]]},
        "r": {"type": "integer", "minimum": 0, "anyOf": [{"maximum": 3}, {"minimum": 10, "maximum": 12}]}},
        "required": ["c", "n", "k", "a", "r"], "additionalProperties": False},
    "patterns as JSON text": {"type": "object", "properties": {
        "ws": {"type": "string", "pattern": "^\\w{1,4}\\s\\w{1,4}$"},
        "ns": {"type": "string", "pattern": "^\\S{1,8}$"},
        "nl": {"type": "string", "pattern": "^a\\nb$"},
        "path": {"type": "string", "pattern": "^[A-Z]:\\\\[a-z]{1,4}$"},
        "dot": {"type": "string", "pattern": "^.{1,12}$"},
        "not": {"type": "string", "pattern": "^[^,]{1,5}$"},
        "quote": {"type": "string", "pattern": '^x"y\\u00e9{1,3}$'},
        "printable": {"type": "string", "pattern": "^[ -~]{1,6}$"}},
        "required": ["ws", "ns", "nl", "path", "dot", "not", "quote", "printable"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "untyped": {"type": "array", "minItems": 2, "maxItems": 3},
        "none": {"type": "array", "items": False},
        "tuple": {"prefixItems": [{"type": "integer"}, {"const": "x"}], "items": {"type": "boolean"}, "maxItems": 3}},
        "required": ["untyped", "none", "tuple"], "additionalProperties": False},
    "no type": {"type": "object", "properties": {"s": {"maxLength": 2}, "i": {"minimum": 0, "maximum": 9},
                                                  "a": {"minItems": 1, "maxItems": 2, "items": {"type": "null"}},
                                                  "far": {"type": "integer", "minimum": -1e308, "maximum": 1e308}},
                "required": ["s", "i", "a", "far"], "additionalProperties": False},
    # a third review: what the rewrite passed on to the base converter as it was
    "alternatives and anchors": {"type": "object", "properties": {
        "yn": {"type": "string", "pattern": "^yes|no$"},
        "opt": {"type": "string", "pattern": "^$|^[a-z]{1,5}$"},
        "lazy": {"type": "string", "pattern": "^a+?b$"}}, "required": ["yn", "opt", "lazy"],
        "additionalProperties": False},
    "allOf": {"type": "object", "properties": {
        "c": {"allOf": [{"$ref": "#/$defs/Color"}], "description": "pydantic v1's field of an enum"},
        "n": {"allOf": [{"type": "integer"}, {"minimum": 2, "maximum": 4}]}},
        "required": ["c", "n"], "additionalProperties": False,
        "$defs": {"Color": {"enum": ["red", "green"], "type": "string"}}},
    "anyOf beside": {"type": "object", "properties": {"a": {"type": "integer"}, "x": {"type": "integer"},
                                                       "y": {"type": "integer"}},
                     "required": ["a"], "additionalProperties": False,
                     "anyOf": [{"required": ["x"]}, {"required": ["y"]}]},
    # keywords beside an enum or a const: the values they allow
    "enum beside": {"type": "object", "properties": {
        "s": {"type": "string", "enum": ["a", 1, "abcd", "ab"], "maxLength": 3},
        "n": {"type": "integer", "enum": [1, True, 2.5, 40], "maximum": 10},
        "p": {"enum": ["xa", "ya", "xb"], "pattern": "^x"}}, "required": ["s", "n", "p"],
        "additionalProperties": False},
    # a session-53 lead: a number's bounds were ignored (llama-server ignores them too)
    "number range": {"type": "object", "properties": {
        "p": {"type": "number", "minimum": 0, "maximum": 1},
        "t": {"type": "number", "exclusiveMinimum": -2.5, "maximum": -0.125},
        "x": {"type": ["number", "null"], "minimum": 0.5, "exclusiveMaximum": 0.75},
        "u": {"exclusiveMinimum": 99.5, "maximum": 100}},
        "required": ["p", "t", "x", "u"], "additionalProperties": False},
    # and a string's length beside a pattern (here, of one character repeated)
    "length beside a pattern": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4},
        "d": {"type": "string", "pattern": "^\\d*$", "maxLength": 3},
        "w": {"type": "string", "pattern": "^\\w{2,9}$", "minLength": 3, "maxLength": 5}},
        "required": ["s", "d", "w"], "additionalProperties": False},
    # and keywords beside a $ref (pydantic writes them; draft 2019-09 on, they hold too)
    "ref siblings": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/S", "maxLength": 3}, "b": {"$ref": "#/$defs/N", "maximum": 2},
        "c": {"$ref": "#/$defs/S", "enum": ["long text", "ok"]}},
        "required": ["a", "b", "c"], "additionalProperties": False,
        "$defs": {"S": {"type": "string"}, "N": {"type": "integer", "minimum": 0}}},
    "draft 4 bounds": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "properties": {
        "n": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 0.01},
        "i": {"type": "integer", "minimum": 3, "maximum": 5, "exclusiveMaximum": True}},
        "required": ["n", "i"], "additionalProperties": False},
    "int64": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 9007199254740990,
                                                     "maximum": 9007199254740991}},
              "required": ["n"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("mode", [dict(temperature=0), dict(temperature=0.9, seed=3), dict(temperature=0.9, seed=11)])
def test_what_the_old_converter_broke_now_validates(dense_model, name, mode):
    schema = SCHEMAS[name]
    r = dense_model.generate("data:", json_schema=schema, max_tokens=240, **mode)
    if r.finish_reason == "stop":
        jsonschema.validate(json.loads(r.text), schema)
    else:      # the unbounded ones may run to the limit
        assert name in ("long string", "long array", "any items", "long with a format", "long tuple", "arrays") \
            and r.finish_reason == "length", r.text


@pytest.mark.parametrize("seed", range(12))
def test_sampled_patterns_are_json_strings_that_match(dense_model, seed):
    """Sampled, the patterns whose classes name their characters. A class that names what
    it leaves out ("." , \\S, [^,]) lets through a token of bytes that are not UTF-8, which
    llama.cpp's grammar reads as characters: the text then decodes to more characters
    than the pattern counts, as a plain string's maxLength can (greedy runs them above)."""
    every = SCHEMAS["patterns as JSON text"]
    named = {k: v for k, v in every["properties"].items() if k not in ("ns", "dot", "not")}
    schema = {**every, "properties": named, "required": sorted(named)}
    r = dense_model.generate("data:", json_schema=schema, max_tokens=240, temperature=1.0, seed=seed)
    assert r.finish_reason == "stop", r.text
    jsonschema.validate(json.loads(r.text), schema)


@pytest.mark.parametrize("seed", range(6))
def test_a_function_without_parameters_is_called_with_an_object(dense_model, seed):
    """``"parameters": {}``: any value would be a schema's reading; a call's arguments are
    an object (they came back as numbers, null, "Infinity")."""
    from pymtp.tool_reply import parse_call
    from pymtp.tools import ToolChoice, check_tools, tool_call_grammar

    tools = check_tools([{"type": "function", "function": {"name": "h", "parameters": {}}}])
    gbnf = tool_call_grammar(tools, ToolChoice("required"), False)
    r = dense_model.generate("call:", grammar=gbnf, max_tokens=120, temperature=0.9, seed=seed)
    # any object may run past the limit: what came opens one
    assert re.search(r'"arguments"\s*:\s*\{', r.text), r.text
    if r.finish_reason == "stop":
        call = parse_call(r.text.split("<tool_call>", 1)[1].rsplit("</tool_call>", 1)[0])
        assert call is not None and isinstance(json.loads(call["function"]["arguments"]), dict)


def test_a_long_bound_is_a_count_not_a_nesting():
    assert "{0,20000}" in json_schema_grammar({"type": "string", "maxLength": 20000})
    gbnf = json_schema_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 20000})
    assert "{1,19999}" in gbnf and gbnf.count("(") < 20


@pytest.mark.parametrize("lo, hi", [(0, 9), (1, 5), (0, 100), (7, 1234), (-5, 5), (-120, -3), (None, 10), (10, None),
                                    (None, -7), (-3, None), (None, None), (0, 0), (99, 1000), (305, 30599)])
def test_an_integer_range_is_the_integers_between_written_as_json_writes_them(lo, hi):
    rx = _as_regex(integer_range(lo, hi))
    for x in range(-2000, 2000):
        assert bool(rx.fullmatch(str(x))) == ((lo is None or x >= lo) and (hi is None or x <= hi)), x
    for x in (30598, 30599, 30600, 10 ** 6, -(10 ** 6)):
        assert bool(rx.fullmatch(str(x))) == ((lo is None or x >= lo) and (hi is None or x <= hi)), x
    assert not any(rx.fullmatch(t) for t in ("00", "01", "-0", "-01", "007", "+1", ""))


@pytest.mark.parametrize("lo, hi, takes, refuses", [
    (0, None, ["9" * 16, "0"], ["1" + "0" * 16]),
    (None, 5, ["-" + "9" * 16, "5"], ["-1" + "0" * 16]),
    (-3, None, ["9" * 16, "-3"], ["1" + "0" * 16, "-4"]),
    (10 ** 17, None, [str(10 ** 17 + 5), "9" * 18], ["1" + "0" * 18, "9" * 17]),
])
def test_an_open_integer_range_stops_at_16_digits(lo, hi, takes, refuses):
    """``minimum: 0`` alone let a model write digits until max_tokens; the open side now
    ends where the base converter's integers and llama.cpp's end (or at the bound's own
    length, past that)."""
    rx = _as_regex(integer_range(lo, hi))
    for text in takes + refuses:
        assert bool(rx.fullmatch(text)) == (text in takes), text


@pytest.mark.parametrize("bounds, takes, refuses", [
    ({"minimum": 0}, ["9" * 16, "1." + "0" * 15 + "1"], ["1" + "0" * 16, "1." + "0" * 16 + "1"]),
    ({"exclusiveMinimum": 0}, ["0." + "0" * 15 + "1", "0.1" + "0" * 15 + "1", "1.5"], ["0.1" + "0" * 16 + "1", "0"]),
    ({"maximum": 0}, ["-" + "9" * 16, "0." + "0" * 16], ["-1" + "0" * 16, "0." + "0" * 17]),
])
def test_an_open_number_range_stops_at_16_digits_a_side(bounds, takes, refuses):
    rx = _as_regex(number_range(*number_bounds(bounds)))
    for text in takes + refuses:
        assert bool(rx.fullmatch(text)) == (text in takes), text


def _as_regex(gbnf: str) -> re.Pattern:
    """A GBNF expression of quoted literals, classes and counts, as Python reads it."""
    return re.compile(re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), gbnf).replace(" ", ""))


JSON_DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")
NUMBER_TEXTS = sorted({"".join(t) for n in range(1, 4) for t in itertools.product("0123456789.-", repeat=n)}
                      | {f"{sign}{i}{frac}" for sign in ("", "-") for i in (0, 1, 2, 3, 7, 9, 10, 99, 100, 101, 123)
                         for frac in ("", ".0", ".00", ".001", ".01", ".05", ".1", ".125", ".2", ".25", ".3", ".49",
                                      ".5", ".50", ".51", ".7", ".75", ".9", ".99", ".999")})


@pytest.mark.parametrize("bounds", [
    {"minimum": 0, "maximum": 1}, {"minimum": -2.5, "exclusiveMaximum": 3.25}, {"exclusiveMinimum": 0},
    {"maximum": -0.5}, {"minimum": 0.1, "maximum": 0.3}, {"exclusiveMinimum": -1, "exclusiveMaximum": 0},
    {"minimum": -0.05, "maximum": 0.05}, {"minimum": 1.5}, {"exclusiveMaximum": 100}, {"minimum": 7, "maximum": 7},
    {"minimum": 0, "exclusiveMinimum": True, "maximum": 10, "exclusiveMaximum": True},
    {"minimum": -12.75, "maximum": -3.125}, {"minimum": 0.001, "exclusiveMaximum": 0.01},
    {"minimum": 99.99, "maximum": 101}, {"minimum": 0.5, "exclusiveMinimum": 0.5, "maximum": 2}])
def test_a_number_range_is_the_decimals_between(bounds):
    """Every decimal text (JSON's, no exponent) whose value lies in the range, and no other:
    no "-0", no "1.", no leading zeros."""
    lo, hi = number_bounds(bounds)
    rx = _as_regex(number_range(lo, hi))
    for text in NUMBER_TEXTS:
        value = Decimal(text) if JSON_DECIMAL.fullmatch(text) else None
        inside = value is not None and not (text.startswith("-") and value == 0) and \
            (lo is None or value > lo.value or (value == lo.value and not lo.strict)) and \
            (hi is None or value < hi.value or (value == hi.value and not hi.strict))
        assert bool(rx.fullmatch(text)) == inside, (bounds, text)


@pytest.mark.parametrize("pattern, takes, refuses", [
    ("^[a-z]+\\.com$", ["ab.com"], ["abxcom", "ab.co"]),
    ("^\\d{2}-\\w+$", ["12-a_b"], ["1-ab", "12-a b"]),
    ("^[\\d.]+$", ["1.5"], ["a"]),
    ("^\\S+\\s\\S$", ["ab c"], ["ab  c", "a"]),
    ("^a\\/b\\?$", ["a/b?"], ["a/b"]),
    ("^a\\nb$", ["a\nb"], ["a\\nb", "anb"]),
    ("^a\\\\b$", ["a\\b"], ["ab", "a\\\\b"]),
    ('^a"b\\u00e9+$', ['a"b\u00e9\u00e9'], ["ab\u00e9", 'a"b']),
    ("^[ -~]{2}$", ["a~"], ["a", "\u00e9a"]),
    ("^yes|no$", ["yes", "no"], ["yesno", "ye", ""]),
    ("^$|^[a-z]+$", ["", "abc"], ["a1"]),
    ("^\\S+$", ["ab"], ["a\u00a0b", "a\u3000", "a b"]),
    ("^\\D\\W$", ["a-"], ["\u0663-", "a\u00e9"]),
])
def test_a_pattern_keeps_its_meaning(pattern, takes, refuses):
    """The rewritten pattern, read by Python's regex over a string's JSON text, takes what
    the pattern takes over the string (these values) and refuses what it refuses."""
    plain = re.compile(plain_pattern(pattern))
    for value in takes + refuses:
        text = json.dumps(value, ensure_ascii=False)[1:-1]
        assert bool(plain.fullmatch(text)) == bool(re.fullmatch(pattern, value)) == (value in takes), \
            (plain.pattern, value)


@pytest.mark.parametrize("pattern, takes, refuses", [
    ("^(?:ab|cd)$", ["ab", "cd"], ["abcd", "a"]),
    ("^(?<year>\\d{4})-(?:0[1-9]|1[0-2])$", ["2024-07"], ["2024-13", "24-07"]),
    ("[0-9]{3}", ["123", "x123y", "a1234"], ["12", "1a2b3"]),
    ("^ab", ["ab", "abc"], ["cab"]),
    ("ab$", ["ab", "cab"], ["abc"]),
    ("^a\\$", ["a$", "a$b"], ["a", "ba$"]),
    ("", ["", "anything"], []),
])
def test_a_pattern_is_a_search_and_its_groups_need_not_capture(pattern, takes, refuses):
    """As JSON schema reads a pattern (ECMA-262's search): an end without its anchor takes
    any text there, and (?:...) and (?<name>...) groups are groups. Each was a 400 (the
    converter's assertion, or "must start with ^ and end with $"), where llama-server
    takes the first and writes any string for the second."""
    plain = re.compile(plain_pattern(pattern))
    python = pattern.replace("(?<", "(?P<")
    for value in takes + refuses:
        text = json.dumps(value, ensure_ascii=False)[1:-1]
        assert bool(plain.fullmatch(text)) == bool(re.search(python, value)) == (value in takes), \
            (plain.pattern, value)


@pytest.mark.parametrize("schema, says", [
    ({"type": "string", "pattern": "^a{1,5000}$"}, "counts past 1000"),
    ({"type": "string", "pattern": "^\\bx$"}, "\\b is not supported"),
    ({"type": "string", "pattern": "^[\\W]$"}, "inside [...]"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "no integer lies between"),
    ({"type": "string", "pattern": "^\\d{5}$", "maxLength": 3}, "no string of pattern '^\\\\d{5}$' has a length"),
    ({"type": "number", "minimum": 2, "maximum": 1.5}, "no number lies between the bounds 2 and 1.5"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number lies between the bounds 1 and 1"),
    ({"type": "number", "minimum": "0"}, "minimum must be a finite number, got '0'"),
    ({"type": "number", "exclusiveMinimum": 1e-40}, "nearer zero than 1e-30"),
    ({"type": "number", "minimum": 1e21}, "number bounds past 1e+20"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}, "allows nothing"),
    (False, "allows no value"),
    ({"type": "string", "pattern": "^a^b$"}, "an anchor (^) inside a branch"),
    ({"type": "string", "const": "abc", "pattern": "^x$"}, "no value of ['abc'] fits"),
    ({"type": "string", "pattern": "^(?=a)\\w$"}, "has a lookaround ((?=...) at position 1"),
    ({"anyOf": [{"type": "integer", "minimum": 5, "maximum": 2}, False]}, "allows no JSON value (no integer lies"),
    ({"type": "object", "properties": {"b": False}, "required": ["b"]}, "property 'b' is required, but its schema is false"),
])
def test_what_cannot_be_a_grammar_is_a_400_naming_the_field(schema, says):
    with pytest.raises(ParamError, match=re.escape(says)) as e:
        json_schema_grammar(schema, "response_format")
    assert e.value.param == "response_format"


@pytest.fixture(scope="module")
def demo():
    import pymtp

    m = pymtp.load(threads=2)
    yield m
    m.close()


def _accepts(model, schema, text: str) -> bool:
    """Whether llama.cpp's grammar of ``schema`` takes ``text`` whole: its tokens one by
    one through the constraint's states, then an end-of-generation token."""
    import numpy as np

    from pymtp.constraint import constraint_for

    c = constraint_for(model._native, None, schema)
    state = c.start()
    for t in model.tokenize(text, add_special=False):
        if not state.allows(np.array([t], dtype=np.int32))[0]:
            return False
        state = state.then(t)
    return bool(state.allows(np.flatnonzero(c.ends).astype(np.int32)).any())


EMPLOYEE_V1 = {"$ref": "#/definitions/Employee", "definitions": {"Employee": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                     "boss": {"description": "pydantic v1's field of a model", "allOf": [
                                         {"$ref": "#/definitions/Employee"}]}},
    "required": ["name"], "additionalProperties": False}}}


@pytest.mark.parametrize("schema, takes, refuses", [
    # an optional property beside additionalProperties: the other keys came without a comma
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},
     ['{"a": 1, "x": 2}', '{"x": 2}', '{"a": 1}'], ['{"a": 1"x": 2}', '{"a": 1 "x": 2}']),
    # merged schemas: both bounds hold, not the later one's
    ({"allOf": [{"type": "integer", "maximum": 5}, {"maximum": 1000}]}, ["5"], ["559"]),
    ({"$ref": "#/$defs/S", "maxLength": 2, "$defs": {"S": {"type": "string", "maxLength": 50}}}, ['"ab"'], ['"abc"']),
    ({"type": "integer", "maximum": 3, "anyOf": [{"maximum": 1000}, {"minimum": 0}]}, ["3"], ["559"]),
    # strict bounds as clients read numbers, as floats: 0.99999999999999999 reads as 1.0
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, ["0.9999999999999999", "0.5", "0.001"],
     ["0.99999999999999999", "1", "0", "0." + "0" * 40 + "1"]),
    # pydantic v1's recursive model: was a RecursionError (a 400)
    (EMPLOYEE_V1, ['{"name": "a", "boss": {"name": "b"}}'], ['{"name": "a", "boss": {}}']),
])
def test_what_a_second_review_found_is_enforced(demo, schema, takes, refuses):
    for text in takes + refuses:
        assert _accepts(demo, schema, text) == (text in takes), text
        if text in takes:
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema, takes, refuses", [
    # a branch no value satisfies adds nothing to anyOf (it refused the schema); the rest hold
    ({"anyOf": [{"type": "integer", "minimum": 5, "maximum": 1}, {"type": "string", "maxLength": 2}]},
     ['"ab"'], ["3", '"abc"']),
    ({"type": "object", "properties": {"a": {"anyOf": [{"enum": []}, {"type": "integer"}]}}, "required": ["a"]},
     ['{"a": 1}'], ['{"a": "x"}']),
    # {} at the root is some JSON object, as llama-server's converter reads it; inside, any value
    ({}, ['{"x": [1]}', "{}"], ['"s"', "1", "[]"]),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"]}, ['{"a": "s"}', '{"a": [1]}'], ["{}"]),
    # a property of schema false is one the object leaves out (the schema was refused)
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": False}, "required": ["a"]},
     ['{"a": 1}'], ['{"a": 1, "b": 2}', '{"b": 2}']),
])
def test_what_a_third_review_found_is_enforced(demo, schema, takes, refuses):
    for text in takes + refuses:
        assert _accepts(demo, schema, text) == (text in takes), text
        if text in takes:
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema, takes, refuses", [
    # allOf's parts (and a ref's siblings) intersected: the later part's keyword replaced the
    # earlier's, so {"n": 7.07} passed an integer, "c" an enum of a and b
    ({"allOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}, ['"b"'], ['"a"', '"c"']),
    ({"allOf": [{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                 "additionalProperties": False}, {"properties": {"n": {"minimum": 5, "maximum": 9}}}]},
     ['{"n": 7}'], ['{"n": 7.5}', '{"n": 4}', '{"n": 7, "m": 1}']),
    ({"allOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, ["1"], ["1.5", "-1"]),
    ({"allOf": [{"type": "string"}, {"type": ["string", "null"]}]}, ['"a"'], ["null"]),
    ({"allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, {"anyOf": [{"type": "string"}, {"type": "null"}]}]},
     ['"s"'], ["1", "null"]),
    ({"allOf": [{"type": "array", "items": {"type": "integer"}}, {"items": {"minimum": 0}}]}, ["[1]"], ["[-1]", "[1.5]"]),
    ({"$ref": "#/$defs/Color", "enum": ["red"], "$defs": {"Color": {"enum": ["red", "green"]}}}, ['"red"'], ['"green"']),
    # a name one part leaves to additionalProperties: false is one the object leaves out
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                {"properties": {"b": {"type": "string"}}}]}, ['{"a": 1}'], ['{"a": 1, "b": "x"}', '{"b": "x"}']),
    # two patterns beside values: the values both match
    ({"allOf": [{"enum": ["ab", "AB", "abcd"], "pattern": "^[a-z]+$"}, {"pattern": "^.{1,3}$"}]},
     ['"ab"'], ['"AB"', '"abcd"']),
])
def test_what_a_fourth_review_found_is_enforced(demo, schema, takes, refuses):
    _grammar_as_jsonschema(demo, schema, takes, refuses)


@pytest.mark.parametrize("schema, takes, refuses", [
    # a required name properties leaves out was dropped: objects without it passed (the
    # grammar writes required names first, as every object of the converter)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     ['{"a": 1, "b": "x"}', '{"a": 1, "b": [2]}'], ['{"a": 1}', '{"b": 2}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
      "additionalProperties": {"type": "string"}}, ['{"b": "x"}', '{"b": "x", "a": 1}'], ['{"b": 2}', '{"a": 1}']),
    # required with no properties: any object holding the names (it was any object)
    ({"type": "object", "required": ["b"]}, ['{"b": 1}', '{"b": 1, "c": 2}'], ['{"c": 2}', "{}"]),
])
def test_a_required_name_properties_leaves_out_is_still_required(demo, schema, takes, refuses):
    _grammar_as_jsonschema(demo, schema, takes, refuses)


def _grammar_as_jsonschema(model, schema: dict, takes: list[str], refuses: list[str]) -> None:
    """The grammar takes each of ``takes`` and refuses each of ``refuses``, as jsonschema
    validates them."""
    for text in takes + refuses:
        assert _accepts(model, schema, text) == (text in takes), text
        if text in takes:
            jsonschema.validate(json.loads(text), schema)
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema, says", [
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"], "additionalProperties": False},
     "property 'b' is required, but properties does not define it and additionalProperties is false"),
    ({"type": "object", "properties": [{"a": {}}]}, "properties must be an object of each property's schema by its name"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": "ab"}, 'required must be a list of property names, got "ab"'),
    ({"allOf": [{"type": "object", "required": [1]}, {"required": ["a"]}]}, "required must be a list of property names"),
])
def test_an_object_schema_s_bad_words_are_a_400_naming_them(schema, says):
    with pytest.raises(ParamError, match=re.escape(says)):
        json_schema_grammar(schema)


def test_a_thousand_optional_properties_are_a_grammar(demo):
    """The base class's optional chain recursed once a property: 1,000 were a
    RecursionError (a 400), 900 took 2 s to write."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)},
              "additionalProperties": {"type": "string"}}
    for text, ok in [('{"p999": 1}', True), ('{"p3": 1, "p999": 2}', True), ('{"p3": 1, "x": "s"}', True),
                     ('{"p999": 1, "p3": 2}', False), ('{"p3": 1 "x": "s"}', False)]:
        assert _accepts(demo, schema, text) == ok, text


def test_non_ascii_values_and_names_are_their_utf8_text(demo):
    """An enum's value and a property's name beyond ASCII are the text itself, as
    llama-server writes them (they were \\u escapes, six characters a letter); a lone
    surrogate, which UTF-8 cannot hold, keeps its escape."""
    schema = {"type": "object", "properties": {"città": {"enum": ["Zürich", "東京"]}}, "required": ["città"],
              "additionalProperties": False}
    for text in ['{"città": "Zürich"}', '{"città": "東京"}']:
        assert _accepts(demo, schema, text), text
    for text in ['{"citt\\u00e0": "Zürich"}', '{"città": "Z\\u00fcrich"}']:
        assert not _accepts(demo, schema, text), text
    assert _accepts(demo, {"const": "a\ud800"}, '"a\\ud800"')


# A refusal names where in the schema it lies (a JSON pointer), so that a schema of many
# properties says which one; a ref's target where the user's schema holds it.
@pytest.mark.parametrize("schema, at", [
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": "x"}}}},
     " at /properties/a/items;"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 5, "maxItems": 2}}}, " at /properties/a;"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "strin"}}}}},
     " at /properties/a/properties/b;"),
    ({"type": "object", "properties": {"a/b~": {"anyOf": [{"type": "string"}, {"type": "strin"}]}}},
     " at /properties/a~1b~0/anyOf/1;"),
    ({"$defs": {"Foo": {"type": "object", "properties": {"x": {"type": "strin"}}}},
      "type": "object", "properties": {"a": {"$ref": "#/$defs/Foo"}}}, " at /$defs/Foo/properties/x;"),
    ({"$defs": {"a/b": {"type": "array", "items": {"type": "strin"}}},
      "type": "object", "properties": {"a": {"$ref": "#/$defs/a~1b"}}}, " at /$defs/a~1b/items;"),
    ({"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "v": {"type": "strin"}}},
     " at /properties/v;"),
])
def test_a_refusal_names_where_in_the_schema_it_lies(schema, at):
    with pytest.raises(ParamError, match=re.escape(at)) as e:
        json_schema_grammar(schema)
    assert e.value.param == "json_schema" and str(e.value).count(" at /") == 1


def test_a_refusal_of_the_whole_schema_names_no_place():
    with pytest.raises(ParamError) as e:
        json_schema_grammar({"type": "strin"})
    assert " at " not in str(e.value) and "type must be one of string, number" in str(e.value)


# A keyword of the wrong shape is refused naming the keyword and the shape it takes, where
# the converter's own text named what it tripped on (AttributeError: 'int' object has no
# attribute 'startswith'; "Unrecognized schema"; an anyOf's first key taken for a schema).
@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "pattern": 5}, "pattern must be a string (a regular expression), got 5);"),
    ({"$ref": ["#/$defs/A"]}, "$ref must be a string"),
    ({"anyOf": {"type": "string"}}, 'anyOf must be a list of schemas, got {"type": "string"}'),
    ({"allOf": {"type": "string"}}, "allOf must be a list of schemas"),
    ({"type": "object", "properties": {"a": {"oneOf": "x"}}}, 'oneOf must be a list of schemas, got "x") at /properties/a;'),
    ({"type": ["string", 3]}, 'type must be one of string, number, integer, boolean, object, array, null, or a list of them, got ["string", 3]'),
    ({"type": []}, "type must be one of"),
    ({"type": "string", "format": 5}, "format must be a string, got 5"),
    ({"type": "object", "properties": [{"a": 1}]}, "properties must be an object of each property's schema by its name"),
    ({"type": "object", "required": "ab", "properties": {"a": {}}}, 'required must be a list of property names, got "ab"'),
])
def test_a_keyword_of_the_wrong_shape_is_named_with_the_shape_it_takes(schema, words):
    with pytest.raises(ParamError) as e:
        json_schema_grammar(schema)
    assert e.value.param == "json_schema" and words in str(e.value) and "Error: '" not in str(e.value)


@pytest.mark.parametrize("schema, words", [
    ({"allOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"pattern": "^.{1,3}$"}]}, "set pattern to"),
    ({"allOf": [{"type": "string", "format": "date"}, {"format": "uuid"}]}, "set format to"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allows no JSON value"),
    ({"allOf": [{"enum": [1, 2]}, {"enum": [True, "1"]}]}, "allows no JSON value"),
    ({"allOf": [{"type": "string"}, False]}, "allows no JSON value"),
])
def test_parts_of_allof_that_cannot_be_one_grammar_are_a_400(schema, words):
    with pytest.raises(ParamError, match=words):
        json_schema_grammar(schema)


@pytest.mark.parametrize("pattern", ["^(a$", "^a{2,1}$", "^a**$", "^a)$", "^*a$"])
def test_a_malformed_pattern_is_a_400(pattern):
    """No regex dialect reads these; the converter wrote "^(a$" as "a" and "^a{2,1}$" as "aa"."""
    with pytest.raises(ParamError, match="is not a regular expression"):
        json_schema_grammar({"type": "string", "pattern": pattern})


def test_nested_counts_that_stall_the_grammar_are_a_400():
    """((a-z){0,20}){0,20} took llama.cpp's grammar minutes a request; (\\d{1,3}\\.){3} is fine."""
    with pytest.raises(ParamError, match="nests counted repeats that multiply to 400"):
        json_schema_grammar({"type": "string", "pattern": "^([a-z]{0,20}){0,20}$"})
    json_schema_grammar({"type": "string", "pattern": "^(\\d{1,3}\\.){3}\\d{1,3}$"})


@pytest.mark.parametrize("pattern, group", [
    ("^(.*.*.*.*)*$", "(.*.*.*.*)*"), ("^(.*)+$", "(.*)+"), ("^x(?:a|)*$", "(?:a|)*"),
    ("^(a?b?){2,}$", "(a?b?){2,}"), ("^(.*.*.*.*){0,20}$", "(.*.*.*.*){0,20}"), ("^((a*)b)*(c*)*$", "(c*)*"),
])
def test_a_repeated_group_that_can_match_nothing_is_a_400(pattern, group):
    """(.*.*.*.*)* took 50 s a token's mask over 8,192 ids and held the server for
    minutes: refused, naming the group."""
    with pytest.raises(ParamError, match=re.escape(f"repeats {group!r}, which can match the empty string")):
        json_schema_grammar({"type": "string", "pattern": pattern})


@pytest.mark.parametrize("pattern", ["^(\\w+\\s*)*$", "^(.*,)*$", "^([a-z]*)?$", "^\\(.*\\)*$", "^[(]*(a)+$"])
def test_a_repeated_group_that_takes_a_character_is_fine(pattern):
    assert json_schema_grammar({"type": "string", "pattern": pattern})


def test_model_chats_json_may_hold_the_fallback_templates_end_of_turn():
    """The Python API as the server: a schema's reply on a template-less model is not cut
    at "<|im_end|>" inside its JSON; a reply with no format still ends there."""
    import pymtp

    model = pymtp.load(str(pymtp.__path__[0]) + "/data/qwen35-tiny-mtp-q8_0.gguf", threads=2)
    try:
        schema = {"type": "object", "properties": {"k": {"const": "a<|im_end|>b"}}, "required": ["k"]}
        msgs = [{"role": "user", "content": "Hi"}]
        r = model.chat(msgs, json_schema=schema, max_tokens=40, temperature=0)
        assert r.finish_reason == "stop" and json.loads(r.text) == {"k": "a<|im_end|>b"}
        assert model.chat(msgs, grammar='root ::= "x<|im_end|>y"', max_tokens=40, temperature=0).text == "x"
    finally:
        model.close()
