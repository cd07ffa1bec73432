"""The prompt cache over real HTTP (#11): a ``pymtp serve`` process with two slots on the
demo model. Each turn of a greedy chat reuses what its slot holds and answers what a cold
run of the same request (``cache_prompt: false``) answers; usage and timings say how
many prompt tokens were reused; the snapshots stay within ``--cache-ram``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import require_cache_exact
from pymtp.prefix_cache import TAIL_TOKENS

from .helpers import live_server

SYSTEM = "You are a careful assistant who answers with short Python code."
ASKS = ["Write a function that adds two numbers.", "Now make it add three.", "Add type hints.",
        "Write a test for it."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(["--parallel", "2", "--ctx-size", "1024", "--threads", "1", "--cache-ram", "64"],
                     tmp_path_factory.mktemp("cache-server")) as s:
        yield s


def _chat(server, messages, **extra) -> dict:
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict) -> int:
    n = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    t = resp["timings"]
    assert t["cache_n"] == n and t["prompt_n"] == resp["usage"]["prompt_tokens"] - n
    return n


def test_chat_turns_reuse_their_slot_and_equal_cold_runs(server):
    require_cache_exact()
    messages = [{"role": "system", "content": SYSTEM}]
    before = 0
    for turn, ask in enumerate(ASKS):
        messages.append({"role": "user", "content": ask})
        warm = _chat(server, messages)
        cold = _chat(server, messages, cache_prompt=False)
        assert _cached(cold) == 0
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"], turn
        assert warm["usage"]["completion_tokens"] == cold["usage"]["completion_tokens"]
        if turn:       # everything the previous turn sent is held, and more (its reply)
            assert _cached(warm) >= before, turn
        before = warm["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": warm["choices"][0]["message"]["content"]})


def test_mtp_turn_after_a_spec_none_turn_reuses_it(server):
    """A ``spec: "none"`` turn leaves snapshots without MTP rows; the next MTP turn resumes
    from its end all the same (its new tokens are more than RESUME_ROWS), and answers
    what a cold run does (it read its whole prompt again before)."""
    require_cache_exact()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASKS[0]}]
    plain = _chat(server, messages, spec="none")
    messages += [{"role": "assistant", "content": plain["choices"][0]["message"]["content"]},
                 {"role": "user", "content": ASKS[1]}]
    warm = _chat(server, messages)
    cold = _chat(server, messages, cache_prompt=False)
    assert _cached(warm) >= plain["usage"]["prompt_tokens"]
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert warm["timings"]["draft_n"] > 0 and plain["timings"]["draft_n"] == 0


def test_more_chats_than_slots_keep_their_prompts(server):
    """Three chats on two slots, in turns: each takes a slot from another, which is
    shelved in host memory (as llama-server's --cache-ram), and each next turn gets its
    own back: it reuses all its last turn sent and answers as a cold run."""
    require_cache_exact()
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}] for ask in ASKS[:3]]
    sent = [0, 0, 0]
    for turn in range(2):
        for i, messages in enumerate(chats):
            warm = _chat(server, messages)
            if turn:
                assert _cached(warm) >= sent[i], i
                cold = _chat(server, messages, cache_prompt=False)
                assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"], i
            sent[i] = warm["usage"]["prompt_tokens"]
            messages += [{"role": "assistant", "content": warm["choices"][0]["message"]["content"]},
                         {"role": "user", "content": ASKS[3]}]


def test_two_conversations_keep_two_slots(server):
    convs = [[{"role": "system", "content": SYSTEM}],
             [{"role": "system", "content": "You translate English to French."}]]
    asks = [["Sort a list.", "Reverse it.", "Now dedupe it."], ["Hello.", "Good night.", "Thank you."]]
    before = [0, 0]
    for turn in range(3):
        for i, conv in enumerate(convs):       # alternating: each must find its own slot
            conv.append({"role": "user", "content": asks[i][turn]})
            r = _chat(server, conv)
            if turn:
                assert _cached(r) >= before[i], (turn, i)
            before[i] = r["usage"]["prompt_tokens"]
            conv.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})


def test_cancelled_stream_then_the_same_request(server):
    require_cache_exact()
    prompt = "def bubble_sort(items):\n    n = len(items)\n    for i in range(n):\n"
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
                if events >= 3:
                    break           # the client goes away mid-generation
    plain = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    again = httpx.post(server.base_url + "/v1/completions", json=plain, timeout=60).json()
    cold = httpx.post(server.base_url + "/v1/completions", json={**plain, "cache_prompt": False},
                      timeout=60).json()
    n = again["usage"]["prompt_tokens"]
    assert _cached(again) == n - TAIL_TOKENS      # the snapshot 4 tokens before the prompt's end
    assert _cached(cold) == 0
    assert again["choices"][0]["text"] == cold["choices"][0]["text"]


def test_cache_prompt_false_and_bad_value(server):
    prompt = "import os\nimport sys\n\ndef main():\n"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    off = httpx.post(server.base_url + "/v1/completions", json={**body, "cache_prompt": False}, timeout=60)
    assert _cached(off.json()) == 0
    bad = httpx.post(server.base_url + "/v1/completions", json={**body, "cache_prompt": "no"}, timeout=60)
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "cache_prompt" and "boolean" in err["message"]


def test_stream_usage_reports_cached_tokens(server):
    prompt = "class Point:\n    def __init__(self, x, y):\n"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={**body, "stream": True, "stream_options": {"include_usage": True}})
    objs = [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
    usage = objs[-1]["usage"]
    timings = next(o["timings"] for o in objs if "timings" in o)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - TAIL_TOKENS
    assert timings["cache_n"] == usage["prompt_tokens"] - TAIL_TOKENS


def test_usage_counts_the_cached_tokens_of_every_prompt(server):
    # a list of prompts: cached_tokens is the share of prompt_tokens, which sums them all
    # (it counted the first prompt's alone). Each prompt alone says what its slot reused.
    prompts = ["def area(r):\n    return 3.14 * r * r\n", "while True:\n    line = input()\n"]
    body = {"max_tokens": 3, "temperature": 0}
    post = lambda p: httpx.post(server.base_url + "/v1/completions", json={**body, "prompt": p}, timeout=60).json()
    post(prompts)
    again = post(prompts)["usage"]
    alone = [post(p)["usage"] for p in prompts]
    assert again["prompt_tokens"] == sum(u["prompt_tokens"] for u in alone)
    assert again["prompt_tokens_details"]["cached_tokens"] == \
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in alone) == \
        sum(u["prompt_tokens"] - TAIL_TOKENS for u in alone)


def test_snapshots_stay_within_the_budget(tmp_path):
    # the demo model's recurrent state is 0.62 MiB: 2 MiB holds three snapshots
    with live_server(["--parallel", "2", "--ctx-size", "512", "--threads", "1", "--cache-ram", "2"], tmp_path) as s:
        for i in range(4):
            httpx.post(s.base_url + "/v1/completions", timeout=60,
                       json={"prompt": f"# file {i}\nimport os\n" * 3, "max_tokens": 8, "temperature": 0})
            m = s.metrics()
            assert 0 < m["pymtp_prompt_cache_bytes"] <= m["pymtp_prompt_cache_budget_bytes"] == 2 * 2**20
        assert m["pymtp_prompt_tokens_cached_total"] == 0      # four different prompts
