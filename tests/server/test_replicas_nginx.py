"""Two real ``pymtp serve`` replicas of the demo model behind a real nginx running the
shipped deploy/nginx/pymtp.conf, all on 127.0.0.1: requests spread over both, one replica is
restarted (SIGTERM, drain, start again) under load, and no client sees an error, because
nginx passes what the draining or absent replica refused on to the other one.

nginx runs unprivileged-style from its own prefix in tmp (no daemon, its own pid file, logs
and temp paths); the test is skipped when no nginx binary is found (PATH, /usr/sbin/nginx, or
$PYMTP_NGINX). On Debian: ``apt-get install nginx``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pymtp.testing.processes import stop

from .helpers import REPO, LiveServer, free_port, completion_text, finish_reason, live_server, parse_sse

SHIPPED = REPO / "deploy" / "nginx" / "pymtp.conf"
SHIPPED_UPSTREAMS = ("127.0.0.1:8081", "127.0.0.1:8082")
SHIPPED_LISTEN = "listen 127.0.0.1:8080;"
# each replica: 2 slots on one thread (two replicas and nginx share the machine's cores);
# --shutdown-timeout well above a request's length, so a drain lets every running one finish
REPLICA_ARGS = ["--parallel", "2", "--threads", "1", "--ctx-size", "512", "--shutdown-timeout", "60",
                "--no-webui"]
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_TOKENS = 160          # long enough that a replica is busy when it gets SIGTERM
CLIENTS = 4
# nginx's access log: when each request ended, its status, and every replica nginx tried
LOG_FORMAT = "'$msec $status $request_method $uri \"$upstream_addr\" \"$upstream_status\"'"


def find_nginx() -> str | None:
    """$PYMTP_NGINX (which must then work), else nginx on PATH, else Debian's /usr/sbin/nginx."""
    given = os.environ.get("PYMTP_NGINX")
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            pytest.fail(f"PYMTP_NGINX={given!r} is not an executable file; point it at an nginx binary "
                        "or unset it")
        return given
    debian = "/usr/sbin/nginx"          # not on a non-root user's PATH
    return shutil.which("nginx") or (debian if os.access(debian, os.X_OK) else None)


def render_config(upstream_ports: list[int], listen_port: int) -> str:
    """The shipped file with the test's ports in place of its example addresses."""
    text = SHIPPED.read_text()
    for shipped in (*SHIPPED_UPSTREAMS, SHIPPED_LISTEN):
        assert text.count(shipped) == 1, f"{SHIPPED} no longer has exactly one {shipped!r}"
    for shipped, port in zip(SHIPPED_UPSTREAMS, upstream_ports):
        text = text.replace(shipped, f"127.0.0.1:{port}")
    return text.replace(SHIPPED_LISTEN, f"listen 127.0.0.1:{listen_port};")


