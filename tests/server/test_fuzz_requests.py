"""Property-based request fuzzing against a real ``pymtp serve`` on the demo model.

Bodies for /v1/completions and /v1/chat/completions are drawn from both endpoints'
schemas: each known field gets values of its own type (small and edge-case) or any JSON
value (random types, nesting, sizes, unicode including lone surrogates, huge integers,
NaN and infinities written as the raw tokens ``NaN``/``Infinity``), plus unknown fields;
a third property sends raw bytes (truncated, deeply nested, over-long numbers). Every
answer must be a valid response or a 4xx in the OpenAI error shape, never a 5xx, and
the server must keep serving.

The examples are fixed (``derandomize``) so CI sees the same ones every run; set
``PYMTP_FUZZ_RANDOM=1`` (and ``PYMTP_FUZZ_EXAMPLES=N``) to explore new ones.
"""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from .helpers import live_server, parse_sse

EXAMPLES = int(os.environ.get("PYMTP_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=os.environ.get("PYMTP_FUZZ_RANDOM") != "1",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                print_blob=True)

N_VOCAB_EDGE = [0, 1, 151643, 151645, 248_000, 2**31 - 1, 2**31, 2**63, -1, -(2**63) - 1]
HUGE_INTS = [0, -1, 2**31, 2**32 + 1, 2**53 + 1, 2**63, 2**64, 10**30, -(2**63), -(10**30), 10**400]
EDGE_FLOATS = [0.0, -0.0, 1e-320, 1e308, -1e308, math.inf, -math.inf, math.nan, 0.5, 2.0, -1.0]

# Text that means something to the model or its template; lone surrogates come with the
# wild values below (a body that holds one anywhere is refused before anything else).
specials = st.sampled_from(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "\x00",
                            "\ud83d\ude00", "\u202e", "{{ 7*7 }}", "{% raw %}", "{{ raise_exception('x') }}",
                            "\r\n", "\ufeff", " " * 300, "\U0010ffff", "\u0301"])
texts = st.one_of(st.text(max_size=40), specials,
                  st.lists(st.one_of(st.text(max_size=8), specials), max_size=5).map("".join))
wild_texts = st.one_of(st.text(st.characters(codec=None, exclude_categories=()), max_size=20),
                       st.sampled_from(["\ud800", "x\udfff", "\udc00\ud800"]))
ints = st.one_of(st.integers(-5, 20), st.integers(), st.sampled_from(HUGE_INTS))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EDGE_FLOATS))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), ints, floats, texts, wild_texts),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.one_of(texts, wild_texts), inner,
                                                                   max_size=4)),
                           max_leaves=12)
sometimes = lambda common, *edges: st.one_of(common, common, common, *edges)   # noqa: E731

token_ids = st.lists(st.one_of(st.integers(0, 5000), st.sampled_from(N_VOCAB_EDGE)), max_size=6)

# Each field's own type, with edge values of that type: what a client that read the docs
# (carelessly) sends.
OWN = {
    "model": st.one_of(st.sampled_from(["qwen35-tiny-mtp", "gpt-4o", ""]), texts),
    "max_tokens": sometimes(st.integers(1, 6), st.sampled_from(HUGE_INTS)),
    "stop": st.one_of(texts, st.lists(texts, max_size=6)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "temperature": sometimes(st.sampled_from([0, 0.0, 0.7, 1.0, 2.0]), floats),
    "top_p": sometimes(st.sampled_from([1, 0.9, 0.5]), floats),
    "top_k": sometimes(st.sampled_from([0, -1, 1, 40]), ints),
    "min_p": sometimes(st.sampled_from([0, 0.05, 0.5]), floats),
    "seed": ints,
    "spec": st.sampled_from(["mtp", "none", "MTP", ""]),
    "draft_max": sometimes(st.integers(1, 3), ints),
    "p_min": sometimes(st.sampled_from([0.0, 0.5, 1.0]), floats),
    "ignore_eos": st.booleans(),
    "n": st.sampled_from([1, 1, 2, 3, 5, 0, 129]),
    "logprobs": sometimes(st.sampled_from([None, False, True, 0, 1, 5]), st.sampled_from([20, 21, -1, 2**63])),
    "top_logprobs": sometimes(st.sampled_from([None, 0, 2]), st.sampled_from([20, 21, -1, 2**63])),
    "echo": st.sampled_from([False, True]), "best_of": st.sampled_from([1, 2]),
    "suffix": st.sampled_from(["", "x"]), "presence_penalty": st.sampled_from([0, 0.5]),
    "frequency_penalty": st.sampled_from([0, -0.5]), "logit_bias": st.sampled_from([{}, {"1": 5}, {"1": False}, [[1, -100]], {"x": 1}, {"1": 500},
                                                                {"99999999": 1}, [[1]], "1"]),
    "tools": st.sampled_from([None, [], [{"type": "function", "function": {"name": "f"}}]]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "user": texts, "metadata": st.dictionaries(texts, texts, max_size=2),
    # llama-server's own sampler fields (sampler_fields.py)
    "samplers": st.sampled_from([[], ["top_k", "temperature"], ["temperature", "top_k"], "kpmt", "kq", ["x"]]),
    "typical_p": sometimes(st.sampled_from([1.0, 0.9]), floats), "mirostat": st.sampled_from([0, 2]),
    "dry_multiplier": st.sampled_from([0, 0.8]), "xtc_probability": st.sampled_from([0, 0.5]),
    "lora": st.sampled_from([[], [{"id": 0, "scale": 1}]]),
}
CHAT_OWN = {
    "max_completion_tokens": OWN["max_tokens"],
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["add_generation_prompt", "enable_thinking", "messages", "tools", "bos_token", "x"]),
        json_values, max_size=3),
    "reasoning_format": st.sampled_from(["auto", "none", "deepseek", "x", 1]),
}

