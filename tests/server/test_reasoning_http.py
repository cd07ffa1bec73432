"""A reply's thinking apart from its content (pymtp/reasoning.py) over the chat route:
``reasoning_content`` in the message and in the stream's deltas, as llama-server's
default ``--reasoning-format auto`` gives it, for a reasoning model's template; "none"
(per request or for the server) leaves the reply as the model wrote it. The dense
fixture writes a thinking block under a grammar, with a template that speaks of thinking
(Qwen's drop it from earlier turns), or with one that ends its generation prompt in
``<think>`` and so opens it."""

from __future__ import annotations

import pytest

from pymtp.chat import ChatTemplate
from pymtp.reasoning import split_reasoning
from pymtp.server import ServerSettings
from pymtp.server.responses import ChunkWriter, Envelope
from pymtp.results import Chunk
from pymtp.tools import ToolPlan

from .helpers import app_client, parse_sse

MSGS = [{"role": "user", "content": "What is the sum?"}]
# the model writes its own block (its prompt opens none)
WRITES = 'root ::= " "? "<think>" [a-z ]{2,14} "</think>" "\\n\\n"? [a-z ]{1,12}'
# the prompt opened the block: the reply holds only its end
ENDS = 'root ::= [a-z\\n ]{2,14} "</think>" "\\n\\n"? [a-z ]{1,12}'
PLAIN = 'root ::= [a-z ]{2,14}'
# ChatML that drops earlier turns' thinking, as Qwen's templates do: a reasoning model's
THINKING = ("{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'].split('</think>')[-1] + '<|im_end|>\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
OPENING = ("{% for message in messages %}"
           "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
           "{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


def _template(client, text: str) -> None:
    service = client.app.state.service
    service.template = ChatTemplate(text, bos_token=service.template.bos_token, eos_token=service.template.eos_token)


@pytest.fixture(scope="module")
def clients(dense_model):
    """(default server, server with --reasoning-format none, server whose template opens
    the block), the first two with a reasoning model's template."""
    with app_client(dense_model) as auto, \
            app_client(dense_model, ServerSettings(parallel=2, reasoning_format="none")) as none, \
            app_client(dense_model) as opening:
        _template(auto, THINKING)
        _template(none, THINKING)
        _template(opening, OPENING)
        yield auto, none, opening


def _chat(client, grammar: str, stream: bool = False, **extra) -> dict | list[dict]:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 40, "temperature": 0,
                                                  "grammar": grammar, "stream": stream, **extra})
    assert r.status_code == 200, r.text
    return parse_sse(r.text) if stream else r.json()


def _joined(events: list[dict]) -> tuple[str, str]:
    """The stream's reasoning_content and content, joined as a client does."""
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    return "".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content") or "" for d in deltas)


@pytest.mark.parametrize("which, grammar, opened", [(0, WRITES, False), (2, ENDS, True)])
def test_thinking_comes_back_apart_whole_and_streamed(clients, which, grammar, opened):
    client = clients[which]
    raw = _chat(client, grammar, reasoning_format="none")["choices"][0]["message"]
    assert "reasoning_content" not in raw and "</think>" in raw["content"]
    # where the prompt opened the block, "none" keeps its tag in the content (reasoning.opener)
    assert raw["content"].startswith("<think>\n") == opened
    thinking, content = split_reasoning(raw["content"])
    assert thinking and content and "think>" not in thinking + content

    message = _chat(client, grammar)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thinking, content)
    assert _chat(client, grammar, reasoning_format="deepseek")["choices"][0]["message"] == message
    # deepseek-legacy is deepseek at the pinned llama.cpp, a stream too (its flag for a
    # stream's thinking in the content is read by no parser there)
    assert _chat(client, grammar, reasoning_format="deepseek-legacy")["choices"][0]["message"] == message
    assert _joined(_chat(client, grammar, stream=True, reasoning_format="deepseek-legacy")) == (thinking, content)

    events = _chat(client, grammar, stream=True)
    assert _joined(events) == (thinking, content)
    for e in events:       # no delta carries a tag, or an empty reasoning_content
        for c in e.get("choices", []):
            assert "think>" not in (c["delta"].get("content") or "") and c["delta"].get("reasoning_content", 1)
    assert _joined(_chat(client, grammar, stream=True, reasoning_format="none")) == ("", raw["content"])


