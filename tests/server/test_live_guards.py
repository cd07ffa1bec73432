"""A real ``pymtp serve`` guarding itself against clients: a request abandoned while it
waits for a slot leaves the queue and never generates; a body past ``--max-body-size`` is
a 413 before it is read; a body that stops short of its Content-Length is a 408 after
``--body-timeout``. Raw sockets where a well-behaved client cannot misbehave enough."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .helpers import live_server

MAX_BODY = 64 * 1024
BODY_TIMEOUT = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The demo model on one slot with a queue of two; a long context so that one request
    can hold the slot for as long as a test needs."""
    with live_server(["--parallel", "1", "--queue", "2", "--ctx-size", "16384", "--threads", "1",
                      "--max-body-size", str(MAX_BODY), "--body-timeout", str(BODY_TIMEOUT)],
                     tmp_path_factory.mktemp("guarded-server")) as s:
        yield s


def _connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _post_raw(server, path: str, body: dict) -> socket.socket:
    """Send a whole JSON request and leave its answer unread."""
    data = json.dumps(body).encode()
    sock = _connect(server)
    sock.sendall(_head(path, {"Content-Type": "application/json", "Content-Length": str(len(data))}) + data)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one response with a Content-Length; raises on a timeout."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    n = int(headers["content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the body"
        rest += chunk
    return int(status_line.split()[1]), headers, rest[:n]


