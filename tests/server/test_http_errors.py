"""Every refusal is an OpenAI-shaped error with the right status, never a 500 for bad input;
overload is a 503 with Retry-After; an unexpected failure is a counted 500."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pymtp import Chunk
from pymtp.server import ServerSettings

from .helpers import app_client, parse_sse

MSGS = [{"role": "user", "content": "hi"}]


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    # OpenAI's four fields, and llama-server's numbers of a prompt over the context
    assert {"message", "type", "param", "code"} <= set(err) <= {"message", "type", "param", "code", "n_prompt_tokens",
                                                             "n_ctx"} and err["message"]
    return err


@pytest.mark.parametrize("raw", ["{not json", "", "[1, 2]", '"text"'])
def test_malformed_body(client, raw):
    err = _error(client.post("/v1/completions", content=raw), 400)
    assert err["code"] == "invalid_json"


@pytest.mark.parametrize("route, raw", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, '
                             '"response_format": {"type": "json_schema", "json_schema": {"name": "n", '
                             '"schema": {"enum": [Infinity]}}}}'),
    ("/completion", '{"prompt": "Hi", "n_predict": 4, "json_schema": {"const": NaN}}'),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "dry_base": -Infinity}'),
])
def test_nan_and_infinity_are_not_json(client, route, raw):
    """Python's parser takes JavaScript's NaN and Infinity: a schema's value came back as
    ``Infinity`` in "JSON" output, an echoed tool a 500, a field NaN silently."""
    err = _error(client.post(route, content=raw), 400)
    assert err["code"] == "invalid_json" and "not a JSON number" in err["message"], err


def test_a_compressed_body_is_415_not_misread(client):
    import gzip

    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    for coding, raw in (("gzip", gzip.compress(body)), ("br", body)):
        r = client.post("/v1/completions", content=raw, headers={"Content-Encoding": coding})
        err = _error(r, 415)
        assert err["code"] == "unsupported_content_encoding" and repr(coding) in err["message"], err
    r = client.post("/v1/completions", content=body, headers={"Content-Encoding": "identity"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -2}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n_predict": -5}, "n_predict"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 65}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": [1, None]}, "prompt"),     # [1, "a"] is llama-server's mixed prompt
    ("/v1/completions", {"prompt": "x", "model": 7}, "model"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": False, "stream_options": {}}, "stream_options"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),    # as llama-server's
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0]"),
    # a call without arguments rendered as broken JSON, an id object as its Python repr,
    # another type of call as a function's (llama-server: 500s)
    *[("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [call]}]}, "messages[0].tool_calls[0]")
      for call in ({"id": "1", "type": "function", "function": {"name": "f"}},
                   {"id": {"x": 1}, "type": "function", "function": {"name": "f", "arguments": "{}"}},
                   {"id": "1", "type": "custom", "function": {"name": "f", "arguments": "{}"}})],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "chat_template_kwargs": []}, "chat_template_kwargs"),
])
def test_wrong_types_name_the_field(client, route, body, param):
    err = _error(client.post(route, json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_null_content_is_no_text_as_llama_server_reads_it(client):
    """llama-server renders a user's, system's or tool's null content as "" (a 400 here);
    only a message without the key is refused."""
    body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    for role in ("system", "user"):
        nulls = [{"role": role, "content": None}, {"role": "user", "content": "Hi"}]
        empties = [{"role": role, "content": ""}, {"role": "user", "content": "Hi"}]
        got = client.post("/v1/chat/completions", json={**body, "messages": nulls})
        assert got.status_code == 200, got.text
        want = client.post("/v1/chat/completions", json={**body, "messages": empties}).json()
        assert got.json()["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] and \
            got.json()["choices"][0]["message"] == want["choices"][0]["message"]


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "the fox", "max_tokens": 3}),
    ("/completion", {"prompt": "the fox", "n_predict": 3}),
])
def test_whole_numbers_sent_as_floats_are_integers(client, route, body):
    """Clients that build bodies from floats send 40.0 for top_k; llama-server takes it."""
    def reply(fields: dict) -> dict:
        r = client.post(route, json={**body, "temperature": 0.7, **fields})
        assert r.status_code == 200, r.text
        return r.json()

    ints = {"top_k": 5, "seed": 3, "repeat_last_n": 8}
    want = reply(ints)
    got = reply({k: float(v) for k, v in ints.items()} | {k: float(v) for k, v in body.items() if k != "prompt"})
    pick = (lambda r: r["choices"][0]["text"]) if route.startswith("/v1") else (lambda r: r["content"])
    assert pick(got) == pick(want)
    assert _error(client.post(route, json={**body, "top_k": 2.5}), 400)["param"] == "top_k"


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {}, "messages"),
])
def test_empty_prompt_or_messages(client, route, body, param):
    assert _error(client.post(route, json=body), 400)["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),                          # OpenAI's limit is 128
    ({"n_cmpl": 0}, "n_cmpl"),                  # llama-server's name for it: the error names it
    ({"best_of": True}, "best_of"),             # not best_of 1, though true == 1 in Python
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),      # it was ignored: no call forced
    ({"modalities": ["text", "audio"]}, "modalities"),        # text came back, silently
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"logprobs": 21}, "logprobs"),             # logprobs and echo are served since #18.11
    ({"echo": "yes"}, "echo"),
    ({"best_of": 2}, "best_of"),
    ({"presence_penalty": 5}, "presence_penalty"),        # OpenAI's range is [-2, 2]
    ({"logit_bias": {"1": 500}}, "logit_bias"),           # OpenAI's range is [-100, 100]
    ({"draft_max": 99}, "draft_max"),
    ({"p_min": 2.0}, "p_min"),
    ({"spec": "eagle"}, "spec"),
])
def test_unsupported_values(client, body, param):
    err = _error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}), 400)
    assert err["param"] == param


def test_neutral_values_of_unsupported_fields_are_fine(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 1, "logprobs": None,
                                             "presence_penalty": 0, "echo": False, "user": "me",
                                             "function_call": "auto", "modalities": ["text"], "audio": None})
    assert r.status_code == 200


def test_chat_rejects_non_function_tools_and_images(client):
    # function tools are served (tests/server/test_tools_http.py); other kinds are not
    assert _error(client.post("/v1/chat/completions", json={
        "messages": MSGS, "tools": [{"type": "code_interpreter"}]}), 400)["param"] == "tools"
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert _error(client.post("/v1/chat/completions", json={"messages": img}), 400)["param"] == \
        "messages[0].content[0].type"


def test_any_model_name_is_answered_by_the_served_model(client):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "model": "gpt-4o", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "pymtp-fixture-dense"
    assert client.get("/v1/models/gpt-4o").json()["id"] == "pymtp-fixture-dense"


def test_served_model_names_are_strict(dense_model):
    with app_client(dense_model, ServerSettings(served_names=("my-model", "mm"))) as c:
        err = _error(c.post("/v1/chat/completions", json={"messages": MSGS, "model": "gpt-4o"}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert err["message"] == "The model 'gpt-4o' does not exist; this server serves 'my-model'"
        assert _error(c.get("/v1/models/pymtp-fixture-dense"), 404)["code"] == "model_not_found"
        r = c.post("/v1/completions", json={"prompt": "x", "model": "mm", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "my-model"
        card = c.get("/v1/models").json()["data"][0]
        assert (card["id"], card["meta"]["aliases"]) == ("my-model", ["mm", "my-model"])
        # the token counts answer for a model only where generating does (they said 200)
        for route, body in (("/v1/responses/input_tokens", {"input": "hi"}),
                            ("/v1/chat/completions/input_tokens", {"messages": MSGS}),
                            ("/v1/messages/count_tokens", {"messages": MSGS})):
            r = c.post(route, json={**body, "model": "gpt-4o"})
            assert r.status_code == 404 and "The model 'gpt-4o' does not exist" in r.text, (route, r.text)
            assert c.post(route, json={**body, "model": "mm"}).status_code == 200


def test_prompt_longer_than_context(client):
    for route, body in (("/v1/completions", {"prompt": "word " * 1500}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1500}],
                                                  "stream": True})):
        err = _error(client.post(route, json=body), 400)
        assert err["code"] == "context_length_exceeded" and "context holds 1024" in err["message"]
        # llama-server's numbers, which llama.cpp's web UI reads to say how far over it is
        assert err["n_ctx"] == 1024 and err["n_prompt_tokens"] > 1500
        assert f"prompt has {err['n_prompt_tokens']} tokens" in err["message"]


def test_huge_prompt_refused_by_its_head(client):
    # 200k characters, far past 64 per token of a 1024-token context: refused on its head,
    # with a lower bound on the count, for both routes and the field each calls its prompt
    for route, body, param in (("/v1/completions", {"prompt": "word " * 40_000}, "prompt"),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "word " * 40_000}]}, "messages")):
        err = _error(client.post(route, json=body), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert err["message"].startswith("prompt has at least ") and "context holds 1024" in err["message"]
        assert err["n_ctx"] == 1024 and "n_prompt_tokens" not in err     # not counted: no exact number


def test_token_ids_outside_the_vocabulary(client):
    assert _error(client.post("/v1/completions", json={"prompt": [1, 10**6]}), 400)["param"] == "prompt"


def test_negative_seed_is_400_naming_seed(client):
    # -1 is llama.cpp's fresh seed (tests/server/test_live.py); below it, nothing
    err = _error(client.post("/v1/completions", json={"prompt": "x", "seed": -2, "temperature": 0.7}), 400)
    assert (err["param"], err["code"]) == ("seed", "invalid_value")
    assert err["message"] == "seed must be an integer >= 0, or -1 (or null) for a fresh one, got -2"


def test_sampling_filter_errors_come_back_as_400(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x", "temperature": 0.5, "top_p": 7}), 400)
    assert err["param"] == "top_p"


def test_template_refusal_is_400(dense_model):
    """A template that raises (as Qwen's do for misplaced system messages) is the client's 400."""
    with app_client(dense_model) as c:
        svc = c.app.state.service
        from pymtp.chat import ChatTemplate
        svc.template = ChatTemplate("{{ raise_exception('System message must be first') }}")
        err = _error(c.post("/v1/chat/completions", json={"messages": MSGS}), 400)
        assert "System message must be first" in err["message"] and err["param"] == "messages"


# ---------------------------------------------------------------------------- api key


def test_api_key(dense_model):
    """Any of the keys, as a bearer token or bare (as llama-server takes it) or as x-api-key."""
    with app_client(dense_model, ServerSettings(api_keys=("sekrit", "other"))) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit,other"},
                        {"Authorization": "Bearer sekrit,other"}, {"Authorization": "Basic sekrit"},
                        {"x-api-key": "Bearer"}, {"Authorization": "Bearer"}):
            err = _error(c.get("/v1/models", headers=headers), 401)
            assert err["code"] == "invalid_api_key"
            assert _error(c.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
            assert c.get("/metrics", headers=headers).status_code == 401
        for ok in ({"Authorization": "Bearer sekrit"}, {"Authorization": "bearer other"}, {"Authorization": "sekrit"},
                   {"x-api-key": "other"}, {"Authorization": "Basic x", "x-api-key": "sekrit"}):
            assert c.get("/v1/models", headers=ok).status_code == 200, ok
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=ok).status_code == 200


def test_a_key_beyond_ascii_is_compared_as_the_bytes_the_client_sent(dense_model):
    """A header is bytes; the key's UTF-8 bytes sent raw (curl's, llama-server's compare) get in."""
    with app_client(dense_model, ServerSettings(api_keys=("clé",))) as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer clé".encode()}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": "clé".encode()}).status_code == 200
        # (the test client re-encodes a header that is not UTF-8, so a latin-1 one cannot be sent here)
        for wrong in (b"cle", "clé!".encode(), "clé".encode("utf-16-le")):
            assert _error(c.get("/v1/models", headers={"x-api-key": wrong}), 401)["code"] == "invalid_api_key"


