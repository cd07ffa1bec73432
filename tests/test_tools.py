"""Tool calls in the Python API: the reply's <tool_call> blocks read back (whole and
streamed in pieces), the grammar of a forced call, and Session.chat's flow on the demo
model: a forced call, its result, a final answer."""

from __future__ import annotations

import json

import pytest

import pymtp
from pymtp.config import ParamError
from pymtp.tool_reply import ToolCallStream, parse_tool_calls
from pymtp.tools import ToolPlan, check_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
         '</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n'
         '</parameter>\n</function>\n</tool_call>')


def test_reply_is_split_into_content_and_calls():
    content, calls = parse_tool_calls(REPLY)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 2, "b": 3}     # the XML form
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("no calls <tool_ here") == ("no calls <tool_ here", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>")[0] == "<tool_call>not json</tool_call>"


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_pieces_give_the_same_split(size):
    stream, content, calls = ToolCallStream(), [], []
    for i in range(0, len(REPLY), size):
        text, done = stream.feed(REPLY[i:i + size])
        assert "<" not in text or "<tool" not in text
        content.append(text)
        calls += done
    text, done = stream.finish()
    whole_content, whole_calls = parse_tool_calls(REPLY)
    assert ("".join(content) + text).strip() == whole_content
    assert [c["function"] for c in calls + done] == [c["function"] for c in whole_calls]


@pytest.mark.parametrize("text, args", [
    ('<tool_call>\n{"name": "f", "arguments": {"s": "the tag </tool_call> ends \\"a\\" call"}}\n</tool_call>',
     {"s": 'the tag </tool_call> ends "a" call'}),
    ("<tool_call>\n<function=f>\n<parameter=s>\nclose with </parameter> then more\n</parameter>\n</function>\n"
     "</tool_call>", {"s": "close with </parameter> then more"}),
    ("<tool_call>\n<function=f>\n<parameter=s>\nsay </tool_call> here\n</parameter>\n<parameter=t>\nx\n"
     "</parameter>\n</function>\n</tool_call>", {"s": "say </tool_call> here", "t": "x"}),
])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_closing_tag_inside_an_argument_is_its_text(text, args, size):
    """The forced call's grammar lets a string argument hold </tool_call> or </parameter>:
    the call was lost (its markup the content) or its value cut at the tag."""
    schemas = {"f": {"type": "object", "properties": {"s": {"type": "string"}, "t": {"type": "string"}}}}
    stream, content, calls = ToolCallStream(False, schemas), "", []
    for i in range(0, len(text), size):
        out, done = stream.feed(text[i:i + size])
        content, calls = content + out, calls + done
    out, done = stream.finish()
    assert (content + out, [json.loads(c["function"]["arguments"]) for c in calls + done]) == ("", [args])


@pytest.mark.parametrize("lead", [False, True])
@pytest.mark.parametrize("text", [REPLY, "<tool_call>\nnot json\n</tool_call> after", "plain <tool", "  <tool_call>\n{"])
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_a_streams_spans_say_where_its_text_came_from(text, size, lead):
    """Each piece of text the stream hands out is the text fed at its span (an unparsed
    block's tags included), so a reply's tokens can be placed in it."""
    stream, outs = ToolCallStream(lead), []
    for i in range(0, len(text), size):
        outs.append((stream.feed(text[i:i + size])[0], stream.spans))
    outs.append((stream.finish()[0], stream.spans))
    for out, spans in outs:
        assert "".join(text[a:b] for a, b in spans) == out and all(b > a for a, b in spans)
    assert any(out for out, _ in outs)


def test_bad_tools_are_refused_naming_the_field():
    with pytest.raises(ParamError, match="does not hold") as e:
        ToolPlan.of([WEATHER], {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(ParamError) as e:
        ToolPlan.of([WEATHER, WEATHER])
    assert e.value.param == "tools" and "twice" in str(e.value)
    with pytest.raises(ParamError) as e:
        ToolPlan.of([{"type": "function", "function": {"name": "bad name!"}}])
    assert e.value.param == "tools"
    with pytest.raises(ParamError, match="needs tools") as e:
        ToolPlan.of(None, "required")
    with pytest.raises(ParamError) as e:
        ToolPlan.of([WEATHER], "maybe")
    assert e.value.param == "tool_choice"


def test_only_forced_choices_have_a_grammar():
    assert ToolPlan.of([WEATHER]).grammar is None
    assert ToolPlan.of([WEATHER], "none").grammar is None
    named = ToolPlan.of([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, False).grammar
    assert 'root ::= call "\\n"?\n' in named and "get_weather" not in named
    assert 'root ::= call ("\\n" call)*' in ToolPlan.of([WEATHER, ADD], "required").grammar


@pytest.fixture(scope="module")
def demo():
    m = pymtp.load(threads=1, n_ctx=2048)
    yield m
    m.close()


def test_chat_flow_call_result_answer(demo):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = demo.chat(msgs, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  parallel_tool_calls=False, max_tokens=80)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
    call = r.tool_calls[0]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in "CF"
    # the same call, token for token, without MTP
    plain = demo.chat(msgs, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      parallel_tool_calls=False, max_tokens=80, spec="none")
    assert plain.tokens == r.tokens
    msgs += [{"role": "assistant", "content": None, "tool_calls": r.tool_calls},
             {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 22 C"}]
    final = demo.chat(msgs, tools=[WEATHER, ADD], tool_choice="none", max_tokens=24)
    assert final.tool_calls is None and final.finish_reason in ("stop", "length")
    # the call and its result are in the prompt: longer than the question alone
    assert final.stats.prompt_tokens > demo.chat(msgs[:1], max_tokens=1).stats.prompt_tokens + 20
    # and so are the tools, as under "auto" (llama-server and vLLM render them for "none")
    assert final.prompt_tokens == demo.chat(msgs, tools=[WEATHER, ADD], max_tokens=1).prompt_tokens


def test_tool_results_are_in_the_prompt(demo):
    template = demo.chat_template_for_prompts()
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    from pymtp.tools import template_messages
    text = template.render(template_messages([{"role": "user", "content": "2+3?"},
                                              {"role": "assistant", "content": "", "tool_calls": [call]},
                                              {"role": "tool", "content": "5"}]), extra={"tools": [ADD]})
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_format_beside_tools_is_the_text_replys():
    """As OpenAI's API takes tools with a format: forced calls are their grammar, "none"
    leaves the format alone, "auto" is calls or the format (one grammar, either_grammar)."""
    from pymtp.tools import reply_constraint

    auto = ToolPlan.of([WEATHER, ADD], "auto")
    assert reply_constraint(None, None, PERSON) == (None, PERSON)
    assert reply_constraint(ToolPlan.of([WEATHER], "none"), 'root ::= "a"', None) == ('root ::= "a"', None)
    forced = ToolPlan.of([WEATHER], "required")
    assert reply_constraint(forced, None, PERSON) == (forced.grammar, None)
    assert reply_constraint(auto, None, None) == (None, None)
    grammar, schema = reply_constraint(auto, None, PERSON)
    assert schema is None and grammar.count("\nroot ::=") == 1
    with pytest.raises(ParamError) as e:
        reply_constraint(auto, None, {"type": "nope", "$ref": "#/x"}, "response_format")
    assert e.value.param == "response_format"


@pytest.mark.parametrize("text, whole", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', True),
    ('{"name": "Ann", "age": 7}', True),
    ('{"name": "Ann", "age": "7"}', False),            # off the schema
    ("Sure! Here it is", False),                       # neither calls nor the format
    ('<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>', False),     # no such function
])
def test_calls_or_the_format_is_one_grammar(dense_model, text, whole):
    """Walked token by token through llama.cpp's grammar: a call of a given function, or
    JSON under the schema, and nothing else; and the reply may end after either."""
    from pymtp.tools import reply_constraint
    from test_reasoning import _walk

    grammar, _ = reply_constraint(ToolPlan.of([WEATHER, ADD], "auto", False), None, PERSON)
    allowed, ends = _walk(dense_model, grammar, text)
    assert (allowed and ends) == whole, (allowed, ends)


def test_chat_with_tools_and_a_format_answers_one_or_the_other(demo):
    r = demo.chat([{"role": "user", "content": "Who is Ann?"}], tools=[WEATHER, ADD], json_schema=PERSON,
                  max_tokens=64, temperature=0)
    if r.tool_calls:
        assert r.finish_reason == "tool_calls" and r.tool_calls[0]["function"]["name"] in ("get_weather", "add")
    else:
        got = json.loads(r.text)
        assert set(got) == {"name", "age"} and isinstance(got["age"], int)


def test_the_union_keeps_each_grammars_names_its_own(dense_model):
    """The format's names are renamed whole: one it uses but does not define stays an
    error instead of binding to the calls' rule of that name; repetition counts stay
    counts; a format without root is refused naming the grammar."""
    from pymtp.constraint import Constraint, either_grammar
    from test_reasoning import _walk

    calls = ToolPlan.of([ADD], "required").grammar
    assert "space ::=" in calls
    with pytest.raises(ParamError, match="Undefined rule identifier 'either-b-space'"):
        Constraint(dense_model._native, either_grammar(calls, 'root ::= "a" space')).close()
    assert _walk(dense_model, either_grammar(calls, 'root ::= [a-z]{2,3} x\nx ::= "!"'), "abc!") == (True, True)
    with pytest.raises(ParamError) as e:
        either_grammar(calls, 'start ::= "a"')
    assert e.value.param == "grammar"


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_beside_a_format_only_a_reply_that_starts_with_a_call_holds_calls(size):
    """Under calls-or-a-format the reply's start says which it is: a JSON reply whose
    strings hold a call's markup is all content, whole and streamed in pieces; a reply of
    calls is read as ever; without a format the markup anywhere is a call."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    json_reply = '{"name": "Ann", "age": 7, "note": "<tool_call><function=add></function></tool_call>"}'
    plan = ToolPlan.of([WEATHER, ADD], "auto")
    beside = plan.beside(True)
    assert (beside.calls_lead, plan.calls_lead, ToolPlan.of([ADD], "required").beside(True).calls_lead) == \
        (True, False, False)
    assert plan.read(json_reply)[1], "the markup in a string is a call without a format"
    assert beside.read(json_reply) == (json_reply, [])
    assert [c["function"]["name"] for c in beside.read("\n" + call)[1]] == ["add"]
    for text in (json_reply, "\n" + call, "  ", "<tool"):
        stream = ToolCallStream(True)
        pieces = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        whole = parse_tool_calls(text, True)
        assert ("".join(p for p, _ in pieces).strip(), [c["function"] for _, cs in pieces for c in cs]) == \
            (whole[0], [c["function"] for c in whole[1]])


LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "$defs": {"Zip": {"type": "string"}},
    "properties": {
        "zip": {"type": "string"}, "version": {"type": ["string", "null"]}, "flag": {"anyOf": [{"type": "string"}]},
        "unit": {"enum": ["C", "F"]}, "count": {"type": "integer"}, "opts": {"type": "object"},
        "code": {"$ref": "#/$defs/Zip"}, "area": {"allOf": [{"$ref": "#/$defs/Zip"}, {"minLength": 1}]},
        "mode": {"enum": [1, 2, "auto"]}, "gone": {"type": ["string", "null"]}, "ratio": {"type": "number"}}}}}


def _xml(name: str, **values: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_xml_values_are_read_by_the_parameters_schema(size):
    """Qwen3.5's XML form writes every value as text: a parameter that takes a string keeps
    it as written (a zip code, a version, the word null), any other is JSON where it
    parses; whole and streamed in pieces alike."""
    reply = _xml("lookup", zip="10001", version="3.10", flag="null", unit="C", count="7", opts='{"a": [1]}',
                 code="02134", area="3.10", mode="1", gone="null", ratio="2", other="2.50", note="not json")
    plan = ToolPlan.of([LOOKUP])
    stream = plan.stream()
    pieces = [stream.feed(reply[i:i + size]) for i in range(0, len(reply), size)] + [stream.finish()]
    streamed = [c for _, calls in pieces for c in calls]
    for calls in (plan.read(reply)[1], streamed):
        (call,) = calls
        assert json.loads(call["function"]["arguments"]) == {
            "zip": "10001", "version": "3.10", "flag": "null", "unit": "C", "count": 7, "opts": {"a": [1]},
            "code": "02134", "area": "3.10",        # strings through $ref and allOf
            "mode": 1, "gone": None, "ratio": 2,    # the enum's number, the nullable's null, an integer number
            "other": 2.5, "note": "not json"}      # the last two: no schema says, so JSON where it parses


def test_a_call_of_a_function_the_request_does_not_offer_stays_text():
    """OpenAI's API answers calls of the request's functions only: a block naming another
    (either form) is the reply's text."""
    plan = ToolPlan.of([LOOKUP, ADD])
    foreign = _xml("delete_everything", path="/")
    json_form = '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'
    assert plan.read(foreign) == (foreign, [])
    assert plan.read(json_form) == (json_form, [])
    content, calls = plan.read("Sure.\n" + foreign + "\n" + _xml("lookup", zip="1"))
    assert content == "Sure.\n" + foreign and [c["function"]["name"] for c in calls] == ["lookup"]
    assert parse_tool_calls(foreign)[1], "without the request's tools every name is a call"


PERSON_DEFS = {"type": "object", "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}},
                                                      "required": ["name"], "additionalProperties": False}},
               "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"], "additionalProperties": False}
# another function's Person, of another shape, and a draft-07 ``definitions``
SEAT_DEFS = {"type": "object", "definitions": {"Person": {"type": "object", "properties": {"row": {"type": "integer"}},
                                                          "required": ["row"], "additionalProperties": False}},
             "properties": {"who": {"$ref": "#/definitions/Person"}}, "required": ["who"],
             "additionalProperties": False}
# names a JSON pointer escapes: "a/b" as ~1, "c~d" as ~0
ESCAPED_DEFS = {"type": "object", "$defs": {"a/b": {"type": "integer"}, "c~d": {"type": "boolean"}},
                "properties": {"n": {"$ref": "#/$defs/a~1b"}, "f": {"$ref": "#/$defs/c~0d"}},
                "required": ["n", "f"], "additionalProperties": False}
# an escaped name beside a plain one its alias could take; an escape past the name
CLASHING_DEFS = {"type": "object", "$defs": {"a/b": {"type": "integer"}, "0": {"type": "boolean"},
                                             "O": {"type": "object", "properties": {"x/y": {"type": "string",
                                                                                           "maxLength": 3}}}},
                 "properties": {"n": {"$ref": "#/$defs/a~1b"}, "f": {"$ref": "#/$defs/0"},
                                "s": {"$ref": "#/$defs/O/properties/x~1y"}},
                 "required": ["n", "f", "s"], "additionalProperties": False}
TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
        "required": ["kids"], "additionalProperties": False}


@pytest.mark.parametrize("text, ok", [
    ('{"name": "book", "arguments": {"who": {"name": "Ann"}}}', True),
    ('{"name": "book", "arguments": {"who": {"row": 3}}}', False),        # seat's Person, not book's
    ('{"name": "seat", "arguments": {"who": {"row": 3}}}', True),
    ('{"name": "seat", "arguments": {"who": {"name": "Ann"}}}', False),
    ('{"name": "tree", "arguments": {"kids": [{"kids": []}]}}', True),    # "#": the parameters' own root
    ('{"name": "tree", "arguments": {"kids": [{"kids": "x"}]}}', False),
    ('{"name": "pair", "arguments": {"n": 7, "f": true}}', True),
    ('{"name": "pair", "arguments": {"n": true, "f": 7}}', False),
    ('{"name": "clash", "arguments": {"n": 7, "f": true, "s": "ab"}}', True),
    ('{"name": "clash", "arguments": {"n": true, "f": true, "s": "ab"}}', False),
    ('{"name": "clash", "arguments": {"n": 7, "f": true, "s": 5}}', False),
])
def test_a_forced_calls_grammar_resolves_each_functions_refs(dense_model, text, ok):
    """Clients send nested models as $defs and $ref (openai-python's pydantic_function_tool):
    a forced call's grammar resolves each function's refs in its own parameters, two
    functions' definitions of one name apart, and names a ref escapes (~1, ~0)."""
    from test_reasoning import _walk

    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("book", PERSON_DEFS), ("seat", SEAT_DEFS), ("tree", TREE), ("pair", ESCAPED_DEFS),
                                    ("clash", CLASHING_DEFS))]
    plan = ToolPlan.of(tools, "required", False)
    allowed, ends = _walk(dense_model, plan.grammar, f"<tool_call>\n{text}\n</tool_call>")
    assert (allowed and ends) == ok, (allowed, ends)
    named = ToolPlan.of(tools, {"type": "function", "function": {"name": "book"}})
    assert named.grammar is not None and "seat" not in named.grammar


