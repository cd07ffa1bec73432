"""OpenAI's ``n``: several choices of one prompt in one response (it used to be a 400).

Each choice is a generation of its own on a slot of its own, so the batched engine decodes
them together; with a seed, choice i samples with seed + i (schemas.choices_of). Every
test compares a choice with the same request sent alone, token for token."""

from __future__ import annotations

import time

import pytest

from pymtp.server import ServerSettings
from server.helpers import app_client, parse_sse
from test_batch import require_batch_exact
from test_batch_server import _metric_samples

PROMPT = "The quick brown fox"
SAMPLED = {"max_tokens": 12, "ignore_eos": True, "temperature": 0.9, "top_k": 20}


def _alone(client, route: str, body: dict) -> dict:
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("spec", ["mtp", "none"])
def test_each_choice_is_the_request_alone_with_its_seed(client, spec):
    """Choice i of n=3 with seed 7 is the request with n=1 and seed 7 + i; the three
    differ; usage counts the prompt once and every choice's tokens; no timings (those
    are one generation's)."""
    require_batch_exact()
    body = {"prompt": PROMPT, "spec": spec, "seed": 7, **SAMPLED}
    out = _alone(client, "/v1/completions", {**body, "n": 3})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    alone = [_alone(client, "/v1/completions", {**body, "seed": 7 + i}) for i in range(3)]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert len({c["text"] for c in out["choices"]}) > 1
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    u = out["usage"]
    assert u["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == 3 * 12 == u["total_tokens"] - u["prompt_tokens"]
    assert "timings" not in out and "timings" in alone[0]


def test_greedy_choices_are_one_text(client):
    require_batch_exact()      # two greedy choices share a batch; alone, the request has none
    out = _alone(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True, "n": 2})
    texts = [c["text"] for c in out["choices"]]
    assert texts[0] == texts[1] == _alone(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10,
                                                                       "ignore_eos": True})["choices"][0]["text"]


def test_a_streamed_chat_interleaves_its_choices_by_index(client):
    """Streamed, each choice opens with the assistant's role, sends its deltas and its
    own finish under its index; the usage chunk comes once, last, with every choice's
    tokens. Each index's text is the whole answer's choice of that index."""
    require_batch_exact()
    body = {"messages": [{"role": "user", "content": "Say something"}], "seed": 3, "n": 2, **SAMPLED}
    whole = _alone(client, "/v1/chat/completions", body)
    r = client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    chunks = parse_sse(r.text)
    assert chunks[-1]["choices"] == [] and all(c["choices"] for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 24
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == "length"
        assert "".join(m["delta"].get("content") or "" for m in mine) == whole["choices"][i]["message"]["content"]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    assert all("timings" not in c for c in chunks)


def test_more_choices_than_slots_and_queue_is_a_503_that_keeps_nothing(dense_model):
    """n choices take n slots: past the slots and the queue the request is refused whole
    (503), and the choices it had started are ended, so the next request finds every slot
    free and runs whole. (Its texts against requests alone: the first test.)"""
    with app_client(dense_model, ServerSettings(parallel=2, queue=0, retry_after=1)) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "n": 3, "max_tokens": 400, "ignore_eos": True})
        assert r.status_code == 503, r.text
        deadline = time.monotonic() + 20      # ended choices free their slots at the next round
        while _metric_samples(c)["pymtp_slots_busy"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        m = _metric_samples(c)
        assert m["pymtp_generations_total{finish_reason=cancelled}"] == 2     # the two that had slots
        assert m["pymtp_generated_tokens_total"] < 2 * 400
        body = {"prompt": PROMPT, "n": 2, "seed": 1, **SAMPLED}
        two = _alone(c, "/v1/completions", body)
        assert [ch["finish_reason"] for ch in two["choices"]] == ["length", "length"]
        assert two["usage"]["completion_tokens"] == 2 * 12


def test_the_openai_client_reads_the_choices(dense_server):
    client = dense_server.openai()
    out = client.completions.create(model="pymtp-fixture-dense", prompt=PROMPT, n=2, seed=11, max_tokens=8,
                                    temperature=0.9, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 16
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
