"""Logprobs over real HTTP (#18.11): a ``pymtp serve`` process on the demo model, its
numbers compared exactly with the library's plain decoding of the same prompt in this
process (the demo model's Q8_0 kernels give a row the same bits in a verify batch as
alone on CPUs, docs/exactness.md; JSON carries a float's every bit)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from conftest import _load, bos_adding_copy, one_row_logits, require_exact_kernels, require_rows_within_patch
from pymtp.config import MAX_LOGPROBS
from pymtp.results import Chunk
from pymtp.logprobs import TokenLogprob, log_softmax, top_n
from pymtp.server.responses import Extras
from pymtp.chat import template_for

from .helpers import app_client, parse_sse

PROMPTS = ["def fibonacci(n):\n    ", "The quick brown fox"]
# the demo model (a code model) repeats this, then writes ChatML's end as text: 13 tokens of
# content, then the 6 of the template's stop string "<|im_end|>"
MSGS = [{"role": "user", "content": "x = [1, 2, 3]\nprint("}]


@pytest.fixture(scope="module")
def demo():
    """The library on the model and context size the demo server runs."""
    import pymtp

    require_exact_kernels()
    m = pymtp.load(threads=1, n_ctx=512)
    yield m
    m.close()


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, timeout=120)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _text(model, token: int) -> str:
    return model.token_bytes(token).decode("utf-8", errors="replace")


def _completion_entry(model, rec) -> tuple[str, float, dict[str, float]]:
    """What the completions shape shows for one library record: the token's text, its
    logprob, and the alternatives with the chosen token always among them."""
    top: dict[str, float] = {}
    for t, lp in rec.top + ((rec.token, rec.logprob),):
        top.setdefault(_text(model, t), lp)
    return _text(model, rec.token), rec.logprob, top


def _chat_entry(model, rec) -> dict:
    def one(t, lp):
        return {"token": _text(model, t), "logprob": lp, "bytes": list(model.token_bytes(t))}
    return {**one(rec.token, rec.logprob), "top_logprobs": [one(t, lp) for t, lp in rec.top]}


def _shown(model, records: list, text: str) -> list:
    """The records of the tokens whose text began before ``text`` ended: those a reply cut
    by a stop string shows logprobs for (the stop string's own tokens have none)."""
    out, at = [], 0
    for r in records:
        if at >= len(text.encode()):
            break
        out.append(r)
        at += len(model.token_bytes(r.token))
    return out


def _completion_logprobs(choice: dict) -> list[tuple[str, float, dict[str, float]]]:
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))


def _chat_ids(model, messages: list[dict]) -> list[int]:
    """The server's prompt for plain-text messages: the template's text, special tokens parsed."""
    return model.tokenize(template_for(model).render(messages), special=True)


# ------------------------------------------------------------------ values


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_logprobs_equal_plain_decoding(demo_server, demo, prompt):
    """The server decodes with MTP; every token's logprob and alternatives are those of
    the library decoding the prompt one token at a time."""
    # a fixed depth: auto (the default) may run it plainly, and the drafts are what is tested
    body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0, "logprobs": 5,
            "draft_max": 3}
    out = _ok(_post(demo_server, "/v1/completions", body))
    plain = demo.generate(prompt, max_tokens=24, ignore_eos=True, spec="none", logprobs=5)
    choice = out["choices"][0]
    assert choice["text"] == plain.text
    assert out["timings"]["draft_n_accepted"] > 0          # accepted drafts were scored too
    assert _completion_logprobs(choice) == [_completion_entry(demo, r) for r in plain.logprobs]
    # offsets count characters from the start of the prompt, echoed or not (OpenAI's)
    texts = choice["logprobs"]["tokens"]
    assert "".join(texts) == plain.text
    assert choice["logprobs"]["text_offset"] == [len(prompt) + len("".join(texts[:i])) for i in range(len(texts))]


def test_echo_prompt_logprobs_equal_a_plain_scoring(demo_server, demo):
    """``echo`` puts the prompt's tokens first, the first with null (nothing predicts it),
    each other scored on the row a one-token-at-a-time decode of the prompt gives."""
    require_rows_within_patch("the prompt's prefill")
    prompt = PROMPTS[0]
    body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "logprobs": 3, "echo": True}
    choice = _ok(_post(demo_server, "/v1/completions", body))["choices"][0]
    ids = demo.tokenize(prompt)
    plain = demo.generate(ids, max_tokens=6, ignore_eos=True, spec="none", logprobs=3, prompt_logprobs=3)
    assert choice["text"] == prompt + plain.text
    got = _completion_logprobs(choice)
    assert got[0] == (_text(demo, ids[0]), None, None)
    rows = one_row_logits(demo, ids)
    for i, (token, logprob, top) in enumerate(got[1:len(ids)], start=1):
        want = log_softmax(rows[i - 1])
        assert token == _text(demo, ids[i]) and logprob == want[ids[i]]
        assert top == {_text(demo, t): want[t] for t in [*top_n(rows[i - 1], 3), ids[i]]}
    assert got[len(ids):] == [_completion_entry(demo, r) for r in plain.logprobs]
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets[len(ids)] == len(prompt)



