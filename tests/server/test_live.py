"""A real ``pymtp serve`` process on a loopback port, driven by the official openai client:
completions on the embedded demo model, chat on the dense fixture, isolation between
concurrent requests, a client that walks away mid-stream, and metrics that add up."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import require_rows_within_patch

from .helpers import COLD, live_server

PROMPTS = ["Once upon a time", "def fibonacci(n):", "The capital of France is", "import numpy as np\n",
           "In 1492, Columbus", "class Stack:\n    def", "The quick brown fox", "Dear Sir or Madam,"]


def _counts(usage) -> dict:
    """A usage object's token counts; how many prompt tokens a slot's prompt cache held
    (prompt_tokens_details) depends on what ran there before, so it is left out."""
    d = usage.model_dump()
    d.pop("prompt_tokens_details", None)
    return d


def _complete(client, prompt: str, max_tokens: int, stream: bool,
              extra: dict | None = None) -> tuple[str, str, dict | None]:
    """(text, finish_reason, token counts) of one greedy completion, streamed or not;
    ``extra``: more body fields."""
    if not stream:
        r = client.completions.create(model="qwen35-tiny-mtp", prompt=prompt, max_tokens=max_tokens,
                                      extra_body=extra)
        return r.choices[0].text, r.choices[0].finish_reason, _counts(r.usage)
    text, finish, usage = [], None, None
    for chunk in client.completions.create(model="qwen35-tiny-mtp", prompt=prompt, max_tokens=max_tokens,
                                           stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = _counts(chunk.usage)
    return "".join(text), finish, usage


def test_completions_with_openai_client(demo_server):
    client = demo_server.openai()
    assert [m.id for m in client.models.list()] == ["qwen35-tiny-mtp"]
    whole = client.completions.create(model="qwen35-tiny-mtp", prompt="Once upon a time", max_tokens=32,
                                      extra_body=COLD)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 32
    assert whole.model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens
    text, finish, usage = _complete(client, "Once upon a time", 32, stream=True, extra=COLD)
    assert text == whole.choices[0].text and finish == whole.choices[0].finish_reason
    assert usage == _counts(whole.usage)


def test_chat_with_openai_client(dense_server):
    client = dense_server.openai()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"}]
    fixed = COLD
    whole = client.chat.completions.create(model="pymtp-fixture-dense", messages=msgs, max_tokens=24,
                                           extra_body=fixed)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    pieces, roles, finish, timings = [], [], None, None
    for chunk in client.chat.completions.create(model="pymtp-fixture-dense", messages=msgs, max_tokens=24,
                                                stream=True, extra_body=fixed):
        assert chunk.object == "chat.completion.chunk"
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        pieces.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
        timings = (chunk.model_extra or {}).get("timings") or timings
    assert roles[0] == "assistant" and set(roles[1:]) == {None}
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert timings["draft_n"] == whole.model_extra["timings"]["draft_n"]


def test_openai_client_with_an_arbitrary_model_name(dense_server):
    client = dense_server.openai()
    r = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert r.model == "pymtp-fixture-dense" and r.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.completions.create(model="anything-at-all", prompt="x", max_tokens=3, stream=True))
    assert {c.model for c in chunks} == {"pymtp-fixture-dense"}


def test_served_model_name_is_strict_with_openai_client(tmp_path):
    with live_server(["--served-model-name", "my-model,mm", "--ctx-size", "256", "--threads", "1"],
                     tmp_path) as server:
        client = server.openai()
        assert [m.id for m in client.models.list()] == ["my-model"]
        assert client.completions.create(model="mm", prompt="x", max_tokens=2).model == "my-model"
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
        assert e.value.code == "model_not_found"


def test_openai_client_sees_typed_errors(dense_server):
    client = dense_server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="pymtp-fixture-dense", n=0,
                                       messages=[{"role": "user", "content": "x"}])
    assert e.value.param == "n"


def _metric(server, name: str) -> float:
    return server.metrics().get(name, 0.0)


def _solo_then_together(client) -> tuple[list, list]:
    """Each prompt alone, then all 8 at once on 4 slots (half of them streamed)."""
    solo = [_complete(client, p, 40, stream=False) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda ip: _complete(client, ip[1], 40, stream=ip[0] % 2 == 1),
                                 enumerate(PROMPTS)))
    return solo, together


def test_concurrent_requests_equal_their_solo_runs(demo_server):
    """Isolation: a request decoded in a batch with others gets its solo run's text."""
    require_rows_within_patch("a batched round")
    solo, together = _solo_then_together(demo_server.openai(timeout=60))
    for p, a, b in zip(PROMPTS, solo, together):
        assert b == a, p


def test_concurrent_requests_metrics_add_up(demo_server):
    """8 greedy requests on 4 slots: the counters move by exactly what the responses report."""
    before = demo_server.metrics()
    solo, together = _solo_then_together(demo_server.openai(timeout=60))
    after = demo_server.metrics()
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)   # noqa: E731
    reported = [u for _, _, u in solo + together]
    assert all(finish in ("length", "stop") for _, finish, _ in solo + together)
    assert delta("pymtp_generated_tokens_total") == sum(u["completion_tokens"] for u in reported)
    assert delta("pymtp_prompt_tokens_total") == sum(u["prompt_tokens"] for u in reported)
    assert delta("pymtp_generations_total{finish_reason=length}") + \
        delta("pymtp_generations_total{finish_reason=stop}") == 16
    assert after["pymtp_slots_busy"] == 0 and after["pymtp_queue_waiting"] == 0