def test_definitions_that_are_not_an_object_are_a_refusal_naming_tools():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                          "$defs": []}}}
    with pytest.raises(ParamError, match=r"\$defs that is not an object") as e:
        ToolPlan.of([bad], "required")
    assert e.value.param == "tools"


@pytest.mark.parametrize("text, ok", [
    ('{"n": 7, "f": true, "s": "ab"}', True),
    ('{"n": true, "f": true, "s": "ab"}', False),
    ('{"n": 7, "f": true, "s": 5}', False),
])
def test_a_json_schemas_escaped_refs_resolve(dense_model, text, ok):
    """response_format's schema (and every route's format) resolves refs the converter
    cannot read itself: escaped names (~1, ~0), past a definition's name too (it was a
    400, "Error resolving ref")."""
    from pymtp.constraint import json_schema_grammar
    from test_reasoning import _walk

    allowed, ends = _walk(dense_model, json_schema_grammar(CLASHING_DEFS), text)
    assert (allowed and ends) == ok, (allowed, ends)


def test_flat_refs_files_each_target_once_under_its_own_name():
    """A recursive schema refers to its own name; definitions no ref reaches are not filed."""
    from pymtp.schema_refs import flat_refs

    defs: dict = {"k-Node": "another schema's"}
    schema = {"$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}},
                        "Unused": {"type": "string"}},
              "type": "object", "properties": {"head": {"$ref": "#/$defs/Node"}}}
    body = flat_refs(schema, "k", defs)
    assert body == {"type": "object", "properties": {"head": {"$ref": "#/$defs/k-Node-1"}}}
    assert defs == {"k-Node": "another schema's",
                    "k-Node-1": {"type": "object", "properties": {"next": {"$ref": "#/$defs/k-Node-1"}}}}


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}, "$defs": {"Y": {"type": "integer"}}},
     "json_schema at /properties/a: $ref '#/$defs/X' points at nothing in the schema; define its target there "
     "(under $defs) or correct the name"),
    ({"type": "array", "items": {"$ref": "#/$defs/Y"}, "$defs": {"Y": {"type": "array", "items": {"$ref": "#/$defs/Z"}}}},
     "json_schema at /$defs/Y/items: $ref '#/$defs/Z' points at nothing in the schema; define its target there "
     "(under $defs) or correct the name"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}},
     "json_schema at /properties/a: $ref 'https://example.com/s.json' is not in this schema (only refs starting "
     "with '#' are read; nothing is fetched); copy its target under $defs and refer to it as '#/$defs/Name'"),
    ({"type": "object", "properties": {"a": {"$ref": 5}}},
     'json_schema at /properties/a: $ref must be a string ("#/$defs/Name"), got 5'),
])
def test_a_ref_that_cannot_be_read_is_refused_where_it_is(schema, message):
    """The converter's refusal of a ref to nothing said "$defs not in {...}" (the whole
    schema, its $defs taken out: 12.7 KB for a 10 KB schema) with no place; one to
    another document told an HTTP client to pass --allow-fetch."""
    from pymtp.constraint import json_schema_grammar

    with pytest.raises(ParamError) as e:
        json_schema_grammar(schema)
    assert (e.value.param, str(e.value)) == ("json_schema", message)


