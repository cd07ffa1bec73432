"""llama-server's /completion (pymtp/server/llama_completion.py): its fields and its
answer's shape in process on the dense fixture, against the library's own generation;
and -- where $PYMTP_LLAMA_SERVER names a llama-server binary -- the same bodies sent to
the real one, answered alike."""

from __future__ import annotations

import os
from itertools import accumulate

import httpx
import pytest

from conftest import row_tolerance
from pymtp.llama_server import LlamaServer, server_command
from pymtp.server import ServerSettings

from .helpers import app_client, parse_sse

LLAMA_SERVER = os.environ.get("PYMTP_LLAMA_SERVER")
PROMPT = "the quick brown fox"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def llama(dense_model):
    with app_client(dense_model, ServerSettings(parallel=4)) as client:
        yield client


def _post(client, body: dict, status: int = 200):
    r = client.post("/completion", json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_the_answer_is_the_librarys_generation(llama, dense_model):
    solo = dense_model.generate(PROMPT, max_tokens=12, temperature=0, logprobs=3, spec="none")
    got = _post(llama, {"prompt": PROMPT, "n_predict": 12, "return_tokens": True, "n_probs": 3, **GREEDY})
    assert got["content"] == solo.text and got["tokens"] == solo.tokens
    assert got["stop"] is True and got["stop_type"] == "limit" and got["stopping_word"] == ""
    assert got["truncated"] is False and got["index"] == 0
    assert got["tokens_predicted"] == 12 and got["tokens_evaluated"] == len(dense_model.tokenize(PROMPT))
    assert got["tokens_cached"] == got["tokens_evaluated"] + 11     # the slot holds all but the last token
    assert got["prompt"] == PROMPT and got["has_new_line"] == ("\n" in solo.text)
    assert got["generation_settings"]["n_predict"] == 12 and got["generation_settings"]["n_probs"] == 3
    assert got["timings"]["predicted_n"] == 12
    probs = got["completion_probabilities"]
    assert [p["id"] for p in probs] == solo.tokens
    for p, lp in zip(probs, solo.logprobs):
        assert p["logprob"] == lp.logprob and [t["id"] for t in p["top_logprobs"]] == [t for t, _ in lp.top]
        assert bytes(p["bytes"]) == dense_model.token_bytes(p["id"], special=True)
    # the route's other name; without return_tokens, no tokens
    r = llama.post("/completions", json={"prompt": PROMPT, "n_predict": 12, **GREEDY})
    assert r.status_code == 200 and r.json()["content"] == solo.text and r.json()["tokens"] == []
    # llama-server's route takes stream_options on an unstreamed reply (the /v1 routes refuse it)
    r = llama.post("/completion", json={"prompt": PROMPT, "n_predict": 12, "stream_options": {"include_usage": True},
                                        **GREEDY})
    assert r.status_code == 200 and r.json()["content"] == solo.text


def test_n_probs_lists_as_many_as_asked_not_openais_20(llama, dense_model):
    """llama-server's n_probs has no cap of 20 (the /v1 routes' OpenAI limit): 50 lists 50
    alternatives, the first 20 those of 20, and the vocabulary's all for more than it
    has; 0 or less lists none."""
    def probs(n):
        return _post(llama, {"prompt": PROMPT, "n_predict": 3, "n_probs": n, **GREEDY}).get("completion_probabilities")

    fifty, twenty = probs(50), probs(20)
    assert [len(p["top_logprobs"]) for p in fifty] == [50] * 3
    assert [p["top_logprobs"][:20] for p in fifty] == [p["top_logprobs"] for p in twenty]
    assert [len(p["top_logprobs"]) for p in probs(dense_model.n_vocab + 5)] == [dense_model.n_vocab] * 3
    assert probs(-1) is None and probs(0) is None      # no probabilities at all, as llama-server


def test_a_stream_sends_each_chunk_then_the_end_without_done(llama):
    whole = _post(llama, {"prompt": PROMPT, "n_predict": 20, "return_tokens": True, **GREEDY})
    r = llama.post("/completion", json={"prompt": PROMPT, "n_predict": 20, "stream": True, "n_probs": 1, **GREEDY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    objs = parse_sse(r.text, done=False)
    parts, last = objs[:-1], objs[-1]
    assert all(p["stop"] is False for p in parts) and last["stop"] is True
    assert "".join(p["content"] for p in parts) == whole["content"]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    assert [p["tokens_predicted"] for p in parts] == list(accumulate(len(p["tokens"]) for p in parts))
    assert [e["id"] for p in parts for e in p["completion_probabilities"]] == whole["tokens"]
    # one object a token, as llama-server's, though a verify round accepts several
    assert [len(p["tokens"]) for p in parts] == [1] * 20
    assert [[e["id"] for e in p["completion_probabilities"]] for p in parts] == [p["tokens"] for p in parts]
    assert last["content"] == "" and last["tokens"] == [] and last["tokens_predicted"] == 20
    assert last["stop_type"] == "limit" and last["has_new_line"] == whole["has_new_line"]


def test_a_stop_word_and_the_end_of_generation_are_told_apart(llama):
    whole = _post(llama, {"prompt": PROMPT, "n_predict": 24, **GREEDY})
    word = whole["content"][8:11]
    got = _post(llama, {"prompt": PROMPT, "n_predict": 24, "stop": ["\x00never", word], **GREEDY})
    assert (got["stop_type"], got["stopping_word"]) == ("word", word)
    assert got["content"] == whole["content"][: whole["content"].index(word)]
    # the probabilities leave out as many tokens as the stop word has, as llama-server's
    probs = _post(llama, {"prompt": PROMPT, "n_predict": 24, "stop": [word], "n_probs": 1, **GREEDY})
    n_word = len(llama.app.state.service.model.tokenize(word, add_special=False))
    assert len(probs["completion_probabilities"]) == probs["tokens_predicted"] - n_word
    # a stop word at the very start leaves no token: llama-server leaves the field out
    first = _post(llama, {"prompt": PROMPT, "n_predict": 24, "stop": [whole["content"][:1]], "n_probs": 1, **GREEDY})
    assert (first["content"], first["stop_type"]) == ("", "word")
    assert "completion_probabilities" not in first
    got = _post(llama, {"prompt": PROMPT, "n_predict": 24, "grammar": 'root ::= " yes"', **GREEDY})
    assert (got["content"], got["stop_type"], got["stopping_word"]) == (" yes", "eos", "")
    # the slot holds every token here: the last one sampled was the end token
    assert got["tokens_cached"] == got["tokens_evaluated"] + got["tokens_predicted"]
    got = _post(llama, {"prompt": PROMPT, "n_predict": 24, "json_schema": {"const": 7}, **GREEDY})
    assert (got["content"], got["stop_type"]) == ("7", "eos")


def test_several_prompts_answer_a_list_in_order(llama, dense_model):
    mixed = ["the quick", 300, " fox"]
    ids = dense_model.tokenize("the quick") + [300] + dense_model.tokenize(" fox", add_special=False)
    body = {"prompt": [PROMPT, [5, 6, 7], mixed, {"prompt_string": "brown"}], "n_predict": 6, **GREEDY}
    got = _post(llama, body)
    assert [g["index"] for g in got] == [0, 1, 2, 3]
    for g, p in zip(got, [PROMPT, [5, 6, 7], ids, "brown"]):
        assert g["content"] == dense_model.generate(p, max_tokens=6, temperature=0).text
    assert got[2]["tokens_evaluated"] == len(ids)
    # n_cmpl choices each, prompt i's choice j at i * n + j, each choice its own seed
    got = _post(llama, {"prompt": [PROMPT, "brown"], "n_predict": 6, "n_cmpl": 2, "temperature": 1.5, "seed": 3})
    assert [g["index"] for g in got] == [0, 1, 2, 3]
    assert [g["generation_settings"]["seed"] for g in got] == [3, 4, 3, 4]


def test_n_predict_zero_is_one_token_and_minus_one_no_limit(llama):
    got = _post(llama, {"prompt": PROMPT, "n_predict": 0, **GREEDY})
    assert got["tokens_predicted"] == 1 and got["stop_type"] == "limit"
    got = _post(llama, {"prompt": PROMPT, "n_predict": -1, "ignore_eos": True, **GREEDY})
    # the context filled up: all its 1024 positions, and the last token needs none
    assert got["tokens_predicted"] == 1024 + 1 - got["tokens_evaluated"]
    assert got["stop_type"] == "limit" and got["truncated"] is True
    assert got["generation_settings"]["n_predict"] == -1


def test_a_banned_token_is_reported_as_json_can_say_it(llama):
    body = {"prompt": PROMPT, "n_predict": 3, "logit_bias": [[5, False], [6, 2]], **GREEDY}
    got = _post(llama, body)
    assert got["generation_settings"]["logit_bias"] == [{"bias": None, "token": 5}, {"bias": 2.0, "token": 6}]
    r = llama.post("/completion", json={**body, "stream": True})
    assert r.status_code == 200 and "Infinity" not in r.text and "NaN" not in r.text


def test_response_fields_pick_paths(llama):
    got = _post(llama, {"prompt": PROMPT, "n_predict": 3, **GREEDY,
                        "response_fields": ["content", "generation_settings/n_predict", "nope", "timings/nope"]})
    assert set(got) == {"content", "generation_settings/n_predict"} and got["generation_settings/n_predict"] == 3


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "n_indent": "4"}, "n_indent"),
    ({"prompt": PROMPT, "t_max_predict_ms": 1.5}, "t_max_predict_ms"),
    ({"prompt": PROMPT, "lora": [{"id": 0, "scale": 1}]}, "lora"),
    ({"prompt": PROMPT, "n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs"),
    ({"prompt": PROMPT, "n_predict": -2}, "n_predict"),
    ({"prompt": PROMPT, "max_tokens": -5}, "max_tokens"),
    ({"prompt": PROMPT, "n_probs": 2**31}, "n_probs"),
    ({"prompt": PROMPT, "logprobs": "x"}, "logprobs"),
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": [{"prompt_string": "a", "multimodal_data": ["AAAA"]}]}, "prompt[0].multimodal_data"),
    ({"prompt": PROMPT, "stop": [3]}, "stop"),
    ({"prompt": PROMPT, "grammar": "root ::= \"a\"", "json_schema": {}}, "json_schema"),
    ({"prompt": PROMPT, "json_schema": {"type": "string", "pattern": "^(a$"}}, "json_schema"),   # not convertible
    ({"prompt": PROMPT, "json_schema": {"type": "foo"}}, "json_schema"),
    ({"prompt": PROMPT, "response_fields": "content"}, "response_fields"),
    ({"prompt": [PROMPT, [1, 10 ** 6]]}, "prompt"),              # an id outside the vocabulary
    ({"prompt": ["fox " * 3000, 5]}, "prompt"),                  # a string part past the context
    ({"prompt": PROMPT, "stop": ["a"] * 65}, "stop"),            # each is matched at every token
    ({"prompt": PROMPT, "stop": ["a" * 257]}, "stop"),
])
def test_bad_bodies_are_400s_naming_the_field(llama, body, param):
    err = _post(llama, body, 400)["error"]
    assert err["param"] == param, err


