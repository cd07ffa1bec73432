"""llama-server's own routes (pymtp/server/llama_routes.py): /tokenize, /detokenize,
/apply-template and /props in process on the dense fixture, the route names llama-server
answers besides OpenAI's, and -- where $PYMTP_LLAMA_SERVER names a llama-server binary --
the same bodies sent to the real one, answered alike."""

from __future__ import annotations

import os

import httpx
import pytest

from pymtp.llama_server import LlamaServer, server_command
from pymtp.server import ServerSettings

from .helpers import app_client, parse_sse

LLAMA_SERVER = os.environ.get("PYMTP_LLAMA_SERVER")
TEXT = "The fox <|im_end|> ran\n\tdef f(x): return x ü 😀"
TOKENIZE_BODIES = [
    {"content": TEXT},
    {"content": TEXT, "with_pieces": True},
    {"content": TEXT, "add_special": True, "parse_special": False},
    {"content": ["The fox", 7, " ran", 300], "add_special": True},
    {"content": "😀", "with_pieces": True},        # pieces that are not whole UTF-8 come as bytes
    {},
]
CHAT = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
                     {"role": "user", "content": "Hi <|im_end|> there"},
                     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sum 2 and 3."}]}


@pytest.fixture(scope="module")
def llama(dense_model):
    with app_client(dense_model) as client:
        yield client


def _ids(llama, body: dict) -> list[int]:
    r = llama.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_tokenize_is_the_models_tokenizer(llama, dense_model):
    assert _ids(llama, {"content": TEXT}) == dense_model.tokenize(TEXT, special=True, add_special=False)
    assert _ids(llama, {"content": TEXT, "parse_special": False, "add_special": True}) == \
        dense_model.tokenize(TEXT, special=False, add_special=True)
    assert _ids(llama, {"content": ["The fox", 7, " ran"]}) == \
        dense_model.tokenize("The fox", special=True, add_special=False) + [7] + \
        dense_model.tokenize(" ran", special=True, add_special=False)
    assert _ids(llama, {}) == [] and _ids(llama, {"content": ""}) == []
    # null is each flag's default, as llama-server reads it (it was a 400)
    assert _ids(llama, {"content": TEXT, "add_special": None, "parse_special": None, "with_pieces": None}) == \
        dense_model.tokenize(TEXT, special=True, add_special=False)


def test_pieces_join_to_the_text_and_detokenize_inverts(llama, dense_model):
    pieces = _ids(llama, {"content": TEXT, "with_pieces": True})
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == TEXT and any(isinstance(p["piece"], list) for p in pieces)   # 😀's bytes split
    assert [p["id"] for p in pieces] == _ids(llama, {"content": TEXT})
    r = llama.post("/detokenize", json={"tokens": [p["id"] for p in pieces]})
    assert r.status_code == 200 and r.json() == {"content": TEXT}
    assert llama.post("/detokenize", json={}).json() == {"content": ""}


@pytest.mark.parametrize("route, body, param", [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": ["a", -1]}, "content[1]"),
    ("/tokenize", {"content": ["a", 1.5]}, "content[1]"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "a", "add_special": 1}, "add_special"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/apply-template", {"messages": []}, "messages"),
])
def test_bad_bodies_are_400s_naming_the_field(llama, route, body, param):
    r = llama.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_apply_template_is_the_chat_routes_prompt(llama, dense_model):
    prompt = llama.post("/apply-template", json=CHAT).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "Sum 2 and 3." in prompt
    r = llama.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    # the chat route tokenizes message content as plain text (a forged <|im_end|> stays text)
    assert r.json()["usage"]["prompt_tokens"] == len(dense_model.tokenize(
        prompt, special=True, add_special=True)) + len(dense_model.tokenize("<|im_end|>", special=False)) - 1