# ---------------------------------------------------------------------------- overload and crashes


class BlockingSession:
    """Holds its slot until released; stands in for a long generation."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.go = threading.Event()

    def stream(self, prompt, *, stats_out=None, **kwargs):
        def run():
            self.started.release()
            self.go.wait(10)
            yield Chunk("done", [1], "length")
        return run()

    def close(self) -> None:
        pass


def test_full_queue_is_503_with_retry_after(dense_model):
    slot = BlockingSession()
    with app_client(dense_model, ServerSettings(parallel=1, queue=1, retry_after=3), sessions=[slot]) as c, \
            ThreadPoolExecutor(2) as pool:
        first = pool.submit(c.post, "/v1/completions", json={"prompt": "a"})
        assert slot.started.acquire(timeout=10)
        queued = pool.submit(c.post, "/v1/completions", json={"prompt": "b", "stream": True})
        svc = c.app.state.service
        for _ in range(200):
            if svc.pool.waiting == 1:
                break
            threading.Event().wait(0.01)
        assert svc.pool.waiting == 1
        r = c.post("/v1/chat/completions", json={"messages": MSGS})
        err = _error(r, 503)
        assert r.headers["retry-after"] == "3" and err["type"] == "overloaded_error"
        # Anthropic's status for it (its SDK's OverloadedError; 503 is ServiceUnavailableError)
        r = c.post("/v1/messages", json={"max_tokens": 2, "messages": MSGS})
        assert r.status_code == 529 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "overloaded_error"
        slot.go.set()
        assert first.result(10).json()["choices"][0]["text"] == "done"
        assert "done" in queued.result(10).text
        assert svc.pool.busy == 0 and svc.pool.waiting == 0


class FailingSession(BlockingSession):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def stream(self, prompt, *, stats_out=None, **kwargs):
        def run():
            for _ in range(self.after):
                yield Chunk("ok ", [1])
            raise RuntimeError("kaboom")
        return run()


def test_unexpected_failure_is_a_counted_500(dense_model):
    with app_client(dense_model, sessions=[FailingSession(0)]) as c:
        err = _error(c.post("/v1/completions", json={"prompt": "a"}), 500)
        assert err["type"] == "server_error" and "kaboom" in err["message"]
        metrics = c.get("/metrics").text
        assert 'pymtp_errors_total{type="server_error"} 1.0' in metrics
        assert 'pymtp_requests_total{route="/v1/completions",status="500"} 1.0' in metrics
        assert c.app.state.service.pool.busy == 0


def test_failure_mid_stream_is_reported_in_band(dense_model):
    with app_client(dense_model, sessions=[FailingSession(2)]) as c:
        r = c.post("/v1/completions", json={"prompt": "a", "stream": True})
        assert r.status_code == 200
        events = parse_sse(r.text)
        assert [e["choices"][0]["text"] for e in events[:2]] == ["ok ", "ok "]
        assert events[-1]["error"]["type"] == "server_error"
        assert c.app.state.service.pool.busy == 0
        assert json.loads(c.post("/v1/completions", json={"prompt": "a"}).text)["error"]


def test_a_grammar_the_bias_leaves_no_token_is_a_400_streamed_or_not(client):
    """Found only tokens in: the reply's own doing, a 400 (invalid_value) however far it
    got, streamed too (there it was an internal 500 error with a logged traceback)."""
    body = {"messages": MSGS, "max_tokens": 16, "grammar": 'root ::= "xyz" [a-c]',
            "logit_bias": [["a", False], ["b", False], ["c", False]]}
    err = _error(client.post("/v1/chat/completions", json=body), 400)
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_value")
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200
    last = parse_sse(r.text)[-1]["error"]
    assert (last["type"], last["code"], last["message"]) == ("invalid_request_error", "invalid_value", err["message"])
    r = client.post("/v1/messages", json={**body, "stream": True})
    failed = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")][-1]
    assert failed == {"type": "error", "error": {"type": "invalid_request_error", "message": err["message"]}}


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": _deep_schema(300)}}]


@pytest.mark.parametrize("route, body, param, says", [
    # llama.cpp's parser takes {5,2} and builds rules until memory runs out (24 GB, then
    # the kernel killed the server): refused before it compiles, on every route
    ("/v1/chat/completions", {"messages": MSGS, "grammar": 'root ::= "a"{5,2}'}, "grammar", "{5,2}"),
    ("/completion", {"prompt": "a", "grammar": 'root ::= x\nx ::= ("a" | "b"){ 3 , 1 }'}, "grammar", "{ 3 , 1 }"),
    ("/v1/messages", {"messages": MSGS, "max_tokens": 2, "grammar": 'root ::= "a"{9,8}'}, "grammar", "{9,8}"),
    # a grammar that dead-ends after its first tokens was an internal 500 with a traceback
    ("/completion", {"prompt": "a", "grammar": 'root ::= "xyz" [c-a]'}, None, "allows no token"),
    ("/v1/chat/completions", {"messages": MSGS, "grammar": 'root ::= "xyz" [c-a]'}, None, "allows no token"),
    # the schema walks recurse once per level: a RecursionError and a 500
    ("/v1/chat/completions", {"messages": MSGS, "tools": DEEP_TOOLS, "tool_choice": "required"}, "tools",
     "nest too deeply"),
    ("/apply-template", {"messages": MSGS, "tools": DEEP_TOOLS, "tool_choice": "required"}, "tools",
     "nest too deeply"),
    # NaN compares as "off": it slipped past the check of a sampler pymtp does not have (the
    # body's parser refuses JavaScript's NaN and Infinity now, before any field is read)
    ("/v1/chat/completions", {"messages": MSGS, "typical_p": float("nan")}, None, "NaN is not a JSON number"),
    ("/v1/completions", {"prompt": "a", "mirostat": float("nan")}, None, "NaN is not a JSON number"),
    # a field read only when another switches its sampler on was not read at all
    ("/v1/chat/completions", {"messages": MSGS, "xtc_threshold": float("nan")}, None, "NaN is not a JSON number"),
    ("/v1/completions", {"prompt": "a", "dry_penalty_last_n": float("inf")}, None, "Infinity is not a JSON number"),
    # llama-server refuses it too; to a template the string "false" is true
    ("/v1/chat/completions", {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": "false"}},
     "chat_template_kwargs", "true or false"),
])
def test_what_would_have_been_a_crash_or_a_500_is_a_400_naming_the_field(client, route, body, param, says):
    body = {"max_tokens": 4, **body} if route != "/completion" else {"n_predict": 4, **body}
    r = client.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})    # NaN as sent
    if route == "/v1/messages":
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        return
    err = _error(r, 400)
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("route, body, path, param", [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt", "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\udfff"]}', "stop[0]", "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages[0].content", "messages"),
], ids=["prompt", "stop", "chat-content"])
def test_lone_surrogate_is_400(client, route, body, path, param):
    err = _error(client.post(route, content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and err["code"] == "invalid_unicode"
    assert err["message"].startswith(f"{path} holds a lone surrogate (")
    # a surrogate pair is one real character and still works
    ok = client.post("/v1/completions", content='{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "The quick brown fox"}),
    ("/v1/chat/completions", {"messages": MSGS}),
])
def test_llama_servers_token_limits_on_the_openai_routes(client, route, body):
    """llama.cpp's web UI sends max_tokens -1 for "no limit" and llama-server takes 0 as one
    token and n_predict beside OpenAI's names: answered as llama-server answers them."""
    def tokens(extra: dict) -> tuple[int, str]:
        r = client.post(route, json={**body, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]

    unbounded = tokens({})
    assert tokens({"max_tokens": -1}) == unbounded
    assert tokens({"max_tokens": 0}) == (1, "length")
    assert tokens({"n_predict": 3}) == (3, "length")
    assert tokens({"max_tokens": 2, "n_predict": 5}) == (2, "length")      # OpenAI's name first


def test_more_than_four_stop_strings(client):
    """OpenAI's API takes 4; llama-server and vLLM take more, and their clients send more."""
    stops = [f"never{i}" for i in range(10)] + ["o"]
    r = client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 16,
                                             "temperature": 0, "stop": stops})
    plain = client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    text = plain.json()["choices"][0]["text"]
    assert "o" in text, "the test needs a reply holding the last stop string"
    assert r.json()["choices"][0]["text"] == text[:text.index("o")]


