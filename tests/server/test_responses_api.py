"""OpenAI's Responses API (pymtp/server/responses_api.py): a request is the chat route's
request, so its answer must be the chat route's reply as output items -- compared in
process on the dense fixture (text, instructions, function calls and their outputs,
reasoning, text.format, the event stream, the 400s) -- and the official openai client's
``responses`` must drive it over real HTTP against a real ``pymtp serve``."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from conftest import row_tolerance
from pymtp.server.errors import APIError
from pymtp.server.responses_api import to_chat
from pymtp.server.schemas import parse_chat
from test_tools import ADD, WEATHER

from .helpers import COLD, app_client
from .test_anthropic import THINKING_SHOWN
from .test_reasoning_http import ENDS, MSGS as THINK_MSGS, OPENING, _template

GREEDY = {"temperature": 0}
LOGPROBS = {"include": ["message.output_text.logprobs"]}
EVENT = TypeAdapter(ResponseStreamEvent)
USER = [{"role": "user", "content": "hello there"}]


def _resp_tool(tool: dict) -> dict:
    return {"type": "function", **tool["function"]}


def _post(client, body: dict, status: int = 200) -> dict:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    if status == 200:         # the official client's own type takes it, required fields and all
        Response.model_validate(r.json())
    return r.json()


def _chat(client, body: dict) -> dict:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _prompt(client, body: dict) -> str:
    return client.app.state.service.render_chat(to_chat(body))


def _same_prompt(client, body: dict, chat: dict) -> None:
    r = client.post("/apply-template", json=chat)
    assert r.status_code == 200, r.text
    assert _prompt(client, body) == r.json()["prompt"]


def _stream(client, body: dict) -> tuple[list[dict], dict]:
    """A stream's events, checked in order, and the response its last event carries,
    whose output must be the items the events finished."""
    r = client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = []
    for frame in r.text.split("\n\n")[:-1]:
        head, data = frame.split("\n")
        events.append(json.loads(data[len("data: "):]))
        assert head == "event: " + events[-1]["type"]
        EVENT.validate_python(events[-1])         # each is one of the official client's event types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    done, open_at, texts = [], None, {}
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert open_at is None and e["output_index"] == len(done)
            open_at = e["output_index"]
            texts[open_at] = ""
        elif kind.endswith(".delta"):
            assert e["output_index"] == open_at
            texts[open_at] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["output_index"] == open_at and e["text"] == texts[open_at]
        elif kind == "response.function_call_arguments.done":
            assert e["output_index"] == open_at and e["arguments"] == texts[open_at]
        elif kind in ("response.content_part.added", "response.content_part.done"):
            assert e["output_index"] == open_at and e["part"]["text"] == ("" if kind.endswith("added") else texts[open_at])
        elif kind == "response.output_item.done":
            assert e["output_index"] == open_at
            done.append(e["item"])
            open_at = None
        else:
            raise AssertionError(f"an event out of place: {e}")
    assert open_at is None and last["response"]["output"] == done
    for i, item in enumerate(done):        # the deltas join to each item's text
        whole = {"message": lambda it: it["content"][0]["text"], "function_call": lambda it: it["arguments"],
                 "reasoning": lambda it: it["content"][0]["text"]}[item["type"]](item)
        assert texts[i] == whole
    return events, last["response"]


def _same_logprobs(got: list[dict], want: list[dict]) -> None:
    """The same tokens with the same alternatives; logprobs within two decodes' rounding."""
    assert [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in got] == \
        [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in want]
    for a, b in zip(got, want):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=row_tolerance(4))


def _text(resp: dict) -> str:
    return "".join(p["text"] for it in resp["output"] if it["type"] == "message" for p in it["content"])


