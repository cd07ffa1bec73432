"""OpenAI's presence/frequency penalties and llama-server's repeat_penalty over HTTP: applied
as the library applies them (they used to be refused with a 400)."""

from __future__ import annotations

import pytest

PROMPT = "The quick brown fox"
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repeat_penalty": 1.5, "repeat_last_n": 16}


@pytest.mark.parametrize("spec", ["mtp", "none"])
def test_penalties_reach_the_engine(client, dense_model, spec):
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "spec": spec}
    r = client.post("/v1/completions", json={**body, **PENALTIES})
    assert r.status_code == 200, r.text
    want = dense_model.generate(PROMPT, max_tokens=24, ignore_eos=True, spec=spec, **PENALTIES)
    assert r.json()["choices"][0]["text"] == want.text
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert plain != want.text          # the penalties changed the text


def test_chat_takes_penalties_too(client):
    msgs = [{"role": "user", "content": "hello"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "presence_penalty": -1.0,
                                                  "frequency_penalty": 0.5})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, value, message", [
    ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2]"),
    ("repeat_penalty", 0, "repeat_penalty must be finite and > 0"),
    ("repeat_last_n", -5, "repeat_last_n must be an integer >= -1"),
    ("presence_penalty", "a lot", "presence_penalty must be a number"),
])
def test_bad_penalties_are_a_400_naming_the_field(client, field, value, message):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and message in err["message"]