def test_flat_refs_origins_map_filed_names_back_to_the_users_pointers():
    from pymtp.schema_refs import flat_refs, user_pointer

    defs: dict = {}
    origins: dict = {}
    schema = {"definitions": {"a/b": {"type": "string"}},
              "type": "object", "properties": {"s": {"$ref": "#/definitions/a~1b"},
                                               "me": {"$ref": "#"}}}
    flat_refs(schema, "k", defs, origins)
    # "a/b" cannot name a rule, so its target is filed under the key alone, the root after it
    assert origins == {"k": "/definitions/a~1b", "k-1": ""} and set(defs) == {"k", "k-1"}
    assert user_pointer("/$defs/k/maxLength", origins) == "/definitions/a~1b/maxLength"
    assert user_pointer("/$defs/k-1/properties/s", origins) == "/properties/s"
    assert user_pointer("/$defs/k", origins) == "/definitions/a~1b"
    assert user_pointer("/$defs/other/x", origins) == "/$defs/other/x"
    assert user_pointer("/properties/s", origins) == "/properties/s"


# definitions named as other tools name them: a dotted namespace, a space, a colon, two
# names that read alike once spelled as rule names (llama.cpp's are [A-Za-z0-9-])
ODD_NAMES = {"$defs": {"ns.Node": {"type": "object", "properties": {
                           "v": {"$ref": "#/$defs/ns-Node"},
                           "next": {"anyOf": [{"$ref": "#/$defs/ns.Node"}, {"type": "null"}]}},
                       "required": ["v", "next"]},
                       "ns-Node": {"type": "integer"},
                       "My Item: x": {"type": "string"}},
             "type": "object", "properties": {"head": {"$ref": "#/$defs/ns.Node"},
                                              "name": {"$ref": "#/$defs/My Item: x"}},
             "required": ["head", "name"]}