PREFILL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here"}]
# (body, the prompt's end, or the 400's param): as the real llama-server answers them (below)
CONTINUATIONS = [
    ({"messages": PREFILL}, "<|im_start|>assistant\nSure, here"),          # a trailing assistant message is continued
    ({"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False}, "assistant\nSure, here"),
    ({"messages": PREFILL[:1], "add_generation_prompt": False}, "<|im_start|>user\nHi<|im_end|>\n"),
    ({"messages": PREFILL, "continue_final_message": True}, "continue_final_message"),     # 400: both true
    ({"messages": PREFILL + [{"role": "assistant", "content": "B"}]}, "messages"),       # 400: two at the end
    # the continued text is tokenized with the template's text before it (BPE merges across)
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nSure"}]}, "assistant\n\nSure"),
]
def test_a_continuation_with_a_constraint_is_a_new_turn_or_a_400(llama):
    # a grammar would start over after the continued text: a chat that merely ends with an
    # assistant message gets a new turn, as before prefills; asking to continue is a 400
    body = {"messages": PREFILL, "response_format": {"type": "json_object"}}
    assert llama.post("/apply-template", json=body).json()["prompt"].endswith("Sure, here<|im_end|>\n<|im_start|>assistant\n")
    r = llama.post("/v1/chat/completions", json={**body, "continue_final_message": True, "add_generation_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    thinking = {"messages": PREFILL[:1] + [{"role": "assistant", "content": "", "reasoning_content": "I think"}]}
    r = llama.post("/v1/chat/completions", json=thinking)
    assert r.status_code == 400 and "continuing a message's thinking" in r.json()["error"]["message"]
    r = llama.post("/v1/chat/completions", json={"messages": PREFILL, "continue_final_message": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    # tool calls nothing answers: the history's fault, not a continuation's the client asked for
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    unanswered = PREFILL[:1] + [{"role": "assistant", "content": None, "tool_calls": calls}]
    err = llama.post("/v1/chat/completions", json={"messages": unanswered}).json()["error"]
    assert err["param"] == "messages" and '"tool" message' in err["message"], err
    r = llama.post("/v1/chat/completions", json={"messages": unanswered, "continue_final_message": True,
                                                  "add_generation_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_text_parts_join_as_the_template_joins_them(llama, dense_model):
    from pymtp.chat import ChatTemplate

    base = llama.app.state.service.template
    assert base.parts_separator is None and base.text_of(["", "Hi", "", "x"]) == "Hi\n\nx"    # llama.cpp's rule
    reads_parts = ChatTemplate("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
                               "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}\n{% endfor %}",
                               bos_token=base.bos_token, eos_token=base.eos_token)
    assert reads_parts.parts_separator == "" and reads_parts.text_of(["Be", "brief."]) == "Bebrief."
    llama.app.state.service.template = reads_parts
    try:
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]}]}
        assert llama.post("/apply-template", json=body).json()["prompt"].startswith("user:Bebrief.")
    finally:
        llama.app.state.service.template = base


# Where pymtp answers otherwise, on purpose: llama-server continues a user message as if it
# were the assistant's ("<|im_start|>assistant\nHi"), and an empty assistant message as no
# turn at all (the prompt ends "<|im_end|>\n"); pymtp refuses the first naming the field
# and answers the second as a new turn
OURS = [
    ({"messages": PREFILL[:1], "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
]


@pytest.mark.parametrize("body, want", CONTINUATIONS + OURS)
def test_a_chat_continues_its_last_assistant_message(llama, dense_model, body, want):
    r = llama.post("/apply-template", json=body)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == want
        assert llama.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 400
        return
    prompt = r.json()["prompt"]
    assert prompt.endswith(want) and not prompt.endswith("<|im_start|>assistant\n" + "<|im_end|>\n")
    chat = llama.post("/v1/chat/completions", json={**body, "max_tokens": 6, "temperature": 0}).json()
    ids = dense_model.tokenize(prompt, special=True, add_special=True)
    assert chat["usage"]["prompt_tokens"] == len(ids)
    # the reply's content starts with the continued text, as llama-server's does
    prefill = body["messages"][-1]["content"] if body["messages"][-1]["role"] == "assistant" else ""
    want_text = dense_model.generate(ids, max_tokens=6, ignore_eos=True, spec="none").text
    assert chat["choices"][0]["message"]["content"] == prefill + want_text
    events = parse_sse(llama.post("/v1/chat/completions", json={**body, "max_tokens": 6, "temperature": 0,
                                                                 "stream": True}).text)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")) == \
        prefill + want_text


def test_an_empty_last_assistant_message_is_a_new_turn(llama):
    body = {"messages": PREFILL[:1] + [{"role": "assistant", "content": ""}]}
    assert llama.post("/apply-template", json=body).json()["prompt"] == \
        llama.post("/apply-template", json={"messages": PREFILL[:1]}).json()["prompt"]


def test_props_say_what_the_server_runs(dense_model):
    with app_client(dense_model, ServerSettings(parallel=3, model_id="fox")) as client:
        props = client.get("/props").json()
        # a request that names no setting (its grammar ends it at once; /slots leaves grammars out)
        r = client.post("/completion", json={"prompt": "the fox", "grammar": 'root ::= " yes"'})
        slot = client.get("/slots").json()[r.json()["id_slot"]]
    assert slot["params"] == props["default_generation_settings"]["params"]
    assert (props["endpoint_slots"], props["endpoint_props"], props["endpoint_metrics"]) == (True, False, True)
    assert props["default_generation_settings"]["n_ctx"] == dense_model.n_ctx
    assert props["total_slots"] == 3 and props["model_alias"] == "fox"
    assert props["model_path"] == str(dense_model.path) and props["chat_template"] == dense_model.chat_template
    assert props["default_generation_settings"]["params"]["temperature"] == 0.0


def test_llama_servers_route_names_answer_alike(llama):
    assert llama.get("/models").json() == llama.get("/v1/models").json()
    assert llama.get("/v1/health").json() == {"status": "ok"}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    a, b = llama.post("/chat/completions", json=body).json(), llama.post("/v1/chat/completions", json=body).json()
    assert a["choices"] == b["choices"] and a["object"] == "chat.completion"


def test_the_routes_take_the_api_key(dense_model):
    with app_client(dense_model, ServerSettings(parallel=1, api_keys=("k",))) as client:
        for route in ("/tokenize", "/detokenize", "/apply-template"):
            assert client.post(route, json={}).status_code == 401
        assert client.get("/props").status_code == 401
        assert client.post("/tokenize", json={"content": "a"}, headers={"Authorization": "Bearer k"}).status_code == 200


@pytest.mark.skipif(not LLAMA_SERVER, reason="set PYMTP_LLAMA_SERVER to a llama-server binary")
def test_the_real_llama_server_answers_the_same_bodies_alike(llama, dense_path, tmp_path):
    server = LlamaServer(lambda port: server_command(LLAMA_SERVER, str(dense_path), port=port, threads=1,
                                                     n_ctx=512, n_batch=512), tmp_path / "llama-server.log")
    server.start()
    try:
        for body in TOKENIZE_BODIES:
            theirs = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()
            assert llama.post("/tokenize", json=body).json() == theirs, body
            ids = theirs["tokens"] if not body.get("with_pieces") else [p["id"] for p in theirs["tokens"]]
            assert llama.post("/detokenize", json={"tokens": ids}).json() == \
                httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()
        theirs = httpx.post(server.url + "/apply-template", json=CHAT, timeout=30).json()
        assert llama.post("/apply-template", json=CHAT).json() == theirs
        for body, _ in CONTINUATIONS:
            theirs = httpx.post(server.url + "/apply-template", json=body, timeout=30)
            ours = llama.post("/apply-template", json=body)
            assert ours.status_code == theirs.status_code, body
            if ours.status_code == 200:
                assert ours.json() == theirs.json(), body
            theirs = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 6, "temperature": 0},
                                timeout=30)
            ours = llama.post("/v1/chat/completions", json={**body, "max_tokens": 6, "temperature": 0})
            assert ours.status_code == theirs.status_code, body
            if ours.status_code == 200:       # the same prompt, the same greedy tokens and content
                assert ours.json()["usage"]["prompt_tokens"] == theirs.json()["usage"]["prompt_tokens"]
                assert ours.json()["choices"][0]["message"]["content"] == \
                    theirs.json()["choices"][0]["message"]["content"], body
        props = httpx.get(server.url + "/props", timeout=30).json()
        assert props["chat_template"] == llama.get("/props").json()["chat_template"]
        # the model list's Ollama-style "models" beside "data", alike but for the model's name
        (theirs,) = httpx.get(server.url + "/v1/models", timeout=30).json()["models"]
        (ours,) = llama.get("/v1/models").json()["models"]
        assert {k: v for k, v in ours.items() if k not in ("name", "model")} == \
            {k: v for k, v in theirs.items() if k not in ("name", "model")}
        # ... and the card's facts of the model, which clients read for its context and size
        (theirs,) = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        (ours,) = llama.get("/v1/models").json()["data"]
        facts = ("vocab_type", "n_vocab", "n_ctx_train", "n_embd", "n_params", "size")
        assert {k: ours["meta"][k] for k in facts} == {k: theirs["meta"][k] for k in facts}
        assert (type(ours["aliases"]), ours["tags"]) == (type(theirs["aliases"]), theirs["tags"])
        # a generating llama-server answers these as pymtp does
        for route in ("/v1/embeddings", "/rerank"):
            theirs = httpx.post(server.url + route, json={"input": "hi", "query": "q", "documents": ["a"]}, timeout=30)
            assert (theirs.status_code, theirs.json()["error"]["type"]) == (501, "not_supported_error")
        assert httpx.get(server.url + "/lora-adapters", timeout=30).json() == llama.get("/lora-adapters").json()
        for body in ([], [{"id": 0, "scale": 0.0}], [{"id": 0, "scale": None}], {"id": 0}):   # answered alike
            theirs = httpx.post(server.url + "/lora-adapters", json=body, timeout=30)
            ours = llama.post("/lora-adapters", json=body)
            assert ours.status_code == theirs.status_code, body
            if ours.status_code == 200:
                assert ours.json() == theirs.json(), body
        for path in ("/v1/chat/completions/input_tokens", "/v1/responses/input_tokens"):
            # (no special-token text in the content: pymtp reads a message's text as plain text)
            body = {"messages": CHAT["messages"][2:]} if "chat" in path else \
                {"input": "Sum 2 and 3.", "instructions": "Be brief."}
            theirs = httpx.post(server.url + path, json=body, timeout=30).json()
            assert llama.post(path, json=body).json() == theirs, path
        # a browser page of another origin: both answer the preflight and name the origin
        # allowed ("*" here, the origin there: both let the page read the answer)
        preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "content-type"}
        theirs = httpx.options(server.url + "/v1/chat/completions", headers=preflight, timeout=30)
        ours = llama.options("/v1/chat/completions", headers=preflight)
        assert ours.status_code == theirs.status_code == 200
        for r in (ours, theirs):
            assert r.headers["access-control-allow-origin"] in ("*", "http://example.com")
            assert "POST" in r.headers["access-control-allow-methods"]
        for method, path in (("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy"), ("POST", "/cors-proxy")):
            theirs = httpx.request(method, server.url + path, json={}, timeout=30)
            ours = llama.request(method, path, json={})
            assert (ours.status_code, ours.json()["error"]["type"]) == \
                (theirs.status_code, theirs.json()["error"]["type"]) == (403, "feature_disabled"), (method, path)
        theirs = httpx.post(server.url + "/props", json={}, timeout=30)
        ours = llama.post("/props", json={})
        assert (ours.status_code, ours.json()["error"]["type"]) == \
            (theirs.status_code, theirs.json()["error"]["type"]) == (501, "not_supported_error")
    finally:
        server.stop()


@pytest.mark.parametrize("route", ["/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking",
                                   "/v1/rerank", "/v1/reranking"])
def test_routes_of_other_server_kinds_say_so(llama, route):
    r = llama.post(route, json={"input": "hi", "query": "q", "documents": ["a"]})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert "generation only" in r.json()["error"]["message"]


@pytest.mark.parametrize("method, path, flag", [("GET", "/tools", "--tools"), ("POST", "/tools", "--tools"),
                                               ("GET", "/cors-proxy", "--webui-mcp-proxy")])
def test_llama_servers_disabled_features_answer_its_403(llama, method, path, flag):
    """llama.cpp's web page reads this 403 as a feature that is off, and asks no more."""
    r = llama.request(method, path)
    assert r.status_code == 403 and r.json()["error"]["type"] == "feature_disabled"
    assert flag in r.json()["error"]["message"]


def test_no_lora_adapter_is_loaded(llama):
    assert llama.get("/lora-adapters").json() == []


@pytest.mark.parametrize("body, status, message", [
    ([], 200, None),
    ([{"id": 0, "scale": 0.0}, {"id": 3}], 200, None),      # every adapter off: what llama-server answers too
    ([{"id": 0, "scale": None}], 200, None),                 # null is 0, as llama-server reads it
    ([{"scale": 2}], 400, "there is no LoRA adapter for entry 0 (it has no id) to scale by 2"),
    ([{"id": 0, "scale": 1.0}], 400, "there is no LoRA adapter 0 to scale by 1.0"),
    ({"id": 0}, 400, "Request body must be an array"),
    ([5], 400, "entry 0 must be an object"),
    ([{"id": 0, "scale": "high"}], 400, "entry 0's scale must be a number"),
])
def test_setting_lora_scales_enables_none(llama, body, status, message):
    r = llama.post("/lora-adapters", json=body)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json() == {"success": True}
    else:
        assert message in r.json()["error"]["message"]
    assert llama.post("/lora-adapters", content=b"[{").status_code == 400


def test_the_context_is_what_llama_cpp_sizes(dense_path):
    """llama.cpp rounds a context up to a multiple of 256 tokens: --ctx-size 300 holds 512,
    as llama-server's /props says, and a reply without a limit (-1, which llama.cpp's web UI
    sends) runs to that end, not to the 300 asked for."""
    from pymtp import load

    with load(dense_path, n_ctx=300, threads=1) as model:
        assert (model.options.n_ctx, model.n_ctx) == (300, 512)
        with app_client(model) as client:
            assert client.get("/props").json()["default_generation_settings"]["n_ctx"] == 512
            r = client.post("/v1/completions", json={"prompt": "the fox", "max_tokens": -1, "ignore_eos": True,
                                                     "temperature": 0})
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    # positions 0-511 hold the prompt and every token but the last, which needs no cell
    assert (usage["prompt_tokens"] + usage["completion_tokens"], choice["finish_reason"]) == (513, "length")