def test_the_route_takes_the_api_key(dense_model):
    with app_client(dense_model, ServerSettings(api_keys=("k",))) as client:
        assert client.post("/completion", json={"prompt": PROMPT}).status_code == 401
        r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2


@pytest.mark.skipif(not LLAMA_SERVER, reason="set PYMTP_LLAMA_SERVER to a llama-server binary")
def test_the_real_llama_server_answers_the_same_bodies_alike(llama, dense_path, tmp_path):
    # four slots, as the in-process server has, for n_cmpl (llama-server bounds it by them)
    server = LlamaServer(lambda port: server_command(LLAMA_SERVER, str(dense_path), port=port, threads=1,
                                                     n_ctx=1024, n_batch=512, extra_args=["-np", "4", "-c", "4096"]),
                         tmp_path / "llama-server.log")
    same = ("content", "stop_type", "stopping_word", "tokens_evaluated", "prompt", "has_new_line", "truncated",
            "index", "stop", "tokens_cached")
    bodies = [
        {"prompt": PROMPT, "n_predict": 16, "return_tokens": True, "n_probs": 2},
        {"prompt": PROMPT, "n_predict": 0},
        {"prompt": [PROMPT, [5, 6, 7], ["the quick", 300, " fox"]], "n_predict": 8},
        {"prompt": PROMPT, "n_predict": 24, "stop": ["\n", " the"]},
        {"prompt": PROMPT, "max_tokens": 5, "response_fields": ["content", "generation_settings/n_predict", "x/y"]},
        {"prompt": PROMPT, "n_predict": -2},
        {"prompt": PROMPT, "n_predict": 10, "return_tokens": True, "grammar": 'root ::= " yes"'},     # EOS
        {"prompt": PROMPT, "n_predict": 24, "stop": [" the", "\n"], "n_probs": 2, "return_tokens": True},
        {"prompt": [PROMPT, "brown"], "n_predict": 5, "n_cmpl": 2, "return_tokens": True},
        {"prompt": PROMPT, "n_predict": 3, "logit_bias": [[5, False]]},
        {"prompt": PROMPT, "n_predict": 3, "logit_bias": [[5, -2]], "ignore_eos": True},     # its ban listed too
        {"prompt": PROMPT, "n_predict": 6, "logit_bias": [[" the lazy", -5], ["fox", False], [7, 1]]},  # text
        {"prompt": PROMPT, "n_predict": 6, "logit_bias": {" jumps": -3, "12": 2}},
    ]
    server.start()
    try:
        for body in bodies:
            body = {**body, **GREEDY}
            theirs = httpx.post(server.url + "/completion", json=body, timeout=60)
            ours = llama.post("/completion", json=body)
            assert ours.status_code == theirs.status_code, (body, theirs.text)
            if ours.status_code != 200:
                continue
            t, o = theirs.json(), ours.json()
            if "response_fields" in body:
                assert o == t, body
                continue
            for a, b in zip(o if isinstance(o, list) else [o], t if isinstance(t, list) else [t], strict=True):
                assert {k: a[k] for k in same} == {k: b[k] for k in same}, body
                eos = a["stop_type"] == "eos"       # llama-server lists and counts the end token
                assert a["tokens"] == b["tokens"][:len(b["tokens"]) - eos], body
                assert a["tokens_predicted"] == b["tokens_predicted"] - eos, body
                assert a["generation_settings"]["logit_bias"] == b["generation_settings"]["logit_bias"], body
                for pa, pb in zip(a.get("completion_probabilities", []), b.get("completion_probabilities", []),
                                  strict=True):
                    assert [pa["id"], pa["token"], pa["bytes"]] == [pb["id"], pb["token"], pb["bytes"]]
                    # a verify batch's row against llama-server's: conftest's bound for the build
                    assert pa["logprob"] == pytest.approx(pb["logprob"], abs=row_tolerance(4))
                    assert [x["id"] for x in pa["top_logprobs"]] == [x["id"] for x in pb["top_logprobs"]]
        # (where a stop string's start is held back, llama-server's objects release it a
        # token later or sooner than here: the text and tokens in all agree, not each object)
        for extra in ({}, {"n_probs": 1}):
            body = {"prompt": PROMPT, "n_predict": 24, "stream": True, **extra, **GREEDY}
            theirs = parse_sse(httpx.post(server.url + "/completion", json=body, timeout=60).text, done=False)
            ours = parse_sse(llama.post("/completion", json=body).text, done=False)
            # one object a token on both, though a verify round accepts several here
            assert [(o["content"], o["tokens"], o["tokens_predicted"]) for o in ours[:-1]] == \
                [(o["content"], o["tokens"], o["tokens_predicted"]) for o in theirs[:-1]], extra
            assert [[p["id"] for p in o.get("completion_probabilities", [])] for o in ours[:-1]] == \
                [[p["id"] for p in o.get("completion_probabilities", [])] for o in theirs[:-1]], extra
            assert not any(o["stop"] for o in ours[:-1] + theirs[:-1])
            assert {k: ours[-1][k] for k in same} == {k: theirs[-1][k] for k in same}
    finally:
        server.stop()


