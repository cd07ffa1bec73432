"""The server on one batched engine (#10): concurrent requests share rounds and each gets
what the library gives it alone; a full queue answers 503; a client that leaves frees
its slot for the next request; /metrics shows the batching."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_batch import require_batch_exact
from pymtp.depth_batched import occupancy_label
from pymtp.server import ServerSettings
from server.helpers import app_client

PROMPTS = ["Once upon a time", "def fibonacci(n):", "The capital of France is", "import numpy as np\n",
           "In 1492, Columbus", "class Stack:\n    def"]

# per request: depth, temperature with a seed, plain decoding, p_min
SETTINGS = [dict(draft_max=3), dict(draft_max=1, temperature=0.9, top_k=20, seed=5), dict(spec="none"),
            dict(draft_max=4, p_min=0.3), dict(draft_max=2, temperature=0.6, seed=11), dict(draft_max=3)]


def _metric_samples(client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def all_equal_solo_runs(client, model) -> None:
    """POST every prompt with its SETTINGS at once; each completion's text must equal
    ``Model.generate`` of the same request."""
    def post(i):
        body = dict(prompt=PROMPTS[i], max_tokens=30, ignore_eos=True, **SETTINGS[i])
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(post, range(len(PROMPTS))))
    for i, text in enumerate(texts):
        solo = model.generate(PROMPTS[i], max_tokens=30, ignore_eos=True, **SETTINGS[i])
        assert text == solo.text, SETTINGS[i]


def test_concurrent_requests_equal_their_solo_library_runs(dense_model):
    """Six requests with different depths, temperatures and seeds at once on three slots:
    each completion's text equals ``Model.generate`` of the same request."""
    require_batch_exact()
    with app_client(dense_model, ServerSettings(parallel=3)) as c:
        all_equal_solo_runs(c, dense_model)
        m = _metric_samples(c)
        together = sum(v for k, v in m.items() if k.startswith("pymtp_batch_rounds_total{size=")
                       and int(k.split("=")[1].rstrip("}")) >= 2)
        assert together > 0                                   # rounds really were shared
        assert m["pymtp_queue_seconds_count"] == len(PROMPTS)
        assert m["pymtp_time_to_first_token_seconds_count"] == len(PROMPTS)
        drafted = sum(v for k, v in m.items() if k.startswith("pymtp_slot_draft_tokens_total{"))
        assert drafted == m["pymtp_draft_tokens_total"] > 0
        assert m["pymtp_slots_busy"] == 0


def test_full_queue_503_and_a_left_stream_frees_its_slot(dense_model):
    """One slot, no queue: a second request while a stream runs is a 503; once the
    streaming client leaves, the next request runs and equals its solo run."""
    require_batch_exact()
    with app_client(dense_model, ServerSettings(parallel=1, queue=0, retry_after=2)) as c:
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            busy = c.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
        # the client went away: the server notices, and the engine drops the request at
        # its next round
        deadline = time.monotonic() + 20
        while _metric_samples(c)["pymtp_slots_busy"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = c.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 20, "ignore_eos": True})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == dense_model.generate(PROMPTS[1], max_tokens=20,
                                                                      ignore_eos=True).text
        m = _metric_samples(c)
        assert m["pymtp_generations_total{finish_reason=cancelled}"] == 1
        assert m["pymtp_generated_tokens_total"] < 400 + 20