prompts = st.one_of(texts, token_ids, st.lists(st.one_of(texts, token_ids), max_size=3))
content_parts = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", "input_audio"])},
                          optional={"text": json_values, "image_url": json_values})), max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "user", "assistant", "tool", "function"]),
     "content": st.one_of(texts, texts, content_parts, st.none())},
    optional={"name": texts, "tool_calls": json_values, "tool_call_id": texts, "reasoning_content": json_values})
messages = st.lists(message, min_size=1, max_size=4)


@st.composite
def bodies(draw, kind: str) -> dict:
    """A body with a few of the optional fields, then a few fields given wild values
    (any JSON: other types, nesting, lone surrogates, huge numbers, NaN): none at all
    once Hypothesis has shrunk a failure, so the culprit stands out."""
    own = OWN if kind == "completion" else {**OWN, **CHAT_OWN}
    main = "prompt" if kind == "completion" else "messages"
    body = {main: draw(prompts if kind == "completion" else messages), "max_tokens": draw(OWN["max_tokens"])}
    for name in draw(st.lists(st.sampled_from(sorted(own)), unique=True, max_size=6)):
        body[name] = draw(own[name])
    wild = [main, "messages[0]", "messages[0].content", "messages[0].role", "extra_field", *sorted(own)]
    for name in draw(st.lists(st.sampled_from(wild), unique=True, max_size=2)):
        value = draw(json_values)
        if name.startswith("messages[0]") and isinstance(body.get("messages"), list) and body["messages"]:
            if name == "messages[0]":
                body["messages"][0] = value
            elif isinstance(body["messages"][0], dict):
                body["messages"][0][name.rsplit(".", 1)[1]] = value
        elif not name.startswith("messages[0]"):
            body[name] = value
    return body


completion_bodies = bodies("completion")
chat_bodies = bodies("chat")
# llama-server's /completion (llama_completion.py): its own fields over the completion bodies'
LLAMA_OWN = {
    "n_predict": sometimes(st.sampled_from([-1, 0, 1, 4]), st.sampled_from([-2, *HUGE_INTS])),
    "n_probs": sometimes(st.sampled_from([0, 1, 3]), st.sampled_from([21, -1, 2**63])),
    "return_tokens": st.booleans(), "stream": st.booleans(), "n_cmpl": st.sampled_from([1, 2, 3]),
    "response_fields": st.lists(st.sampled_from(["content", "tokens", "generation_settings/n_predict", "x/y",
                                                 "timings/predicted_n"]), max_size=3),
    "json_schema": st.sampled_from([{}, {"const": 3}, {"type": "integer"}, {"type": "x"}]),
    "grammar": st.sampled_from(['root ::= "a"', "root ::=", "x"]),
    "n_indent": st.sampled_from([0, 2]), "post_sampling_probs": st.booleans(), "id_slot": ints,
    "n_keep": ints, "timings_per_token": st.booleans(),
}
llama_prompts = st.one_of(prompts, st.lists(st.one_of(texts, st.integers(-1, 9000)), min_size=1, max_size=4),
                          st.fixed_dictionaries({"prompt_string": texts}, optional={"multimodal_data": json_values}))


