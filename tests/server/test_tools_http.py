"""Tool calls and structured output over HTTP: the official openai client's tool-calling
flow (forced call -> tool result -> final answer) against a real ``pymtp serve`` on the
demo model, streamed and not; response_format and grammar on both endpoints; and the 400s
that name the field."""

from __future__ import annotations

import json

import pytest

from test_tools import ADD, WEATHER

from .helpers import COLD
from .test_http_errors import MSGS, _error

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test extra: pip install -e '.[test]'")

LOOP = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}, "$defs": {"B": {"$ref": "#/$defs/B"}}}}}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _streamed_calls(stream) -> tuple[dict, str | None, str]:
    """Tool calls accumulated from delta.tool_calls as a client does, by index."""
    calls: dict[int, dict] = {}
    finish, content = None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content.append(choice.delta.content or "")
        for tc in choice.delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
    return calls, finish, "".join(content)


@pytest.mark.parametrize("spec", ["mtp", "none"])
def test_openai_client_tool_flow(demo_server, spec):
    client = demo_server.openai(timeout=60)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="m", tools=[WEATHER, ADD], max_tokens=96, extra_body={"spec": spec, **COLD})
    r = client.chat.completions.create(messages=messages, tool_choice=FORCE_WEATHER,
                                       parallel_tool_calls=False, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    # streamed: the same call, as delta.tool_calls chunks
    calls, finish, content = _streamed_calls(client.chat.completions.create(
        messages=messages, tool_choice=FORCE_WEATHER, parallel_tool_calls=False, stream=True, **kw))
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == args
    # the client's own accumulation gives the whole answer's message (its content was "")
    with client.chat.completions.stream(messages=messages, tool_choice=FORCE_WEATHER, parallel_tool_calls=False,
                                        **kw) as s:
        message = s.get_final_completion().choices[0].message
    assert message.content is None and message.tool_calls[0].function.arguments == call.function.arguments

    # the result goes back as a tool message; the final answer is text
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "temp": 22})}]
    final = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].finish_reason in ("stop", "length")
    # the call and its result are in the prompt: longer than the question alone
    alone = client.chat.completions.create(messages=messages[:1], tool_choice="none", **{**kw, "max_tokens": 1})
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    # and so are the tools, as under "auto" (llama-server renders them for "none" too)
    auto = client.chat.completions.create(messages=messages, tool_choice="auto", **{**kw, "max_tokens": 1})
    assert final.usage.prompt_tokens == auto.usage.prompt_tokens


def test_a_call_cut_by_max_tokens_leaves_no_markup_and_a_stop_string_cuts_none(demo_server):
    """A named call cut at 8 tokens gave "<tool_call>\n{..." as the content (a chat UI
    showed it): now no content and no call, streamed or whole, as llama-server. A stop
    string the call's markup or JSON holds ("\n", a quote) cut it too, leaving no call:
    now stop strings end the text around the calls only, and the call comes back whole."""
    client = demo_server.openai(timeout=60)
    kw = dict(model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tools=[WEATHER], tool_choice=FORCE_WEATHER, max_tokens=8)
    whole = client.chat.completions.create(**kw).choices[0]
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (None, None, "length")
    calls, finish, content = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert (content, calls, finish) == ("", {}, "length")
    kw |= dict(max_tokens=96, parallel_tool_calls=False)
    (free,) = client.chat.completions.create(**kw).choices[0].message.tool_calls
    kw |= dict(stop=["\n", '"'])
    whole = client.chat.completions.create(**kw).choices[0]
    (call,) = whole.message.tool_calls
    assert (whole.message.content, call.function, whole.finish_reason) == (None, free.function, "tool_calls")
    calls, finish, content = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert (content, [(c["name"], c["arguments"]) for c in calls.values()], finish) == \
        ("", [(free.function.name, free.function.arguments)], "tool_calls")


def test_required_calls_any_function(demo_server):
    client = demo_server.openai(timeout=60)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                       tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=96)
    (call,) = r.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER, "add": ADD}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_response_format_json_schema_on_both_endpoints(demo_server):
    client = demo_server.openai(timeout=60)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for spec in ("mtp", "none"):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Who are you?"}],
                                           response_format=rf, max_tokens=96, extra_body={"spec": spec})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        c = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=96,
                                      extra_body={"response_format": rf, "spec": spec})
        jsonschema.validate(json.loads(c.choices[0].text), PERSON)
    j = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=128,
                                       response_format={"type": "json_object"})
    if j.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(j.choices[0].message.content), dict)
    g = client.completions.create(model="m", prompt="def", max_tokens=32,
                                  extra_body={"grammar": 'root ::= " " [a-z_]+ "(" [a-z]* "):"'})
    assert g.choices[0].finish_reason == "stop" and g.choices[0].text.startswith(" ") and g.choices[0].text.endswith("):")


