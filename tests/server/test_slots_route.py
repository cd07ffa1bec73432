"""llama-server's /slots (pymtp/server/slot_board.py): each slot's state and its last
request, in process and on a real ``pymtp serve`` while a request runs; and -- where
$PYMTP_LLAMA_SERVER names a llama-server binary -- the real one's answer for the same
request, key for key."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from pymtp.llama_server import LlamaServer, server_command
from pymtp.server import ServerSettings
from pymtp.server.sampler_fields import LLAMA_DEFAULT

from .helpers import app_client, live_server

LLAMA_SERVER = os.environ.get("PYMTP_LLAMA_SERVER")
PROMPT = "the quick brown fox"
BODY = {"prompt": PROMPT, "n_predict": 8, "temperature": 0}


@pytest.fixture(scope="module")
def llama(dense_model):
    with app_client(dense_model) as client:
        yield client


def _slots(client) -> list[dict]:
    r = client.get("/slots")
    assert r.status_code == 200, r.text
    return r.json()


def test_idle_slots_say_only_what_they_are(dense_model):
    with app_client(dense_model, ServerSettings(parallel=3)) as client:
        spec = dense_model.has_mtp
        assert _slots(client) == [{"id": i, "n_ctx": dense_model.options.n_ctx, "speculative": spec,
                                   "is_processing": False} for i in range(3)]
        assert client.get("/slots?fail_on_no_slot=1").status_code == 200


@pytest.mark.parametrize("ends", ["limit", "eos"])
def test_a_finished_request_is_told_on_its_slot(llama, ends):
    # a grammar that leaves only the end of generation after " yes"
    eos = {"grammar": 'root ::= " yes"', "n_predict": 10} if ends == "eos" else {}
    first = llama.post("/completion", json={**BODY, "n_probs": 1, **eos}).json()
    assert first["stop_type"] == ends
    _check_slot(_slots(llama)[first["id_slot"]], first, 10 if eos else 8)
    again = llama.post("/completion", json={**BODY, "n_predict": 5}).json()    # its prompt from the cache
    slots = {s["id"]: s for s in _slots(llama)}
    _check_slot(slots[again["id_slot"]], again, 5)
    assert slots[again["id_slot"]]["n_prompt_tokens_cache"] > 0
    ids = [s["id_task"] for s in slots.values() if "id_task" in s]
    assert len(set(ids)) == len(ids)


def test_a_request_is_told_on_the_slot_whose_cache_it_took(dense_model):
    """The pool lends its free slots in turn, but the engine gives a request the seq id
    whose prompt cache serves it: the second of two same prompts reported the other slot
    (id_slot and /slots), while the first's held its prompt and ran it."""
    with app_client(dense_model, ServerSettings(parallel=2)) as client:
        first = client.post("/completion", json=BODY).json()
        again = client.post("/completion", json={**BODY, "n_predict": 5}).json()
        assert again["timings"]["cache_n"] > 0
        assert again["id_slot"] == first["id_slot"]
        slots = _slots(client)
        _check_slot(slots[again["id_slot"]], again, 5)
        other = slots[1 - again["id_slot"]]
        assert other == {"id": 1 - again["id_slot"], "n_ctx": dense_model.options.n_ctx,
                         "speculative": dense_model.has_mtp, "is_processing": False}


def _check_slot(s: dict, got: dict, n_predict: int) -> None:
    """Slot ``s`` tells the request that answered ``got`` (/completion's answer)."""
    t = got["timings"]
    assert s["is_processing"] is False
    assert s["n_prompt_tokens"] == got["tokens_cached"]      # the slot's context, as llama-server's
    assert (s["n_prompt_tokens_cache"], s["n_prompt_tokens_processed"]) == (t["cache_n"], t["prompt_n"])
    assert s["next_token"] == [{"has_next_token": False, "has_new_line": got["has_new_line"],
                                "n_remain": n_predict - got["tokens_predicted"],
                                "n_decoded": got["tokens_predicted"]}]
    assert (s["draft_n"], s["draft_n_accepted"]) == (t["draft_n"], t["draft_n_accepted"])
    settings = got["generation_settings"]
    assert s["params"] == {k: v for k, v in settings.items() if k not in ("stop", "logit_bias", "grammar")}
    assert s["params"]["n_predict"] == n_predict and s["params"]["temperature"] == 0