def main_config(tmp: Path) -> str:
    """nginx.conf around the shipped file: everything nginx writes stays under ``tmp``."""
    # as root, nginx's workers would drop to "nobody", which cannot write in pytest's tmp
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
    temps = "\n".join(f"    {kind}_temp_path {tmp / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                          "uwsgi", "scgi"))
    return f"""{user}
daemon off;
worker_processes 1;
pid {tmp / 'nginx.pid'};
error_log {tmp / 'error.log'} warn;
events {{ worker_connections 256; }}
http {{
{temps}
    log_format replicas {LOG_FORMAT};
    access_log {tmp / 'access.log'} replicas;
    include {tmp / 'pymtp.conf'};
}}
"""


@contextlib.contextmanager
def nginx(binary: str, tmp: Path, upstream_ports: list[int]):
    """A foreground nginx balancing over ``upstream_ports``; yields its base URL."""
    port = free_port()
    (tmp / "pymtp.conf").write_text(render_config(upstream_ports, port))
    conf = tmp / "nginx.conf"
    conf.write_text(main_config(tmp))
    cmd = [binary, "-p", f"{tmp}/", "-c", str(conf)]
    check = subprocess.run([*cmd, "-t"], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, f"nginx -t refused the config:\n{check.stderr}"
    log = tmp / "nginx.out"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"nginx exited with {proc.returncode}:\n{log.read_text()}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, f"nginx did not listen in 30 s:\n{log.read_text()}"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@dataclass
class LogLine:
    """One request in nginx's access log."""
    at: float                 # when it ended (epoch seconds)
    status: int               # what the client got
    uri: str
    tried: list[str]          # replicas nginx tried, in order ("127.0.0.1:PORT")
    statuses: list[str]       # each try's status ("502" for a refused connection)


def read_access_log(path: Path) -> list[LogLine]:
    out = []
    for line in path.read_text().splitlines():
        msec, status, _method, uri, rest = line.split(" ", 4)
        addr, statuses = (part.strip('"') for part in rest.split('" "'))
        out.append(LogLine(float(msec), int(status), uri, addr.split(", "), statuses.split(", ")))
    return out


@dataclass
class Cluster:
    """Two replicas (fixed ports, so one can be restarted in place) behind one nginx."""
    base_url: str
    ports: list[int]
    servers: list[LiveServer]
    tmp: Path
    stack: contextlib.ExitStack
    restarted_at: dict[int, float] = field(default_factory=dict)   # replica index -> new start

    def restart(self, i: int) -> None:
        """SIGTERM replica ``i``, wait for its drained exit (status 0), start it again on the
        same port."""
        old = self.servers[i]
        old.proc.send_signal(signal.SIGTERM)
        assert old.proc.wait(timeout=90) == 0, old.log.read_text()[-2000:]
        time.sleep(0.5)                       # a deploy's gap; also keeps the two lifetimes apart in time
        self.restarted_at[i] = time.time()
        self.servers[i] = self.stack.enter_context(live_server(REPLICA_ARGS, self.tmp, port=self.ports[i]))

    def addr(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"


@pytest.fixture
def cluster(tmp_path):
    binary = find_nginx()
    if binary is None:
        pytest.skip("no nginx binary (PATH, /usr/sbin/nginx, $PYMTP_NGINX); on Debian: apt-get install nginx")
    ports = [free_port(), free_port()]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(live_server(REPLICA_ARGS, tmp_path, port=p)) for p in ports]
        base = stack.enter_context(nginx(binary, tmp_path, ports))
        yield Cluster(base, ports, servers, tmp_path, stack)


def generated_ok(server: LiveServer) -> int:
    """Generation requests this replica process answered with 200 (its /metrics)."""
    m = server.metrics()
    return int(sum(m.get(f"pymtp_requests_total{{route={r},status=200}}", 0) for r in GENERATION_ROUTES))


def request_body(n: int) -> tuple[str, dict]:
    """The n-th request of a client: completions and chat, each streamed and not."""
    stream = n % 2 == 1
    base = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    if n % 4 < 2:
        return "/v1/completions", {**base, "prompt": f"def f{n % 7}(x):"}
    return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": f"Count to {n % 7}."}]}


def problem(route: str, body: dict, r: httpx.Response) -> str | None:
    """What a client would find wrong with this answer (None: a whole, normal answer)."""
    if r.status_code != 200:
        return f"{route} -> {r.status_code}: {r.text[:300]}"
    # ignore_eos runs a completion to max_tokens; a chat reply may still end at the
    # template's end-of-turn text, a stop string
    ends = ("length",) if route == "/v1/completions" else ("length", "stop")
    try:
        if body["stream"]:
            chunks = parse_sse(r.text)
            assert not [c for c in chunks if "error" in c], chunks[-1]
            assert finish_reason(chunks) in ends, chunks[-1]
            if route == "/v1/completions":
                assert completion_text(chunks)
        else:
            out = r.json()
            assert out["choices"][0]["finish_reason"] in ends, out
            if route == "/v1/completions":
                assert out["usage"]["completion_tokens"] == MAX_TOKENS, out["usage"]
    except (AssertionError, ValueError, KeyError) as exc:
        return f"{route} stream={body['stream']}: {exc!r}"
    return None


class Load:
    """``CLIENTS`` threads sending requests through nginx back to back, with no retries of
    their own, until stopped; every answer is checked."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.halt = threading.Event()
        self.lock = threading.Lock()
        self.done: Counter[str] = Counter()      # "stream"/"plain" -> answers
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads), "a client is stuck past its timeouts"

    @property
    def total(self) -> int:
        with self.lock:
            return sum(self.done.values()) + len(self.errors)

    def client(self, i: int) -> None:
        n = i
        with httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(120, connect=10)) as http:
            while not self.halt.is_set():
                route, body = request_body(n)
                try:
                    wrong = problem(route, body, http.post(route, json=body))
                except httpx.HTTPError as exc:
                    wrong = f"{route} stream={body['stream']}: {exc!r}"
                with self.lock:
                    if wrong:
                        self.errors.append(wrong)
                    else:
                        self.done["stream" if body["stream"] else "plain"] += 1
                n += 1

    def wait_for(self, ok, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s ({self.total} requests done)"
            assert all(t.is_alive() for t in self.threads), "a client thread died"
            time.sleep(0.05)


def logged(cluster: Cluster, n: int, timeout: float = 10.0) -> list[LogLine]:
    """The access log's generation requests, once all ``n`` are in (nginx writes a line as a
    request ends, a moment after its client has the last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [x for x in read_access_log(cluster.tmp / "access.log") if x.uri in GENERATION_ROUTES]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_restart_under_load_no_client_sees_an_error(cluster):
    b = 1                                                    # the replica restarted
    with Load(cluster.base_url) as load:
        load.wait_for(lambda: load.total >= 4 * CLIENTS, "the first requests")
        # restart while the replica is generating, so its drain has something to finish
        cluster.servers[b].wait_metrics(lambda m: m["pymtp_slots_busy"] >= 1, "a request running on it")
        signalled = time.time()
        cluster.restart(b)
        load.wait_for(lambda: generated_ok(cluster.servers[b]) >= 16, "the restarted replica back in use")
    assert load.errors == [], f"{len(load.errors)} of {load.total} clients saw an error: {load.errors[:5]}"

    lines = logged(cluster, load.total)
    assert len(lines) == load.total and all(x.status == 200 for x in lines), \
        [x for x in lines if x.status != 200][:5]
    a_addr, b_addr = cluster.addr(0), cluster.addr(b)
    by_replica = Counter(x.tried[-1] for x in lines)
    b_old = [x for x in lines if x.tried[-1] == b_addr and x.at < cluster.restarted_at[b]]
    b_new = [x for x in lines if x.tried[-1] == b_addr and x.at >= cluster.restarted_at[b]]
    retried = [x for x in lines if len(x.tried) > 1]
    refusals = Counter(x.statuses[0] for x in retried)       # "503": draining; "502": port closed
    print(f"\nreplicas behind nginx: {load.total} requests ({dict(load.done)}), {len(load.errors)} errors, "
          f"1 restart; served by A {by_replica[a_addr]}, B {len(b_old)} before its restart and "
          f"{len(b_new)} after; {len(retried)} passed on by nginx ({dict(refusals)})")

    # the counts nginx saw are each replica process's own: A all along, B since its restart
    assert generated_ok(cluster.servers[0]) == by_replica[a_addr]
    assert generated_ok(cluster.servers[b]) == len(b_new) >= 16
    # spread: each replica served a good share
    assert min(by_replica[a_addr], by_replica[b_addr]) >= 0.15 * load.total, by_replica
    # the drain let B finish requests it was running at SIGTERM, through nginx
    assert [x for x in b_old if x.at >= signalled]
    # and what B refused meanwhile (a 503 while draining, a closed port while it was down)
    # went to A: nginx's retries are what kept every client's answer whole
    assert retried and all(x.tried[0] == b_addr and x.tried[-1] == a_addr for x in retried), retried[:5]
    assert set(refusals) <= {"503", "502"}, refusals


def test_streams_pass_through_as_generated_and_no_replica_is_a_json_503(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.base_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        # the first tokens reached the client while the replica was still generating
        busy = sum(s.metrics()["pymtp_slots_busy"] for s in cluster.servers)
        rest = [first, *lines]
    assert busy == 1, busy
    chunks = parse_sse("".join(line + "\n" for line in rest))
    assert finish_reason(chunks) == "length" and len(completion_text(chunks)) > 0

    for server in cluster.servers:
        assert stop(server.proc, grace=60) == 0
    r = httpx.post(cluster.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "no_replica_available"