def test_filter_values_openai_and_llama_server_take(client):
    """top_p 0 (OpenAI takes it) keeps the likeliest token alone: sampled, the reply is the
    greedy one; a negative top_k (vLLM's -1, llama-server's <= 0) is off: the reply is
    top_k 0's with the same seed."""
    def text(**extra) -> str:
        r = client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 12, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text(temperature=1.5, top_p=0, seed=3) == greedy
    sampled = text(temperature=1.5, top_k=0, seed=3)
    assert sampled != greedy, "the test needs a seed whose sampled reply is not the greedy one"
    assert text(temperature=1.5, top_k=-1, seed=3) == sampled
    assert client.post("/v1/completions", json={"prompt": "x", "top_p": -0.1}).status_code == 400


def test_echo_with_no_tokens_is_refused_not_one_token_more(client):
    """OpenAI's way to score a text is echo with max_tokens 0: llama-server's 0 (one token)
    would add a generated token to the score unasked."""
    err = _error(client.post("/v1/completions", json={"prompt": "The quick", "echo": True, "max_tokens": 0,
                                                      "logprobs": 0}), 400)
    assert err["param"] == "max_tokens" and "echo" in err["message"]
    r = client.post("/v1/completions", json={"prompt": "The quick", "echo": True, "max_tokens": 1, "logprobs": 0})
    assert r.status_code == 200, r.text


def test_a_negative_top_k_beside_a_samplers_list(client):
    body = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 1.2, "seed": 5}
    def text(**extra) -> str:
        r = client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    assert text(samplers=["temperature", "top_k"], top_k=-1) == text(samplers=["temperature"])
