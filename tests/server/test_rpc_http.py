"""``pymtp serve --rpc`` with two real rpc-server workers on 127.0.0.1: the split server
answers as a local one does, and a worker killed mid-generation gives that request a
clear error while the server fails over and goes on serving (tests/test_rpc.py says what
the tests need to run)."""

from __future__ import annotations

import json

import httpx
import pytest

from pymtp.ggml_devices import rpc_add_server
from pymtp.testing.rpc_workers import find_rpc_server, rpc_workers

from .helpers import completion_text, live_server, parse_sse

RPC_SERVER = find_rpc_server()
pytestmark = pytest.mark.skipif(
    rpc_add_server() is None or RPC_SERVER is None,
    reason=("this pymtp build has no RPC backend (reinstall llama-cpp-python with "
            "CMAKE_ARGS=\"-DGGML_RPC=on\")" if rpc_add_server() is None else
            "no rpc-server binary: set PYMTP_RPC_SERVER, or build it with benchmarks/build_llama_server.sh"))

PROMPT = "def fibonacci(n):"


def _complete(base: str, max_tokens: int = 32) -> dict:
    r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_worker_killed_mid_stream_errors_that_request_and_the_server_goes_on(tmp_path):
    common = ["--parallel", "2", "--ctx-size", "512", "--threads", "1", "--no-webui"]
    with live_server(common, tmp_path) as local:
        want = _complete(local.base_url)["choices"][0]["text"]
    with rpc_workers(2, RPC_SERVER, tmp_path) as workers:
        split = ["--rpc", ",".join(ep for ep, _ in workers), "--tensor-split", "1,1,1"]
        with live_server(common + split, tmp_path, timeout=120) as server:
            assert _complete(server.base_url)["choices"][0]["text"] == want
            body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
            # httpx's read timeout bounds every wait: a hung server fails the test
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"]
                workers[0][1].kill()
                rest = "\n\n".join([first] + [line for line in lines if line]) + "\n\n"
            events = parse_sse(rest)
            assert events[-1]["error"]["code"] == "rpc_worker_lost", events[-1]
            assert "Remote RPC server crashed" in events[-1]["error"]["message"]
            assert len(completion_text(events[:-1])) > 0
            # the server failed over to this host alone: it answers, and as a local run does
            assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
            assert _complete(server.base_url)["choices"][0]["text"] == want
            log = server.log.read_text(errors="replace")
            assert "failed over" in log and "load the model again" not in log, log[-2000:]
