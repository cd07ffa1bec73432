"""A model split across llama.cpp RPC workers (pymtp/rpc.py), on loopback only.

The pure parts (endpoints, the split, the handshake against scripted TCP peers) run
everywhere. The rest starts two real rpc-server processes on 127.0.0.1 and needs a pymtp
build with RPC (CMAKE_ARGS="-DGGML_RPC=on") and the rpc-server binary that
benchmarks/build_llama_server.sh builds ($PYMTP_RPC_SERVER, or beside $PYMTP_LLAMA_SERVER).
"""

from __future__ import annotations

import math
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest

import pymtp
from pymtp.rpc import (RPC_PROTO_VERSION, RemoteCalls, RpcUnreachable, RpcUnsupported, RpcVersionMismatch, RpcWorkerLost,
                       one_worker_each, parse_endpoints, plan_split, probe, refusing)
from pymtp.testing.rpc_workers import find_rpc_server, rpc_workers

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "The capital of France is"]


# ---------------------------------------------------------------------------- pure


def test_endpoints_parsed_and_bad_ones_named():
    assert parse_endpoints("10.0.0.2:50052, 10.0.0.3:50053") == ("10.0.0.2:50052", "10.0.0.3:50053")
    for bad in ("10.0.0.2", "host:0", "host:port", ":50052", "a:1,a:1", ""):
        with pytest.raises(ValueError, match="rpc: "):
            parse_endpoints(bad)


@pytest.mark.parametrize("endpoint", ["[::1]:50052", "::1:50052", "[127.0.0.1]:50052", "fe80::1:50052"])
def test_an_ipv6_or_bracketed_endpoint_is_refused_as_such(endpoint):
    """ggml-rpc cuts an endpoint at its first ':' and connects over IPv4: these passed
    here and failed at the connection, blamed on a lost worker."""
    with pytest.raises(ValueError, match=r"ggml-rpc reaches workers over IPv4 only"):
        parse_endpoints(endpoint)


def test_one_worker_under_two_names_is_refused_before_connecting():
    """127.0.0.1:P and localhost:P passed as two workers: ggml-rpc's second connection
    waited out rpc_timeout (300 s) on a worker that serves one client, then blamed it."""
    with pytest.raises(ValueError, match=r"127\.0\.0\.1:50052 and localhost:50052 are one worker \(127\.0\.0\.1:50052\)"):
        one_worker_each(["127.0.0.1:50052", "localhost:50052"])
    names = {"a": "10.0.0.2", "b": "10.0.0.2", "c": "10.0.0.3"}
    with pytest.raises(ValueError, match="a:1 and b:1 are one worker"):
        one_worker_each(["a:1", "c:1", "b:1"], names.__getitem__)
    one_worker_each(["a:1", "b:2", "c:1"], names.__getitem__)          # other ports, other hosts

    def unknown(host: str) -> str:
        raise socket.gaierror(host)
    one_worker_each(["x:1", "y:1"], unknown)         # the handshake names what does not resolve


def test_cpu_head_keeps_its_share_as_the_first_layers():
    # 8 blocks + output = 9 units; equal shares: 3 stay on the CPU, 6 go to 2 workers
    s = plan_split(9, [1, 1, 1], n_local_devices=0)
    assert (s.n_gpu_layers, s.tensor_split) == (6, (1.0, 1.0))
    s = plan_split(9, [2, 1], n_local_devices=0)
    assert (s.n_gpu_layers, s.tensor_split) == (3, (1.0,))


def test_gpu_head_passes_the_shares_through():
    s = plan_split(9, [3, 1, 1], n_local_devices=1)
    assert (s.n_gpu_layers, s.tensor_split) == (-1, (3.0, 1.0, 1.0))


def test_split_refuses_shares_without_weight():
    with pytest.raises(ValueError, match="positive sum"):
        plan_split(9, [0, 0], n_local_devices=0)
    with pytest.raises(ValueError, match=">= 0"):
        plan_split(9, [1, -1], n_local_devices=0)
    for shares in ([1, math.inf], [math.inf, 1], [1e308, 1e308], [math.nan, 1]):
        with pytest.raises(ValueError, match="finite numbers >= 0"):
            plan_split(9, shares, n_local_devices=0)


