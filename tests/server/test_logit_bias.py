"""OpenAI's logit_bias over HTTP (it used to be refused with a 400): applied as the library
applies it, in OpenAI's object form and llama-server's list of pairs, on both endpoints."""

from __future__ import annotations

import math

import httpx
import pytest

from pymtp.server.body_fields import logit_bias_of

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


def test_a_negative_integer_past_a_double_bans_as_false(client, dense_model):
    """-10**400 reads as JSON's -1e400 does, -inf: llama-server's ban (it was a 500)."""
    first = _plain(dense_model, spec="none")
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    huge = client.post("/v1/completions", json={**body, "logit_bias": {str(first[0]): -10**400}})
    ban = client.post("/v1/completions", json={**body, "logit_bias": {str(first[0]): False}})
    assert huge.status_code == 200, huge.text
    assert huge.json()["choices"][0]["text"] == ban.json()["choices"][0]["text"]
    assert dense_model.tokenize(huge.json()["choices"][0]["text"])[0] != first[0]


def test_chat_takes_a_bias_too(client, dense_model):
    msgs = [{"role": "user", "content": "hello"}]
    body = {"messages": msgs, "max_tokens": 8, "ignore_eos": True}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    top = dense_model.tokenize(plain)[0]
    r = client.post("/v1/chat/completions", json={**body, "logit_bias": {str(top): -100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] != plain


@pytest.mark.parametrize("value, message", [
    ({"-3": 5}, "logit_bias keys must be token ids"),
    ({"5": 150}, "logit_bias for token 5 must be in [-100, 100] (or false to ban it), got 150.0"),
    ([[5, 60], [5, -150]], "logit_bias for token 5 must be in [-100, 100] (or false to ban it), got -150.0"),
    ({"hello": 101}, "logit_bias for token 'hello' must be in [-100, 100] (or false to ban it), got 101.0"),
    # past a double (a 500 from float() before)
    ({"5": 10**400}, "logit_bias for token 5 must be in [-100, 100] (or false to ban it), got an integer of 401"),
    ([[5, 10**400]], "logit_bias for token 5 must be in [-100, 100] (or false to ban it), got an integer of 401"),
    ({"5": "a lot"}, "logit_bias for token 5 must be a number (or false to ban it), got a string"),
    ({"99999999": 1}, "logit_bias names token 99999999, but this model's vocabulary has"),
    ([[5]], "logit_bias must be an object of token ids to biases"),
    ([[None, 1]], "logit_bias pairs take a token id or a text, got null"),
    ({"hello": "a lot"}, "logit_bias for token 'hello' must be a number"),
    ("5:1", "logit_bias must be an object of token ids to biases"),
])
def test_a_bad_bias_is_a_400_naming_the_field(client, value, message):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logit_bias": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and message in err["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/completion"])
def test_a_text_biases_each_of_its_tokens_as_llama_server(client, route):
    """llama-server reads a pair's string, or an object's key that is no id, as text and
    biases each of its tokens (it was a 400 here): the same answer as the ids' biases,
    "0" in a pair being the digit's token, not id 0."""
    tok = lambda text: client.post("/tokenize", json={"content": text}).json()["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 8, "n_predict": 8, "ignore_eos": True, "temperature": 0}
    plain = client.post(route, json=body).json()
    text = plain["choices"][0]["text"] if route != "/completion" else plain["content"]
    word = text.split()[0]
    words = tok(word) + tok(" " + word)
    for bias, ids in (([[word, -100], [" " + word, -100], ["0", -100]], words + tok("0")),
                      ({word: -100, " " + word: -100, "0": -100}, words + [0])):     # an object's "0" is id 0
        got = client.post(route, json={**body, "logit_bias": bias}).json()
        want = client.post(route, json={**body, "logit_bias": {str(t): -100 for t in ids}}).json()
        if route == "/completion":
            assert got["content"] == want["content"] != plain["content"]
            assert got["generation_settings"]["logit_bias"] == want["generation_settings"]["logit_bias"]
        else:
            assert got["choices"][0]["text"] == want["choices"][0]["text"] != text


def test_an_objects_key_is_an_id_where_strtol_reads_it_whole_as_llama_servers():
    got = logit_bias_of({"logit_bias": {" 377": -1, "+12": -2, "\t-5": -3, "": -4, "9 ": -5, "+": -6, " ": -7,
                                        "0x10": -8}})
    assert got == {377: -1.0, 12: -2.0, -5: -3.0, 0: -4.0, "9 ": -5.0, "+": -6.0, " ": -7.0, "0x10": -8.0}
    # a pair's string stays text, as before
    assert logit_bias_of({"logit_bias": [[" 377", -1]]}) == {" 377": -1.0}


def test_a_tokens_biases_add_up_within_the_range_each_is_checked_against(client):
    """llama.cpp applies each entry, so a token named twice, or a text holding it twice,
    gets both: the sum is held within [-100, 100] (it was refused, quoting a sum the
    client never sent)."""
    tok = lambda text: client.post("/tokenize", json={"content": text}).json()["tokens"]  # noqa: E731
    body = {"prompt": PROMPT, "n_predict": 8, "ignore_eos": True, "temperature": 0}
    twice = next(w for w in ("aaaa", "abab", "  ", "xxxx") if len(set(tok(w))) < len(tok(w)))
    cases = [([[5, -60], [5, -60]], {"5": -100}), ([[5, 30], [5, 40]], {"5": 70}),
             ([[twice, -100]], {str(t): -100 for t in tok(twice)}), ([[5, False], [5, 50]], [[5, False]])]
    for bias, same in cases:
        got = client.post("/completion", json={**body, "logit_bias": bias})
        assert got.status_code == 200, (bias, got.text)
        want = client.post("/completion", json={**body, "logit_bias": same}).json()
        assert got.json()["generation_settings"]["logit_bias"] == want["generation_settings"]["logit_bias"], bias


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