def test_a_response_is_the_chats_reply(client):
    body = {"input": USER[0]["content"], "instructions": "Be brief.", "max_output_tokens": 12, **GREEDY}
    got = _post(client, body)
    chat = _chat(client, {"messages": [{"role": "system", "content": "Be brief."}, *USER], "max_tokens": 12, **GREEDY})
    assert got["object"] == "response" and got["id"].startswith("resp_")
    assert [it["type"] for it in got["output"]] == ["message"]
    assert _text(got) == chat["choices"][0]["message"]["content"]
    assert got["status"] == "incomplete" and got["incomplete_details"] == {"reason": "max_output_tokens"}
    assert got["output"][0]["status"] == "incomplete"          # the cut item, as OpenAI marks it
    u = got["usage"]
    assert (u["input_tokens"], u["output_tokens"]) == (chat["usage"]["prompt_tokens"], 12)
    assert u["total_tokens"] == u["input_tokens"] + 12 and got["instructions"] == "Be brief."
    # input as items of parts is the same prompt
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER[0]["content"]}]}]
    _same_prompt(client, {**body, "input": items}, {"messages": [{"role": "system", "content": "Be brief."}, *USER]})
    # instructions and the system and developer items that open the input are one system
    # message (Qwen3.5's template refused a second: Codex sends instructions, then a developer item)
    dev = [{"role": "developer", "content": "Read only."}, {"role": "system", "content": [{"type": "input_text", "text": "No net."}]}]
    _same_prompt(client, {**body, "input": [*dev, *items]},
                 {"messages": [{"role": "system", "content": "Be brief.\n\nRead only.\n\nNo net."}, *USER]})
    _same_prompt(client, {"input": [*dev, *items]}, {"messages": [{"role": "system", "content": "Read only.\n\nNo net."}, *USER]})
    later = [*items, {"role": "developer", "content": "Now in French."}]     # one later on stays where it is
    _same_prompt(client, {**body, "input": later},
                 {"messages": [{"role": "system", "content": "Be brief."}, *USER, {"role": "system", "content": "Now in French."}]})
    ended = _post(client, {"input": "hi", "max_output_tokens": 20, "grammar": 'root ::= "ok"', **GREEDY})
    assert ended["status"] == "completed" and ended["incomplete_details"] is None and _text(ended) == "ok"