@pytest.mark.parametrize("text, ok", [
    ('{"head": {"v": 1, "next": {"v": 2, "next": null}}, "name": "a"}', True),
    ('{"head": {"v": "1", "next": null}, "name": "a"}', False),
    ('{"head": {"v": 1, "next": null}, "name": 5}', False),
])
def test_definition_names_outside_a_rules_spelling_resolve(dense_model, text, ok):
    """A recursive definition whose name holds a dot (pydantic's module-qualified names)
    gave a grammar llama.cpp refused ("Undefined rule identifier"): names are spelled as
    rule names, apart from each other."""
    from pymtp.constraint import json_schema_grammar
    from test_reasoning import _walk

    allowed, ends = _walk(dense_model, json_schema_grammar(ODD_NAMES), text)
    assert (allowed and ends) == ok, (allowed, ends)


def test_call_arguments_are_json_a_client_can_parse():
    """Python's JSON reader takes NaN, Infinity and 1e400 and wrote them back into a call's
    arguments, which JavaScript's JSON.parse throws on: the JSON form with them is no call
    (as llama-server reads it), the XML form's values stay their text."""
    from pymtp.tool_reply import parse_call

    assert parse_call('{"name": "f", "arguments": {"x": NaN}}') is None
    assert parse_call('{"name": "f", "arguments": {"x": 1e400}}') is None
    schemas = {"f": {"type": "object", "properties": {"x": {"type": "number"}, "note": {}, "z": {"type": "number"}}}}
    call = parse_call("<function=f>\n<parameter=x>\nNaN\n</parameter>\n<parameter=note>\n-Infinity\n</parameter>\n"
                      "<parameter=y>\n1e400\n</parameter>\n<parameter=z>\n2.5\n</parameter>\n</function>", schemas)
    assert call["function"]["arguments"] == '{"x": "NaN", "note": "-Infinity", "y": "1e400", "z": 2.5}'