def test_llama_servers_json_schema_field_and_an_empty_grammar_on_every_route(demo_server):
    """llama-server's ``json_schema`` body field constrains a chat reply as response_format
    does (it was ignored there); an empty ``grammar`` is none (it was a 400); and the
    template-less demo model's end-of-turn text, a stop string, does not cut JSON that holds
    it (the reply was cut inside its string)."""
    client = demo_server.openai(timeout=60)
    schema = {"type": "object", "properties": {"k": {"const": "a<|im_end|>b"}, "n": {"type": "integer",
                                                                                      "minimum": 1, "maximum": 3}},
              "required": ["k", "n"], "additionalProperties": False}
    kw = dict(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=48, temperature=0)
    by_field = client.chat.completions.create(**kw, extra_body={"json_schema": schema, **COLD})
    by_format = client.chat.completions.create(**kw, extra_body=COLD, response_format={
        "type": "json_schema", "json_schema": {"name": "k", "schema": schema}})
    assert by_field.choices[0].finish_reason == by_format.choices[0].finish_reason == "stop"
    assert by_field.choices[0].message.content == by_format.choices[0].message.content
    got = json.loads(by_field.choices[0].message.content)
    jsonschema.validate(got, schema)
    assert got["k"] == "a<|im_end|>b"
    # the same text with no format still ends at it
    plain = client.chat.completions.create(**kw, extra_body={"grammar": 'root ::= "x<|im_end|>y"'})
    assert plain.choices[0].message.content == "x"
    for empty in (client.chat.completions.create(**kw, extra_body={"grammar": "", **COLD}),
                  client.completions.create(model="m", prompt="Hi", max_tokens=8, temperature=0,
                                            extra_body={"grammar": "", **COLD})):
        free = (client.chat.completions.create(**kw, extra_body=COLD) if empty.object == "chat.completion" else
                client.completions.create(model="m", prompt="Hi", max_tokens=8, temperature=0, extra_body=COLD))
        assert empty.choices[0] == free.choices[0]


def test_a_format_beside_tools_is_the_text_replys(demo_server):
    """OpenAI's API takes tools beside a response_format (it used to be a 400 here): under
    "auto" the reply is calls or JSON under the schema, whole and streamed alike; under a
    forced choice, calls; the Responses API's text.format with tools (as Codex's
    --output-schema sends it) likewise."""
    client = demo_server.openai(timeout=60)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kw = dict(model="m", messages=[{"role": "user", "content": "Who is Ann? Or the weather?"}], tools=[WEATHER, ADD],
              response_format=rf, max_tokens=96, parallel_tool_calls=False, extra_body=COLD)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name in ("get_weather", "add")
    else:
        jsonschema.validate(json.loads(msg.content), PERSON)
    calls, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert (content, [c["name"] for c in calls.values()]) == \
        (msg.content or "", [c.function.name for c in msg.tool_calls or ()])
    forced = client.chat.completions.create(**{**kw, "tool_choice": "required"})
    assert forced.choices[0].finish_reason == "tool_calls"
    # a format the model will not take (greedy, this model writes no "<x>"): the calls branch
    raw = {k: v for k, v in kw.items() if k != "response_format"}
    called = client.chat.completions.create(**{**raw, "extra_body": {"grammar": 'root ::= "<x>"'}})
    assert called.choices[0].finish_reason == "tool_calls" and called.choices[0].message.tool_calls
    resp = client.responses.create(model="m", input="Who is Ann?", max_output_tokens=96,
                                   tools=[{"type": "function", **t["function"]} for t in (WEATHER, ADD)],
                                   text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    kinds = [it.type for it in resp.output]
    assert kinds in (["message"], ["function_call"])
    if kinds == ["message"]:
        jsonschema.validate(json.loads(resp.output_text), PERSON)


def test_a_json_schema_format_without_its_schema_is_any_object(client):
    """``json_schema.schema`` is optional in OpenAI's API; llama-server reads it absent as
    any JSON object (it was a 400): the reply is json_object's, token for token."""
    body = {"messages": MSGS, "max_tokens": 24, "temperature": 0}
    got = client.post("/v1/chat/completions", json={**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "anything"}}})
    want = client.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]
    assert got.json()["choices"][0]["message"]["content"].lstrip().startswith("{")


