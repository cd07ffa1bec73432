"""Anthropic's Messages API (pymtp/server/anthropic.py): a request is the chat route's
request, so its answer must be the chat route's answer in Anthropic's shape -- compared
in process on the dense fixture (text, system, tools, thinking, stop sequences, usage,
the event stream, the errors) -- and the official anthropic client must drive it over
real HTTP against a real ``pymtp serve`` (the tool flow, streamed and not)."""

from __future__ import annotations

import json

import pytest

from test_tools import ADD, WEATHER

from .helpers import COLD, app_client
from pymtp.server.anthropic import _Blocks, billing_header_fixed, ending, to_chat

from .test_reasoning_http import ENDS, MSGS as THINK_MSGS, OPENING, _template

USER = [{"role": "user", "content": "hello there"}]
# ChatML that shows an assistant turn's reasoning_content, so that it shows in the prompt
THINKING_SHOWN = ("{% for message in messages %}"
                  "{{ '<|im_start|>' + message['role'] + '\\n' }}"
                  "{% if message.reasoning_content %}{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}"
                  "{{ message['content'] + '<|im_end|>\\n' }}"
                  "{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GREEDY = {"temperature": 0}


def _anthropic_tool(tool: dict) -> dict:
    fn = tool["function"]
    out = {"name": fn["name"], "input_schema": fn["parameters"]}
    return {**out, "description": fn["description"]} if "description" in fn else out


def _post(client, body: dict, status: int = 200) -> dict:
    r = client.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    return r.json()


def _chat(client, body: dict) -> dict:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _events(text: str) -> list[tuple[str, dict]]:
    """(event, data) of an Anthropic stream; asserts the framing."""
    out = []
    assert text.endswith("\n\n")
    for frame in text.split("\n\n")[:-1]:
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), frame
        out.append((head[len("event: "):], json.loads(data[len("data: "):])))
        assert out[-1][1]["type"] == out[-1][0]
    return out


def _stream(client, body: dict) -> tuple[list[tuple[str, dict]], list[dict]]:
    """A stream's events, and its content blocks rebuilt from them as a client does, with
    the order of events checked: one block open at a time, each started, then stopped."""
    r = client.post("/v1/messages", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = _events(r.text)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks: list[dict] = []
    open_at = None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_at is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            open_at = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_at
            d, b = data["delta"], blocks[open_at]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "input_json_delta":
                b["partial"] = b.get("partial", "") + d["partial_json"]
            else:
                assert d["type"] == "signature_delta" and b["type"] == "thinking"
                b["signature"] = d["signature"]
        else:
            assert name == "content_block_stop" and data["index"] == open_at
            open_at = None
    assert open_at is None
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("partial"))
    return events, blocks