def test_a_call_waits_rpc_timeout_and_the_load_longer():
    """One call counts its worker lost after rpc_timeout; the load, which sends every
    worker its layers, waits that plus the file's bytes at 10 MiB/s (a large model's
    upload outlasted the 300 s and was reported as a lost worker)."""
    remote = RemoteCalls(["127.0.0.1:1"], timeout=0.05)
    try:
        assert remote.load_timeout(20 * 2**20) == pytest.approx(2.05)
        assert remote.call(time.sleep, 0.2, timeout=1.0) is None       # the load's own bound
        with pytest.raises(RpcWorkerLost, match=r"no reply within 0\.05 s \(rpc_timeout\)"):
            remote.call(time.sleep, 0.3)
    finally:
        remote.close()
    assert RemoteCalls(["127.0.0.1:1"], timeout=None).load_timeout(10**12) is None


def test_a_call_ending_as_its_worker_is_called_lost_settles_once(monkeypatch):
    """A call the helper thread finishes while another thread calls the worker lost (a
    timeout's caller, an abort): both settled its future, and the second raised
    InvalidStateError in place of RpcWorkerLost. Settling is under one lock now: the
    loss, called first, stands, and the finished call's result is dropped."""
    import pymtp.rpc

    running, failing, result_set, go = (threading.Event() for _ in range(4))

    class Watched(Future):
        def set_result(self, result):
            super().set_result(result)
            result_set.set()

        def set_exception(self, exc):
            failing.set()
            result_set.wait(1)        # the race's other side, where it can run meanwhile
            super().set_exception(exc)

    def work() -> int:
        running.set()
        go.wait(5)
        return 42

    monkeypatch.setattr(pymtp.rpc, "Future", Watched)
    remote = RemoteCalls(["127.0.0.1:1"], timeout=None)
    outcome: list = []
    errors: list = []

    def call() -> None:
        try:
            outcome.append(remote.call(work))
        except RpcWorkerLost as exc:
            outcome.append(exc)

    def lose() -> None:
        try:
            remote._lost("Remote RPC server crashed")
        except Exception as exc:      # noqa: BLE001 - what the test looks for
            errors.append(exc)

    try:
        caller = threading.Thread(target=call)
        caller.start()
        assert running.wait(5)
        loser = threading.Thread(target=lose)
        loser.start()
        assert failing.wait(5)
        go.set()
        caller.join(5)
        loser.join(5)
        assert errors == []
        assert len(outcome) == 1 and isinstance(outcome[0], RpcWorkerLost), outcome
    finally:
        go.set()
        remote.close()


def test_the_load_is_bounded_by_the_file_size(dense_path):
    """NativeModel's load through a worker's calls asks for rpc_timeout plus its bytes'
    worth; every later call takes the call's own bound."""
    from pymtp.native import NativeModel

    class Remote:
        timeout, lost = 7.0, None
        bounds: list = []

        def call(self, fn, *args, timeout="rpc_timeout"):
            self.bounds.append(timeout)
            return fn(*args)

        load_timeout = RemoteCalls.load_timeout

    remote = Remote()
    model = NativeModel(str(dense_path), remote=remote)
    try:
        assert remote.bounds[0] == pytest.approx(7.0 + os.path.getsize(dense_path) / (10 * 2**20))
        assert set(remote.bounds[1:]) <= {"rpc_timeout"}
    finally:
        model.remote = None
        model.close()


