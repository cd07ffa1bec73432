"""OpenAI's logit_bias over HTTP (it used to be refused with a 400): applied as the library
applies it, in OpenAI's object form and llama-server's list of pairs, on both endpoints."""

from __future__ import annotations

import math

import httpx
import pytest

PROMPT = "The quick brown fox"


def _plain(dense_model, **kw) -> list[int]:
    return dense_model.generate(PROMPT, max_tokens=16, ignore_eos=True, **kw).tokens


@pytest.mark.parametrize("spec", ["mtp", "none"])
def test_a_bias_reaches_the_engine(client, dense_model, spec):
    first = _plain(dense_model, spec="none")
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "spec": spec}
    r = client.post("/v1/completions", json={**body, "logit_bias": {str(first[0]): -100, str(first[2]): 5}})
    assert r.status_code == 200, r.text
    want = dense_model.generate(PROMPT, max_tokens=16, ignore_eos=True, spec=spec,
                                logit_bias={first[0]: -100.0, first[2]: 5.0})
    assert r.json()["choices"][0]["text"] == want.text
    assert want.tokens[0] != first[0]      # the bias changed the text
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] != want.text


def test_llama_servers_pairs_and_false_ban_a_token(client, dense_model):
    first = _plain(dense_model, spec="none")
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True}
    pairs = client.post("/v1/completions", json={**body, "logit_bias": [[first[0], False], [first[1], 1.5],
                                                                         [first[1], 1.5]]})
    assert pairs.status_code == 200, pairs.text
    # pairs naming a token twice add up, as llama.cpp applies each
    want = dense_model.generate(PROMPT, max_tokens=16, ignore_eos=True, logit_bias={first[0]: -math.inf,
                                                                                    first[1]: 3.0})
    assert pairs.json()["choices"][0]["text"] == want.text
    assert first[0] not in want.tokens


def test_chat_takes_a_bias_too(client, dense_model):
    msgs = [{"role": "user", "content": "hello"}]
    body = {"messages": msgs, "max_tokens": 8, "ignore_eos": True}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    top = dense_model.tokenize(plain)[0]
    r = client.post("/v1/chat/completions", json={**body, "logit_bias": {str(top): -100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] != plain


@pytest.mark.parametrize("value, message", [
    ({"hello": 5}, "logit_bias keys must be token ids (such as \"1234\"), got 'hello'"),
    ({"-3": 5}, "logit_bias keys must be token ids"),
    ({"5": 150}, "logit_bias for token 5 must be in [-100, 100] (or -inf to ban it), got 150.0"),
    ({"5": "a lot"}, "logit_bias for token 5 must be a number (or false to ban it), got a string"),
    ({"99999999": 1}, "logit_bias names token 99999999, but this model's vocabulary has"),
    ([[5]], "logit_bias must be an object of token ids to biases"),
    # a pair's string is text to llama-server: "0" the digit, not token 0
    ([["0", -100]], "in a [token, bias] pair llama-server reads a string as text"),
    ([[5, 1], ["hello", -1]], "got the string 'hello'"),
    ("5:1", "logit_bias must be an object of token ids to biases"),
])
def test_a_bad_bias_is_a_400_naming_the_field(client, value, message):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logit_bias": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and message in err["message"]


def test_an_empty_bias_is_no_bias(client):
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    a = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert client.post("/v1/completions", json={**body, "logit_bias": {}}).json()["choices"][0]["text"] == a


def test_a_bias_refused_for_the_vocabulary_leaves_the_slots_free(dense_server):
    # The ids are checked before the request is queued: refused in the batched engine's
    # stepping thread, a streamed one left its slot busy and the next request waited forever.
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=dense_server.base_url, timeout=60) as http:
        for stream in (True, False, True):
            r = http.post("/v1/completions", json={**body, "stream": stream, "logit_bias": {"99999999": 1}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        for _ in range(3):      # more than the two slots
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