@st.composite
def llama_bodies(draw) -> dict:
    if draw(st.booleans()):      # the completion bodies' wild fields, or llama-server's alone
        body = draw(completion_bodies)
        body["prompt"] = draw(llama_prompts) if draw(st.booleans()) else body.get("prompt")
    else:
        body = {"prompt": draw(llama_prompts), "max_tokens": draw(st.integers(0, 4))}
    for name in draw(st.lists(st.sampled_from(sorted(LLAMA_OWN)), unique=True, max_size=4)):
        body[name] = draw(LLAMA_OWN[name])
    if draw(st.booleans()):
        body["n_predict"] = body.pop("max_tokens", 3)
    return body


def encode(body: dict, ascii_only: bool) -> bytes:
    """JSON as a client might send it: NaN/Infinity as raw tokens, lone surrogates as
    ``\\udXXX`` escapes (ascii) or as the invalid UTF-8 a careless encoder writes."""
    text = json.dumps(body, ensure_ascii=ascii_only, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def raw_bodies(draw) -> bytes:
    """Bodies that are not JSON objects, or JSON that strains the parser."""
    depth = draw(st.one_of(st.integers(1, 100_000), st.integers(400, 1100)))   # around Python's limit
    nested = b"[" * depth + b"]" * depth
    where = draw(st.sampled_from([b"prompt", b"messages", b"tools", b"logit_bias", b"stop", b"user",
                                  b"chat_template_kwargs", b"response_format", b"metadata"]))
    digits = draw(st.integers(1, 50_000))
    valid = encode(draw(st.one_of(completion_bodies, chat_bodies)), True)
    return draw(st.one_of(
        st.binary(max_size=64),
        st.just(valid[:draw(st.integers(0, max(len(valid) - 1, 0)))]),           # truncated
        st.just(b'{"prompt": ' + nested + b', "max_tokens": 1}'),
        st.just(b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "'
                + where + b'": ' + nested + b"}"),
        st.just(b'{"' + where + b'": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b', "max_tokens": 1}'),
        st.just(b'{"prompt": "x", "max_tokens": ' + b"9" * digits + b"}"),
        st.just(b'{"prompt": "x", "max_tokens": 1, "temperature": ' + b"1" * digits + b".5e-99999}"),
        st.just(b'{"prompt": "x", "max_tokens": 1, "seed": -' + b"9" * digits + b"}"),
        st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b"NaN", b"\xef\xbb\xbf{}", b"{}",
                         b'{"prompt": "x", "prompt": 5}', b'{"prompt": "\\ud800", "max_tokens": 1}',
                         b'{"prompt": "x", "max_tokens": NaN}', b'{"prompt": "x", "max_tokens": -Infinity}',
                         b'{"prompt": "x\xff\xfe", "max_tokens": 1}', b'{"messages": [{"role": "user"}]}']),
    ))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A small context bounds what a request without a usable max_tokens can generate.
    with live_server(["--parallel", "2", "--ctx-size", "256", "--threads", "1"],
                     tmp_path_factory.mktemp("fuzz-server")) as s:
        with httpx.Client(base_url=s.base_url, timeout=120) as http:
            s.http = http
            yield s
        assert s.proc.poll() is None, "the server died"
        m = s.metrics()
        assert m.get("pymtp_errors_total{type=server_error}", 0) == 0
        assert m["pymtp_slots_busy"] == 0 and m["pymtp_queue_waiting"] == 0