def test_bad_request_is_a_400_and_leaves_the_engine_serving(dense_model):
    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "draft_max": 99})
        assert r.status_code == 400 and r.json()["error"]["param"] == "draft_max"
        r = c.post("/v1/completions", json={"prompt": "x " * 1100, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def _serves_as_alone(c, model) -> None:
    """After a failure: the next request runs as it would alone, and no slot stays busy."""
    r = c.post("/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 16, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == model.generate(PROMPTS[3], max_tokens=16, ignore_eos=True).text
    assert _metric_samples(c)["pymtp_slots_busy"] == 0


def test_a_failed_round_ends_its_requests_and_the_engine_goes_on(dense_model, monkeypatch):
    """A round that raises ends every request in it with a 500; their seq ids are freed
    and the next request is served as if nothing had happened."""
    require_batch_exact()
    from pymtp.rounds import Rounds
    from pymtp.native import NativeError

    real = Rounds.launch
    failures = []

    def failing_once(self, seqs, budget=None):
        if not failures:
            failures.append(len(seqs))
            raise NativeError("llama_decode returned -3 (injected)")
        return real(self, seqs, budget)

    monkeypatch.setattr(Rounds, "launch", failing_once)
    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8})
        assert r.status_code == 500 and failures == [1]
        _serves_as_alone(c, dense_model)


def test_a_failed_start_is_a_500_for_its_request_alone(dense_model, monkeypatch):
    """A request whose start fails in the engine's thread (an injected native error) gets
    a 500 naming it; the stream running beside it goes on to its solo run's text, and
    the failed request's seq id serves the next one."""
    require_batch_exact()
    from pymtp.rounds import Rounds
    from pymtp.native import NativeError

    real = Rounds.start

    def start(self, seq, prompt, p, stats):
        if p.max_tokens == 3:
            raise NativeError("llama_state_seq_set_data returned 0 (injected)")
        return real(self, seq, prompt, p, stats)

    monkeypatch.setattr(Rounds, "start", start)
    kw = dict(max_tokens=60, ignore_eos=True)
    with app_client(dense_model, ServerSettings(parallel=2, engines=1)) as c:
        with c.stream("POST", "/v1/completions", json=dict(prompt=PROMPTS[0], stream=True, **kw)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            for _ in range(2):
                bad = c.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 3})
                assert bad.status_code == 500, bad.text
                assert "llama_state_seq_set_data returned 0 (injected)" in bad.json()["error"]["message"]
            rest = [line for line in lines if line.startswith("data:")]
        events = [json.loads(line[5:]) for line in [first] + rest if line != "data: [DONE]"]
        assert "".join(e["choices"][0]["text"] for e in events) == dense_model.generate(PROMPTS[0], **kw).text
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        _serves_as_alone(c, dense_model)


def test_a_worker_lost_at_a_start_still_fails_the_model_over(dense_model, monkeypatch, caplog):
    """A lost RPC worker met in a request's start (restoring its cached prompt, say) is
    the model's failure: it ends the step, and the server's worker fails over to what
    ``replace`` makes, where the next request runs. Kept as that request's error alone,
    every later start failed the same way and nothing ever failed over."""
    from pymtp.rpc import RpcWorkerLost
    from pymtp.server.batching import BatchSlot, BatchWorker
    from pymtp.server.errors import APIError

    b = dense_model.batcher(2)
    replaced = []

    def replace():
        replaced.append(dense_model.batcher(2))
        return replaced[-1]

    def lost(*args, **kwargs):
        raise RpcWorkerLost("an RPC worker (127.0.0.1:1) failed: connection lost (injected)")

    monkeypatch.setattr(b.engine.rounds, "start", lost)
    w = BatchWorker(b, replace=replace)
    try:
        slot = BatchSlot(w)
        # the request's error tells the client to send it again, not to reload a model
        with pytest.raises(APIError, match=r"\(injected\); the server goes on without it: send the request again"):
            list(slot.stream(PROMPTS[0], max_tokens=4))
        deadline = time.monotonic() + 20
        while not replaced or w.batcher is b:
            assert time.monotonic() < deadline, "no fail-over"
            time.sleep(0.01)
        chunks = list(slot.stream(PROMPTS[1], max_tokens=6, ignore_eos=True))
        assert sum(len(c.tokens) for c in chunks) == 6
        # the log says what happens next, not the lone model's advice to load it again
        logged = caplog.text
        assert "(injected); failing over to this host" in logged and "load the model again" not in logged, logged
    finally:
        w.close()
        b.close()


def test_a_worker_lost_with_no_fail_over_makes_the_server_unavailable(dense_model, monkeypatch):
    """A lost RPC worker the server cannot fail over from leaves nothing that decodes:
    /health and every later request say so with a 503 (health said ok, and requests got a
    502, which a load balancer neither retries elsewhere nor counts against the replica)."""
    from pymtp.rpc import RpcWorkerLost

    def lost(*args, **kwargs):
        raise RpcWorkerLost("an RPC worker (127.0.0.1:1) failed: connection lost (injected)")

    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        assert c.get("/health").json() == {"status": "ok"}
        worker = c.app.state.service.workers[0]
        monkeypatch.setattr(worker.batcher.engine.rounds, "start", lost)
        first = c.post("/v1/completions", json=dict(prompt=PROMPTS[0], max_tokens=4))
        assert first.status_code == 502 and first.json()["error"]["code"] == "rpc_worker_lost", first.text
        deadline = time.monotonic() + 20
        while worker.broken is None:      # the fail-over (none here: not a split model) ends
            assert time.monotonic() < deadline, "the worker never gave up"
            time.sleep(0.01)
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "error", health.text
        assert "(injected)" in health.json()["error"] and "Retry-After" not in health.headers
        later = c.post("/v1/completions", json=dict(prompt=PROMPTS[1], max_tokens=4))
        assert later.status_code == 503, later.text
        assert later.json()["error"]["code"] == "rpc_worker_lost"
        assert "cannot decode until it is restarted" in later.json()["error"]["message"]