def test_chat_logprobs_equal_plain_decoding(demo_server, demo):
    # not ignore_eos: the fallback's end of turn is then written past, not a stop
    body = {"messages": MSGS, "max_tokens": 24, "logprobs": True, "top_logprobs": 4}
    out = _ok(_post(demo_server, "/v1/chat/completions", body))
    ids = _chat_ids(demo, MSGS)
    assert out["usage"]["prompt_tokens"] == len(ids)
    stop = list(template_for(demo).stop_strings)      # the demo model has no template: ChatML's end
    plain = demo.generate(ids, max_tokens=24, spec="none", stop=stop, logprobs=4)
    choice = out["choices"][0]
    assert choice["message"]["content"] == plain.text and choice["finish_reason"] == plain.finish_reason == "stop"
    shown = _shown(demo, plain.logprobs, plain.text)
    assert 0 < len(shown) < len(plain.logprobs)          # the stop string's tokens have none
    assert choice["logprobs"] == {"content": [_chat_entry(demo, r) for r in shown], "refusal": None}   # OpenAI's keys
    assert all(len(e["top_logprobs"]) == 4 for e in choice["logprobs"]["content"])


def test_chat_without_top_logprobs_has_no_alternatives(demo_server, demo):
    body = {"messages": MSGS, "max_tokens": 8, "ignore_eos": True, "logprobs": True}
    content = _ok(_post(demo_server, "/v1/chat/completions", body))["choices"][0]["logprobs"]["content"]
    plain = demo.generate(_chat_ids(demo, MSGS), max_tokens=8, ignore_eos=True, spec="none",
                          stop=list(template_for(demo).stop_strings), logprobs=0)
    assert content == [_chat_entry(demo, r) for r in plain.logprobs]
    assert all(e["top_logprobs"] == [] for e in content)


# ------------------------------------------------------------------ streaming


def _stream(server, route: str, body: dict) -> list[dict]:
    r = _post(server, route, {**body, "stream": True})
    assert r.status_code == 200, r.text
    return [c for c in parse_sse(r.text) if c["choices"]]


def test_completion_stream_chunks_carry_their_logprobs(demo_server):
    # one fixed depth for both requests: auto (the default) picks in each apart, and on a GPU
    # a row's logprobs differ with the decode's shape (docs/exactness.md)
    body = {"prompt": PROMPTS[1], "max_tokens": 20, "ignore_eos": True, "logprobs": 2, "echo": True,
            "draft_max": 3}
    whole = _ok(_post(demo_server, "/v1/completions", body))["choices"][0]
    chunks = _stream(demo_server, "/v1/completions", body)
    assert chunks[0]["choices"][0]["text"] == PROMPTS[1]                # the echo comes first
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"] is not None]
    assert len(parts) > 2                                              # not all in one event
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == whole["logprobs"][key], key
    for c in chunks:     # each event's tokens are the text it carries (all ASCII here)
        lp = c["choices"][0]["logprobs"]
        if lp is not None and c is not chunks[0]:
            assert "".join(lp["tokens"]) == c["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_chat_stream_chunks_carry_their_logprobs(demo_server):
    body = {"messages": MSGS, "max_tokens": 20, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
            "draft_max": 3}      # one fixed depth for both requests, as above
    whole = _ok(_post(demo_server, "/v1/chat/completions", body))["choices"][0]
    chunks = _stream(demo_server, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["logprobs"] is None                 # the role opening
    assert chunks[-1]["choices"][0]["logprobs"] is None                # the finish_reason closing
    parts = [c["choices"][0]["logprobs"]["content"] for c in chunks[1:-1]]
    assert len(parts) > 2 and all(parts)
    assert [e for p in parts for e in p] == whole["logprobs"]["content"]
    assert all(c["choices"][0]["logprobs"]["refusal"] is None for c in chunks[1:-1])


# ------------------------------------------------------------------ not asked, refused


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPTS[1]}),
    ("/v1/completions", {"prompt": PROMPTS[1], "logprobs": None, "echo": False}),
    ("/v1/chat/completions", {"messages": MSGS}),
    ("/v1/chat/completions", {"messages": MSGS, "logprobs": False, "top_logprobs": 0}),
])
def test_no_logprobs_unless_asked(demo_server, route, body):
    body = {**body, "max_tokens": 6}
    assert _ok(_post(demo_server, route, body))["choices"][0]["logprobs"] is None
    assert all(c["choices"][0]["logprobs"] is None for c in _stream(demo_server, route, body))