def test_input_tokens_counts_what_a_response_would_read(client):
    body = {"input": "hello there, count me", "instructions": "Be brief.", "max_output_tokens": 2, **GREEDY}
    got = _post(client, body)
    for route in ("/v1/responses/input_tokens", "/responses/input_tokens"):
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text
        assert r.json() == {"object": "response.input_tokens", "input_tokens": got["usage"]["input_tokens"]}
    assert _post(client, body | {"input": "hello"})["usage"]["input_tokens"] < got["usage"]["input_tokens"]
    chat = _chat(client, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **GREEDY})
    for route in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        r = client.post(route, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.json() == {"object": "response.input_tokens", "input_tokens": chat["usage"]["prompt_tokens"]}
    again = client.post("/responses", json=body).json()["usage"]     # llama-server's other name
    # the same counts (it may reuse the first one's prompt, shelved since: cached_tokens)
    assert {k: v for k, v in again.items() if k != "input_tokens_details"} == \
        {k: v for k, v in got["usage"].items() if k != "input_tokens_details"}
    assert again["input_tokens_details"]["cached_tokens"] < again["input_tokens"]
    # a count is what a client asks to learn whether to cut its input: past the context too
    long = {"input": "the quick brown fox " * 400}
    assert client.post("/v1/responses", json=long | {"max_output_tokens": 1}).status_code == 400
    n = client.post("/v1/responses/input_tokens", json=long).json()["input_tokens"]
    assert n > client.get("/props").json()["default_generation_settings"]["n_ctx"]
    r = client.post("/v1/responses/input_tokens", json={"input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_a_stream_builds_the_same_response(client):
    body = {"input": "hello there", "max_output_tokens": 16, **GREEDY}
    whole = _post(client, body)
    events, final = _stream(client, body)
    assert _text(final) == _text(whole) and final["status"] == whole["status"] == "incomplete"
    assert [it["status"] for it in final["output"]] == [it["status"] for it in whole["output"]] == ["incomplete"]
    assert final["usage"] == whole["usage"] | {"input_tokens_details": final["usage"]["input_tokens_details"]}


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_chats_when_included(client, stream):
    """``include: ["message.output_text.logprobs"]`` gives the text part the chat route's
    logprobs (``top_logprobs`` alternatives each); a stream's deltas carry their tokens'."""
    body = {"input": USER[0]["content"], "max_output_tokens": 12, "top_logprobs": 2, **GREEDY, **LOGPROBS}
    chat = _chat(client, {"messages": USER, "max_tokens": 12, "logprobs": True, "top_logprobs": 2, **GREEDY})
    want = chat["choices"][0]["logprobs"]["content"]
    events, got = _stream(client, body) if stream else ([], _post(client, body))
    (part,) = got["output"][0]["content"]
    assert len(want) == 12 and all(len(e["top_logprobs"]) == 2 for e in want)
    _same_logprobs(part["logprobs"], want)
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"] and got["top_logprobs"] == 2
    if stream:
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert all("".join(x["token"] for x in e["logprobs"]) == e["delta"] for e in deltas)
        assert [x for e in deltas for x in e["logprobs"]] == part["logprobs"]
        (done,) = [e for e in events if e["type"] == "response.output_text.done"]
        assert done["logprobs"] == part["logprobs"]
    # not included: empty lists, as OpenAI's, top_logprobs or not
    plain = _stream(client, {**body, "include": []})[1] if stream else _post(client, {**body, "include": []})
    assert plain["output"][0]["content"][0]["logprobs"] == [] and _text(plain) == part["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_a_function_call_item(client, stream):
    tools = [WEATHER, ADD]
    body = {"input": "Weather in Paris?", "max_output_tokens": 160, "tools": [_resp_tool(t) for t in tools],
            "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False, **GREEDY}
    chat = _chat(client, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 160,
                          "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                          "parallel_tool_calls": False, **GREEDY})
    (call,) = chat["choices"][0]["message"]["tool_calls"]
    got = _stream(client, body)[1] if stream else _post(client, body)
    (item,) = got["output"]
    assert item["type"] == "function_call" and item["status"] == "completed" and item["id"].startswith("fc_")
    assert (item["name"], item["arguments"]) == ("get_weather", call["function"]["arguments"])
    assert item["call_id"].startswith("call_") and got["status"] == "completed"


def test_call_and_output_items_are_the_chats_messages(client):
    args = json.dumps({"city": "Paris", "unit": "C"})
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"role": "user", "content": "And tomorrow?"}]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "user", "content": "And tomorrow?"}]
    _same_prompt(client, {"input": items, "tools": [_resp_tool(WEATHER)]}, {"messages": chat, "tools": [WEATHER]})
    # an assistant message then two calls are one turn
    joined = [items[0], {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
              items[1], {**items[1], "call_id": "c2"}, items[2], {**items[2], "call_id": "c2"}, items[3]]
    calls = chat[1]["tool_calls"] + [{**chat[1]["tool_calls"][0], "id": "c2"}]
    _same_prompt(client, {"input": joined, "tools": [_resp_tool(WEATHER)]},
                 {"messages": [chat[0], {"role": "assistant", "content": "On it.", "tool_calls": calls}, chat[2],
                               {**chat[2], "tool_call_id": "c2"}, chat[3]], "tools": [WEATHER]})
    # a server tool (none runs here) is left out, as llama-server leaves it
    assert _prompt(client, {"input": items, "tools": [_resp_tool(WEATHER), {"type": "web_search"}]}) == \
        _prompt(client, {"input": items, "tools": [_resp_tool(WEATHER)]})


def test_reasoning_items_join_the_assistant_turn_they_begin():
    req = to_chat({"input": [{"role": "user", "content": "q"},
                             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "a"}]},
                             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "b"}]},
                             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                             {"type": "function_call_output", "call_id": "c", "output": "r"}]})
    assert [(m["role"], m.get("reasoning_content")) for m in req.messages] == \
        [("user", None), ("assistant", "a\nb"), ("tool", None)]
    assert req.messages[1]["tool_calls"][0]["id"] == "c"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_is_a_reasoning_item_first(dense_model, stream):
    with app_client(dense_model) as c:
        _template(c, OPENING)
        body = {"input": THINK_MSGS, "max_output_tokens": 40, "grammar": ENDS, **GREEDY, **LOGPROBS}
        choice = _chat(c, {"messages": THINK_MSGS, "max_tokens": 40, "grammar": ENDS, "logprobs": True,
                           **GREEDY})["choices"][0]
        message = choice["message"]
        got = _stream(c, body)[1] if stream else _post(c, body)
        assert [it["type"] for it in got["output"]] == ["reasoning", "message"]
        assert got["output"][0]["content"] == [{"type": "reasoning_text", "text": message["reasoning_content"]}]
        assert _text(got) == message["content"]
        # the text's logprobs are its tokens' alone: the chat's last ones, after "</think>"'s
        lps, every = got["output"][1]["content"][0]["logprobs"], choice["logprobs"]["content"]
        assert 0 < len(lps) < len(every) and "</think>" in "".join(e["token"] for e in every[:-len(lps)])
        _same_logprobs(lps, every[-len(lps):])
        assert "".join(e["token"] for e in lps).strip() == message["content"].strip()
        # reasoning_tokens: the generated tokens up to the one that completes "</think>",
        # found here by detokenizing ever longer prefixes of the same greedy reply
        prompt = c.post("/apply-template", json={"messages": THINK_MSGS}).json()["prompt"]
        tokens = dense_model.generate(prompt, max_tokens=40, grammar=ENDS, **GREEDY).tokens
        ends = next(n for n in range(1, len(tokens) + 1) if "</think>" in dense_model.detokenize(tokens[:n]))
        assert 0 < ends < len(tokens) == got["usage"]["output_tokens"]
        assert got["usage"]["output_tokens_details"] == {"reasoning_tokens": ends}
        # a reasoning item sent back is the next turn's reasoning_content
        _template(c, THINKING_SHOWN)
        back = [*THINK_MSGS, {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"role": "user", "content": "and?"}]
        _same_prompt(c, {"input": back}, {"messages": [*THINK_MSGS, {"role": "assistant", "content": "ok",
                                                                     "reasoning_content": "hm"},
                                                       {"role": "user", "content": "and?"}]})


