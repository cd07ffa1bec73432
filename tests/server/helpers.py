"""Helpers for the server tests: in-process apps, real ``pymtp serve`` processes on
loopback ports, and reading a server-sent-event body the way a strict client would."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from pymtp.server import ServerSettings, create_app
from pymtp.testing.processes import child_env, free_port, stop, wait_healthy

REPO = Path(__file__).resolve().parents[2]
# The body fields that make two runs of one request decode alike on every backend: no
# prompt-cache hit (on a GPU build a cached run decodes the rest of its prompt in other
# batch shapes, conftest.CACHE_CHUNKS) and one fixed depth (the default, auto, may give the
# second run another, whose verify batches a GPU rounds differently). Either parted a
# streamed answer from the whole one at a near-tie on an H200 (session 66).
COLD = {"cache_prompt": False, "draft_max": 3}


@contextlib.contextmanager
def app_client(model, settings: ServerSettings | None = None, sessions=None):
    """A TestClient on a fresh app (own registry, own sessions), lifespan included."""
    app = create_app(model, settings or ServerSettings(parallel=2), sessions=sessions)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def _serve_command() -> list[str]:
    """``pymtp serve`` once the lead has registered it, the module's own entry until then."""
    from pymtp import cli

    if "serve" in getattr(cli.main, "commands", {}):
        return [sys.executable, "-m", "pymtp.cli", "serve"]
    return [sys.executable, "-m", "pymtp.server.cli"]


class LiveServer:
    def __init__(self, base_url: str, proc: subprocess.Popen, log: Path) -> None:
        self.base_url = base_url
        self.proc = proc
        self.log = log

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by ``name{labels}``, as floats."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_metrics(self, ok, what: str, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until ``ok(samples)``; fail naming ``what`` with the last samples."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if ok(m):
                return m
            assert time.monotonic() < deadline, f"{what}: {m}"
            time.sleep(0.05)


@contextlib.contextmanager
def live_server(args: list[str], tmp: Path, timeout: float = 60.0, port: int | None = None):
    """A ``pymtp serve`` on 127.0.0.1 (``port``, or a free one), stopped at exit. A server
    started again on the same port (a replica's restart) adds to the same log."""
    port = port or free_port()
    log = tmp / f"serve-{port}.log"
    cmd = _serve_command() + args + ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    env = child_env(REPO)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base + "/health", log, timeout=timeout, what="pymtp serve", poll=0.1)
        yield LiveServer(base, proc, log)
    finally:
        stop(proc)


def parse_sse(body: str, done: bool = True) -> list[dict]:
    """The JSON objects of a ``data:`` stream; asserts the framing and the final [DONE]
    (``done``), or (llama-server's /completion) that there is none."""
    assert body.endswith("data: [DONE]\n\n") == done, body[-200:]
    frames = body.split("\n\n")
    assert frames[-1] == ""
    frames = frames[:-1]
    if done:
        assert frames[-1] == "data: [DONE]"
        frames = frames[:-1]
    out = []
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame, frame
        out.append(json.loads(frame[len("data: "):]))
    return out


def chat_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def completion_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def finish_reason(chunks: list[dict]) -> str | None:
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert all(r is None for r in reasons[:-1]), reasons
    return reasons[-1]