# Qwen3.5's template writes calls in the XML form; a forced call's grammar writes them so
XML_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                  "units": {"enum": ["c", "f"]}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "noargs", "parameters": {"type": "object"}}}]
_CITY = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n"


@pytest.mark.parametrize("text, ok", [
    (_CITY.format("Paris\nis </param nice") + "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", True),
    (_CITY.format("Paris") + "<parameter=units>\nc\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=noargs>\n</function>\n</tool_call>", True),
    ("<tool_call>\n<function=noargs>\n<parameter=q>\nany\n</parameter>\n</function>\n</tool_call>", True),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", False),
    (_CITY.format("Paris") + "<parameter=units>\nk\n</parameter>\n</function>\n</tool_call>", False),
    (_CITY.format("Paris") + "<parameter=days>\nx\n</parameter>\n</function>\n</tool_call>", False),
    (_CITY.format("Paris") + "</function>\n</tool_call>", True),
    ('<tool_call>\n{"name": "noargs", "arguments": {}}\n</tool_call>', False),
])
def test_a_forced_calls_xml_grammar(dense_model, text, ok):
    """Required parameters always, in the schema's order, a string's text up to its
    closing tag, an enum's words, JSON for an integer; no JSON form where the XML is asked."""
    from pymtp.tools import ToolChoice, tool_call_grammar
    from test_reasoning import _walk

    gbnf = tool_call_grammar(XML_TOOLS, ToolChoice("required"), True, xml=True)
    allowed, ends = _walk(dense_model, gbnf, text)
    assert (allowed and ends) == ok, (allowed, ends)
    if ok:
        calls = parse_tool_calls(text, False, {t["function"]["name"]: t["function"]["parameters"] for t in XML_TOOLS})[1]
        assert calls and calls[0]["function"]["name"] in text