def _post(server, path: str, data: bytes) -> httpx.Response:
    try:
        return server.http.post(path, content=data, headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        pytest.fail(f"no answer ({type(exc).__name__}: {exc}); server log:\n{_log_tail(server)}")


def _log_tail(server) -> str:
    return server.log.read_text(errors="replace")[-4000:]


def _check(server, r: httpx.Response, kind: str) -> None:
    """A valid response or an OpenAI-shaped 4xx; then the server still answers /health."""
    where = f"{r.status_code} {r.text[:600]!r}\nserver log:\n{_log_tail(server)}"
    event(f"{r.status_code} {r.json()['error']['code'] if r.status_code != 200 and r.status_code < 500 else ''}")
    assert r.status_code < 500, where
    if r.status_code != 200:
        assert 400 <= r.status_code < 500, where
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and err["message"], where
        assert isinstance(err["type"], str) and err["type"], where
        assert err["param"] is None or isinstance(err["param"], str), where
        assert err["code"] is None or isinstance(err["code"], str), where
    elif r.headers["content-type"].startswith("text/event-stream"):
        chunks = parse_sse(r.text)
        assert chunks and all("error" not in c for c in chunks), where
        by_index: dict[int, list] = {}        # several choices (n, a batch of prompts) interleave
        for c in chunks:
            if c["choices"]:
                by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0]["finish_reason"])
        assert sorted(by_index) == list(range(len(by_index))), where
        for reasons in by_index.values():
            assert reasons[-1] in ("stop", "length") and not any(reasons[:-1]), where
        want = "chat.completion.chunk" if kind == "chat" else "text_completion"
        assert all(c["object"] == want for c in chunks), where
    else:
        body = r.json()
        choice = body["choices"][0]
        assert body["object"] == ("chat.completion" if kind == "chat" else "text_completion"), where
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), where
        u = body["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0
    assert server.http.get("/health").status_code == 200


@FUZZ
@given(body=completion_bodies, ascii_only=st.booleans())
def test_completions_answer_every_body_without_a_server_error(server, body, ascii_only):
    _check(server, _post(server, "/v1/completions", encode(body, ascii_only)), "completion")


@FUZZ
@given(body=chat_bodies, ascii_only=st.booleans())
def test_chat_answers_every_body_without_a_server_error(server, body, ascii_only):
    _check(server, _post(server, "/v1/chat/completions", encode(body, ascii_only)), "chat")


@settings(FUZZ, max_examples=max(EXAMPLES // 3, 10))
@given(data=raw_bodies(), chat=st.booleans())
def test_raw_bodies_get_a_client_error_or_an_answer(server, data, chat):
    path, kind = ("/v1/chat/completions", "chat") if chat else ("/v1/completions", "completion")
    _check(server, _post(server, path, data), kind)


@FUZZ
@given(body=llama_bodies(), ascii_only=st.booleans())
def test_llama_servers_completion_answers_every_body_without_a_server_error(server, body, ascii_only):
    r = _post(server, "/completion", encode(body, ascii_only))
    where = f"{r.status_code} {r.text[:600]!r}\nserver log:\n{_log_tail(server)}"
    event(f"{r.status_code} {r.json()['error']['code'] if 400 <= r.status_code < 500 else ''}")
    assert r.status_code < 500, where
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, where
    else:
        stream = r.headers["content-type"].startswith("text/event-stream")
        answers = parse_sse(r.text, done=False) if stream else r.json()
        answers = answers if isinstance(answers, list) else [answers]
        assert answers and all("error" not in a for a in answers), where
        if not body.get("response_fields") or stream:
            finals = [a for a in answers if a["stop"]]
            assert finals and all(a["stop_type"] in ("eos", "word", "limit") for a in finals), where
            assert sorted(a["index"] for a in finals) == list(range(len(finals))), where
    assert server.http.get("/health").status_code == 200


# Anthropic's Messages API (anthropic.py): its blocks, tools and choices, some wild
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": texts, "name": texts, "input": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": texts},
                          optional={"content": st.one_of(texts, json_values), "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "image", "document", "x"])},
                          optional={"thinking": json_values, "signature": texts, "data": texts}),
    json_values)
ANTHROPIC_OWN = {
    "system": st.one_of(texts, st.lists(block, max_size=2)),
    "tools": st.lists(st.one_of(st.fixed_dictionaries({"name": texts, "input_schema": st.sampled_from(
        [{"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "x"}, 5])},
        optional={"description": texts, "type": st.sampled_from(["custom", "bash_20250124"])}), json_values), max_size=2),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "tool", "x"])},
                                                   optional={"name": texts, "disable_parallel_tool_use": st.booleans()}),
                             json_values),
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])},
                                                optional={"budget_tokens": ints}), json_values),
    "stop_sequences": st.one_of(st.lists(texts, max_size=3), json_values),
    "stream": st.booleans(), "temperature": OWN["temperature"], "top_k": OWN["top_k"],
    "metadata": st.dictionaries(texts, texts, max_size=2),
}


