"""The chat page's request from its settings and its count of a reply's rounds
(webui/reply.js), run under node: numbers as typed reach the server (parseInt made "1e3"
1 and "2.9" 2), and a reply's depths are the server's (a last chunk without tokens counted
as a depth-0 round)."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import resources

import pytest

from .helpers import app_client, parse_sse

NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(not NODE, reason="no node to run the page's script (apt-get install nodejs)")

BODIES = """
const cases = JSON.parse(require("fs").readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(cases.map((settings) => {
  try { return requestBody([], settings); } catch (e) { return {error: e.message}; }
})));
"""

TALLY = """
const exts = JSON.parse(require("fs").readFileSync(0, "utf8"));
const t = new Tally();
for (const ext of exts) t.add(ext);
process.stdout.write(JSON.stringify({depths: t.depths, rounds: t.rounds, tokens: t.tokens}));
"""

BLANK = {name: ["", False] for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed")}
BLANK |= {"draft_max": "", "spec": ""}


def _node(driver: str, stdin) -> object:
    script = (resources.files("pymtp.server") / "webui" / "reply.js").read_text() + driver
    r = subprocess.run([NODE, "-e", script], input=json.dumps(stdin), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_settings_reach_the_request_as_typed():
    cases = [BLANK,
             {**BLANK, "max_tokens": [" 1e3 ", False], "top_k": ["2.9", False], "seed": ["7", False],
              "temperature": ["0.7", False], "draft_max": "auto", "spec": "none"},
             {**BLANK, "draft_max": "3"},
             {**BLANK, "temperature": ["", True]}]
    got = _node(BODIES, cases)
    base = {"messages": [], "stream": True, "pymtp": {"origins": True}}
    assert got == [base,
                   {**base, "max_tokens": 1000, "top_k": 2.9, "seed": 7, "temperature": 0.7, "draft_max": "auto",
                    "spec": "none"},
                   {**base, "draft_max": 3},
                   {"error": "temperature is not a number: correct the field or clear it"}]


def test_a_setting_the_server_refuses_is_its_400_naming_the_field(dense_model):
    """"2.9" tokens went out as 2 and was served; it is the server's to refuse."""
    (body,) = _node(BODIES, [{**BLANK, "max_tokens": ["2.9", False]}])
    with app_client(dense_model) as client:
        r = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


@pytest.fixture(scope="module")
def short_model(dense_path):
    import pymtp

    return pymtp.load(dense_path, threads=1, n_ctx=256, draft_limit=4)


def test_a_reply_that_fills_the_context_counts_the_servers_rounds(short_model):
    """The reply that ends at the context's end has a last chunk with no tokens: the page
    counted it a depth-0 round that the server's stats do not have."""
    with app_client(short_model) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "word " * 80}], "max_tokens": 1000, "temperature": 0,
            "draft_max": 4, "stream": True, "pymtp": {"origins": True}})
        assert r.status_code == 200, r.text
        stats = client.get("/pymtp/stats").json()
    events = parse_sse(r.text)
    exts = [e["pymtp"] for e in events if e.get("pymtp")]
    assert exts[-1]["tokens"] == [] and events[-1]["choices"][0]["finish_reason"] == "length"
    got = _node(TALLY, exts)
    assert got["depths"] == stats["depths"]
    assert got["tokens"] == sum(len(e["tokens"]) for e in exts)
    assert got["rounds"] == sum(n for k, n in stats["depths"].items() if k != "0")