def _last(client) -> dict:
    return max((s for s in _slots(client) if "id_task" in s), key=lambda s: s["id_task"])


def test_params_name_the_chain_as_llama_server_does(llama):
    body = {"prompt": PROMPT, "n_predict": 2, "temperature": 0.7, "top_k": 20, "seed": 3, "stream": True,
            "samplers": ["top_k", "temperature"]}
    llama.post("/completion", json=body)
    s = _last(llama)
    assert s["params"]["samplers"] == ["top_k", "temperature"]
    assert (s["params"]["seed"], s["params"]["stream"], s["params"]["top_k"]) == (3, True, 20)
    chat = llama.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 3, "temperature": 0})
    s = _last(llama)
    assert (s["params"]["n_predict"], s["params"]["samplers"]) == (3, list(LLAMA_DEFAULT))
    assert s["next_token"][0]["n_decoded"] == chat.json()["usage"]["completion_tokens"]


def test_props_chain_sent_back_keeps_the_filters(llama):
    """llama.cpp's web page sends /props' samplers back with each request: that list must
    leave a request's top_k on (a list of only the samplers on at the defaults would not)."""
    chain = llama.get("/props").json()["default_generation_settings"]["params"]["samplers"]
    body = {"prompt": PROMPT, "n_predict": 16, "temperature": 1.5, "top_k": 3, "seed": 5}
    text = lambda extra: llama.post("/completion", json={**body, **extra}).json()["content"]
    assert text({"samplers": chain}) == text({}) != text({"samplers": ["temperature"]})


def test_a_refused_request_leaves_its_slot_as_it_was(dense_model):
    with app_client(dense_model, ServerSettings(parallel=1)) as client:
        assert client.post("/completion", json=BODY).status_code == 200
        before = _slots(client)
        r = client.post("/completion", json={**BODY, "grammar": "root ::= nope"})
        assert r.status_code == 400, r.text
        assert _slots(client) == before


def test_a_refused_requests_slot_is_idle_when_its_400_arrives(dense_model, monkeypatch):
    """The 400 reached the client before the worker ended the slot's task, so /slots read
    right after it showed the request running (a flaky CI failure of the test above); the
    slot's end is slowed here so that the order shows every time."""
    with app_client(dense_model, ServerSettings(parallel=1)) as client:
        board = client.app.state.service.board
        end = board.end

        def slow_end(*args, **kwargs):
            time.sleep(0.3)
            return end(*args, **kwargs)

        monkeypatch.setattr(board, "end", slow_end)
        r = client.post("/completion", json={**BODY, "grammar": "root ::= nope"})
        assert r.status_code == 400, r.text
        assert _slots(client)[0]["is_processing"] is False


def test_turned_off_and_slot_files_are_501s(dense_model):
    with app_client(dense_model, ServerSettings(parallel=1, slots_endpoint=False)) as client:
        r = client.get("/slots")
        assert r.status_code == 501 and "--no-slots" in r.json()["error"]["message"]
        r = client.post("/slots/0?action=save", json={"filename": "x.bin"})
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]