@st.composite
def anthropic_bodies(draw) -> dict:
    turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                  "content": st.one_of(texts, st.lists(block, max_size=3))})
    body = {"max_tokens": draw(st.one_of(st.integers(1, 4), ints)),
            "messages": draw(st.one_of(st.lists(turn, min_size=1, max_size=3), json_values))}
    for name in draw(st.lists(st.sampled_from(sorted(ANTHROPIC_OWN)), unique=True, max_size=4)):
        body[name] = draw(ANTHROPIC_OWN[name])
    return body


@FUZZ
@given(body=anthropic_bodies(), ascii_only=st.booleans(), count=st.booleans())
def test_anthropic_messages_answer_every_body_without_a_server_error(server, body, ascii_only, count):
    r = _post(server, "/v1/messages/count_tokens" if count else "/v1/messages", encode(body, ascii_only))
    where = f"{r.status_code} {r.text[:600]!r}\nserver log:\n{_log_tail(server)}"
    assert r.status_code < 500, where
    if r.headers["content-type"].startswith("text/event-stream"):
        assert "event: message_stop" in r.text and "event: error" not in r.text, where
    else:
        answer = r.json()
        event(f"{r.status_code} {answer.get('type')}")
        if r.status_code == 200:
            assert answer.get("type") == "message" or set(answer) == {"input_tokens"}, where
        else:                          # in Anthropic's shape
            assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, where
            assert answer["error"]["message"], where
    assert server.http.get("/health").status_code == 200


# OpenAI's Responses API (responses_api.py): its items, tools and formats, some wild
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
                           "content": st.one_of(texts, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"])},
                               optional={"text": texts, "refusal": texts}), max_size=2))},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": texts, "name": texts, "arguments": texts}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": texts},
                          optional={"output": st.one_of(texts, json_values)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "x"])},
                          optional={"content": json_values, "summary": json_values, "id": texts}),
    st.fixed_dictionaries({"type": st.just("reasoning")},     # a review found a 500 in these
                          optional={"content": st.sampled_from([5, True, [1], [{"text": 1}], [{"text": "a"}]]),
                                    "summary": st.sampled_from([True, [], [{"text": "s"}], "s"])}),
    json_values)
RESPONSES_OWN = {
    "instructions": st.one_of(texts, json_values),
    "tools": st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("function"), "name": texts, "parameters":
                                                       st.sampled_from([{"type": "object"}, {"type": "x"}, 5])}),
                                st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search"])}),
                                json_values), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "x"]),
                             st.fixed_dictionaries({"type": st.just("function"), "name": texts}), json_values),
    "text": st.one_of(st.fixed_dictionaries({"format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
                              optional={"name": texts, "schema": json_values}), json_values)}), json_values),
    "previous_response_id": st.sampled_from([None, "", "resp_1"]), "background": st.booleans(),
    "reasoning": json_values, "store": st.booleans(), "stream": st.booleans(),
    "parallel_tool_calls": st.booleans(), "temperature": OWN["temperature"],
}


@st.composite
def responses_bodies(draw) -> dict:
    body = {"max_output_tokens": draw(st.one_of(st.integers(1, 4), ints)),
            "input": draw(st.one_of(texts, st.lists(item, min_size=1, max_size=3), json_values))}
    for name in draw(st.lists(st.sampled_from(sorted(RESPONSES_OWN)), unique=True, max_size=4)):
        body[name] = draw(RESPONSES_OWN[name])
    return body


@FUZZ
@given(body=responses_bodies(), ascii_only=st.booleans())
def test_responses_answer_every_body_without_a_server_error(server, body, ascii_only):
    r = _post(server, "/v1/responses", encode(body, ascii_only))
    where = f"{r.status_code} {r.text[:600]!r}\nserver log:\n{_log_tail(server)}"
    assert r.status_code < 500, where
    if r.headers["content-type"].startswith("text/event-stream"):
        assert "event: response.completed" in r.text or "event: response.incomplete" in r.text, where
        assert "event: error" not in r.text, where
    else:
        answer = r.json()
        event(f"{r.status_code} {answer.get('status') or answer['error']['code']}")
        if r.status_code == 200:
            assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete"), where
        else:
            assert set(answer["error"]) == {"message", "type", "param", "code"}, where
    assert server.http.get("/health").status_code == 200


def test_the_server_survived_and_served_after_the_fuzzing(server):
    """Runs last in this module: an ordinary request still gets its ordinary answer."""
    r = server.http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