def test_text_format_is_the_chats_response_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    got = _post(client, {"input": "hello", "max_output_tokens": 40, **GREEDY,
                         "text": {"format": {"type": "json_schema", "name": "r", "schema": schema}}})
    chat = _chat(client, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 40, **GREEDY,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    assert _text(got) == chat["choices"][0]["message"]["content"] and "n" in json.loads(_text(got))
    assert got["text"] == {"format": {"type": "json_schema", "name": "r", "schema": schema}}


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": 5, "arguments": "{}"}]}, "input[0].name"),
    ({"input": "x", "tool_choice": "maybe"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "text": "json"}, "text"),
    ({"input": "x", "metadata": "x"}, "metadata"),
    ({"input": "x", "metadata": {"k": 5}}, "metadata.k"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),      # the body's names, not the chat's
    ({"input": "x", "max_output_tokens": 0.0}, "max_output_tokens"),    # was one token, and -1.0 no limit
    ({"input": "x", "max_output_tokens": -1.0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "r", "schema": 5}}}, "text.format"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                  "arguments": "{}"}]}, "input[1]"),      # a call last
    # a call whose output never comes, before a message or among answered ones (was a 200)
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                  "arguments": "{}"}, {"role": "user", "content": "never mind"}]},
     "input[1]"),
    ({"input": [{"role": "user", "content": "x"},
                *({"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"} for c in "ab"),
                {"type": "function_call_output", "call_id": "b", "output": "1"}]}, "input[1]"),
    ({"input": "x", "prompt": {"id": "pmpt_1", "variables": {"a": "b"}}}, "prompt"),      # a stored template
    # an output that answers no call, as OpenAI's 400 (clients that trim a history count on it)
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "input[1].call_id"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "g"}]}},
     "tool_choice.tools[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "allowed_tools", "mode": "sometimes", "tools": [{"type": "function", "name": "f"}]}},
     "tool_choice"),
    ({"input": [{"type": "reasoning", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "reasoning", "summary": True}, {"role": "user", "content": "x"}]}, "input[0].summary"),
    ({"input": "x", "include": "message.output_text.logprobs"}, "include"),
    ({"input": "x", "include": ["message.output_text.logprobs", "logprobs"]}, "include[1]"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "top_logprobs": -1, **LOGPROBS}, "top_logprobs"),
])
def test_bad_bodies_are_400s_naming_the_field(client, body, param):
    err = _post(client, body, 400)["error"]
    assert err["param"] == param, err