class _Peer:
    """A TCP peer on loopback that answers a HELLO as scripted (or not at all)."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.got = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            self.got = conn.recv(1 + 8 + 24)
            if self.reply is None:
                time.sleep(2)          # a worker busy with another head says nothing
            else:
                conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "_Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _hello_reply(major: int, minor: int, patch: int) -> bytes:
    return struct.pack("<Q", 28) + bytes([major, minor, patch, 0]) + bytes(24)


def test_probe_reads_the_worker_version():
    with _Peer(_hello_reply(*RPC_PROTO_VERSION)) as peer:
        assert probe(peer.endpoint, timeout=5) == RPC_PROTO_VERSION
        peer.thread.join(5)
        assert peer.got == struct.pack("<BQ", 14, 24) + bytes(24)     # HELLO with empty caps


def test_probe_names_a_version_mismatch():
    with _Peer(_hello_reply(RPC_PROTO_VERSION[0] - 1, 4, 0)) as peer:
        with pytest.raises(RpcVersionMismatch, match=rf"{peer.endpoint} speaks protocol 6\.4\.0, this build 7\.0\.0"):
            probe(peer.endpoint, timeout=5)


def test_probe_names_a_short_handshake_as_another_protocol():
    with _Peer(struct.pack("<Q", 4) + bytes([3, 0, 0, 0])) as peer:
        with pytest.raises(RpcVersionMismatch, match="answered the handshake with 4 bytes"):
            probe(peer.endpoint, timeout=5)


def test_probe_of_a_silent_worker_times_out_and_says_why():
    with _Peer(None) as peer:
        with pytest.raises(RpcUnreachable, match="one client at a time"):
            probe(peer.endpoint, timeout=0.5)


def test_probe_of_a_closed_port_is_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]        # bound, never listening: refused
        with pytest.raises(RpcUnreachable, match=rf"127\.0\.0\.1:{port} is unreachable.*rpc-server"):
            probe(f"127.0.0.1:{port}", timeout=2)


def test_a_lost_worker_among_several_is_the_one_refusing_connections():
    """ggml-rpc's abort names no endpoint; the guard names the worker that refuses a
    connection now, and says the others still take them."""
    with socket.socket() as live, socket.socket() as dead:
        live.bind(("127.0.0.1", 0))
        live.listen(1)             # never accepts, as an rpc-server serving its one client
        dead.bind(("127.0.0.1", 0))
        eps = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in (live, dead)]
        assert refusing(eps) == (eps[1],)
        guard = RemoteCalls(eps)
        try:
            guard._lost("ggml abort: Remote RPC server crashed or returned malformed response")
            with pytest.raises(RpcWorkerLost) as e:
                guard.call(int)
            assert str(e.value).startswith(f"RPC worker {eps[1]} failed: Remote RPC server crashed or returned "
                                           f"malformed response (it refuses connections now; {eps[0]} still "
                                           f"accepts them); this model can no longer decode")
        finally:
            guard.close()
        both = RemoteCalls([eps[1], eps[1].replace("127.0.0.1", "127.0.0.2")])   # none answers: none named
        try:
            both._lost("Remote RPC server crashed")
            with pytest.raises(RpcWorkerLost, match=r"^an RPC worker \(127\.0\.0\.1:\d+, 127\.0\.0\.2:\d+\) failed"):
                both.call(int)
        finally:
            both.close()


def test_tensor_split_without_workers_is_refused(dense_path):
    with pytest.raises(ValueError, match="tensor_split .* pass rpc="):
        pymtp.load(dense_path, tensor_split=(1, 1), threads=1)


@pytest.mark.parametrize("timeout", [0, -1, math.inf, math.nan, "30"])
def test_rpc_timeout_must_be_positive(dense_path, timeout):
    with pytest.raises(ValueError, match="rpc_timeout must be a number of seconds > 0"):
        pymtp.load(dense_path, rpc="127.0.0.1:50052", rpc_timeout=timeout, threads=1)


@pytest.mark.parametrize("options, message", [
    (dict(tensor_split=(1, math.inf)), "tensor_split must be finite numbers >= 0 with a positive sum"),
    (dict(tensor_split="1,1"), "tensor_split must be finite numbers >= 0 with a positive sum"),
    (dict(draft_vocab=100), "draft_vocab with rpc workers is not supported"),
])
def test_split_options_are_judged_before_any_worker_is_reached(dense_path, options, message):
    """Refused before a connection (here to a port nothing listens on) or the weights'
    upload: draft_vocab was refused only once the layers had gone to the workers."""
    with pytest.raises(ValueError, match=message):
        pymtp.load(dense_path, rpc="127.0.0.1:1", threads=1, **options)


def _has_rpc() -> bool:
    from pymtp.ggml_devices import rpc_add_server

    return rpc_add_server() is not None


def test_build_without_rpc_says_how_to_build_it(dense_path):
    if _has_rpc():
        pytest.skip("this build has the RPC backend")
    with pytest.raises(RpcUnsupported, match=r'CMAKE_ARGS="-DGGML_RPC=on" pip install'):
        pymtp.load(dense_path, rpc="127.0.0.1:50052", threads=1)


def test_cli_names_an_unreachable_worker():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        out = subprocess.run([sys.executable, "-m", "pymtp.cli", "generate", "--prompt", "x", "-n", "2",
                              "--rpc", endpoint], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    want = f"{endpoint} is unreachable" if _has_rpc() else "-DGGML_RPC=on"
    assert want in out.stderr, out.stderr


# ---------------------------------------------------------------------------- real workers

RPC_SERVER = find_rpc_server()
needs_workers = pytest.mark.skipif(
    not _has_rpc() or RPC_SERVER is None,
    reason=("this pymtp build has no RPC backend (reinstall llama-cpp-python with "
            "CMAKE_ARGS=\"-DGGML_RPC=on\")" if not _has_rpc() else
            "no rpc-server binary: set PYMTP_RPC_SERVER, or build it with benchmarks/build_llama_server.sh"))


@pytest.fixture(scope="module")
def local_demo():
    with pymtp.load(threads=1, n_ctx=512) as m:
        yield m


@pytest.fixture()
def workers(tmp_path):
    with rpc_workers(2, RPC_SERVER, tmp_path) as procs:
        yield procs


def _split(endpoints, **kw):
    return pymtp.load(threads=1, n_ctx=512, rpc=",".join(endpoints), tensor_split=(1, 1, 1), **kw)


@needs_workers
def test_split_three_ways_gives_the_local_tokens(local_demo, workers):
    with _split([ep for ep, _ in workers]) as m:
        n_units = m.info.block_count + 1
        assert m.placement.split.n_gpu_layers == round(n_units * 2 / 3)
        assert [n.split(" ")[-1] for n in m.placement.names[1:]] == [f"({ep})" for ep, _ in workers]
        for prompt in PROMPTS:
            want = local_demo.generate(prompt, max_tokens=48, spec="none")
            for k in (1, 3):
                got = m.generate(prompt, max_tokens=48, draft_max=k)
                assert got.tokens == want.tokens, (prompt, k)
                assert got.stats.drafted > 0


@needs_workers
def test_split_by_free_memory_by_default(local_demo, workers):
    with pymtp.load(threads=1, n_ctx=512, rpc=[ep for ep, _ in workers]) as m:
        assert len(m.placement.split.shares) == 3 and all(s > 0 for s in m.placement.split.shares)
        want = local_demo.generate(PROMPTS[0], max_tokens=24, spec="none")
        assert m.generate(PROMPTS[0], max_tokens=24).tokens == want.tokens


@needs_workers
def test_worker_killed_mid_generation_raises_then_fails_over(local_demo, workers):
    with _split([ep for ep, _ in workers], rpc_timeout=60) as m:
        stream = m.stream(PROMPTS[0], max_tokens=400, ignore_eos=True)
        next(stream)
        workers[1][1].kill()
        workers[1][1].wait(10)
        ended: list[BaseException] = []

        def drain() -> None:
            try:
                for _ in stream:
                    pass
            except BaseException as exc:
                ended.append(exc)

        t = threading.Thread(target=drain, daemon=True)     # a hang fails the test, not the run
        t.start()
        t.join(120)
        assert not t.is_alive(), "the generation hangs after its worker was killed"
        assert len(ended) == 1 and isinstance(ended[0], RpcWorkerLost), ended
        assert re.search(r"RPC worker .* failed: Remote RPC server crashed", str(ended[0])), ended[0]
        # ggml-rpc names no endpoint: the killed one is told apart by refusing connections
        dead, alive = workers[1][0], workers[0][0]
        assert f"RPC worker {dead} failed: " in str(ended[0]) and f"{alive} still accepts them" in str(ended[0])
        with pytest.raises(RpcWorkerLost):       # the split model stays refused, at once
            m.generate(PROMPTS[1], max_tokens=4)
        m.fail_over_to_local()
        assert m.placement is None
        want = local_demo.generate(PROMPTS[1], max_tokens=32, spec="none")
        assert m.generate(PROMPTS[1], max_tokens=32).tokens == want.tokens


@needs_workers
def test_two_models_share_the_workers_of_one_process(local_demo, workers):
    # ggml-rpc holds one connection per worker for the process; the second load must not
    # probe a worker that connection keeps busy
    endpoints = [ep for ep, _ in workers]
    with _split(endpoints) as a, pymtp.load(threads=1, n_ctx=512, rpc=endpoints[:1], tensor_split=(1, 1)) as b:
        want = local_demo.generate(PROMPTS[2], max_tokens=16, spec="none").tokens
        assert a.generate(PROMPTS[2], max_tokens=16).tokens == want
        assert b.generate(PROMPTS[2], max_tokens=16).tokens == want
    c = _split(endpoints)        # closed models let go of the connection: probed anew
    c.close()