def test_top_p_zero_is_reported_as_sent(llama):
    """top_p 0 runs as the likeliest token alone (top_k 1 in the library's terms), and
    ``generation_settings`` reports what the request sent, as llama-server does: it said
    top_p 1.0 and top_k 1 (the values pymtp ran)."""
    got = _post(llama, {"prompt": PROMPT, "n_predict": 6, "temperature": 1.5, "top_p": 0, "top_k": 40, "seed": 3})
    settings = got["generation_settings"]
    assert (settings["top_p"], settings["top_k"]) == (0, 40)
    assert got["content"] == _post(llama, {"prompt": PROMPT, "n_predict": 6, **GREEDY})["content"]


def test_a_control_tokens_piece_is_empty_as_llama_servers(demo_server):
    """completion_probabilities render pieces as llama-server does, without special tokens'
    text: the end token, likely after this prompt on the demo model, is "" with no bytes
    (its "<|endoftext|>" joined into a client's text was text the reply never held)."""
    with httpx.Client(base_url=demo_server.base_url, timeout=60) as http:
        (end,) = http.post("/tokenize", json={"content": "<|endoftext|>", "parse_special": True}).json()["tokens"]
        r = http.post("/completion", json={"prompt": "if __name__ == '__main__':\n    main()\n", "n_predict": 1,
                                           "n_probs": 2, "ignore_eos": True, **GREEDY}).json()
    tops = {t["id"]: t for t in r["completion_probabilities"][0]["top_logprobs"]}
    assert end in tops and (tops[end]["token"], tops[end]["bytes"]) == ("", [])
    assert all(t["bytes"] and t["token"] == bytes(t["bytes"]).decode() for i, t in tops.items() if i != end)


