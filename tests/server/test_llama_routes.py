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

from .helpers import app_client

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


def test_props_say_what_the_server_runs(dense_model):
    with app_client(dense_model, ServerSettings(parallel=3, model_id="fox")) as client:
        props = client.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == dense_model.options.n_ctx
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
    with app_client(dense_model, ServerSettings(parallel=1, api_key="k")) as client:
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
        props = httpx.get(server.url + "/props", timeout=30).json()
        assert props["chat_template"] == llama.get("/props").json()["chat_template"]
    finally:
        server.stop()