def test_completion_logprobs_zero_gives_the_chosen_token_only(demo_server, demo):
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "ignore_eos": True, "logprobs": 0}
    choice = _ok(_post(demo_server, "/v1/completions", body))["choices"][0]
    plain = demo.generate(PROMPTS[1], max_tokens=6, ignore_eos=True, spec="none", logprobs=0)
    assert _completion_logprobs(choice) == [_completion_entry(demo, r) for r in plain.logprobs]
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])


@pytest.mark.parametrize("route, extra, param, message", [
    ("/v1/completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs", "logprobs must be an integer from 0 to 20, got 21"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "logprobs must be an integer from 0 to 20, got -1"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "logprobs must be an integer, got a boolean"),
    ("/v1/completions", {"echo": "yes"}, "echo", "echo must be a boolean"),
    ("/v1/completions", {"top_logprobs": 3}, "top_logprobs", "is a chat field"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be an integer from 0 to 20, got 21"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "must be an integer"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs", "logprobs must be a boolean"),
    ("/v1/chat/completions", {"echo": True}, "echo", "is a completions field"),
])
def test_bad_logprobs_values_are_a_400_naming_the_field(demo_server, route, extra, param, message):
    base = {"prompt": "hi"} if route == "/v1/completions" else {"messages": MSGS}
    for stream in (False, True):
        r = _post(demo_server, route, {**base, "max_tokens": 2, "stream": stream, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err


# ------------------------------------------------------------------ the official client


def test_openai_client_parses_both_endpoints(demo_server, demo):
    client = demo_server.openai(timeout=120)
    c = client.completions.create(model="any", prompt=PROMPTS[1], max_tokens=6, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    ids = demo.tokenize(PROMPTS[1])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(ids) + 6 and lp.text_offset[0] == 0
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert all(lp.token_logprobs[i] == lp.top_logprobs[i][lp.tokens[i]] for i in range(1, len(lp.tokens)))

    chat = client.chat.completions.create(model="any", messages=MSGS, max_tokens=6, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    plain = demo.generate(_chat_ids(demo, MSGS), max_tokens=6, ignore_eos=True, spec="none",
                          stop=list(template_for(demo).stop_strings), logprobs=3)
    assert [(e.token, e.logprob, e.bytes) for e in content] == \
        [(_text(demo, r.token), r.logprob, list(demo.token_bytes(r.token))) for r in plain.logprobs]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in content] == \
        [[(_text(demo, t), lp) for t, lp in r.top] for r in plain.logprobs]

    stream = client.chat.completions.create(model="any", messages=MSGS, max_tokens=6, logprobs=True,
                                            top_logprobs=1, stream=True, extra_body={"ignore_eos": True})
    streamed = [e.logprob for ch in stream if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert streamed == [r.logprob for r in plain.logprobs]


def _stopped(client, route: str, body: dict, stream: bool) -> tuple[str, list[str]]:
    """The reply's text and its logprobs' token texts, whole or joined from the stream."""
    r = client.post(route, json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    chat = route.endswith("chat/completions")
    choices = [c for e in (parse_sse(r.text) if stream else [r.json()]) for c in e.get("choices", ())]
    text = "".join((c["delta" if stream else "message"].get("content") or "") if chat else c["text"] for c in choices)
    lps = [c["logprobs"] for c in choices if c.get("logprobs")]
    tokens = [e["token"] for lp in lps for e in lp["content"]] if chat else [t for lp in lps for t in lp["tokens"]]
    return text, tokens


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_end_with_the_text_a_stop_string_left(dense_model, route, stream):
    # A token whose text the stop string took whole has no logprob (llama-server's answers
    # have none for the stop word's tokens); one whose text began before the stop has.
    # They had every token's, and the tokens joined ran past the reply's text.
    chat = route.endswith("chat/completions")
    head = {"messages": MSGS} if chat else {"prompt": PROMPTS[0]}
    body = {**head, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            **({"logprobs": True, "top_logprobs": 0} if chat else {"logprobs": 0})}
    with app_client(dense_model) as client:
        text, tokens = _stopped(client, route, body, stream=False)
        assert "".join(tokens) == text and len(tokens) == 24
        starts = np.cumsum([0] + [len(t) for t in tokens])
        for j in range(2, 20):
            whole = text[starts[j]:starts[j + 2]]          # tokens j and j+1
            if len(tokens[j]) >= 2 and text.find(whole) == starts[j] and text.find(whole[1:]) == starts[j] + 1:
                break
        else:
            pytest.skip("no two tokens here to make a stop string of")
        for stop, kept in ((whole, j), (whole[1:], j + 1)):      # at a token's start; inside it
            got_text, got = _stopped(client, route, {**body, "stop": [stop]}, stream)
            assert got_text == text[:text.find(stop)]
            assert got == tokens[:kept]


def _records_shown(pieces: dict[int, bytes], chunks: list) -> list[list[int]]:
    extras = Extras("completion", lambda t, special: pieces[t], logprobs=True)
    out = []
    for c in chunks:
        got = extras.of(c)
        out.append(None if got is None else [t for t in got["tokens"]])
    return out


def test_held_logprobs_go_out_with_their_text_or_not_at_all():
    pieces = {1: b"\xff", 2: b"ab", 3: b"cd", 4: b"xy"}
    lp = lambda t: TokenLogprob(t, -1.0, ())          # noqa: E731
    # an invalid byte is one replacement character in the text and in the tokens' count:
    # "cd", which the stop string "bcd" took whole, has no logprob
    assert _records_shown(pieces, [Chunk("\ufffda", [1, 2], logprobs=[lp(1), lp(2)]),
                                   Chunk("", [3], "stop", logprobs=[lp(3)], stop_word="bcd")]) == \
        [["bytes:\\xff", "ab"], []]
    # text held back for a stop string that never came goes out with the last chunk, also
    # one without tokens (a full context ends a run with an empty step)
    assert _records_shown(pieces, [Chunk("ab", [2, 4], logprobs=[lp(2), lp(4)]),
                                   Chunk("xy", [], "length")]) == [["ab"], ["xy"]]


def test_a_cut_characters_replacement_is_not_the_next_tokens_text():
    """A lead byte the next token does not continue shows as U+FFFD only with that next
    token's text; the next token's offset counted it as its own and was one short
    ([0, 1, 1, 3] for "a\ufffdab"). A token that completes a character starts on it."""
    pieces = {1: b"\xe4", 2: b"a", 3: b"b", 4: b"\xe4\xb8", 5: b"\xad"}
    lp = lambda t: TokenLogprob(t, -1.0, ())          # noqa: E731
    cases = (([2, 1, 2, 3], "a\ufffdab", [0, 1, 2, 3]), ([2, 4, 5, 3], "a\u4e2db", [0, 1, 1, 2]),
             ([4, 2, 1, 1], "\ufffda\ufffd\ufffd", [0, 1, 2, 3]))
    for ids, text, offsets in cases:
        extras = Extras("completion", lambda t, special: pieces[t], logprobs=True)
        assert extras.of(Chunk(text, ids, "length", logprobs=[lp(t) for t in ids]))["text_offset"] == offsets
        echo = Extras("completion", lambda t, special: pieces[t], logprobs=True, echo=True, prompt_text=text,
                      prompt_ids=ids, prompt_logprobs=[None] * len(ids))
        assert echo.opening()[1]["text_offset"] == offsets


def test_legacy_logprobs_name_split_characters_by_their_bytes():
    """The legacy shape has no ``bytes`` field: tokens holding part of a character are
    named ``bytes:\\xNN`` as OpenAI names them, so that alternatives made of different
    bytes stay apart in ``top_logprobs`` and the chosen token's own entry is there."""
    pieces = {1: b"\xe2", 2: b"\xe2\x80", 3: b"\xf0\x9f", 4: "\u20ac".encode(), 5: b"\xe2\x82"}
    extras = Extras("completion", lambda t, special: pieces[t], logprobs=True)
    chosen = TokenLogprob(5, -2.5, ((1, -0.5), (2, -1.0), (3, -1.5), (4, -2.0)))
    got = extras.of(Chunk("\ufffd", [5], "length", logprobs=[chosen]))
    assert got["tokens"] == ["bytes:\\xe2\\x82"]
    assert got["top_logprobs"] == [{"bytes:\\xe2": -0.5, "bytes:\\xe2\\x80": -1.0, "bytes:\\xf0\\x9f": -1.5,
                                    "\u20ac": -2.0, "bytes:\\xe2\\x82": -2.5}]


def test_echoed_offsets_skip_the_bos_the_vocabulary_adds(tmp_path):
    """On a vocabulary that adds BOS, the echoed prompt's offsets counted the BOS's text,
    which the echoed text does not hold: every prompt token's offset pointed 13 characters
    past it, and the reply's went backwards. Each token now starts where its offset says."""
    from pathlib import Path

    import pymtp

    model = _load(bos_adding_copy(next((Path(pymtp.__file__).parent / "data").glob("*.gguf")), tmp_path))
    with app_client(model) as client:
        r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
                                                  "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert tokens[0] == model.bos_token and offsets[:2] == [0, 0] and offsets == sorted(offsets)
    assert all(text.startswith(tok, at) for tok, at in zip(tokens[1:], offsets[1:])), list(zip(tokens, offsets))