@pytest.mark.parametrize("pieces, text, held, shares", [
    (["a", "b", "c"], "abc", 0, ["a", "b", "c"]),
    (["a", "", "\u00e9", "b"], "a\u00e9b", 0, ["a", "", "\u00e9", "b"]),     # a token ending inside a character
    (["a", "b"], "a", 0, ["a", ""]),              # "b" may start a stop string: held back
    (["c", "d"], "bcd", 1, ["bc", "d"]),          # ... and released with the next token
    (["x", "\n", "y"], "x", 0, ["x", "", ""]),    # cut before a stop string "\ny"
    (["a"], "a\ufffd", 0, ["a\ufffd"]),           # more than the pieces: the last token's
])
def test_each_token_streams_the_text_it_released(pieces, text, held, shares):
    from pymtp.server.llama_completion import token_texts

    assert token_texts(pieces, text, held) == shares


def test_a_stream_with_a_stop_string_still_sends_one_object_a_token(llama):
    """Where a stop string's start is held back the round's tokens went in one object;
    now each token has its own, the held text coming with the token that releases it."""
    whole = _post(llama, {"prompt": PROMPT, "n_predict": 24, **GREEDY})["content"]
    stop = whole[9:14]
    want = _post(llama, {"prompt": PROMPT, "n_predict": 24, "stop": [stop], "return_tokens": True, **GREEDY})
    r = llama.post("/completion", json={"prompt": PROMPT, "n_predict": 24, "stop": [stop], "stream": True,
                                        "n_probs": 1, **GREEDY})
    parts = parse_sse(r.text, done=False)[:-1]
    assert "".join(p["content"] for p in parts) == want["content"]
    assert [len(p["tokens"]) for p in parts] == [1] * len(parts)
    assert [[e["id"] for e in p["completion_probabilities"]] for p in parts] == [p["tokens"] for p in parts]
    assert any(p["content"] == "" for p in parts)        # a token whose text was held back
