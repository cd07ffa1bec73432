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
    """Choice i of n=2 (the client's slots) with seed 7 is the request with n=1 and seed
    7 + i; the two differ; usage counts the prompt once and every choice's tokens; no
    timings (those are one generation's)."""
    require_batch_exact()
    body = {"prompt": PROMPT, "spec": spec, "seed": 7, **SAMPLED}
    out = _alone(client, "/v1/completions", {**body, "n": 2})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    alone = [_alone(client, "/v1/completions", {**body, "seed": 7 + i}) for i in range(2)]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert out["choices"][0]["text"] != out["choices"][1]["text"]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    u = out["usage"]
    assert u["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == 2 * 12 == u["total_tokens"] - u["prompt_tokens"]
    assert "timings" not in out and "timings" in alone[0]


def test_llama_servers_n_cmpl_is_n(client):
    """llama-server names ``n`` ``n_cmpl`` too; it was ignored (one choice, silently)."""
    require_batch_exact()
    body = {"prompt": PROMPT, "seed": 7, **SAMPLED}
    out = _alone(client, "/v1/completions", {**body, "n_cmpl": 2})
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in _alone(client, "/v1/completions",
                                                                            {**body, "n": 2})["choices"]]
    assert len(_alone(client, "/v1/completions", {**body, "n": 2, "n_cmpl": 2})["choices"]) == 2
    r = client.post("/v1/completions", json={**body, "n": 1, "n_cmpl": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_cmpl", r.text
    assert len(_alone(client, "/v1/completions", {**body, "n_cmpl": 3})["choices"]) == 3


def test_a_batch_of_prompts_gives_each_prompts_choices_in_order(client):
    """OpenAI's batch of prompts (a list of strings or of token lists; it was a 400):
    prompt i's choice j is choices[i * n + j], each the request alone with that prompt
    and seed + j; usage counts each prompt once; streamed, each index carries its text."""
    require_batch_exact()
    prompts = [PROMPT, [5, 6, 7, 8]]
    body = {"prompt": prompts, "seed": 7, **SAMPLED}
    out = _alone(client, "/v1/completions", body)
    alone = [_alone(client, "/v1/completions", {**body, "prompt": p}) for p in prompts]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert out["usage"]["completion_tokens"] == 24
    pairs = _alone(client, "/v1/completions", {**body, "prompt": [PROMPT], "n": 2})
    assert [c["text"] for c in pairs["choices"]] == \
        [c["text"] for c in _alone(client, "/v1/completions", {**body, "prompt": PROMPT, "n": 2})["choices"]]
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = parse_sse(r.text)
    for i, a in enumerate(alone):
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i) \
            == a["choices"][0]["text"]
    # the prompt cache holds the prompts by now: all but how many
    assert {**chunks[-1]["usage"], "prompt_tokens_details": None} == {**out["usage"], "prompt_tokens_details": None}
    # 4 generations > 2 slots: a whole answer runs them in turns, each its own seed's
    four = _alone(client, "/v1/completions", {**body, "prompt": [PROMPT, [5, 6, 7, 8]], "n": 2})
    assert [c["index"] for c in four["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in four["choices"]] == \
        [_alone(client, "/v1/completions", {**body, "prompt": p, "seed": 7 + j})["choices"][0]["text"]
         for p in prompts for j in range(2)]
    # ... and so does a stream, as llama-server queues them
    r = client.post("/v1/completions", json={**body, "prompt": [PROMPT, [5, 6, 7, 8]], "n": 2, "stream": True})
    chunks = parse_sse(r.text)
    ended = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(ended[:2]) == [0, 1] and sorted(ended[2:]) == [2, 3]      # a turn, then the next
    assert ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(4)] \
        == [c["text"] for c in four["choices"]]
    # [PROMPT, 5] is one prompt, llama-server's mixed one (test_routes.py); not a number
    r = client.post("/v1/completions", json={**body, "prompt": [PROMPT, 5.5]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_llama_servers_prompt_object_on_the_openai_route(client):
    """``{"prompt_string": ...}``, llama-server's prompt object, alone or in a list, is its
    text on /v1/completions as on /completion (it was a 400 there)."""
    require_batch_exact()      # the list's two prompts share a batch
    body = {"max_tokens": 6, "ignore_eos": True, "temperature": 0}
    text = _alone(client, "/v1/completions", {**body, "prompt": PROMPT})["choices"][0]["text"]
    one = _alone(client, "/v1/completions", {**body, "prompt": {"prompt_string": PROMPT}})
    two = _alone(client, "/v1/completions", {**body, "prompt": [{"prompt_string": PROMPT}, PROMPT]})
    assert [c["text"] for c in one["choices"] + two["choices"]] == [text] * 3
    r = client.post("/v1/completions", json={**body, "prompt": {"prompt_string": PROMPT, "multimodal_data": ["AA"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.multimodal_data", r.text


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
        assert mine[0]["delta"] == {"role": "assistant", "content": None}
        assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == "length"
        assert "".join(m["delta"].get("content") or "" for m in mine) == whole["choices"][i]["message"]["content"]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    assert all("timings" not in c for c in chunks)


def test_more_choices_than_slots_run_in_turns(client):
    """More choices than slots (the client fixture has 2) run in turns of the slots, each
    choice its seed's text, as llama-server queues them: a whole answer, and a stream
    too (it was refused: a client asking n=3 of a 2-slot server got a 400), whose
    usage counts every turn's choices."""
    require_batch_exact()       # two of the choices share a batch; alone, each has none
    body = {"prompt": PROMPT, "n": 3, "seed": 11, **SAMPLED}
    out = _alone(client, "/v1/completions", body)
    alone = [_alone(client, "/v1/completions", {**body, "n": 1, "seed": 11 + i})["choices"][0]["text"] for i in range(3)]
    assert [c["text"] for c in out["choices"]] == alone
    assert out["usage"]["completion_tokens"] == 36
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    chunks = parse_sse(r.text)
    texts = ["", "", ""]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == alone
    assert chunks[-1]["choices"] == [] and \
        {**chunks[-1]["usage"], "prompt_tokens_details": None} == {**out["usage"], "prompt_tokens_details": None}
    answers = _alone(client, "/completion", {"prompt": [PROMPT, "a", "b"], "n_predict": 4, "ignore_eos": True})
    assert [a["index"] for a in answers] == [0, 1, 2] and all(a["tokens_predicted"] == 4 for a in answers)
    r = client.post("/completion", json={"prompt": [PROMPT, "a", "b"], "n_predict": 4, "ignore_eos": True,
                                         "stream": True})
    objs = parse_sse(r.text, done=False)
    assert [o["content"] for o in objs if o["stop"]] == ["", "", ""]
    assert ["".join(o["content"] for o in objs if o["index"] == i) for i in range(3)] == \
        [a["content"] for a in answers]


def test_a_choice_refused_ends_the_ones_started(dense_model, monkeypatch):
    """Of n=2, choice 0 starts (it has its first chunk) and then choice 1 is refused (a
    503, injected: which slot frees first is a race on a fast device). The request is
    that 503, and the started choice is ended (cancelled), not left generating 900
    tokens for nobody; every slot is free again after."""
    import asyncio

    from pymtp.server.errors import overloaded
    from pymtp.server.service import Service

    real = Service.start
    started = []

    async def start(self, req):
        if req.seed == 101:
            while not started:             # until choice 0 has its first chunk
                await asyncio.sleep(0.001)
            raise overloaded(1)
        run = await real(self, req)
        started.append(run)
        return run

    monkeypatch.setattr(Service, "start", start)
    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "n": 2, "seed": 100, "max_tokens": 900,
                                            "ignore_eos": True, "temperature": 0.9})
        assert r.status_code == 503, r.text
        deadline = time.monotonic() + 20      # an ended generation frees its slot at the next round
        while _metric_samples(c)["pymtp_slots_busy"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        m = _metric_samples(c)
        assert m["pymtp_generations_total{finish_reason=cancelled}"] == 1
        assert m["pymtp_generated_tokens_total"] < 900
        two = _alone(c, "/v1/completions", {"prompt": PROMPT, "n": 2, "seed": 1, **SAMPLED})
        assert [ch["finish_reason"] for ch in two["choices"]] == ["length", "length"]
        assert two["usage"]["completion_tokens"] == 2 * 12


def test_the_servers_default_seed_makes_choices_that_differ(dense_model):
    """A server started with a default seed gives an unseeded request with n=2 choices
    seeded as a request with that seed would be (seed, seed + 1), not one text twice."""
    require_batch_exact()
    from pymtp.config import DecodeParams

    with app_client(dense_model, ServerSettings(parallel=2, decode=DecodeParams(seed=5))) as c:
        out = _alone(c, "/v1/completions", {"prompt": PROMPT, "n": 2, **SAMPLED})
        texts = [ch["text"] for ch in out["choices"]]
        assert texts[0] != texts[1]
        assert texts[1] == _alone(c, "/v1/completions", {"prompt": PROMPT, "seed": 6, **SAMPLED})["choices"][0]["text"]


def test_the_openai_client_reads_the_choices(dense_server):
    client = dense_server.openai()
    out = client.completions.create(model="pymtp-fixture-dense", prompt=PROMPT, n=2, seed=11, max_tokens=8,
                                    temperature=0.9, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 16
    assert all(c.finish_reason == "length" and c.text for c in out.choices)


@pytest.mark.parametrize("route", ["/v1/completions", "/completion"])
@pytest.mark.parametrize("later, code", [
    ("word " * 1500, "context_length_exceeded"),
    ([1] * 1500, "context_length_exceeded"),       # ids too: they passed until their turn
    ([5, 10**6], "invalid_value"),                  # outside the vocabulary
    ("", "empty_prompt"),
])
def test_a_later_turns_bad_prompt_is_refused_before_any_work(dense_model, route, later, code):
    """A whole answer runs its generations in turns of the slots: a prompt of a later turn
    the library would refuse is refused before the first turn decodes anything (token ids
    went unchecked until their turn: a 400 after the first turn's work, or an error event
    in a stream already answered 200)."""
    with app_client(dense_model, ServerSettings(parallel=1)) as c:
        before = _metric_samples(c)
        for stream in (False, True):
            r = c.post(route, json={"prompt": ["Hi", "Yo", later], "max_tokens": 8, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        after = _metric_samples(c)
        assert after.get("pymtp_generated_tokens_total", 0) == before.get("pymtp_generated_tokens_total", 0)
        ok = c.post("/v1/completions", json={"prompt": ["Hi", "Yo"], "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and [ch["index"] for ch in ok.json()["choices"]] == [0, 1]
