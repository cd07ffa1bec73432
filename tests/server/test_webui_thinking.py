"""The chat page's split of a streamed reply into thinking and content (webui/thinking.js),
run under node on real streams of the chat route: the dense fixture writing a thinking
block under a grammar, with reasoning templates (tests/server/test_reasoning_http.py's).
The page draws the coloured pieces (pymtp.origins); the split of their text must be the
server's ``reasoning_content`` and ``content``, as a client joins the deltas."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import resources

import pytest

from pymtp.server import ServerSettings

from .helpers import app_client, parse_sse
from .test_reasoning_http import ENDS, MSGS, OPENING, PLAIN, THINKING, WRITES, _joined, _template

NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(not NODE, reason="no node to run the page's script (apt-get install nodejs)")

# what app.js does with a stream: the first traced chunk says how the server splits, then
# every chunk's pieces are fed
DRIVER = """
const events = JSON.parse(require("fs").readFileSync(0, "utf8"));
let split = null;
const out = {thinking: "", content: "", origins: []};
const draw = (pieces) => { for (const [where, text, origin] of pieces) {
  out[where] += text; out.origins.push(origin); } };
for (const obj of events) {
  if (obj.pymtp) {
    split = split || new ThinkingSplit(obj.pymtp.thinking);
    for (const [piece, origin] of obj.pymtp.pieces) draw(split.feed(piece, origin));
  }
}
if (split) draw(split.finish());
process.stdout.write(JSON.stringify(out));
"""


def _page_split(events: list[dict]) -> dict:
    script = (resources.files("pymtp.server") / "webui" / "thinking.js").read_text() + DRIVER
    r = subprocess.run([NODE, "-e", script], input=json.dumps(events), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def clients(dense_model):
    with app_client(dense_model) as writes, app_client(dense_model) as opening, \
            app_client(dense_model, ServerSettings(parallel=2, reasoning_format="none")) as none:
        _template(writes, THINKING)
        _template(opening, OPENING)
        _template(none, THINKING)
        yield {"writes": writes, "opening": opening, "none": none}


@pytest.mark.parametrize("which, grammar, thinks", [
    ("writes", WRITES, True),       # the model opens the block itself
    ("opening", ENDS, True),        # the prompt opened it: the reply holds only its end
    ("writes", PLAIN, False),       # a reasoning template, a reply without a block
    ("none", WRITES, False),        # --reasoning-format none: the reply as written
    # empty blocks (a model that chose not to think): no thinking, and no tags in the content
    ("opening", 'root ::= "\\n\\n</think>\\n\\nok then"', False),
    ("writes", 'root ::= "<think>\\n\\n</think>\\n\\nok then"', False),
    ("writes", 'root ::= "\\n <b>ok" [a-z ]{1,8}', False),       # no block, starting with space and "<"
    ("opening", 'root ::= "<think>x\\n</think>ok"', True),       # an opened block that writes the tag again
])
@pytest.mark.parametrize("draft_max", [1, 3])
def test_the_pages_split_of_the_pieces_is_the_servers(clients, which, grammar, thinks, draft_max):
    r = clients[which].post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 40, "temperature": 0, "grammar": grammar, "stream": True,
        "draft_max": draft_max, "pymtp": {"origins": True}})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    thinking, content = _joined(events)
    assert bool(thinking) == thinks
    page = _page_split(events)
    assert page["content"] == content
    assert "think>" not in content or which == "none"       # the tags stay only where nothing splits
    assert page["thinking"] == thinking       # both drop the white space before it, keep what ends it
    pieces = [o for e in events if e.get("pymtp") for _, o in e["pymtp"]["pieces"]]
    assert set(page["origins"]) <= set(pieces)          # each drawn piece keeps a piece's colour
