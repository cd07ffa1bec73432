"""The chat page's reading of a stream and what its conversation keeps (webui/stream.js),
run under node on real streams of the chat route: the page must read the events a client
parses, however the bytes arrive (one at a time, CR LF or CR line ends, a character split
across reads), and must not take a stream cut before ``[DONE]`` for a whole reply."""

from __future__ import annotations

import base64
import json
import random
import shutil
import subprocess
from importlib import resources

import pytest

from .helpers import app_client, parse_sse

NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(not NODE, reason="no node to run the page's script (apt-get install nodejs)")

# what app.js does with a response: every event of sseEvents, then what it threw
READ = """
const chunks = JSON.parse(require("fs").readFileSync(0, "utf8")).map((c) => Buffer.from(c, "base64"));
const body = new ReadableStream({start(c) { for (const x of chunks) c.enqueue(new Uint8Array(x)); c.close(); }});
(async () => {
  const out = {events: [], error: null};
  try { for await (const e of sseEvents(new Response(body))) out.events.push(e); }
  catch (e) { out.error = String(e.message); }
  process.stdout.write(JSON.stringify(out));
})();
"""

KEEP = """
const cases = JSON.parse(require("fs").readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(cases.map(([m, r, o]) => conversationAfter(m, r, o))));
"""


def _node(driver: str, stdin) -> object:
    script = (resources.files("pymtp.server") / "webui" / "stream.js").read_text() + driver
    r = subprocess.run([NODE, "-e", script], input=json.dumps(stdin), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _read(chunks: list[bytes]) -> dict:
    return _node(READ, [base64.b64encode(c).decode() for c in chunks])


@pytest.fixture(scope="module")
def stream(dense_model) -> bytes:
    """A real streamed chat reply with pymtp's pieces, and text that is not all ASCII."""
    with app_client(dense_model) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "héllo wörld, say ünïcode"}], "max_tokens": 24,
            "temperature": 0, "draft_max": 3, "stream": True, "pymtp": {"origins": True}})
        assert r.status_code == 200, r.text
        return r.content


def _bytes_each(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


def _random_splits(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), 40))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


@pytest.mark.parametrize("line_end", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("split", ["whole", "bytes", "random"])
def test_the_page_reads_the_events_a_client_parses(stream, line_end, split):
    want = parse_sse(stream.decode())
    assert len(want) > 5 and any(e.get("pymtp") for e in want)
    data = stream.decode().replace("\n", line_end).encode()
    chunks = {"whole": [data], "bytes": _bytes_each(data), "random": _random_splits(data, len(line_end))}[split]
    got = _read(chunks)
    assert got == {"events": want, "error": None}


@pytest.mark.parametrize("cut", ["before [DONE]", "inside a frame", "nothing"])
def test_a_stream_cut_before_done_is_an_error_after_what_came(stream, cut):
    text = stream.decode()
    want = parse_sse(text)
    body = text[:-len("data: [DONE]\n\n")]
    if cut == "inside a frame":
        body = body[:body.rindex("data: ") + 9]
        want = want[:-1]
    elif cut == "nothing":
        body, want = "", []
    got = _read(_bytes_each(body.encode()))
    assert got["events"] == want
    assert got["error"] == "the stream ended before the reply did (the connection was closed)"


@pytest.mark.parametrize("line_end", ["\n", "\r\n", "\r"])
def test_comments_and_data_over_several_lines_read_as_server_sent_events_say(line_end):
    """A proxy's keep-alive comment is no event; an event's data may span data: lines,
    joined by line feeds (a CR LF split across reads must not end such an event early)."""
    body = (": keep-alive\n\n"
            "event: message\nid: 1\ndata: {\"a\":\ndata: 1}\n\n"
            ": ping\ndata:{\"b\": [2,\ndata:  3]}\n\n"
            "data: [DONE]\n\n").replace("\n", line_end).encode()
    got = _read(_bytes_each(body))
    assert got == {"events": [{"a": 1}, {"b": [2, 3]}], "error": None}


def test_a_crlf_split_across_reads_eats_one_lf_only(stream):
    """Frames ending "\\r\\n\\n" read as "...\\r", "\\n", "\\n...": the second read is the
    CRLF's LF, the third a line end of its own. The reader still took the third for the
    CRLF's (its CR flag outlived the read that ended it), so two frames ran together and
    JSON.parse threw."""
    frames = stream.decode().replace("\n\n", "\r\n\n").encode()
    chunks, at = [], 0
    while (end := frames.find(b"\r\n\n", at)) >= 0:
        chunks += [frames[at:end + 1], b"\n", b"\n"]
        at = end + 3
    got = _read(chunks + [frames[at:]])
    assert got == {"events": parse_sse(stream.decode()), "error": None}


def test_frames_after_done_are_not_read(stream):
    got = _read([stream + b'data: {"late": true}\n\n'])
    assert got == {"events": parse_sse(stream.decode()), "error": None}


def test_the_conversation_keeps_a_reply_as_far_as_it_went():
    system = {"role": "system", "content": "be brief"}
    user = {"role": "user", "content": "hi"}
    before = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    cases = [
        ([system, *before, user], "hello", "done"),
        ([*before, user], "hel", "stopped"),      # stopped mid-reply: kept as far as it went
        ([system, user], "", "stopped"),          # stopped before any text: as it was
        ([system, user], "hel", "error"),         # an error: as it was
        ([user], "", "done"),                     # an empty reply that ended is a turn
    ]
    got = _node(KEEP, cases)
    reply = lambda text: {"role": "assistant", "content": text}   # noqa: E731
    assert got == [[*before, user, reply("hello")], [*before, user, reply("hel")], None, None,
                   [user, reply("")]]