def test_metrics_show_what_auto_measured(dense_model):
    """/metrics has draft_max=auto's seconds a sequence-round and estimated tokens a
    second by occupancy, gap and depth: why it drafts what it drafts."""
    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        for _ in range(3):        # enough rounds of one sequence for the limit's probe
            r = c.post("/v1/completions", json=dict(prompt=PROMPTS[0], max_tokens=40, ignore_eos=True,
                                                    draft_max="auto"))
            assert r.status_code == 200, r.text
        m = _metric_samples(c)
        epochs = c.app.state.service.workers[0].batcher.engine.rounds.epochs
        expected = epochs.estimates()
        assert expected, "no depth measured"
        for (bucket, gap), k, seconds, rate in expected:
            key = f"depth={k},engine=0,gap={int(gap)},occupancy={occupancy_label(bucket)}"
            assert m[f"pymtp_auto_sequence_round_seconds{{{key}}}"] == pytest.approx(seconds)
            assert m[f"pymtp_auto_estimated_tokens_per_second{{{key}}}"] == pytest.approx(rate)


@pytest.mark.parametrize("grammar", ['root ::= "a"', 'root ::= "x" "a"'])
def test_a_request_whose_own_draw_fails_is_a_400_beside_a_served_one(dense_model, grammar):
    """A request whose grammar leaves only tokens its logit bias bans is refused with a
    400 whether that shows at its first token or later (a later one was a 500, "internal
    error"), and the request running beside it gets its solo text (it got the other's
    error)."""
    require_batch_exact()
    banned = [[t, False] for w in ("a", "xa") for t in dense_model.tokenize(w, add_special=False)[-1:]]
    bad = {"prompt": PROMPTS[0], "max_tokens": 6, "grammar": grammar, "temperature": 0.7, "seed": 3,
           "draft_max": 2, "logit_bias": banned}       # llama-server's ban
    good = {"prompt": PROMPTS[1], "max_tokens": 24, "ignore_eos": True, "draft_max": 2}
    solo = dense_model.generate(PROMPTS[1], max_tokens=24, ignore_eos=True, draft_max=2).text
    with app_client(dense_model, ServerSettings(parallel=2)) as c:
        with ThreadPoolExecutor(2) as pool:
            got_bad, got_good = pool.map(lambda body: c.post("/v1/completions", json=body), (bad, good))
        assert got_bad.status_code == 400 and got_bad.json()["error"]["code"] == "invalid_value", got_bad.text
        assert "nothing is left to draw" in got_bad.json()["error"]["message"]
        assert got_good.status_code == 200 and got_good.json()["choices"][0]["text"] == solo


def test_a_finished_request_keeps_its_last_chunk_when_the_next_launch_fails(dense_model, monkeypatch):
    """Where a launch decodes on the device while the host goes on (a GPU: overlapped,
    forced here), a request that finished in the step's land gets its last chunk before
    the failed launch's error ends the others (it got the error instead)."""
    from pymtp.rounds import Rounds
    from pymtp.server.batching import BatchSlot, BatchWorker, _Placed

    kw = dict(max_tokens=4, ignore_eos=True)
    solo = dense_model.generate(PROMPTS[2], **kw).text
    b = dense_model.batcher(2)
    b.engine.rounds.overlapped = True
    real, state = Rounds.launch, {}

    def launch(self, *a, **k):
        run = state.get("run")
        if run is not None and run.request.done and not state.get("raised"):
            state["raised"] = True
            raise RuntimeError("the device is lost")
        return real(self, *a, **k)

    monkeypatch.setattr(Rounds, "launch", launch)
    worker = BatchWorker(b)
    try:
        other = BatchSlot(worker).stream(PROMPTS[3], max_tokens=60, ignore_eos=True)
        state["run"], chunks = worker.submit(PROMPTS[2], **kw)
        texts = []
        assert isinstance(chunks.get(timeout=60), _Placed)     # its seq id, before its chunks
        while not texts or not texts[-1][1]:
            item = chunks.get(timeout=60)
            assert not hasattr(item, "exc"), item.exc
            texts.append((item.text, item.finish_reason))
        assert "".join(t for t, _ in texts) == solo and state.get("raised")
        with pytest.raises(RuntimeError, match="the device is lost"):
            list(other)
    finally:
        worker.close()