def test_a_format_without_its_schema_is_told_in_the_responses_shape(client):
    """The flat Responses format needs "schema" beside "type" (the chat's nested
    "json_schema" object was what the 400 asked for)."""
    err = _post(client, {"input": "x", "text": {"format": {"type": "json_schema", "name": "r"}}}, 400)["error"]
    assert err["param"] == "text.format" and '"schema": {...} beside the type' in err["message"]
    assert '"json_schema": {' not in err["message"]
    # a schema the converter refuses is named as text.format (it said response_format)
    err = _post(client, {"input": "x", "text": {"format": {"type": "json_schema", "name": "r",
                                                          "schema": {"$ref": "#/nowhere"}}}}, 400)["error"]
    assert err["param"] == "text.format", err


def test_a_stream_that_fails_ends_with_response_failed(client):
    """A failure mid-stream (a grammar the bias leaves no token) was the error event alone:
    a client waiting for the terminal event (Codex) took the closed stream for a dropped
    connection. It is followed by ``response.failed``, the error in the response."""
    body = {"input": "hi", "max_output_tokens": 16, "grammar": 'root ::= "xyz" [a-c]',
            "logit_bias": [["a", False], ["b", False], ["c", False]]}
    said = _post(client, body, 400)["error"]
    r = client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200
    events = [json.loads(frame.split("\n")[1][len("data: "):]) for frame in r.text.split("\n\n")[:-1]]
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error, failed = events[-2:]
    assert (error["type"], error["code"], error["message"]) == ("error", "invalid_value", said["message"])
    assert failed["type"] == "response.failed"
    assert failed["response"]["id"] == events[0]["response"]["id"] and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "invalid_prompt", "message": said["message"]}
    Response.model_validate(failed["response"])
    # what was streamed stays in the response (it was "output": []), its item closed first
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text and "xyz".startswith(text)     # a round that fails streams none of its tokens
    [item] = failed["response"]["output"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == text
    assert events[-3] == {"type": "response.output_item.done", "output_index": 0, "item": item,
                          "sequence_number": events[-3]["sequence_number"]}


def test_the_openai_clients_responses_drive_a_real_server(demo_server):
    """The official client's ``responses`` against a real ``pymtp serve``: a forced call,
    its output sent back, a text answer; streamed, the same call."""
    client = demo_server.openai(timeout=60)
    tools = [_resp_tool(WEATHER), _resp_tool(ADD)]
    kw = dict(model="m", tools=tools, max_output_tokens=96, parallel_tool_calls=False)
    force = {"type": "function", "name": "get_weather"}
    r = client.responses.create(input="What is the weather in Paris?", tool_choice=force, extra_body=COLD, **kw)
    (call,) = [it for it in r.output if it.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    with client.responses.stream(input="What is the weather in Paris?", tool_choice=force, extra_body=COLD,
                                 **kw) as s:
        streamed = s.get_final_response()
    assert [(it.type, it.arguments) for it in streamed.output] == [("function_call", call.arguments)]
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    final = client.responses.create(input=history, tool_choice="none", **kw)
    assert [it.type for it in final.output] == ["message"] and final.output_text == final.output[0].content[0].text
    alone = client.responses.create(input=history[:1], tool_choice="none", **{**kw, "max_output_tokens": 1})
    assert final.usage.input_tokens > alone.usage.input_tokens + 20       # the call and its output are in
    lp = client.responses.create(input=history, tool_choice="none", **{**kw, "max_output_tokens": 8},
                                 include=["message.output_text.logprobs"], top_logprobs=2,
                                 extra_body={"ignore_eos": True})
    (part,) = lp.output[0].content
    assert part.text and len(part.logprobs) == lp.usage.output_tokens == 8 and lp.top_logprobs == 2
    assert "".join(e.token for e in part.logprobs) == part.text and all(len(e.top_logprobs) == 2 for e in part.logprobs)
    done = client.responses.create(model="m", input="hi", max_output_tokens=10, extra_body={"grammar": 'root ::= "ok"'})
    assert (done.status, done.output_text) == ("completed", "ok")
    # the client's count of a request's input: what the request's usage says it read
    counted = client.responses.input_tokens.count(model="m", input=history, tools=tools, tool_choice="none")
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", final.usage.input_tokens)


def test_reasoning_effort_sets_the_templates_variables_as_llama_server_does():
    """OpenAI's chat ``reasoning_effort`` and Responses' ``reasoning.effort`` (both ignored
    before): "none" switches thinking off, another effort is the template's variable."""
    kw = {"x": 1, "reasoning_effort": "high"}
    for effort, want in (("none", {"x": 1, "enable_thinking": False}), ("low", {"x": 1, "reasoning_effort": "low"})):
        assert parse_chat({"messages": USER, "reasoning_effort": effort, "chat_template_kwargs": kw}).template_kwargs == want
        assert to_chat({"input": "hi", "reasoning": {"effort": effort}, "chat_template_kwargs": kw}).template_kwargs == want
    assert parse_chat({"messages": USER, "chat_template_kwargs": kw}).template_kwargs == kw
    assert to_chat({"input": "hi", "reasoning": {"summary": "auto"}}).template_kwargs == {}
    with pytest.raises(APIError, match="reasoning_effort must be a string") as e:
        parse_chat({"messages": USER, "reasoning_effort": 1})
    assert e.value.param == "reasoning_effort"
    with pytest.raises(APIError, match="reasoning.effort must be a string") as e:
        to_chat({"input": "hi", "reasoning": {"effort": 1}})
    assert e.value.param == "reasoning.effort"
    with pytest.raises(APIError, match="reasoning must be an object") as e:
        to_chat({"input": "hi", "reasoning": "low"})
    assert e.value.param == "reasoning"


def test_errors_name_the_responses_fields_not_the_chats(client):
    """A tool's fields are flat in a Responses body (tools[i].name), and a prompt the
    context cannot hold is the input's, not "messages"."""
    err = _post(client, {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 5}]}, 400)["error"]
    assert err["param"] == "tools" and err["message"].startswith("tools[0].parameters must be"), err
    # a server tool before the function is dropped from the chat; the error still counts the body's
    search = {"type": "web_search"}
    err = _post(client, {"input": "x", "tools": [search, {"type": "function", "name": "f", "parameters": 5}]},
                400)["error"]
    assert err["message"].startswith("tools[1].parameters must be"), err
    err = _post(client, {"input": "x", "tools": [search, search, {"type": "function", "name": "bad name"}]},
                400)["error"]
    assert err["message"].startswith("tools[2].name must be"), err
    # ... and so does a schema refused when the forced call's grammar is built (Service.start)
    bad_ref = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}, "required": ["a"]}
    err = _post(client, {"input": "x", "tool_choice": "required", "max_output_tokens": 4,
                         "tools": [search, {"type": "function", "name": "f", "parameters": bad_ref}]}, 400)["error"]
    assert err["param"] == "tools" and err["message"].startswith("function 'f' has parameters that are not"), err
    err = _post(client, {"input": "word " * 6000, "max_output_tokens": 16}, 400)["error"]
    assert err["param"] == "input" and err["code"] == "context_length_exceeded", err
    assert err["message"].startswith("prompt has "), err


def test_allowed_tools_narrows_the_calls_keeping_every_tool_in_the_prompt(client):
    """OpenAI's allowed_tools: "required" over the allowed functions only, all of them in
    the prompt (which the prompt cache keeps from turn to turn)."""
    tools = [{"type": "function", "name": n, "parameters": {"type": "object", "properties": {
        "x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}} for n in ("f", "g")]
    body = {"input": "call one", "tools": tools, "max_output_tokens": 300, "parallel_tool_calls": False, **GREEDY,
            "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "g"}]}}
    got = _post(client, body)
    calls = [o for o in got["output"] if o["type"] == "function_call"]
    assert calls and {c["name"] for c in calls} == {"g"}, got["output"]
    assert [t["function"]["name"] for t in to_chat(body).tools.template_tools] == ["f", "g"]