def test_a_forced_call_takes_the_form_the_template_asks_for(dense_model, monkeypatch):
    """A forced call was JSON under a template that writes calls as XML (Qwen3.5's): the
    model was made to answer in a form it never learnt."""
    from pymtp.chat import ChatTemplate

    base = dense_model.chat_template_for_prompts()
    xml = ChatTemplate(base.text + "{# calls: <tool_call><function=NAME><parameter=P>VALUE #}",
                       bos_token=base.bos_token, eos_token=base.eos_token)
    assert xml.xml_calls and not base.xml_calls
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
        "required": ["n", "unit"]}}}]
    msgs = [{"role": "user", "content": "pick"}]
    monkeypatch.setattr(dense_model, "_template", xml)
    r = dense_model.chat(msgs, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=150,
                         temperature=0)
    raw = dense_model.detokenize(r.tokens)
    assert raw.startswith("<tool_call>\n<function=pick>\n<parameter=n>\n"), raw
    assert r.tool_calls and set(json.loads(r.tool_calls[0]["function"]["arguments"])) == {"n", "unit"}


@pytest.mark.parametrize("text, whole", [
    ('Sure.\n<tool_call>\n{"name": "get_wea', "Sure.\n"),         # inside the block
    ('Sure. <tool_c', "Sure. "),                                    # inside its opening tag
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"na',
     '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', None),     # it parses: kept as a call
    ("Just text <b>", None),
])
def test_a_call_cut_by_max_tokens_is_left_out(text, whole):
    """A reply cut inside a call's block (or its tag) lost nothing readable but gave its
    markup to the user as content: the cut call is left out, as llama-server drops it,
    the same in a stream (a piece at a time) and in the whole reply."""
    plan = ToolPlan.of([WEATHER, ADD])
    assert plan.uncut(text) == (text if whole is None else whole)
    stream, content, calls = plan.stream(), [], []
    for i in range(0, len(text), 3):
        c, k = stream.feed(text[i:i + 3])
        content.append(c)
        calls += k
    c, k = stream.finish(cut=True)
    # white space aside, which the server's writer trims as the whole reply's read does
    whole_content, whole_calls = plan.read(plan.uncut(text))
    assert ("".join(content) + c).strip() == (whole_content if whole_calls else plan.uncut(text)).strip()
    assert [x["function"]["name"] for x in calls + k] == [x["function"]["name"] for x in whole_calls]


