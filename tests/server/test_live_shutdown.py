"""A real ``pymtp serve`` on the demo model, stopped by real signals while it serves real
HTTP: it drains (503 + Retry-After for new and queued requests, /health "draining"), lets
running requests finish within --shutdown-timeout, ends the rest with OpenAI-shaped errors
(a final SSE error event and [DONE] for streams, a JSON 503 otherwise) and exits 0 with no
traceback in its log."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest import require_rows_within_patch

from .helpers import completion_text, finish_reason, live_server, parse_sse

LONG = {"prompt": "Once upon a time", "max_tokens": 16000, "ignore_eos": True}   # ~30 s on one thread
ARGS = ["--ctx-size", "16384", "--threads", "1"]


class StreamReader(threading.Thread):
    """Reads one SSE response as it arrives (a client that keeps up), noting when each line came."""

    def __init__(self, base_url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.base_url, self.body = base_url, body
        self.status: int | None = None
        self.lines: list[tuple[float, str]] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    @classmethod
    def running(cls, base_url: str, body: dict) -> "StreamReader":
        """Started, with its 200 and first bytes in (fails the test otherwise)."""
        stream = cls(base_url, body)
        stream.start()
        assert stream.started.wait(60) and stream.status == 200
        return stream

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base_url + "/v1/completions", json={**self.body, "stream": True},
                              timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    self.lines.append((time.monotonic(), line))
                    self.started.set()
        except BaseException as exc:   # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.started.set()

    def body_text(self) -> str:
        return "".join(line + "\n" for _, line in self.lines)


def _shutting_down(r: httpx.Response) -> dict:
    """The 503 a draining server answers with: OpenAI-shaped, Retry-After, Connection: close."""
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "shutting down" in err["message"]
    assert err["code"] == "server_shutting_down"
    return err


def _exited_cleanly(server, timeout: float = 60.0) -> str:
    assert server.proc.wait(timeout=timeout) == 0
    log = server.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log
    return log


def test_sigterm_drains_then_ends_running_requests_with_errors(tmp_path):
    with live_server(["--parallel", "2", "--queue", "2", "--shutdown-timeout", "8", *ARGS], tmp_path) as server:
        base = server.base_url
        stream = StreamReader.running(base, LONG)
        with ThreadPoolExecutor(3) as pool:
            whole = pool.submit(httpx.post, base + "/v1/completions", json=LONG, timeout=120)
            server.wait_metrics(lambda m: m["pymtp_slots_busy"] == 2, "both slots busy")
            queued = [pool.submit(httpx.post, base + "/v1/completions", timeout=120,
                                  json={"prompt": "queued", "max_tokens": 4, "stream": stream})
                      for stream in (False, True)]
            server.wait_metrics(lambda m: m["pymtp_queue_waiting"] == 2, "two queued")

            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            for q in queued:                            # not started: refused at once
                _shutting_down(q.result(30))
            for path, body in (("/v1/completions", {"prompt": "new", "max_tokens": 4}),
                               ("/v1/completions", {"prompt": "new", "max_tokens": 4, "stream": True}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                _shutting_down(httpx.post(base + path, json=body, timeout=30))
            health = httpx.get(base + "/health", timeout=30)
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            assert health.headers["retry-after"] == "1"
            assert httpx.head(base + "/health", timeout=30).status_code == 503
            assert not whole.done()                     # still running, inside the timeout

            err = _shutting_down(whole.result(60))      # ended at the timeout
            assert err["type"] == "unavailable_error"
        stream.join(60)
        assert stream.error is None, stream.error
        # the stream kept generating while the server drained, then got an error event and [DONE]
        assert sum(1 for t, line in stream.lines if t > signalled and line.startswith('data: {"id"')) > 0
        events = parse_sse(stream.body_text())
        *chunks, last = events
        assert last["error"]["code"] == "server_shutting_down" and set(last["error"]) == \
            {"message", "type", "param", "code"}
        assert all("error" not in c for c in chunks) and completion_text(chunks)
        log = _exited_cleanly(server)
    # the drain says what it does in uvicorn's format (pymtp's loggers had no handler: bare lines)
    assert "\nWARNING:  shutdown: ending 2 request(s) still running\n" in log, log


def _drain_two_running(tmp_path) -> tuple[str, httpx.Response, list[dict]]:
    """A solo answer, then the same request twice at once (a plain POST and a stream) with
    Ctrl-C sent while both run: returns the solo text, the POST's response and the stream's
    chunks, after the server's exit was checked clean."""
    with live_server(["--parallel", "2", "--shutdown-timeout", "120", *ARGS], tmp_path) as server:
        base = server.base_url
        body = {"prompt": "The quick brown fox", "max_tokens": 600, "ignore_eos": True}
        solo = httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        stream = StreamReader.running(base, body)
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, base + "/v1/completions", json=body, timeout=120)
            server.wait_metrics(lambda m: m["pymtp_slots_busy"] == 2, "both running")
            server.proc.send_signal(signal.SIGINT)       # Ctrl-C drains the same way
            r = whole.result(120)
        stream.join(120)
        _exited_cleanly(server)
    return solo, r, parse_sse(stream.body_text())


def test_requests_running_at_sigterm_finish_within_the_timeout(tmp_path):
    _, r, chunks = _drain_two_running(tmp_path)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 600 and r.json()["choices"][0]["finish_reason"] == "length"
    assert all("error" not in c for c in chunks) and completion_text(chunks) and finish_reason(chunks) == "length"


def test_requests_finished_in_a_drain_equal_their_solo_runs(tmp_path):
    require_rows_within_patch("the round the two share")     # the solo run ran alone
    solo, r, chunks = _drain_two_running(tmp_path)
    assert r.json()["choices"][0]["text"] == solo and completion_text(chunks) == solo


def test_second_sigint_ends_the_drain_at_once(tmp_path):
    with live_server(["--parallel", "1", "--shutdown-timeout", "600", *ARGS], tmp_path) as server:
        base = server.base_url
        stream = StreamReader.running(base, LONG)
        server.proc.send_signal(signal.SIGINT)
        server.wait_metrics(lambda m: httpx.get(base + "/health", timeout=30).status_code == 503,
                      "draining")
        server.proc.send_signal(signal.SIGINT)          # Ctrl-C again: stop waiting for the 600 s
        stream.join(60)
        assert not stream.is_alive() and stream.error is None
        assert parse_sse(stream.body_text())[-1]["error"]["code"] == "server_shutting_down"
        _exited_cleanly(server)
