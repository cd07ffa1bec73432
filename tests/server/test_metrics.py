"""/metrics is Prometheus text from the app's own registry, and its generation counters
add up to what the responses reported, under pymtp's names and llama-server's (compared,
where $PYMTP_LLAMA_SERVER names a llama-server binary, with the real one's)."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pymtp.llama_server import LlamaServer, server_command
from pymtp.server import ServerSettings

from .helpers import app_client, parse_sse


def _samples(client) -> dict[tuple, float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _get(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_add_up_to_the_responses(dense_model):
    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        reported = []
        for i, prompt in enumerate(["the quick brown fox", "hello world", "def fib(n):"]):
            body = {"prompt": prompt, "max_tokens": 10 + 5 * i}
            reported.append(c.post("/v1/completions", json=body).json())
        stream = parse_sse(c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}}).text)
        reported.append({"usage": stream[-1]["usage"], "timings": stream[-2]["timings"]})
        c.post("/v1/completions", json={"prompt": ""})          # a 400, not a generation

        m = _samples(c)
        total = lambda key, f: sum(f(r[key]) for r in reported)   # noqa: E731
        assert _get(m, "pymtp_generated_tokens_total") == total("usage", lambda u: u["completion_tokens"])
        assert _get(m, "pymtp_prompt_tokens_total") == total("usage", lambda u: u["prompt_tokens"])
        assert _get(m, "pymtp_draft_tokens_total") == total("timings", lambda t: t["draft_n"])
        assert _get(m, "pymtp_draft_tokens_accepted_total") == total("timings", lambda t: t["draft_n_accepted"])
        assert _get(m, "pymtp_verify_rounds_total") == total("timings", lambda t: t["draft_rounds"])
        by_position = sum(_get(m, "pymtp_draft_position_accepted_total", position=str(i)) for i in range(3))
        assert by_position == _get(m, "pymtp_draft_tokens_accepted_total") > 0
        assert _get(m, "pymtp_draft_position_drafted_total", position="0") >= \
            _get(m, "pymtp_draft_position_accepted_total", position="0")
        assert _get(m, "pymtp_generations_total", finish_reason="length") == 4
        assert _get(m, "pymtp_requests_total", route="/v1/completions", status="200") == 3
        assert _get(m, "pymtp_requests_total", route="/v1/chat/completions", status="200") == 1
        assert _get(m, "pymtp_requests_total", route="/v1/completions", status="400") == 1
        assert _get(m, "pymtp_errors_total", type="invalid_request_error") == 1
        assert _get(m, "pymtp_request_duration_seconds_count", route="/v1/completions") == 4
        assert _get(m, "pymtp_generation_tokens_per_second_count") == 4
        assert _get(m, "pymtp_slots") == 2 and _get(m, "pymtp_slots_busy") == 0
        assert _get(m, "pymtp_queue_waiting") == 0
        assert _get(m, "pymtp_requests_in_flight") == 1       # the scrape itself


@pytest.mark.parametrize("grammar", ['root ::= "a"', 'root ::= "x" "a"'])
@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_that_fails_counts_as_an_error_not_a_cancel(dense_model, grammar, stream):
    """A grammar that leaves only tokens the logit bias bans fails the generation (at its
    first token, or later); it was counted under finish_reason "cancelled", a client's
    doing."""
    banned = [[t, False] for w in ("a", "xa") for t in dense_model.tokenize(w, add_special=False)[-1:]]
    body = {"prompt": "hello", "max_tokens": 6, "grammar": grammar, "logit_bias": banned, "stream": stream}
    with app_client(dense_model) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code in (200, 400) and "nothing is left to draw" in r.text, r.text
        m = _samples(c)
        assert _get(m, "pymtp_generations_total", finish_reason="error") == 1
        assert _get(m, "pymtp_generations_total", finish_reason="cancelled") == 0


def test_each_app_has_its_own_registry(dense_model):
    with app_client(dense_model) as a, app_client(dense_model) as b:
        a.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert _get(_samples(a), "pymtp_generated_tokens_total") == 3
        assert _get(_samples(b), "pymtp_generated_tokens_total") == 0


def test_llama_servers_names_add_up_too(dense_model):
    """Dashboards written for llama-server read its ``llamacpp:`` names: the same sums; its
    Process-Start-Time-Unix header says when the server started."""
    before = int(time.time())
    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        assert before <= int(c.get("/metrics").headers["Process-Start-Time-Unix"]) <= time.time()
        reported = [c.post("/completion", json={"prompt": p, "n_predict": n, "temperature": 0, **kw}).json()
                    for p, n, kw in (("the quick brown fox", 12, {}), ("the quick brown fox", 9, {}),
                                     ("def fib(n):", 20, {"draft_max": 3, "p_min": 0.9}))]
        assert c.get("/pymtp/stats").status_code == 200        # the chat page's poll leaves the bucket be
        m = _samples(c)
        again = _samples(c)
    total = lambda key: sum(r["timings"][key] for r in reported)   # noqa: E731
    assert _get(m, "llamacpp:prompt_tokens_total") == total("prompt_n")
    assert _get(m, "llamacpp:prompt_tokens_cached_total") == total("cache_n") > 0     # the second's prompt
    assert _get(m, "llamacpp:tokens_predicted_total") == total("predicted_n") == 41
    assert _get(m, "llamacpp:spec_decode_num_draft_tokens_total") == total("draft_n") > 0
    assert _get(m, "llamacpp:spec_decode_num_accepted_tokens_total") == total("draft_n_accepted")
    assert sum(_get(m, "llamacpp:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(8)) == total("draft_n_accepted")
    assert _get(m, "llamacpp:spec_decode_num_drafts_total") == total("draft_rounds") > 0    # rounds with drafts
    assert _get(m, "llamacpp:prompt_seconds_total") == pytest.approx(total("prompt_ms") / 1e3)
    assert _get(m, "llamacpp:tokens_predicted_seconds_total") == pytest.approx(total("predicted_ms") / 1e3)
    assert _get(m, "llamacpp:n_tokens_max") == max(r["tokens_cached"] for r in reported)    # a slot's most
    assert _get(m, "llamacpp:requests_processing") == _get(m, "llamacpp:requests_deferred") == 0
    assert _get(m, "llamacpp:n_decode_total") >= 3 and _get(m, "llamacpp:n_busy_slots_per_decode") >= 1
    # the throughput gauges read the generations since the last scrape, as llama-server's
    # llama-server's steps: a generation's first token came with its prompt
    assert _get(m, "llamacpp:predicted_tokens_seconds") == pytest.approx(
        (total("predicted_n") - len(reported)) / (total("predicted_ms") / 1e3))
    assert _get(m, "llamacpp:prompt_tokens_seconds") == pytest.approx(total("prompt_n") / (total("prompt_ms") / 1e3))
    assert _get(again, "llamacpp:predicted_tokens_seconds") == 0
    assert _get(again, "llamacpp:tokens_predicted_total") == 41


LLAMA_SERVER = os.environ.get("PYMTP_LLAMA_SERVER")


@pytest.mark.skipif(not LLAMA_SERVER, reason="set PYMTP_LLAMA_SERVER to a llama-server binary")
def test_the_real_llama_server_has_the_same_names(dense_model, dense_path, tmp_path):
    server = LlamaServer(lambda port: server_command(LLAMA_SERVER, str(dense_path), port=port, threads=1,
                                                     n_ctx=1024, n_batch=512,
                                                     extra_args=["--metrics", "--spec-type", "draft-mtp"]),
                         tmp_path / "llama-server.log")
    body = {"prompt": "the quick brown fox", "n_predict": 12, "temperature": 0}
    server.start()
    try:
        httpx.post(server.url + "/completion", json=body, timeout=60)
        text = httpx.get(server.url + "/metrics", timeout=30).text
        with app_client(dense_model, ServerSettings(parallel=1)) as c:
            ours = c.post("/completion", json={**body, "draft_max": 3}).json()      # its drafts' positions
            mine_text = c.get("/metrics").text
    finally:
        server.stop()
    theirs, mine = _raw(text), _raw(mine_text)
    assert set(mine) == set(theirs)
    # one greedy request each on the same model: the same tokens counted
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:n_tokens_max",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred",
                 # greedy k=3 drafts on both: the same drafts, accepted alike
                 "llamacpp:spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_accepted_tokens_total",
                 "llamacpp:spec_decode_num_drafts_total",
                 *(n for n in theirs if n.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos"))):
        assert mine[name] == theirs[name], name
    assert ours["tokens_predicted"] == 12


def _raw(text: str) -> dict[str, float]:
    """``llamacpp:`` samples by name (labels included) as a scraper stores them: the text's
    own names (the parser renames a counter's samples)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_answers_made_before_routing_count_under_their_route(dense_model):
    """A 413 for a body past the limit and a CORS preflight are answered by middleware
    before routing; they were counted as route "other". A path no route serves still is."""
    with app_client(dense_model, ServerSettings(max_body_size=64)) as c:
        assert c.post("/v1/completions", content=b'{"prompt": "' + b"x" * 100 + b'"}').status_code == 413
        preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
        assert c.options("/v1/chat/completions", headers=preflight).status_code == 200
        assert c.get("/no/such/route").status_code == 404
        m = _samples(c)
        assert _get(m, "pymtp_requests_total", route="/v1/completions", status="413") == 1
        assert _get(m, "pymtp_requests_total", route="/v1/chat/completions", status="200") == 1
        assert _get(m, "pymtp_requests_total", route="other", status="404") == 1