def test_a_failed_round_leaves_the_queued_requests_to_run(dense_model, monkeypatch):
    """A round that raises ends the requests in it; one still queued (no slot yet) was
    in no round and runs after it as it would alone, as llama-server fails only the
    failed batch's slots. It got the round's error before."""
    from pymtp.rounds import Rounds
    from pymtp.server.batching import BatchWorker

    kw = dict(max_tokens=6, ignore_eos=True)
    solo = dense_model.generate(PROMPTS[2], **kw).text
    real, state = Rounds.launch, {"launches": 0}

    def launch(self, *a, **k):
        state["launches"] += 1
        if state["launches"] == 3:
            raise RuntimeError("llama_decode returned -3 (injected)")
        return real(self, *a, **k)

    worker = BatchWorker(dense_model.batcher(1))
    try:
        _, first = worker.submit(PROMPTS[3], max_tokens=60, ignore_eos=True)
        assert first.get(timeout=60).seq == 0          # its seq id, before its chunks
        item = first.get(timeout=60)
        assert not hasattr(item, "exc"), item.exc
        monkeypatch.setattr(Rounds, "launch", launch)     # the third launch from here fails
        _, second = worker.submit(PROMPTS[2], **kw)
        items = [first.get(timeout=60)]
        while not hasattr(items[-1], "exc") and not items[-1].finish_reason:
            items.append(first.get(timeout=60))
        assert "injected" in str(items[-1].exc)
        texts = []
        assert second.get(timeout=60).seq == 0        # after the failed round, the freed id
        while not texts or not texts[-1].finish_reason:
            item = second.get(timeout=60)
            assert not hasattr(item, "exc"), item.exc
            texts.append(item)
        assert "".join(t.text for t in texts) == solo and state["launches"] > 3
    finally:
        worker.close()


def test_an_interrupt_ends_a_request_in_its_prompts_prefill(monkeypatch):
    """A cancel was seen only after the request's next chunk, so a client gone during a
    long prompt's prefill held its slot until the whole prompt was decoded (seconds).
    Interrupted as soon as it has a seq id (after its prompt's first piece), the stream
    ends with no chunk and the engine stops partway through the prompt."""
    import pymtp
    from pymtp.server.batching import BatchSlot, BatchWorker

    m = pymtp.load(threads=1, n_ctx=8192)
    try:
        ids = m.tokenize("def fibonacci(n):\n    return n\n" * 400)[:4800]
        worker = BatchWorker(m.batcher(1))
        try:
            slot, stats, told, in_time = BatchSlot(worker), [], threading.Event(), []
            engine = worker.batcher.engine
            real = engine.rounds.launch

            def launch(*args, **kwargs):      # each round waits (a while) for the request to hear its slot
                in_time.append(told.wait(10))
                return real(*args, **kwargs)

            def placed(seq: int) -> None:
                told.set()
                slot.interrupt()

            monkeypatch.setattr(engine.rounds, "launch", launch)

            assert list(slot.stream(ids, max_tokens=4, stats_out=stats, placed=placed)) == []
            assert not worker.batcher.busy      # the stream ended once the engine let it go
            held = engine.cache.slots[0].tokens      # what the seq's KV holds now
            assert 0 < len(held) < len(ids) and held == ids[:len(held)]
            # told its slot before any of its prompt was decoded (/slots shows it busy from
            # then); its stats count every piece decoded, the last one too (/metrics reads them)
            assert in_time[0] is True
            assert stats[0].generated_tokens == 0 and stats[0].prompt_processed == len(held)
        finally:
            worker.close()
    finally:
        m.close()