def test_a_forced_call_cut_by_max_tokens_is_no_content(demo):
    """The named call cut at 8 tokens: no call and no markup; the reply is empty."""
    r = demo.chat([{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=8)
    assert (r.text, r.tool_calls, r.finish_reason) == ("", None, "length")


def test_a_stop_string_inside_a_call_does_not_cut_it(demo):
    """A stop string the call's markup or JSON holds gave its markup back as the reply's
    text, and no call: stops end the text around the calls only; the tokens are the
    unstopped run's."""
    kw = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              parallel_tool_calls=False, max_tokens=80)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    free = demo.chat(msgs, **kw)
    cut = demo.chat(msgs, stop=["\n", '"', "unit", "</tool_call>"], **kw)
    assert (cut.text, cut.finish_reason, cut.tokens) == ("", "tool_calls", free.tokens)
    assert [c["function"] for c in cut.tool_calls] == [c["function"] for c in free.tool_calls]
    from pymtp.stops import Stops    # the stop matcher's own form (generate's) is its strings to chat
    again = demo.chat(msgs, stop=Stops(("\n", '"'), ("<a>", "</a>")), **kw)
    assert (again.text, again.finish_reason, again.tokens) == ("", "tool_calls", free.tokens)


@pytest.mark.parametrize("xml", [False, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_reply_may_end_after_its_last_calls_line(dense_model, xml, parallel):
    """A model ends its call's line before it stops: the forced grammar had nothing after
    ``</tool_call>`` but the next call's line, so under ``parallel`` a model that wrote the
    newline could only call again (a reply of calls to max_tokens), and without it could
    not stop at all. A blank line, or text after the calls, stays outside."""
    from pymtp.tools import ToolChoice, tool_call_grammar
    from test_reasoning import _walk

    gbnf = tool_call_grammar(XML_TOOLS, ToolChoice("required"), parallel, xml=xml)
    call = ("<tool_call>\n<function=noargs>\n</function>\n</tool_call>" if xml else
            '<tool_call>\n{"name": "noargs", "arguments": {}}\n</tool_call>')
    assert _walk(dense_model, gbnf, call) == (True, True)
    assert _walk(dense_model, gbnf, call + "\n") == (True, True)
    assert _walk(dense_model, gbnf, call + "\n" + call + "\n") == ((True, True) if parallel else (False, False))
    assert _walk(dense_model, gbnf, call + "\n\n")[1] is False
    assert _walk(dense_model, gbnf, call + "\nok") == (False, False)


def test_parameters_llama_cpp_cannot_take_are_the_tools_fault(dense_model):
    """A schema that refers to itself before any text makes a left-recursive grammar: the
    refusal named ``grammar``, which the caller never passed."""
    loop = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}, "$defs": {"B": {"$ref": "#/$defs/B"}}}}}
    for kw in (dict(tool_choice="required"), dict(json_schema={"type": "object"})):
        with pytest.raises(ParamError, match="left recursion") as e:
            dense_model.chat([{"role": "user", "content": "hi"}], tools=[loop], max_tokens=2, **kw)
        assert e.value.param == "tools"


STRICT_ADD = {"type": "function", "function": {**ADD["function"], "strict": True}}


