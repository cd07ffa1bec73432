"""The chat page in a real headless Chromium, on a real ``pymtp serve`` with the demo model.

The page must show the answer the API gives for the same request, coloured by the
origins the server reports, ask for the API key and keep it in the tab only, talk to its
own origin only, and put model text in as text: a stream holding ``<script>`` must show
those characters, not make elements.

A screenshot of the chat is kept under ``$PYMTP_TEST_ARTIFACTS`` (default: a pytest tmp
directory); its path is printed (``pytest -s`` or ``-rP`` shows it).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from conftest import require_exact_kernels

from .browser import launch_chromium
from .helpers import live_server, parse_sse

KEY = "test-key-7f3a"
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 48
REQUEST = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
           "temperature": 0, "draft_max": 3}
AUTH = {"Authorization": f"Bearer {KEY}"}
D1_BACKGROUND = "rgb(201, 242, 199)"       # style.css --d1
TRANSPARENT = "rgba(0, 0, 0, 0)"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(["--parallel", "2", "--ctx-size", "1024", "--threads", "1", "--api-key", KEY],
                     tmp_path_factory.mktemp("webui-server")) as s:
        yield s


@pytest.fixture(scope="module")
def pw():
    return pytest.importorskip("playwright.sync_api", reason="playwright is a test extra: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def browser(pw):
    with pw.sync_playwright() as p:
        b = launch_chromium(p)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """A fresh tab that records every request it makes and every console error."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    tab = context.new_page()
    tab.requests, tab.console_errors = [], []
    tab.on("request", lambda r: tab.requests.append(r.url))
    tab.on("console", lambda m: m.type == "error" and tab.console_errors.append(m.text))
    yield tab
    context.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    where = os.environ.get("PYMTP_TEST_ARTIFACTS")
    path = Path(where) if where else tmp_path_factory.mktemp("webui-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _is_draft(origin: str) -> bool:
    return re.fullmatch(r"d\d+", origin) is not None


def _open_with_key(page, server) -> None:
    """Load the page; it must ask for the key, refuse a wrong one, and take the right one."""
    page.goto(server.base_url + "/")
    page.wait_for_selector("#key-form:not([hidden])")
    assert page.is_visible("#key-form")
    for key, status in (("wrong-key", 401), (KEY, 200)):
        page.fill("#key", key)
        with page.expect_response(lambda r: r.url.endswith("/v1/models")) as answer:
            page.click("#key-form button")
        assert answer.value.status == status
        assert answer.value.request.headers.get("authorization") == f"Bearer {key}"
    page.wait_for_selector("#model[data-ready=true]")
    assert page.is_hidden("#key-form")


def test_page_streams_the_apis_answer_with_accepted_drafts_coloured(pw, page, server, artifacts):
    require_exact_kernels()        # the page's run and the API's must make the same rounds
    # the API's answers first: whole, and streamed with origins (no prompt cache: each
    # request decodes from scratch, as the page's request will)
    whole = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=120,
                       json={**REQUEST, "cache_prompt": False})
    assert whole.status_code == 200, whole.text
    expected = whole.json()["choices"][0]["message"]["content"]
    timings = whole.json()["timings"]
    streamed = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=120,
                          json={**REQUEST, "cache_prompt": False, "stream": True, "pymtp": {"origins": True}})
    ext = [c["pymtp"] for c in parse_sse(streamed.text) if "pymtp" in c]
    pieces = [tuple(p) for e in ext for p in e["pieces"]]
    n_tokens = sum(len(e["tokens"]) for e in ext)       # up to a stop string, which usage counts past
    assert "".join(p for p, _ in pieces) == expected
    assert any(_is_draft(o) for _, o in pieces), f"no accepted draft to colour: {pieces}"

    _open_with_key(page, server)
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#temperature", "0")
    page.select_option("#draft-max", "3")
    page.fill("#prompt", PROMPT)
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=120_000)
    body = page.locator(".msg.assistant .body").last

    assert body.text_content() == expected
    spans = body.locator(".tok").evaluate_all(
        "els => els.map(e => [e.textContent, e.dataset.origin, e.className, getComputedStyle(e).backgroundColor])")
    assert [(text, origin) for text, origin, _, _ in spans] == pieces
    for text, origin, cls, colour in spans:
        if _is_draft(origin):
            assert re.search(r"\bo-d\d\b", cls) and colour != TRANSPARENT, (text, origin, cls, colour)
        if origin == "d1":
            assert colour == D1_BACKGROUND
        if origin == "decoded":
            assert colour == TRANSPARENT
    # the reply's panel counts the rounds the server accounted for
    assert page.text_content("#r-accepted") == f"{timings['draft_n_accepted']} / {timings['draft_n']}"
    assert page.text_content("#r-rounds") == str(timings["draft_rounds"])
    assert page.text_content("#r-tokens") == str(n_tokens)

    # the server panel polls /pymtp/stats: wait until it shows all three generations
    stats = httpx.get(server.base_url + "/pymtp/stats", headers=AUTH, timeout=10).json()
    pw.expect(page.locator("#s-generations")).to_have_text(str(stats["generations"]), timeout=10_000)
    assert page.text_content("#s-slots").endswith(" / 2")

    # the key stays in the tab, never in the page or in storage that outlives it
    assert page.evaluate("sessionStorage.getItem('pymtp.key')") == KEY
    assert page.evaluate("localStorage.length") == 0
    assert KEY not in page.content()
    # every request went to the page's own origin; the CSP was never violated
    assert page.requests and all(u.startswith(server.base_url + "/") for u in page.requests), page.requests
    assert not [e for e in page.console_errors if "Content Security Policy" in e], page.console_errors

    shot = artifacts / "webui-chat.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"web page screenshot: {shot}")


def _sse(*objs) -> str:
    return "".join(f"data: {json.dumps(o)}\n\n" for o in objs) + "data: [DONE]\n\n"


def test_model_text_with_markup_renders_as_text(page, server):
    """A stream (served by the test in place of the server's) whose text is markup: the
    page must show the characters, and make no script, img or b element of them."""
    hostile = ["<script>window.pwned = 1</script>", '<img src=x onerror="window.pwned = 2">']
    plain = "<b>bold</b> &amp; done"
    head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    def choice(delta, finish=None):
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    stream = _sse(choice({"role": "assistant", "content": ""}),
                  {**choice({"content": "".join(hostile)}),
                   "pymtp": {"drafted": 1, "accepted": 1, "tokens": [1, 2], "origins": ["d1", "bonus"],
                             "pieces": [[hostile[0], "d1"], [hostile[1], "bonus"]]}},
                  choice({"content": plain}),               # a chunk without the extension
                  choice({}, "stop"))
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=stream))
    _open_with_key(page, server)
    page.fill("#prompt", "anything")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=30_000)
    body = page.locator(".msg.assistant .body").last
    assert body.text_content() == "".join(hostile) + plain
    assert body.locator("script, img, b").count() == 0
    assert body.locator(".tok").evaluate_all("els => els.map(e => e.dataset.origin)") == ["d1", "bonus", ""]
    assert page.evaluate("window.pwned") is None
