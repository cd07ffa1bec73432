"""The chat page's routes over HTTP (its headers and files, --no-webui, /pymtp/stats) and
the ``pymtp`` origins extension of streamed chunks, against the engine's own rounds."""

from __future__ import annotations

import re

import httpx
import pytest

from conftest import require_exact_kernels
from pymtp.origins import token_origins
from pymtp.server import ServerSettings
from pymtp.server.page import ASSETS, page_files

from .helpers import app_client, chat_text, completion_text, live_server, parse_sse

PROMPT = "def fibonacci(n):"
ORIGINS = {"pymtp": {"origins": True}}


# ------------------------------------------------------------------ the page

def test_page_is_served_with_a_strict_content_security_policy(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'"
    for directive in ("script-src", "style-src", "connect-src", "img-src"):
        assert csp[directive] == "'self'", directive
    assert r.headers["x-content-type-options"] == "nosniff"
    html = r.text
    linked = re.findall(r'(?:src|href)="webui/([^"]+)"', html)
    assert sorted(linked) == sorted(ASSETS), "index.html loads every page file, and only those"
    for name in linked:
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        a = client.get(f"/webui/{name}")
        assert a.status_code == 200 and a.headers["content-type"].startswith(kind), name
        assert a.content == page_files()[name]


def test_page_has_no_inline_code_and_no_outside_resources():
    files = {name: body.decode() for name, body in page_files().items()}
    html = files["index.html"]
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="webui/' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son[a-z]+\s*=", html), "inline event handlers"
    assert not re.search(r"\sstyle\s*=", html), "inline styles"
    for name, text in files.items():
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text), f"{name} names another origin"
    # model text enters the page as text only
    for name in (n for n in files if n.endswith(".js")):
        assert "innerHTML" not in files[name] and "insertAdjacentHTML" not in files[name], name


def test_unknown_page_file_is_a_404(client):
    assert client.get("/webui/../app.py").status_code == 404
    assert client.get("/webui/secrets.js").status_code == 404


def test_no_webui_turns_the_page_off_but_not_the_stats(dense_model):
    with app_client(dense_model, ServerSettings(parallel=1, webui=False)) as c:
        assert c.get("/").status_code == 404
        assert c.get("/webui/app.js").status_code == 404
        assert c.get("/pymtp/stats").status_code == 200


def test_serve_no_webui_flag(tmp_path):
    with live_server(["--no-webui", "--ctx-size", "256", "--threads", "1"], tmp_path) as s:
        assert httpx.get(s.base_url + "/", timeout=10).status_code == 404
        assert httpx.get(s.base_url + "/pymtp/stats", timeout=10).status_code == 200
    assert "chat page" not in s.log.read_text()


def test_page_is_public_but_stats_need_the_key(dense_model):
    with app_client(dense_model, ServerSettings(parallel=1, api_keys=("sekrit",))) as c:
        page = c.get("/")
        assert page.status_code == 200 and b"sekrit" not in page.content
        assert c.get("/webui/app.js").status_code == 200
        assert c.get("/pymtp/stats").status_code == 401
        assert c.get("/pymtp/stats", headers={"Authorization": "Bearer sekrit"}).status_code == 200


# ------------------------------------------------------------------ /pymtp/stats

def test_stats_add_up_to_the_responses(dense_model):
    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        timings = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "draft_max": k}).json()["timings"]
                   for p, k in (("the quick brown fox", 3), ("hello world", "auto"), ("def fib(n):", 1))]
        s = c.get("/pymtp/stats").json()
    total = lambda key: sum(t[key] for t in timings)     # noqa: E731
    assert s["generations"] == 3 and s["generated_tokens"] == total("predicted_n")
    assert s["drafted"] == total("draft_n") and s["accepted"] == total("draft_n_accepted") > 0
    assert s["rounds"] == total("draft_rounds")
    assert sum(s["accepted_at"]) == s["accepted"] and sum(s["drafted_at"]) == s["drafted"]
    assert s["mean_tokens_per_round"] == pytest.approx((s["accepted"] + s["rounds"]) / s["rounds"])
    assert sum(s["depths"].values()) >= s["rounds"] and s["depths"]["1"] > 0
    assert s["slots"] == {"total": 2, "busy": 0} and s["queue"] == {"waiting": 0, "max": 8}
    assert s["batch"]["rounds"] > 0 and s["batch"]["engines"] == 1 and s["tokens_per_second"] > 0


# ------------------------------------------------------------------ origins in the stream

def _ext(chunks: list[dict]) -> list[dict]:
    return [c["pymtp"] for c in chunks if "pymtp" in c]


@pytest.mark.parametrize("draft_max", [3, "auto"])
def test_streamed_origins_are_the_engines_rounds(client, dense_model, draft_max):
    require_exact_kernels()      # the same rounds in the library and the server
    body = {"prompt": PROMPT, "max_tokens": 40, "draft_max": draft_max, "ignore_eos": True, "cache_prompt": False}
    chunks = parse_sse(client.post("/v1/completions", json={**body, "stream": True, **ORIGINS}).text)
    ext = _ext(chunks)
    alone = list(dense_model.session().stream(PROMPT, max_tokens=40, draft_max=draft_max, ignore_eos=True,
                                              cache_prompt=False))
    if draft_max == "auto":      # the depth follows measured speed: the same tokens, other rounds
        assert [t for e in ext for t in e["tokens"]] == [t for c in alone for t in c.tokens]
    else:
        assert [(e["tokens"], e["drafted"], e["accepted"]) for e in ext] == \
            [(c.tokens, c.drafted, c.accepted) for c in alone]
    timings = chunks[-1]["timings"]
    assert sum(e["drafted"] for e in ext) == timings["draft_n"]
    assert sum(e["accepted"] for e in ext) == timings["draft_n_accepted"] > 0
    assert sum(e["drafted"] > 0 for e in ext) == timings["draft_rounds"]
    for e in ext:
        assert e["origins"] == token_origins(e["drafted"], e["accepted"], len(e["tokens"]))
    text = completion_text(chunks)
    assert "".join(p for e in ext for p, _ in e["pieces"]) == text == "".join(c.text for c in alone)
    assert {o for e in ext for _, o in e["pieces"]} <= {o for e in ext for o in e["origins"]}


def test_chat_pieces_split_each_delta(client):
    chunks = parse_sse(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True, **ORIGINS}).text)
    for c in chunks:
        if "pymtp" in c:
            assert "".join(p for p, _ in c["pymtp"]["pieces"]) == c["choices"][0]["delta"]["content"]
    assert _ext(chunks) and chat_text(chunks)


def test_clients_that_do_not_ask_see_no_extension(client):
    for body in ({}, {"pymtp": {"origins": False}}, {"pymtp": {}}):
        chunks = parse_sse(client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 8, "stream": True, **body}).text)
        assert chunks and not _ext(chunks), body


@pytest.mark.parametrize("ask, stream, param, message", [
    (True, True, "pymtp", "pymtp must be an object"),
    ({"origin": True}, True, "pymtp.origin", "not a pymtp option"),
    ({"origins": "yes"}, True, "pymtp.origins", "must be a boolean"),
    ({"origins": True}, False, "pymtp.origins", "set stream: true"),
])
def test_a_bad_ask_is_a_400_naming_it(client, ask, stream, param, message):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": stream, "pymtp": ask})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"]