CLOSING = OPENING.replace("<think>\\n'", "<think>\\n\\n</think>\\n\\n'")
# writes an empty closed block before an assistant message's text
TURNS = ("{% for message in messages %}"
         "{{ '<|im_start|>' + message['role'] + '\\n' }}"
         "{% if message['role'] == 'assistant' %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
         "{{ message['content'] + '<|im_end|>\\n' }}"
         "{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


def test_reasoning_format_none_keeps_the_generation_prompts_tags(clients):
    """Under "none" a reply's content starts with the generation prompt's think tags, as
    llama-server's (it parses a reply after its generation prompt and keeps the text from
    the reasoning start tag on: ``<think>\\n``, or the empty closed block with thinking off),
    so a client that reads the tags itself finds the block whole: whole and streamed, on
    the chat, Anthropic and Responses routes, after a continued message's tags too. A
    reply a format's grammar writes has none: its content is the JSON."""
    assert "</think>" in CLOSING
    _, none, _ = clients
    try:
        for template, tags, grammar in ((OPENING, "<think>\n", ENDS), (CLOSING, "<think>\n\n</think>\n\n", PLAIN)):
            _template(none, template)
            split = _chat(none, grammar, reasoning_format="auto")["choices"][0]["message"]
            made = split["content"] if template is CLOSING else None   # the model's text, the block closed
            raw = _chat(none, grammar)["choices"][0]["message"]["content"]
            assert raw.startswith(tags), (tags, raw)
            if made is not None:
                assert raw == tags + made and "reasoning_content" not in split
            else:
                assert split_reasoning(raw) == (split["reasoning_content"], split["content"])
            events = _chat(none, grammar, stream=True)
            assert _joined(events) == ("", raw)
            body = {"max_tokens": 40, "messages": MSGS, "grammar": grammar, "temperature": 0}
            text = "".join(b["text"] for b in none.post("/v1/messages", json=body).json()["content"]
                           if b["type"] == "text")
            assert text == raw
            resp = none.post("/v1/responses", json={"input": MSGS[0]["content"], "max_output_tokens": 40,
                                                    "grammar": grammar, "temperature": 0}).json()
            assert "".join(p["text"] for it in resp["output"] if it["type"] == "message"
                           for p in it["content"]) == raw
            schema = _chat(none, "", response_format={"type": "json_object"})["choices"][0]["message"]["content"]
            assert schema.lstrip().startswith("{"), schema
        # a continued message (no grammar: one would start a new turn): the tags the template
        # wrote before its text, then the text
        for template, tags in ((TURNS, "<think>\n\n</think>\n\n"), (OPENING, "")):
            _template(none, template)
            cont = MSGS + [{"role": "assistant", "content": "ab"}]
            got = none.post("/v1/chat/completions", json={"messages": cont, "max_tokens": 4, "temperature": 0})
            assert got.status_code == 200, got.text
            content = got.json()["choices"][0]["message"]["content"]
            assert content.startswith(tags + "ab") and len(content) > len(tags + "ab"), content
    finally:
        _template(none, THINKING)


def test_the_servers_format_is_the_default_a_request_overrides(clients):
    auto, none, _ = clients
    raw = _chat(none, WRITES)["choices"][0]["message"]
    assert "reasoning_content" not in raw and raw["content"].lstrip().startswith("<think>")
    split = _chat(none, WRITES, reasoning_format="auto")["choices"][0]["message"]
    assert (split["reasoning_content"], split["content"]) == split_reasoning(raw["content"])
    assert _chat(auto, WRITES)["choices"][0]["message"] == split


def test_a_reply_without_thinking_is_left_as_it_is(clients):
    auto, none, _ = clients
    message = _chat(auto, PLAIN)["choices"][0]["message"]
    assert message == _chat(none, PLAIN)["choices"][0]["message"] and "reasoning_content" not in message
    assert _joined(_chat(auto, PLAIN, stream=True)) == ("", message["content"])


def test_a_template_that_never_thinks_leaves_the_reply_as_it_is(dense_model):
    # llama-server splits thinking off only where the template is a reasoning model's: the
    # fixture's own ChatML speaks of no <think>, so a reply that starts with one is content
    with app_client(dense_model) as plain:
        raw = _chat(plain, WRITES)["choices"][0]["message"]
        assert "reasoning_content" not in raw and raw["content"].lstrip().startswith("<think>")
        assert _joined(_chat(plain, WRITES, stream=True)) == ("", raw["content"])


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}}}], "tool_choice": "required"},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}},
    # calls or the format (tools under auto beside a format: tools.reply_constraint)
    {"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}}}], "response_format": {"type": "json_object"}},
])
def test_a_reply_pymtp_formats_may_think_first_where_the_prompt_opened_the_block(clients, dense_model, extra):
    # A forced call or response_format constrains the reply from its first token. Under a
    # prompt that opened a thinking block the grammar lets the block's rest and end tag
    # come first (reasoning.think_first; tests/test_reasoning.py walks it): without that,
    # greedy decoding wrote the call or the JSON at once, inside a block that could never
    # close, and all of it came back as reasoning_content. The fixture never writes the
    # 7 tokens of the end tag, so its reply is thinking to the end: free text, not the
    # call or the JSON. With a template that never thinks the same request is formatted at once.
    body = {"messages": MSGS, "max_tokens": 60, "temperature": 0, **extra}
    r = clients[2].post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    thinking = choice["message"]["reasoning_content"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert not thinking.lstrip().startswith(("<tool_call>", "{")), thinking
    with app_client(dense_model) as plain:
        formatted = plain.post("/v1/chat/completions", json={**body, "logprobs": True}).json()["choices"][0]
    assert "reasoning_content" not in formatted["message"]
    # what it wrote (a call cut by max_tokens is left out of the reply: its tokens say it)
    written = "".join(t["token"] for t in formatted["logprobs"]["content"])
    assert written.lstrip().startswith(("<tool_call>", "{")), written


def test_a_bad_schema_under_a_thinking_prompt_is_a_400_naming_response_format(clients):
    r = clients[2].post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "$ref": "#/nowhere"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_completions_are_not_split(clients):
    auto = clients[0]
    r = auto.post("/v1/completions", json={"prompt": "Q:", "max_tokens": 30, "temperature": 0, "grammar": WRITES})
    assert r.status_code == 200 and "</think>" in r.json()["choices"][0]["text"]


@pytest.mark.parametrize("value", ["think", "", 1, "None"])
def test_an_unknown_format_is_a_400_naming_the_field(clients, value):
    r = clients[0].post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "reasoning_format": value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "reasoning_format" and "reasoning_format must be" in err["message"]
    with pytest.raises(ValueError, match="reasoning_format must be one of"):
        ServerSettings(reasoning_format="think")


def test_calls_are_read_from_the_content_after_the_thinking():
    # a reply that thinks, then calls: the block's text is thinking, the call a tool call
    # (in the thinking, a call's markup is only text)
    plan = ToolPlan.of([{"type": "function", "function": {"name": "add"}}])
    writer = ChunkWriter(Envelope("chat", "m"), False, tools=plan, reasoning=True)
    text = ('I should call <tool_call> add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
            '</tool_call>')
    deltas = []
    for i in range(0, len(text), 5):
        chunk = Chunk(text[i:i + 5], [])
        if writer.wants(chunk):
            deltas.append(writer.delta(chunk)["choices"][0]["delta"])
    deltas += [o["choices"][0]["delta"] for o in writer.closing("stop", None)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call <tool_call> add.\n"
    assert "".join(d.get("content") or "" for d in deltas) == ""
    (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert call["function"]["name"] == "add" and call["function"]["arguments"] == '{"a": 1}'
    assert writer.closing("stop", None)[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_thinking_sent_back_reaches_the_template(clients):
    # Qwen's templates render an assistant turn's reasoning_content (the turns of a tool
    # loop after the last question keep their thinking)
    auto = clients[0]
    service = auto.app.state.service
    kept = service.template
    service.template = ChatTemplate(
        "{% for m in messages %}{{ m['role'] + ':' }}{% if m.reasoning_content is string %}"
        "{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}{{ m['content'] + '\\n' }}{% endfor %}",
        bos_token=kept.bos_token, eos_token=kept.eos_token)
    try:
        def prompt_tokens(reply: dict) -> int:
            r = auto.post("/v1/chat/completions", json={"messages": MSGS + [reply, MSGS[0]], "max_tokens": 1})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        bare = {"role": "assistant", "content": "five"}
        thought = prompt_tokens({**bare, "reasoning_content": "two and three make five, so the answer is five"})
        assert thought > prompt_tokens(bare) + 5
        r = auto.post("/v1/chat/completions", json={"messages": [{**bare, "reasoning_content": 5}], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].reasoning_content"
    finally:
        service.template = kept


@pytest.mark.parametrize("which, grammar", [(0, WRITES), (2, ENDS)])
def test_usage_counts_the_thinkings_tokens_whole_and_streamed(clients, dense_model, which, grammar):
    # OpenAI's completion_tokens_details.reasoning_tokens: the reply's tokens up to the one
    # that completes "</think>", found here by detokenizing ever longer prefixes of the
    # same greedy reply; two choices count twice
    client = clients[which]
    prompt = client.post("/apply-template", json={"messages": MSGS}).json()["prompt"]
    tokens = dense_model.generate(prompt, max_tokens=40, grammar=grammar, temperature=0).tokens
    ends = next(n for n in range(1, len(tokens) + 1) if "</think>" in dense_model.detokenize(tokens[:n]))
    assert 0 < ends < len(tokens)
    for n in (1, 2):
        whole = _chat(client, grammar, n=n)["usage"]
        assert whole["completion_tokens"] == n * len(tokens)
        assert whole["completion_tokens_details"] == {"reasoning_tokens": n * ends}
        streamed = _chat(client, grammar, stream=True, n=n, stream_options={"include_usage": True})[-1]["usage"]
        assert streamed | {"prompt_tokens_details": None} == whole | {"prompt_tokens_details": None}  # (the cache's read)


def test_usage_details_no_thinking_where_none_comes_back_apart(clients):
    auto, none, _ = clients
    # a reasoning model's reply without a block: none of its tokens thought
    assert _chat(auto, PLAIN)["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    # the reply as the model wrote it (or a template that never thinks): nothing to detail
    assert "completion_tokens_details" not in _chat(none, WRITES)["usage"]
    assert "completion_tokens_details" not in _chat(none, WRITES, stream=True,
                                                    stream_options={"include_usage": True})[-1]["usage"]


# --- the reasoning budget (pymtp/reasoning_budget.py) ----------------------------------

def _plain(client, **extra) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 30, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _budgeted_reference(client, dense_model, budget: int, message: str) -> tuple[str | None, str, int]:
    """What the library writes for the chat's own prompt under ``budget``: the reply's
    thinking and content, and its tokens."""
    prompt = client.post("/apply-template", json={"messages": MSGS}).json()["prompt"]
    ids = dense_model.tokenize(prompt, special=True)
    got = dense_model.generate(ids, max_tokens=30, temperature=0, reasoning_budget=budget,
                               reasoning_budget_message=message)
    return (*split_reasoning(got.text, True), len(got.tokens))


def test_a_reasoning_budget_forces_the_end_of_thinking_whole_and_streamed(clients, dense_model):
    opening = clients[2]
    free = _plain(opening)["choices"][0]["message"]
    thinking, content, n = _budgeted_reference(opening, dense_model, 3, " stop")
    assert thinking.endswith("stop") and content and (thinking, content) != (free["reasoning_content"], free["content"])
    for name in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        got = _plain(opening, **{name: 3}, reasoning_budget_message=" stop")
        assert (got["choices"][0]["message"]["reasoning_content"], got["choices"][0]["message"]["content"]) == \
            (thinking, content), name
        assert got["usage"]["completion_tokens"] == n      # the forced tokens count as the reply's
    events = parse_sse(opening.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 30, "temperature": 0, "stream": True, "reasoning_budget_tokens": 3,
        "reasoning_budget_message": " stop"}).text)
    assert _joined(events) == (thinking, content)


def test_the_servers_budget_applies_unless_a_request_sets_its_own(dense_model):
    with app_client(dense_model, ServerSettings(parallel=2, reasoning_budget=0)) as client:
        _template(client, OPENING)
        thinking, content, _ = _budgeted_reference(client, dense_model, 0, "")
        assert thinking == "" and content
        for extra in ({}, {"reasoning_budget_tokens": -1}):
            message = _plain(client, **extra)["choices"][0]["message"]
            assert (message.get("reasoning_content", ""), message["content"]) == (thinking, content)
        thinking5, content5, _ = _budgeted_reference(client, dense_model, 5, "")
        message = _plain(client, reasoning_budget_tokens=5)["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (thinking5, content5) != (thinking, content)
        # Anthropic's thinking budget, 10000 where the body gives none, as llama-server's
        body = {"model": "m", "max_tokens": 30, "temperature": 0, "messages": MSGS}
        for thinking_field, want in (({"type": "enabled", "budget_tokens": 5}, content5),
                                     ({"type": "disabled"}, content)):
            r = client.post("/v1/messages", json={**body, "thinking": thinking_field})
            assert r.status_code == 200, r.text
            assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == want, thinking_field
        r = client.post("/v1/messages", json={**body, "thinking": {"type": "enabled"}})
        free = _plain(client, reasoning_budget_tokens=10000)["choices"][0]["message"]["content"]
        assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == free


def test_a_template_that_does_not_think_has_no_budget(dense_model):
    with app_client(dense_model) as client:      # the fixture's ChatML, no thinking
        free = _plain(client)["choices"][0]["message"]
        assert _plain(client, reasoning_budget_tokens=0)["choices"][0]["message"] == free


@pytest.mark.parametrize("field, value, param", [
    ("reasoning_budget_tokens", -2, "reasoning_budget_tokens"),
    ("thinking_budget_tokens", "3", "thinking_budget_tokens"),
    ("reasoning_budget_message", 5, "reasoning_budget_message"),
])
def test_a_bad_budget_field_is_a_400_naming_it(clients, field, value, param):
    r = clients[2].post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = clients[2].post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MSGS,
                                              "thinking": {"type": "enabled", "budget_tokens": -1}})
    assert r.status_code == 400 and "budget_tokens" in r.text, r.text


def test_a_think_tag_in_a_message_starts_no_budget(clients):
    """The budget counts in the reply's block: a user's ``<think>`` in the prompt's last
    tokens started the count, and budget 0 forced ``</think>`` into a reply that had no
    block (and made a schema's reply a 400)."""
    auto = clients[0]     # its generation prompt opens no block; the model may write one
    asked = [{"role": "user", "content": "What does <think> mean?"}]
    for extra in ({}, {"response_format": {"type": "json_object"}}):
        free = auto.post("/v1/chat/completions", json={"messages": asked, "max_tokens": 12, "temperature": 0,
                                                       **extra})
        for budget in (0, 2):
            budgeted = auto.post("/v1/chat/completions", json={"messages": asked, "max_tokens": 12, "temperature": 0,
                                                               "reasoning_budget_tokens": budget, **extra})
            assert free.status_code == budgeted.status_code == 200, budgeted.text
            message = budgeted.json()["choices"][0]["message"]
            assert message == free.json()["choices"][0]["message"] and "</think>" not in message["content"], extra


def test_a_format_under_reasoning_format_none_leaves_the_budget_nothing_to_count(clients):
    """Under "none" a schema's or forced call's grammar starts at once, as llama-server's
    (no room to think first): a budget forced ``</think>`` where that grammar allows no
    such text, a 400 for every such request of a server run with a budget."""
    opening = clients[2]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    for extra in ({"response_format": {"type": "json_object"}}, {"tools": tools, "tool_choice": "required"}):
        body = {"messages": MSGS, "max_tokens": 16, "temperature": 0, "reasoning_format": "none", **extra}
        free = opening.post("/v1/chat/completions", json=body)
        for budget in (0, 3):
            got = opening.post("/v1/chat/completions", json={**body, "reasoning_budget_tokens": budget})
            assert got.status_code == free.status_code == 200, got.text
            assert got.json()["choices"][0]["message"] == free.json()["choices"][0]["message"], (extra, budget)
    # the same reply read for its thinking is budgeted (its grammar thinks first)
    body = {"messages": MSGS, "max_tokens": 16, "temperature": 0, "response_format": {"type": "json_object"}}
    free, got = (opening.post("/v1/chat/completions", json={**body, **b}).json()["choices"][0]["message"]
                 for b in ({}, {"reasoning_budget_tokens": 0}))
    assert (got.get("reasoning_content"), bool(free["reasoning_content"])) == (None, True)


def test_a_calls_marker_in_the_thinking_leaves_the_stops_on(clients):
    """With tools, a ``<tool_call>`` the model writes of while thinking opened a call's
    block for the stop matcher, and no stop string matched for the rest of the reply (its
    thinking holds no calls: the parser reads them from the content)."""
    opening = clients[2]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}]
    for tag in ("<tool_call>", "a tool"):
        grammar = f'root ::= "maybe {tag} later" "</think>" "\\n\\n" "the answer STOP and more"'
        for extra in ({}, {"tools": tools}):
            choice = _chat(opening, grammar, max_tokens=90, stop=["STOP"], **extra)["choices"][0]
            assert (choice["message"]["reasoning_content"], choice["message"]["content"], choice["finish_reason"]) \
                == (f"maybe {tag} later", "the answer ", "stop"), (tag, extra)
            events = _chat(opening, grammar, stream=True, max_tokens=90, stop=["STOP"], **extra)
            assert _joined(events) == (f"maybe {tag} later", "the answer "), (tag, extra)
