"""/metrics is Prometheus text from the app's own registry, and its generation counters
add up to what the responses reported."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

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


def test_each_app_has_its_own_registry(dense_model):
    with app_client(dense_model) as a, app_client(dense_model) as b:
        a.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert _get(_samples(a), "pymtp_generated_tokens_total") == 3
        assert _get(_samples(b), "pymtp_generated_tokens_total") == 0