BAD_TYPE = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "foo"}}}}}


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format",
     "at /properties/a: $ref '#/$defs/missing' points at nothing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, "response_format",
     "schema must be a JSON schema object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", '"json_schema"'),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_object"),
    ({"grammar": "root ::= foo"}, "grammar", "Undefined rule identifier 'foo'"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar", "one of them"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nope", "$ref": "#/none"}}}}, "response_format", "schema"),      # checked beside tools too
    # a schema the converter cannot write, whatever tool_choice (only a forced call's was refused)
    *[({"tools": [WEATHER, BAD_TYPE], **choice}, "tools", "function 'f' has parameters that are not a JSON schema")
      for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}, {"tool_choice": "required"},
                     {"tool_choice": FORCE_WEATHER})],
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),       # without tools too
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]}, "tools", "description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "strict"),
    # parameters that refer to themselves before any text: a grammar llama.cpp refuses,
    # which named "grammar", a field the client never sent
    ({"tools": [LOOP], "tool_choice": "required"}, "tools", "left recursion"),
    ({"tools": [LOOP], "response_format": {"type": "json_object"}}, "tools", "left recursion"),
    ({"tools": [WEATHER], "grammar": "root ::= root"}, "grammar", "left recursion"),    # the client's own
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}, "messages[0].tool_calls[0]",
     "function"),
])
def test_bad_constraints_are_400s_naming_the_field(client, body, param, words):
    err = _error(client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body}), 400)
    assert err["param"] == param and words in err["message"], err


def test_tools_on_completions_are_refused(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x", "tools": [WEATHER]}), 400)
    assert err["param"] == "tools" and "chat" in err["message"]


def test_a_forced_call_takes_the_xml_form_of_the_servers_template(dense_model):
    """As the library's chat (tests/test_tools.py): under a template that writes calls as
    XML (Qwen3.5's), a forced call is written so, and read back as a call."""
    from pymtp.chat import ChatTemplate
    from pymtp.server import ServerSettings

    from .helpers import app_client

    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
        "required": ["n", "unit"]}}}]
    with app_client(dense_model, ServerSettings(parallel=1)) as client:
        service = client.app.state.service
        base = service.template
        service.template = ChatTemplate(base.text + "{# calls: <tool_call><function=NAME><parameter=P>VALUE #}",
                                        bos_token=base.bos_token, eos_token=base.eos_token)
        body = {"messages": MSGS, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
                "max_tokens": 150, "temperature": 0, "logprobs": True}
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "pick" and set(json.loads(call["arguments"])) == {"n", "unit"}
    raw = "".join(t["token"] for t in choice["logprobs"]["content"])      # the reply as the model wrote it
    assert raw.startswith("<tool_call>\n<function=pick>\n<parameter=n>\n"), raw


def test_null_tool_fields_are_their_defaults(client):
    """null is absent, as on every other field: parallel_tool_calls null was a 400, and a
    function's parameters null (no parameters) one too."""
    def tool(params):
        return {"type": "function", "function": {"name": "ping", **params}}

    body = {"messages": MSGS, "max_tokens": 24, "tool_choice": "required", "temperature": 0}
    bodies = [{**body, "tools": [tool({})]}, {**body, "tools": [tool({"parameters": None})]},
              {**body, "tools": [tool({})], "parallel_tool_calls": None}]
    replies = [client.post("/v1/chat/completions", json=b) for b in bodies]
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    got = [r.json()["choices"] for r in replies]
    assert got[0] == got[1] == got[2] and got[0][0]["finish_reason"] == "length"


def test_a_strict_function_holds_the_auto_reply_to_its_grammar(dense_model, monkeypatch):
    """Under "auto", a ``strict`` function's calls follow its schema (tools.auto_call_grammar):
    the server builds that grammar for the request, and the reply stays inside it."""
    import pymtp.tools as tools
    from pymtp.server import ServerSettings
    from test_reasoning import _walk

    from .helpers import app_client

    seen = []
    real = tools.auto_call_grammar
    monkeypatch.setattr(tools, "auto_call_grammar", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    fn = {"name": "pick", "strict": True, "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                         "required": ["n"], "additionalProperties": False}}
    body = {"messages": MSGS, "tools": [{"type": "function", "function": fn}], "max_tokens": 24, "temperature": 0,
            "logprobs": True}
    with app_client(dense_model, ServerSettings(parallel=1)) as client:
        r = client.post("/v1/chat/completions", json=body)
        plain = client.post("/v1/chat/completions", json={**body, "tools": [
            {"type": "function", "function": {**fn, "strict": False}}]})
    assert r.status_code == plain.status_code == 200, r.text
    assert len(seen) == 1 and "free-t0" in seen[0]       # not for the request without strict
    # the reply as the model wrote it; the grammar reads characters, however they are cut into tokens
    raw = b"".join(bytes(t["bytes"]) for t in r.json()["choices"][0]["logprobs"]["content"]).decode()
    assert _walk(dense_model, seen[0], raw)[0] is True, raw