def _closed_after(sock: socket.socket) -> bool:
    """Whether the server closes the connection (instead of waiting for more)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _openai_error(status: int, body: bytes, want_status: int, code: str) -> dict:
    assert status == want_status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == code
    return err


def _generations(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("pymtp_generations_total"))


def test_requests_abandoned_in_the_queue_leave_it_and_never_generate(server):
    base = server.base_url
    before = server.metrics()
    hold = {"prompt": "Once upon a time", "max_tokens": 16000, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", base + "/v1/completions", json=hold, timeout=60) as holder:
            assert holder.status_code == 200
            lines = holder.iter_lines()      # kept: dropping the iterator closes the connection
            next(lines)                      # generating: the only slot is taken
            abandoned = [_post_raw(server, "/v1/completions",
                                   {"prompt": "abandoned", "max_tokens": 8, "stream": stream})
                         for stream in (False, True)]
            server.wait_metrics(lambda m: m["pymtp_queue_waiting"] == 2, "both queued")
            r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
            assert r.status_code == 503              # the queue is full while they wait
            for sock in abandoned:                   # their clients give up
                sock.close()
            m = server.wait_metrics(lambda m: m["pymtp_queue_waiting"] == 0, "queue drained")
            assert m["pymtp_slots_busy"] == 1        # dropped, not served: the holder still runs
            # their places are free again: a live client waits instead of getting a 503
            live = pool.submit(httpx.post, base + "/v1/completions",
                               json={"prompt": "live", "max_tokens": 8}, timeout=60)
            server.wait_metrics(lambda m: m["pymtp_queue_waiting"] == 1 or live.done(), "live queued")
            assert not live.done(), live.result().text
        # the holder walks away mid-stream; the live request gets the slot
        r = live.result(60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    after = server.wait_metrics(lambda m: m["pymtp_slots_busy"] == 0 and
                          _generations(m) - _generations(before) >= 2, "holder and live counted")
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)   # noqa: E731
    # two generations ran, the holder (cancelled) and the live one; the abandoned never did
    assert _generations(after) - _generations(before) == 2
    assert delta("pymtp_generations_total{finish_reason=cancelled}") == 1
    assert delta("pymtp_generations_total{finish_reason=length}") == 1
    assert delta("pymtp_requests_total{route=/v1/completions,status=499}") == 2   # the abandoned
    assert after["pymtp_queue_waiting"] == 0 and after["pymtp_requests_in_flight"] == 1


def test_a_wait_for_the_slot_counts_as_queue_time(server):
    """pymtp_queue_seconds and the time to first token run from a request's arrival: its
    wait for a slot counts (they started at the engine, after it, and read ~0 however long
    requests waited)."""
    base = server.base_url
    before = server.metrics()
    hold = {"prompt": "Once upon a time", "max_tokens": 16000, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", base + "/v1/completions", json=hold, timeout=60) as holder:
            lines = holder.iter_lines()
            next(lines)                      # the only slot is taken
            waiter = pool.submit(httpx.post, base + "/v1/completions",
                                 json={"prompt": "waits", "max_tokens": 2}, timeout=60)
            server.wait_metrics(lambda m: m["pymtp_queue_waiting"] == 1, "waiter queued")
            time.sleep(0.5)                  # it waits at least this long: the slot is held
        assert waiter.result(60).status_code == 200
    after = server.wait_metrics(lambda m: m["pymtp_queue_seconds_count"] - before["pymtp_queue_seconds_count"] == 2
                                and m["pymtp_time_to_first_token_seconds_count"]
                                - before["pymtp_time_to_first_token_seconds_count"] == 2, "both counted")
    assert after["pymtp_queue_seconds_sum"] - before["pymtp_queue_seconds_sum"] >= 0.5
    assert after["pymtp_time_to_first_token_seconds_sum"] - before["pymtp_time_to_first_token_seconds_sum"] >= 0.5


def test_declared_body_past_the_limit_is_413_before_it_is_read(server):
    sock = _connect(server)
    with sock:
        # the body never comes: an answer other than a 408 shows it was not waited for
        sock.sendall(_head("/v1/completions", {"Content-Type": "application/json",
                                               "Content-Length": str(MAX_BODY + 1)}) + b'{"prompt": ')
        status, headers, body = _read_response(sock)
        err = _openai_error(status, body, 413, "request_too_large")
        assert str(MAX_BODY) in err["message"] and headers["connection"] == "close"
        assert _closed_after(sock)
    # on Anthropic's route, in Anthropic's shape (it was OpenAI's)
    sock = _connect(server)
    with sock:
        sock.sendall(_head("/v1/messages", {"Content-Type": "application/json",
                                            "Content-Length": str(MAX_BODY + 1)}) + b'{"messages": ')
        status, headers, body = _read_response(sock)
        got = json.loads(body)
        assert status == 413 and got["type"] == "error" and got["error"]["type"] == "request_too_large", got
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_body_at_the_limit_is_served(server):
    data = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    data += b" " * (MAX_BODY - len(data))          # JSON allows trailing whitespace
    r = httpx.post(server.base_url + "/v1/completions", content=data,
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text


def test_chunked_body_growing_past_the_limit_is_413(server):
    sock = _connect(server)
    with sock:
        sock.sendall(_head("/v1/completions", {"Content-Type": "application/json",
                                               "Transfer-Encoding": "chunked"}))
        piece = b" " * 8192
        for _ in range(MAX_BODY // len(piece) + 1):   # one chunk past the limit, no last chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, headers, body = _read_response(sock)
        _openai_error(status, body, 413, "request_too_large")
        assert headers["connection"] == "close" and _closed_after(sock)
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("framing, partial", [
    ({"Content-Length": "100"}, b'{"prompt": "x"'),                     # 14 of 100 bytes
    ({"Transfer-Encoding": "chunked"}, b'f\r\n{"prompt": "x",\r\n'),   # no last chunk
])
def test_body_short_of_its_framing_is_408_within_the_timeout(server, framing, partial):
    sock = _connect(server)
    with sock:
        sock.settimeout(BODY_TIMEOUT + 10)   # a server that waits forever fails here
        sock.sendall(_head("/v1/completions", {"Content-Type": "application/json", **framing}) + partial)
        status, headers, body = _read_response(sock)
        err = _openai_error(status, body, 408, "request_timeout")
        assert "--body-timeout" in err["message"] and headers["connection"] == "close"
        assert _closed_after(sock)
    m = server.metrics()
    assert m["pymtp_requests_in_flight"] == 1 and m["pymtp_slots_busy"] == 0


def test_client_leaving_mid_body_is_not_a_server_error(server):
    before = server.metrics()
    sock = _connect(server)
    sock.sendall(_head("/v1/completions", {"Content-Type": "application/json", "Content-Length": "100"})
                 + b'{"prompt": "x"')
    sock.close()
    gone = "pymtp_requests_total{route=/v1/completions,status=499}"
    m = server.wait_metrics(lambda m: m.get(gone, 0) > before.get(gone, 0), "counted as 499")
    server_errors = "pymtp_errors_total{type=server_error}"
    assert m.get(server_errors, 0) == before.get(server_errors, 0)
    assert "Traceback" not in server.log.read_text()


def test_openai_client_sees_the_413(server):
    import openai

    with pytest.raises(openai.APIStatusError) as e:
        server.openai().completions.create(model="any", prompt="x" * MAX_BODY, max_tokens=1)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