def test_a_message_is_the_chats_reply(client):
    body = {"max_tokens": 12, "system": "Be brief.", "messages": USER, **GREEDY}
    got = _post(client, body)
    chat = _chat(client, {"max_tokens": 12, "messages": [{"role": "system", "content": "Be brief."}, *USER], **GREEDY})
    assert got["type"] == "message" and got["role"] == "assistant" and got["id"].startswith("msg_")
    assert got["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}]
    assert got["stop_reason"] == "max_tokens" and got["stop_sequence"] is None
    u = got["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    assert u["output_tokens"] == 12
    # a system of text blocks is that text; count_tokens counts the prompt
    blocks = _post(client, {**body, "system": [{"type": "text", "text": "Be brief."}]})
    assert blocks["content"] == got["content"]
    r = client.post("/v1/messages/count_tokens", json={"system": "Be brief.", "messages": USER})
    assert r.status_code == 200 and r.json() == {"input_tokens": chat["usage"]["prompt_tokens"]}


def test_a_stream_builds_the_same_message(client):
    body = {"max_tokens": 16, "messages": USER, **GREEDY}
    whole = _post(client, body)
    events, blocks = _stream(client, body)
    assert blocks == whole["content"]
    start, end = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 16
    # the second stream reads its prompt from the cache: message_start's input counts are
    # the final ones (it counted the cache's reads as input), its output none yet
    assert end["usage"]["cache_read_input_tokens"] > 0
    assert start["usage"] == {**end["usage"], "output_tokens": 0}


def test_a_stop_sequence_is_named_and_a_template_end_is_not(client):
    text = _post(client, {"max_tokens": 24, "messages": USER, **GREEDY})["content"][0]["text"]
    word = text[6:9]
    got = _post(client, {"max_tokens": 24, "messages": USER, "stop_sequences": ["\x00no", word], **GREEDY})
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", word)
    assert got["content"][0]["text"] == text[:text.index(word)]
    events, _ = _stream(client, {"max_tokens": 24, "messages": USER, "stop_sequences": [word], **GREEDY})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": word}
    # the template's own end (<|im_end|>) ends a turn: end_turn, no stop sequence
    ended = _post(client, {"max_tokens": 40, "messages": USER, "grammar": 'root ::= "ok" "<|im_end|>"', **GREEDY})
    assert (ended["stop_reason"], ended["stop_sequence"]) == ("end_turn", None)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_is_a_tool_use_block(client, stream):
    tools = [WEATHER, ADD]
    body = {"max_tokens": 160, "messages": [{"role": "user", "content": "Weather in Paris?"}], **GREEDY,
            "tools": [_anthropic_tool(t) for t in tools], "tool_choice": {"type": "tool", "name": "get_weather"}}
    chat = _chat(client, {"max_tokens": 160, "messages": body["messages"], "tools": tools, **GREEDY,
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    (call,) = chat["choices"][0]["message"]["tool_calls"]
    want = [{"type": "tool_use", "id": call["id"], "name": "get_weather", "input": json.loads(call["function"]["arguments"])}]
    if stream:
        events, blocks = _stream(client, body)
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    else:
        got = _post(client, body)
        assert got["stop_reason"] == "tool_use"
        blocks = got["content"]
    assert [{**b, "id": call["id"]} for b in blocks] == want and blocks[0]["id"].startswith("call_")
    # a stop sequence the call's markup holds ends the text around it, not the call ("<tool_call>"
    # was text, then no block at all)
    cut = {**body, "stop_sequences": ["\n", '"']}
    if stream:
        events, blocks = _stream(client, cut)
        stopped = events[-2][1]["delta"]
    else:
        stopped = _post(client, cut)
        blocks = stopped["content"]
    assert ([{**b, "id": call["id"]} for b in blocks], stopped["stop_reason"], stopped["stop_sequence"]) == \
        (want, "tool_use", None)


def test_tool_use_and_tool_result_blocks_are_the_chats_messages(client):
    """A turn's tool_use blocks are its tool calls, a user turn's tool_result blocks tool
    messages: the prompt is the chat route's for those messages, token for token."""
    args = {"city": "Paris"}
    anthropic = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                                   {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                    "input": args}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                               "content": [{"type": "text", "text": "sunny"}]},
                                              {"type": "text", "text": "And tomorrow?"}]}]
    openai = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "Looking.",
               "tool_calls": [{"id": "t1", "type": "function",
                               "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
              {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
              {"role": "user", "content": "And tomorrow?"}]
    _same_prompt(client, {"messages": anthropic, "tools": [_anthropic_tool(WEATHER)]},
                 {"messages": openai, "tools": [WEATHER]})
    # a tool_result after the turn's text would be another prompt
    moved = [*anthropic[:2], {"role": "user", "content": anthropic[2]["content"][::-1]}]
    assert _prompt(client, {"messages": moved, "tools": [_anthropic_tool(WEATHER)]}) == \
        _prompt(client, {"messages": anthropic, "tools": [_anthropic_tool(WEATHER)]})      # results go first
    got = _post(client, {"max_tokens": 8, "messages": anthropic, "tools": [_anthropic_tool(WEATHER)], **GREEDY})
    chat = _chat(client, {"max_tokens": 8, "messages": openai, "tools": [WEATHER], **GREEDY})
    assert got["usage"]["input_tokens"] + got["usage"]["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    assert got["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def _prompt(client, body: dict) -> str:
    """The prompt an Anthropic body renders to."""
    service = client.app.state.service
    return service.render_chat(to_chat({"max_tokens": 1, **body})[0])


def _same_prompt(client, anthropic: dict, openai: dict) -> None:
    r = client.post("/apply-template", json=openai)
    assert r.status_code == 200, r.text
    assert _prompt(client, anthropic) == r.json()["prompt"]


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_is_a_thinking_block_first(dense_model, stream):
    with app_client(dense_model) as c:
        _template(c, OPENING)
        body = {"max_tokens": 40, "messages": THINK_MSGS, "grammar": ENDS, **GREEDY}
        message = _chat(c, body)["choices"][0]["message"]
        want = [{"type": "thinking", "thinking": message["reasoning_content"], "signature": ""},
                {"type": "text", "text": message["content"]}]
        blocks = _stream(c, body)[1] if stream else _post(c, body)["content"]
        assert blocks == want
        # a thinking block sent back is the turn's reasoning_content, as the chat route takes it
        _template(c, THINKING_SHOWN)
        turn = {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                 {"type": "text", "text": "ok"}]}
        _same_prompt(c, {"messages": THINK_MSGS + [turn, {"role": "user", "content": "and?"}]},
                     {"messages": THINK_MSGS + [{"role": "assistant", "content": "ok", "reasoning_content": "hm"},
                                                {"role": "user", "content": "and?"}]})
        assert "hm" in _prompt(c, {"messages": THINK_MSGS + [turn, {"role": "user", "content": "and?"}]})


@pytest.mark.parametrize("stream", [False, True])
def test_a_continued_assistant_turn_answers_only_what_follows(client, stream):
    """A last assistant turn is a prefill: the reply continues it, and Anthropic's answer
    is only the continuation (the chat route's content starts with the prefill)."""
    msgs = [*USER, {"role": "assistant", "content": "PREFILLED"}]
    chat = _chat(client, {"max_tokens": 8, "messages": msgs, **GREEDY})["choices"][0]["message"]["content"]
    assert chat.startswith("PREFILLED") and len(chat) > len("PREFILLED")
    body = {"max_tokens": 8, "messages": msgs, **GREEDY}
    blocks = _stream(client, body)[1] if stream else _post(client, body)["content"]
    assert blocks == [{"type": "text", "text": chat[len("PREFILLED"):]}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_continued_turn_that_holds_a_thinking_block_answers_only_what_follows(dense_model, stream):
    """A prefill that thinks, then starts its text: the whole answer is the stream's, only
    the continuation (it kept the prefill's text, which the chat route splits into thinking
    and content, where the stream left it out)."""
    from .test_reasoning_http import THINKING

    msgs = [*USER, {"role": "assistant", "content": "<think>plan</think>\n\nSure"}]
    body = {"max_tokens": 8, "messages": msgs, **GREEDY}
    with app_client(dense_model) as c:
        _template(c, THINKING)
        chat = _chat(c, body)["choices"][0]["message"]
        assert chat["reasoning_content"] == "plan" and chat["content"].startswith("Sure")
        blocks = _stream(c, body)[1] if stream else _post(c, body)["content"]
    assert blocks == [{"type": "text", "text": chat["content"][len("Sure"):]}]


def test_a_streamed_call_whose_arguments_are_no_object_has_input_braces():
    """The streamed input is the whole answer's: arguments that are no JSON object are {}."""
    blocks = _Blocks()
    events = blocks.feed({"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '"Paris"'}}]})
    assert [e[1]["delta"]["partial_json"] for e in events if e[0] == "content_block_delta"] == ["{}"]


def test_claude_codes_billing_header_does_not_change_the_prompt(client):
    head = "x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch={};You are Claude Code."
    assert billing_header_fixed(head.format("a5145")) == head.format("fffff")
    assert billing_header_fixed("cch=a5145;") == "cch=a5145;"          # not the header
    prompts = {_prompt(client, {"messages": USER, "system": [{"type": "text", "text": head.format(v)},
                                                           {"type": "text", "text": "Be brief."}]})
               for v in ("a5145", "0b3c9")}
    assert len(prompts) == 1


def test_thinking_kinds_set_the_templates_enable_thinking(client):
    for kind, want in (("enabled", True), ("disabled", False)):
        req, _ = to_chat({"messages": USER, "thinking": {"type": kind, "budget_tokens": 1024},
                          "chat_template_kwargs": {"x": 1}})
        assert req.template_kwargs == {"x": 1, "enable_thinking": want}
    assert to_chat({"messages": USER, "thinking": {"type": "adaptive"}})[0].template_kwargs == {}


def _one(role: str, block: dict) -> dict:
    return {"max_tokens": 4, "messages": [{"role": role, "content": [block]}]}


CALLED = [{"role": "user", "content": "x"},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]


@pytest.mark.parametrize("body, where", [
    ({"max_tokens": 4}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "maybe"}}, "tool_choice"),
    # connected on Anthropic's side: dropped, the client believed the model had their tools
    ({"max_tokens": 4, "messages": USER, "mcp_servers": [{"type": "url", "url": "https://x/sse", "name": "x"}]},
     "mcp_servers"),
    ({"max_tokens": 4, "messages": USER, "container": "container_1"}, "container"),
    ({"max_tokens": 4, "messages": USER, "thinking": "yes"}, "thinking"),
    ({"max_tokens": 4, "messages": USER, "stop_sequences": 5}, "stop_sequences"),
    ({"max_tokens": 4, "messages": USER, "stop_sequences": ["a"] * 65}, "stop_sequences"),    # matched every token
    ({"max_tokens": 4, "messages": [*CALLED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]},
     "messages[2].content[0].content[0]"),
    # a result that answers no call of the message before it, as Anthropic's 400
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[0].tool_use_id 't': no tool_use block"),
    ({"max_tokens": 4, "messages": [*CALLED, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u"}]}]},
     "messages[2].content[0].tool_use_id 'u'"),
    ({"max_tokens": 4, "messages": [*CALLED, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                                    {"role": "assistant", "content": "a"},
                                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[4].content[0].tool_use_id 't'"),
    # a tool_use the next message leaves unanswered, as Anthropic's 400 (was a 200)
    ({"max_tokens": 4, "messages": [*CALLED, {"role": "user", "content": "ok"}]},
     "messages[1] (assistant) has tool_use blocks that messages[2] does not answer (t)"),
    ({"max_tokens": 4, "messages": [USER[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": i, "name": "f", "input": {}} for i in ("t1", "t2")]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]},
     "messages[1] (assistant) has tool_use blocks that messages[2] does not answer (t2)"),
    ({"max_tokens": 4, "messages": CALLED}, "messages[1] (assistant) has tool_use blocks that nothing answers"),
    ({"max_tokens": 4, "messages": [USER[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": 5, "input": {}}]}]}, "messages[1].content[0].name must be a string"),
    ({"max_tokens": 4, "messages": [USER[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]}, "messages[1].content[0].input must be an object"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": "x"}]},
     "tools[0].input_schema must be a JSON schema object"),
    ({"max_tokens": 4, "messages": USER, "system": 5}, "system"),
    ({"max_tokens": -1, "messages": USER}, "max_tokens"),
    ({"max_tokens": 0.0, "messages": USER}, "max_tokens must be an integer >= 1, got 0.0"),    # was one token
    ({"max_tokens": -1.0, "messages": USER}, "max_tokens must be an integer >= 1, got -1.0"),  # was no limit
    # a type, id or choice of the wrong kind was looked up in a table: a 500 (unhashable type)
    (_one("user", {"type": ["text"]}), "messages[0].content[0] must be a block"),
    (_one("user", {"type": {"a": 1}}), "messages[0].content[0] must be a block"),
    (_one("user", "hello"), "messages[0].content[0] must be a block"),
    ({"max_tokens": 4, "messages": [*CALLED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": ["t"]}]}]}, "messages[2].content[0].tool_use_id ['t']"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": []}}, "tool_choice must be"),
    ({"max_tokens": 4, "messages": USER, "temperature": "hot"}, "temperature"),
])
def test_bad_bodies_are_anthropic_errors_naming_the_field(client, body, where):
    err = _post(client, body, 400)
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert where in err["error"]["message"], err


@pytest.mark.parametrize("body, says", [
    # these said "type='text' is not supported in a user message: pymtp serves text, ..."
    (_one("user", {"type": "text"}), "messages[0].content[0].text must be a string, got null"),
    (_one("assistant", {"type": "thinking", "thinking": 5}),
     "messages[0].content[0].thinking must be a string, got an integer"),
    (_one("user", {"type": "tool_use", "id": "t", "name": "f", "input": {}}),
     "messages[0].content[0].type='tool_use': a tool_use block belongs in an assistant message, and messages[0] "
     "is the user's"),
    (_one("assistant", {"type": "tool_result", "tool_use_id": "t", "content": "x"}),
     "a tool_result block belongs in a user message, and messages[0] is the assistant's"),
    # this one said "stop_sequences must be a string or a list of strings, got a list"
    ({"max_tokens": 4, "messages": USER, "stop_sequences": ["a", 1]}, "stop_sequences[1] must be a string, got an integer"),
])
def test_a_block_in_the_wrong_place_or_without_its_text_says_which(client, body, says):
    err = _post(client, body, 400)
    assert says in err["error"]["message"], err


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_structured_outputs_are_the_chats_response_format(client, field):
    """Anthropic's structured outputs (``output_config.format``; the beta's ``output_format``)
    constrain the reply's text to the schema, as the chat's response_format does; they
    were ignored."""
    fmt = {"type": "json_schema", "schema": CITY}
    body = {"max_tokens": 40, "messages": USER, **GREEDY,
            **({"output_config": {"format": fmt, "effort": "low"}} if field == "output_config" else {"output_format": fmt})}
    got = _post(client, body)
    chat = _chat(client, {"max_tokens": 40, "messages": USER, **GREEDY,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": CITY}}})
    text = chat["choices"][0]["message"]["content"]
    assert set(json.loads(text)) == {"city"}
    assert got["content"] == [{"type": "text", "text": text}]
    _, blocks = _stream(client, body)
    assert blocks == got["content"]
    where = "output_config.format" if field == "output_config" else "output_format"
    bad = {**body, **({"output_config": {"format": {"type": "json_schema"}}} if field == "output_config"
                      else {"output_format": {"type": "yaml", "schema": CITY}})}
    assert where in _post(client, bad, 400)["error"]["message"]
    # a schema the converter refuses is named as the body named it, not as the chat's response_format
    refused = {**body, **({"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/nowhere"}}}}
                          if field == "output_config" else
                          {"output_format": {"type": "json_schema", "schema": {"$ref": "#/nowhere"}}})}
    message = _post(client, refused, 400)["error"]["message"]
    assert message.startswith(where) and "response_format" not in message, message


def _text(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def _use(call_id: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": call_id}}


def _result(call_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "cold in " + call_id}


def test_consecutive_messages_of_one_role_are_one_turn(client):
    """Anthropic joins consecutive user or assistant messages into one turn; two assistant
    messages at the end were a 400 ("2 or more assistant messages"), and a tool_use's
    results split over two user messages were refused as unanswered."""
    tools = {"tools": [_anthropic_tool(WEATHER)]}
    split = [{"role": "user", "content": "a"}, {"role": "user", "content": _text("b")},
             {"role": "assistant", "content": _text("let me look")}, {"role": "assistant", "content": [_use("t1")]},
             {"role": "assistant", "content": [_use("t2")]},
             {"role": "user", "content": [_result("t1")]}, {"role": "user", "content": [_result("t2"), *_text("and?")]},
             {"role": "assistant", "content": "It is"}, {"role": "assistant", "content": " cold"}]
    calls = [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})
                                                          .replace(" ", "")}} for c in ("t1", "t2")]
    joined = [{"role": "user", "content": _text("a", "b")},
              {"role": "assistant", "content": _text("let me look"), "tool_calls": calls},
              {"role": "tool", "tool_call_id": "t1", "content": "cold in t1"},
              {"role": "tool", "tool_call_id": "t2", "content": "cold in t2"},
              {"role": "user", "content": _text("and?")}, {"role": "assistant", "content": _text("It is", " cold")}]
    _same_prompt(client, {"messages": split, **tools},
                 {"messages": joined, "tools": [WEATHER], "add_generation_prompt": False,
                  "continue_final_message": True})
    got = _post(client, {"max_tokens": 4, "messages": split, **tools, **GREEDY})
    assert got["content"][0]["type"] == "text"
    # a result missing from the whole user turn is named with the turn's messages
    unanswered = split[:5] + [{"role": "user", "content": [_result("t1")]}, {"role": "user", "content": _text("?")}]
    err = _post(client, {"max_tokens": 4, "messages": unanswered, **tools}, 400)["error"]
    assert "messages[4] (assistant) has tool_use blocks that messages[5..6] does not answer (t2)" in err["message"]


@pytest.mark.parametrize("constraint", [
    {"output_config": {"format": {"type": "json_schema", "schema": CITY}}},
    {"tools": [_anthropic_tool(WEATHER)], "tool_choice": {"type": "any"}},
])
def test_a_prefill_under_a_constraint_is_refused(client, constraint):
    """A schema or a forced tool call constrains the reply from its start: after a prefill
    it would start over, and the prefill became a whole assistant turn before a new one,
    silently. It is a 400 naming the prefill and the constraint."""
    msgs = [*USER, {"role": "assistant", "content": "{\"city\": "}]
    err = _post(client, {"max_tokens": 8, "messages": msgs, **constraint}, 400)["error"]
    what = "output_config.format" if "output_config" in constraint else "tool_choice"
    assert err["message"] == (f"messages[1] (assistant) is a prefill, which the reply continues: {what} constrains "
                              "the reply from its start, which would start over after the prefill: drop the prefill "
                              "or the constraint"), err
    # without the prefill the same constraint is served
    assert _post(client, {"max_tokens": 160, "messages": USER, **constraint, **GREEDY})["content"][0]["type"] \
        == ("text" if "output_config" in constraint else "tool_use")


def test_tool_choice_refusals_are_in_anthropics_words(client):
    """{"type": "any"} without tools, and a tool choice naming no tool given, are told in
    Anthropic's terms (they said the chat route's "required" and "function")."""
    err = _post(client, {"max_tokens": 4, "messages": USER, "tool_choice": {"type": "any"}}, 400)["error"]
    assert '{"type": "any"} needs tools' in err["message"] and "required" not in err["message"]
    body = {"max_tokens": 4, "messages": USER, "tools": [_anthropic_tool(WEATHER)],
            "tool_choice": {"type": "tool", "name": "nope"}}
    err = _post(client, body, 400)["error"]
    assert "names tool 'nope'" in err["message"] and "'get_weather'" in err["message"]
    assert "function" not in err["message"]


def test_every_refusal_on_its_routes_is_in_anthropics_shape(client):
    """An unknown method or path under /v1/messages is Anthropic's error object too (it
    was OpenAI's, which the anthropic client cannot read), with Starlette's Allow header;
    other routes keep OpenAI's."""
    r = client.get("/v1/messages")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "Method Not Allowed"}}
    r = client.post("/v1/messages/batches", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and r.json()["type"] == "error"
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed" and "type" not in r.json()


def test_a_crash_is_a_500_in_the_shape_of_its_route(client, monkeypatch):
    """An unexpected exception on /v1/messages answers 500 in Anthropic's shape (CatchAll;
    it was OpenAI's)."""
    from pymtp.server import anthropic as route

    def crash(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(route, "to_chat", crash)
    r = client.post("/v1/messages", json={"max_tokens": 2, "messages": USER})
    assert r.status_code == 500
    assert r.json() == {"type": "error", "error": {"type": "api_error", "message": "internal error: RuntimeError: boom"}}


def test_anthropic_clients_send_the_key_as_x_api_key(dense_model):
    from pymtp.server import ServerSettings

    with app_client(dense_model, ServerSettings(parallel=1, api_keys=("k",))) as c:
        body = {"max_tokens": 2, "messages": USER}
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"     # Anthropic's shape
        assert c.post("/v1/messages", json=body, headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.post("/v1/chat/completions", json=body, headers={"x-api-key": "k"}).status_code == 200
        assert c.post("/v1/messages", json=body, headers={"x-api-key": "nope"}).status_code == 401
        assert c.post("/v1/messages", json=body, headers={"x-api-key": "k"}).status_code == 200
        assert c.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "k"}).status_code == 200


def test_the_anthropic_client_drives_a_real_server(demo_server):
    """The official client against a real ``pymtp serve`` over HTTP: a forced tool call,
    its result sent back, then a text answer; streamed, the same call."""
    anthropic = pytest.importorskip("anthropic", reason="anthropic is a test extra: pip install -e '.[test]'")
    client = anthropic.Anthropic(base_url=demo_server.base_url, api_key="unused", max_retries=0, timeout=60)
    tools = [_anthropic_tool(WEATHER), _anthropic_tool(ADD)]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="m", max_tokens=96, tools=tools)     # the server samples greedily by default
    cold = dict(extra_body=COLD, **kw)          # whole and streamed alike on every backend
    force = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    r = client.messages.create(messages=messages, tool_choice=force, **cold)
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict)
    with client.messages.stream(messages=messages, tool_choice=force, **cold) as s:
        streamed = s.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [("tool_use", use.input)]
    messages += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    final = client.messages.create(messages=messages, tool_choice={"type": "none"}, **cold)
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    assert not final.usage.cache_read_input_tokens
    with client.messages.stream(messages=messages, tool_choice={"type": "none"}, **cold) as s:
        assert "".join(s.text_stream) == final.content[0].text
        assert not s.get_final_message().usage.cache_read_input_tokens
    # the demo has no chat template: the fallback's end text ends the turn as a stop string,
    # which is the template's, not the request's: end_turn, no stop sequence
    ended = client.messages.create(model="m", max_tokens=20, messages=messages[:1],
                                   extra_body={"grammar": 'root ::= "ok<|im_end|>"'})
    assert (ended.stop_reason, ended.stop_sequence, ended.content[0].text) == ("end_turn", None, "ok")
    # structured outputs, as the client's parse() sends them
    from typing import Literal

    from pydantic import BaseModel

    class City(BaseModel):      # the client moves a string's maxLength into its description
        city: Literal["Paris", "Rome"]

    parsed = client.messages.parse(model="m", max_tokens=60, messages=messages[:1], output_format=City)
    assert isinstance(parsed.parsed_output, City)
    assert client.messages.count_tokens(model="m", messages=messages, tools=tools,
                                        tool_choice={"type": "none"}).input_tokens == final.usage.input_tokens


@pytest.mark.parametrize("finish, word, want", [
    ("tool_calls", "END", ("tool_use", None)),      # a call that a stop sequence ended is a tool_use
    ("stop", "END", ("stop_sequence", "END")),
    ("stop", None, ("end_turn", None)),
    ("length", None, ("max_tokens", None)),
])
def test_stop_sequence_is_named_only_when_it_is_the_reason(finish, word, want):
    assert ending(finish, word) == {"stop_reason": want[0], "stop_sequence": want[1]}


def test_tool_use_input_goes_back_as_llama_server_writes_it():
    """Compact and in UTF-8, as llama-server's conversion dumps it (json.dumps' defaults
    gave '{"city": "Z\\u00fcrich"}', other text than the model wrote)."""
    body = {"max_tokens": 4, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {"city": "Zürich", "n": [1, 2]}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}
    chat = to_chat(body)[0]
    call = next(m for m in chat.messages if m.get("tool_calls"))["tool_calls"][0]
    assert call["function"]["arguments"] == '{"city":"Zürich","n":[1,2]}'