@pytest.mark.parametrize("xml", [False, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_strict_functions_hold_an_auto_replys_calls_to_their_schemas(dense_model, xml, parallel):
    """OpenAI's strict mode under "auto": any text, or text then calls whose arguments
    follow the schema, as a forced call's do (the calls were read from free text, wrong
    arguments and all)."""
    from pymtp.tools import auto_call_grammar
    from test_reasoning import _walk

    gbnf = auto_call_grammar(check_tools([STRICT_ADD]), parallel, xml)

    def call(a: str) -> str:
        return (f"<tool_call>\n<function=add>\n<parameter=a>\n{a}\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
                "</function>\n</tool_call>" if xml else
                f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": 3}}}}\n</tool_call>')

    assert _walk(dense_model, gbnf, "No call: a <t> b, <tool>, </tool_call>.") == (True, True)
    assert _walk(dense_model, gbnf, "<think>\nadd them\n</think>\n\nOn it.\n" + call("2")) == (True, True)
    assert _walk(dense_model, gbnf, call("2") + "\n") == (True, True)
    assert _walk(dense_model, gbnf, call('"two"'))[0] is False
    assert _walk(dense_model, gbnf, call("2") + "\nDone.") == (False, False)
    assert _walk(dense_model, gbnf, call("2") + "\n" + call("5")) == ((True, True) if parallel else (False, False))


def test_only_a_strict_function_constrains_an_auto_reply():
    from pymtp.tools import reply_constraint

    assert reply_constraint(ToolPlan.of([ADD]), None, None) == (None, None)
    assert reply_constraint(ToolPlan.of([STRICT_ADD], "none"), None, None) == (None, None)
    gbnf, schema = reply_constraint(ToolPlan.of([WEATHER, STRICT_ADD]), None, None)
    assert schema is None and gbnf.rstrip().endswith("root ::= free-t0") and '\\"get_weather\\"' in gbnf
    # a format beside keeps its own grammar, calls or the format (each call to its schema)
    fmt = reply_constraint(ToolPlan.of([STRICT_ADD]).beside(True), "root ::= \"ok\"", None)[0]
    assert "free-t0" not in fmt and "either" in fmt


def test_chat_under_auto_with_a_strict_function_follows_the_grammar(demo, monkeypatch):
    """The chat passes the strict grammar to the run (the model's own reply, whatever it
    is, then stays inside it)."""
    import pymtp.tools as tools

    seen = []
    real = tools.auto_call_grammar
    monkeypatch.setattr(tools, "auto_call_grammar", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    r = demo.chat([{"role": "user", "content": "Add 2 and 3."}], tools=[STRICT_ADD], max_tokens=24, temperature=0)
    assert len(seen) == 1 and "free-t0" in seen[0]
    import numpy as np

    from pymtp.constraint import Constraint

    c = Constraint(demo._native, seen[0])
    mask = c.start()
    for t in r.tokens:
        assert mask.allows(np.array([t], dtype=np.int32))[0], r.tokens
        mask = mask.then(t)
    c.close()


def test_allowed_tools_narrow_what_a_reply_may_call():
    """OpenAI's allowed_tools: every tool in the prompt, calls only to the allowed ones
    (forced under "required"; under "auto" a call to another stays text)."""
    def plan(mode: str) -> ToolPlan:
        return ToolPlan.of([WEATHER, ADD], {"type": "allowed_tools", "allowed_tools": {
            "mode": mode, "tools": [{"type": "function", "function": {"name": "add"}}]}})

    forced = plan("required")
    assert '\\"add\\"' in forced.grammar and "get_weather" not in forced.grammar
    assert [t["function"]["name"] for t in forced.template_tools] == ["get_weather", "add"]
    auto = plan("auto")
    assert auto.grammar is None and list(auto.schemas) == ["add"]
    content, calls = auto.read(REPLY)
    assert [c["function"]["name"] for c in calls] == ["add"] and "get_weather" in content
    for bad, param in (({"mode": "all", "tools": [{"type": "function", "function": {"name": "add"}}]},
                        "tool_choice.allowed_tools"),
                       ({"mode": "auto", "tools": [{"type": "function", "function": {"name": "sub"}}]},
                        "tool_choice.allowed_tools.tools[0]")):
        with pytest.raises(ParamError) as e:
            ToolPlan.of([WEATHER, ADD], {"type": "allowed_tools", "allowed_tools": bad})
        assert e.value.param == param


@pytest.mark.parametrize("xml", [False, True])
def test_a_schema_the_converter_refuses_is_named_by_its_function(xml):
    """The grammar converts every function at once; the refusal names the one at fault."""
    from pymtp.tools import ToolChoice, tool_call_grammar

    def tool(name, params):
        return {"type": "function", "function": {"name": name, "parameters": params}}

    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}, "required": ["a"]}
    good = {"type": "object", "properties": {"x": {"type": "integer"}}}
    with pytest.raises(ParamError, match=r"^function 'second' has parameters that are not a JSON schema pymtp can "
                       r"read \(at /properties/a of them\): \$ref '#/\$defs/nowhere' points at nothing") as e:
        tool_call_grammar(check_tools([tool("first", good), tool("second", bad)]), ToolChoice("required"), xml=xml)
    assert e.value.param == "tools"
    # ... and where in that function's parameters it lies
    typo = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "strin"}}}}
    with pytest.raises(ParamError) as e:
        tool_call_grammar(check_tools([tool("first", good), tool("third", typo)]), ToolChoice("required"), xml=xml)
    assert str(e.value).startswith("function 'third' has parameters that are not a JSON schema")
    assert str(e.value).endswith(" at /properties/a/items of its parameters")
    # ... a ref's target as the user's schema holds it, not the name the grammar files it under
    defs = {"definitions": {"Item.v1": {"type": "object", "properties": {"q": {"type": "strin"}}}},
            "type": "object", "properties": {"a": {"$ref": "#/definitions/Item.v1"}}}
    with pytest.raises(ParamError) as e:
        tool_call_grammar(check_tools([tool("fourth", defs)]), ToolChoice("required"), xml=xml)
    assert str(e.value).endswith(" at /definitions/Item.v1/properties/q of its parameters")