def _disconnect_beside_a_bystander(demo_server) -> tuple[tuple, tuple, dict]:
    """A stream abandoned a few events in while another request runs beside it: the
    bystander's solo result, its result beside the stream, and /metrics before."""
    client = demo_server.openai(timeout=60)
    want = _complete(client, PROMPTS[1], 40, stream=False, extra=COLD)
    before = demo_server.metrics()
    body = {"prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(_complete, client, PROMPTS[1], 40, True, COLD)
        with httpx.stream("POST", demo_server.base_url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for n, line in enumerate(r.iter_lines()):
                if n >= 6:            # a few events in, the client goes away
                    break
        got = bystander.result(60)
    return want, got, before


def _cancelled_and_idle(server, before: dict) -> dict:
    """The metrics once a generation more than ``before`` counted was cancelled and no
    slot is busy (within 10 s)."""
    cancelled = "pymtp_generations_total{finish_reason=cancelled}"
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m["pymtp_slots_busy"] == 0 and m.get(cancelled, 0) > before.get(cancelled, 0):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_slot(demo_server):
    want, got, before = _disconnect_beside_a_bystander(demo_server)
    assert got[1] == want[1] and got[2]["completion_tokens"] == want[2]["completion_tokens"]   # served to its end
    m = _cancelled_and_idle(demo_server, before)
    # the abandoned generation stopped early instead of running to its 480 tokens
    abandoned = m["pymtp_generated_tokens_total"] - before["pymtp_generated_tokens_total"] - 40
    assert 0 < abandoned < 240
    assert m["pymtp_requests_in_flight"] == 1 and m["pymtp_queue_waiting"] == 0
    assert _complete(demo_server.openai(timeout=60), PROMPTS[1], 40, stream=True, extra=COLD) == want


def test_disconnect_leaves_the_bystanders_text_alone(demo_server):
    """Isolation through a cancellation: the request beside the abandoned stream gets its
    solo run's text."""
    require_rows_within_patch("the bystander's rounds, which share decodes with the other request's prompt,")
    want, got, _ = _disconnect_beside_a_bystander(demo_server)
    assert got == want


def test_an_unstreamed_request_whose_client_left_counts_as_499(demo_server):
    """The client of a whole (unstreamed) answer goes away while it generates: its
    generation stops, and the request counts as a 499, not as a 200 answered to nobody."""
    import socket
    from urllib.parse import urlsplit

    before = demo_server.metrics()
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True}).encode()
    url = urlsplit(demo_server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        demo_server.wait_metrics(lambda m: m["pymtp_slots_busy"] > 0, "the request to start")
    _cancelled_and_idle(demo_server, before)
    key = "pymtp_requests_total{{route=/v1/completions,status={}}}"
    m = demo_server.wait_metrics(lambda m: m.get(key.format(499), 0) > before.get(key.format(499), 0)
                                 or m.get(key.format(200), 0) > before.get(key.format(200), 0), "its status")
    assert m.get(key.format(499), 0) == before.get(key.format(499), 0) + 1
    assert m.get(key.format(200), 0) == before.get(key.format(200), 0)


def test_serve_refuses_what_it_cannot_serve(nomtp_path, tmp_path):
    from click.testing import CliRunner

    from pymtp.server.cli import serve

    for ask in (["--spec", "mtp"], ["-k", "3"]):      # a depth asks for MTP
        r = CliRunner().invoke(serve, [str(nomtp_path), *ask, "--port", "1"])
        assert r.exit_code == 1 and "no MTP block" in r.output and "--spec none (and no --draft-max)" in r.output
    r = CliRunner().invoke(serve, [str(tmp_path / "missing.gguf")])
    assert r.exit_code == 1 and "model file not found" in r.output
    for args in (["--calibrate", "--draft-max", "3"], ["--calibrate", "--draft-max", "auto", "--spec", "none"]):
        r = CliRunner().invoke(serve, [str(tmp_path / "missing.gguf"), *args])
        assert r.exit_code == 2 and "--calibrate searches the depths of --draft-max auto" in r.output, r.output


def test_spec_defaults_to_mtp_only_when_the_model_has_it():
    from pymtp.clitypes import resolve_spec

    assert resolve_spec(None, True) == ("mtp", None)
    spec, note = resolve_spec(None, False)
    assert spec == "none" and "no MTP block" in note and "gguf_graft" in note
    assert resolve_spec("mtp", False) == ("mtp", None)    # the caller refuses it
    assert resolve_spec(None, False, depth_given=True) == ("mtp", None)     # so is a depth given
    assert resolve_spec(None, True, depth_given=True) == ("mtp", None)
    assert resolve_spec("none", True) == ("none", None)


def test_serve_takes_llama_cpps_sampling_flags_as_request_defaults(tmp_path):
    # a model card's flags (Qwen's: --temp 0.7 --top-k 20 --top-p 0.8 --min-p 0) set what a
    # request that leaves the fields out samples with; its own fields win
    args = ["--temp", "0.9", "--top-k", "20", "--top-p", "0.8", "--min-p", "0", "--seed", "11",
            "--presence-penalty", "0.5", "--ctx-size", "256", "--threads", "1", "--parallel", "1"]
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, **COLD}
    explicit = {**body, "temperature": 0.9, "top_k": 20, "top_p": 0.8, "min_p": 0, "seed": 11, "presence_penalty": 0.5}
    (tmp_path / "flags").mkdir()
    (tmp_path / "plain").mkdir()
    with live_server(args, tmp_path / "flags") as flags, live_server(["--ctx-size", "256", "--threads", "1",
                                                                       "--parallel", "1"], tmp_path / "plain") as plain:
        def text(server, b) -> str:
            r = httpx.post(server.base_url + "/v1/completions", json=b, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        sampled = text(flags, body)
        assert sampled == text(plain, explicit) != text(plain, body)          # plain: greedy
        assert text(flags, {**body, "temperature": 0}) == text(plain, body)
        params = httpx.get(flags.base_url + "/props", timeout=10).json()["default_generation_settings"]["params"]
        assert (params["temperature"], params["top_k"], params["top_p"], params["seed"]) == (0.9, 20, 0.8, 11)


@pytest.mark.parametrize("args, message", [
    (["--temp", "-1"], "temperature must be"),
    (["--top-p", "2"], "top_p must be"),
    (["--seed", "-5"], "a seed is an integer >= 0, or -1 for a fresh one"),
])
def test_serve_refuses_bad_sampling_flags_naming_them(args, message):
    from click.testing import CliRunner

    from pymtp.server.cli import serve

    r = CliRunner().invoke(serve, ["--port", "1", *args])
    assert r.exit_code == 2 and message in r.output and "Invalid value for" in r.output, r.output


def test_a_requests_seed_minus_one_is_fresh_whatever_the_servers_seed(dense_model):
    # llama.cpp's -1: a request escapes a server's --seed, as with llama-server
    from pymtp.config import DecodeParams
    from pymtp.server import ServerSettings

    from .helpers import app_client

    settings = ServerSettings(parallel=3, decode=DecodeParams(temperature=1.5, seed=3))
    body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    with app_client(dense_model, settings) as client:
        def text(**kw) -> str:
            r = client.post("/v1/completions", json={**body, **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        seeded = {text() for _ in range(3)}
        assert len(seeded) == 1 and seeded == {text(seed=3)}
        assert len({text(seed=-1) for _ in range(6)}) > 1
        choices = client.post("/v1/completions", json={**body, "n": 3, "seed": -1}).json()["choices"]
        assert len({c["text"] for c in choices}) > 1
        assert client.post("/v1/completions", json={**body, "seed": -2}).status_code == 400


def test_llama_servers_completion_route_streams_over_real_http(demo_server):
    """llama-server's /completion through a real process: the stream's pieces join to the
    whole answer, and a client that leaves mid-stream frees its slot."""
    body = {"prompt": PROMPTS[1], "n_predict": 40, "temperature": 0, "return_tokens": True, **COLD}
    whole = httpx.post(demo_server.base_url + "/completion", json=body, timeout=60).json()
    assert whole["tokens_predicted"] == len(whole["tokens"]) and whole["stop"] is True
    parts = []
    with httpx.stream("POST", demo_server.base_url + "/completion", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                parts.append(json.loads(line[len("data: "):]))
    assert "".join(p["content"] for p in parts) == whole["content"]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"] and parts[-1]["stop"] is True
    before = demo_server.metrics()
    with httpx.stream("POST", demo_server.base_url + "/completion",
                      json={"prompt": PROMPTS[2], "n_predict": 480, "ignore_eos": True, "stream": True},
                      timeout=60) as r:
        next(r.iter_lines())          # the first object, then away
    _cancelled_and_idle(demo_server, before)


def test_head_answers_every_get_route_with_its_headers_only(demo_server):
    """As llama-server (cpp-httplib serves HEAD with the GET handler): probes send HEAD."""
    served = httpx.get(demo_server.base_url + "/v1/models").json()["data"][0]["id"]
    for path in ("/v1/models", "/models", f"/v1/models/{served}", "/props", "/"):
        got, head = httpx.get(demo_server.base_url + path), httpx.head(demo_server.base_url + path)
        assert got.status_code == head.status_code == 200, path
        assert head.content == b"" and got.content, path
        assert head.headers["content-type"] == got.headers["content-type"], path
        assert int(head.headers["content-length"]) == len(got.content), path
    for path in ("/slots", "/metrics"):       # what they count changes, their answer's shape not
        head = httpx.head(demo_server.base_url + path)
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0, path
    # a POST route is no GET route: 405, as its GET is
    assert httpx.head(demo_server.base_url + "/v1/chat/completions").status_code == 405