def test_a_running_request_shows_and_fills_the_only_slot(dense_path, tmp_path):
    """Over real HTTP: while a stream runs its slot is processing, /metrics' n_tokens_max
    counts what it holds, and fail_on_no_slot is a 503 (a balancer's check); once the
    client leaves, the slot is idle again."""
    with live_server([str(dense_path), "--parallel", "1", "--ctx-size", "4096", "--threads", "1"], tmp_path) as srv:
        body = {"prompt": PROMPT, "n_predict": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", srv.base_url + "/completion", json=body) as r:
                lines = r.iter_lines()
                first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
                s = http.get(srv.base_url + "/slots").json()[0]
                assert s["is_processing"] is True and s["next_token"][0]["has_next_token"] is True
                assert 1 <= s["next_token"][0]["n_decoded"] < 3000
                assert s["next_token"][0]["n_remain"] == 3000 - s["next_token"][0]["n_decoded"]
                held = s["n_prompt_tokens"] - first["tokens_evaluated"]
                assert held == s["next_token"][0]["n_decoded"] - 1, s     # the last sampled is not decoded yet
                # llama-server's n_tokens_max follows the running slot, not only finished requests
                metrics = http.get(srv.base_url + "/metrics").text
                (line,) = (x for x in metrics.splitlines() if x.startswith("llamacpp:n_tokens_max "))
                later = http.get(srv.base_url + "/slots").json()[0]
                assert later["is_processing"] is True, later
                assert s["n_prompt_tokens"] <= float(line.split()[1]) <= later["n_prompt_tokens"], (line, s, later)
                busy = http.get(srv.base_url + "/slots?fail_on_no_slot=1")
                assert busy.status_code == 503 and busy.json()["error"]["message"] == "no slot available"
            deadline = time.monotonic() + 30
            while (s := http.get(srv.base_url + "/slots").json()[0])["is_processing"]:
                assert time.monotonic() < deadline, s
                time.sleep(0.05)
            assert s["next_token"][0]["has_next_token"] is False and s["next_token"][0]["n_decoded"] < 3000
            assert http.get(srv.base_url + "/slots?fail_on_no_slot=1").status_code == 200


@pytest.mark.skipif(not LLAMA_SERVER, reason="set PYMTP_LLAMA_SERVER to a llama-server binary")
def test_the_real_llama_server_tells_the_same_slot(dense_model, dense_path, tmp_path):
    # one slot each, drafting with the MTP head, so that each request's slot is the same one
    server = LlamaServer(lambda port: server_command(LLAMA_SERVER, str(dense_path), port=port, threads=1,
                                                     n_ctx=1024, n_batch=512,
                                                     extra_args=["-np", "1", "--spec-type", "draft-mtp"]),
                         tmp_path / "llama-server.log")
    # every sampling field named: the two servers' defaults differ
    named = {"top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 7, "repeat_last_n": 32, "repeat_penalty": 1.0,
             "presence_penalty": 0.0, "frequency_penalty": 0.0}
    bodies = [{**BODY, **named}, {**BODY, **named, "samplers": ["top_k", "temperature"]},
              {**BODY, **named, "n_predict": 10, "grammar": 'root ::= " yes"'},       # an end of generation
              {**BODY, **named, "n_predict": 24, "stop": [" the"]}]
    server.start()
    try:
        with app_client(dense_model, ServerSettings(parallel=1)) as ours:
            idle_theirs = httpx.get(server.url + "/slots", timeout=30).json()
            # their n_ctx is the context split between the slots, ours a slot's own context
            assert [{**s, "n_ctx": 0} for s in _slots(ours)] == [{**s, "n_ctx": 0} for s in idle_theirs]
            for body in bodies:
                theirs_answer = httpx.post(server.url + "/completion", json=body, timeout=60).json()
                ours_answer = ours.post("/completion", json=body).json()
                assert ours_answer["content"] == theirs_answer["content"], body
                (theirs,) = httpx.get(server.url + "/slots", timeout=30).json()
                (mine,) = _slots(ours)
                assert set(theirs) <= set(mine)
                assert (mine["n_prompt_tokens"], mine["is_processing"], mine["speculative"]) == \
                    (theirs["n_prompt_tokens"], theirs["is_processing"], theirs["speculative"]), body
                assert mine["next_token"][0]["has_next_token"] == theirs["next_token"][0]["has_next_token"] is False
                assert mine["next_token"][0]["has_new_line"] == ours_answer["has_new_line"]
                shared = set(mine["params"]) & set(theirs["params"])
                # a filter the list leaves out: pymtp tells the value it ran (off), llama-server the field
                off = {"top_p", "min_p", "repeat_penalty"} if "samplers" in body else set()
                assert shared >= {"seed", "temperature", "top_k", "top_p", "min_p", "repeat_last_n", "repeat_penalty",
                                  "presence_penalty", "frequency_penalty", "max_tokens", "n_predict", "ignore_eos",
                                  "stream", "n_probs", "samplers", "speculative.types"}
                for k in shared - off:
                    want = theirs["params"][k]       # their numbers are float32s
                    assert mine["params"][k] == (pytest.approx(want, rel=1e-6) if type(want) is float else want), \
                        (k, body)
    finally:
        server.stop()
