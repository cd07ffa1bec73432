"""Drive upstream ``llama-server`` processes so ``pymtp bench`` can measure them beside pymtp.

One server per setting (no-spec, or MTP at one depth and p_min), each started once on a
free loopback port and stopped when the bench ends. An idle server waits on its socket, so
the servers that are not being measured take no CPU time.

The request pieces are pure functions (``server_command``, ``completion_body``,
``parse_completion``) so they can be tested without a binary. Nothing here imports
llama_cpp: the bench passes token ids in and reads token ids out.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .config import DEFAULTS, cpu_has_amx
from .testing.processes import free_port

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 900.0
# pymtp's sampler order (see sampling_filters.py); sent explicitly so llama-server's default chain
# (penalties, DRY, top_n_sigma, typical_p, XTC ...) cannot add a filter pymtp lacks.
SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]

Key = tuple[int, float]   # (draft_max, p_min); draft_max 0 = no speculative decoding


@dataclass(frozen=True)
class Completion:
    """What the bench needs from one ``/completion`` response."""

    tokens: list[int]     # generated token ids
    tok_s: float          # timings.predicted_per_second
    drafted: int          # timings.draft_n (absent = 0)
    accepted: int         # timings.draft_n_accepted
    prompt_tokens: int    # timings.prompt_n: tokens processed, so 0 would mean a cache hit
    request_s: float = 0.0    # timings.prompt_ms + predicted_ms, in seconds: the whole request


def server_command(binary: str, model: str, *, port: int, threads: int, n_ctx: int, n_batch: int,
                   draft_max: int = 0, p_min: float = DEFAULTS.p_min, no_repack: bool = False,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The argv of one single-slot server; MTP flags only when ``draft_max > 0``."""
    cmd = [binary, "-m", model, "--host", HOST, "--port", str(port), "-np", "1",
           "-c", str(n_ctx), "-b", str(n_batch), "-ub", str(n_batch), "-t", str(threads), "-tb", str(threads)]
    if draft_max:
        cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(draft_max),
                "--spec-draft-p-min", f"{p_min:g}"]
    if no_repack:
        cmd.append("--no-repack")
    return cmd + list(extra_args)


def completion_body(prompt: Sequence[int], *, max_tokens: int, temperature: float = DEFAULTS.temperature,
                    top_k: int = DEFAULTS.top_k, top_p: float = DEFAULTS.top_p, min_p: float = DEFAULTS.min_p,
                    seed: int = 0, ignore_eos: bool = True) -> dict:
    """A ``/completion`` request that samples exactly as pymtp does with the same settings.

    Every sampler value is sent, because llama-server's own defaults (top_k 40, top_p 0.95,
    min_p 0.05, temperature 0.8) would otherwise apply. Greedy is top_k 1 at temperature 0.
    """
    greedy = temperature == 0
    return {
        "prompt": list(prompt), "n_predict": max_tokens, "ignore_eos": ignore_eos,
        "cache_prompt": False, "return_tokens": True, "stream": False,
        "samplers": SAMPLERS, "temperature": temperature, "seed": seed,
        "top_k": 1 if greedy else top_k, "top_p": 1.0 if greedy else top_p, "min_p": 0.0 if greedy else min_p,
        "typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "dynatemp_range": 0.0,
        "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
        "mirostat": 0, "n_probs": 0,
    }


def parse_completion(resp: dict) -> Completion:
    """Read tokens and timings from a non-streamed ``/completion`` response."""
    if "error" in resp:
        raise RuntimeError(f"llama-server error: {resp['error']}")
    timings = resp.get("timings")
    if not isinstance(timings, dict) or "predicted_per_second" not in timings:
        raise ValueError("llama-server response has no timings.predicted_per_second")
    if not isinstance(resp.get("tokens"), list):
        raise ValueError("llama-server response has no token ids (was return_tokens sent?)")
    return Completion(tokens=[int(t) for t in resp["tokens"]],
                      tok_s=float(timings["predicted_per_second"]),
                      drafted=int(timings.get("draft_n", 0)),
                      accepted=int(timings.get("draft_n_accepted", 0)),
                      prompt_tokens=int(timings.get("prompt_n", 0)),
                      request_s=(float(timings.get("prompt_ms", 0.0))
                                 + float(timings.get("predicted_ms", 0.0))) / 1e3)


def _http(url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except json.JSONDecodeError:
            return exc.code, {}


class LlamaServer:
    """One llama-server subprocess; ``start`` returns once ``/health`` answers 200."""

    def __init__(self, argv_for_port: Callable[[int], list[str]], log_path: Path) -> None:
        self._argv_for_port = argv_for_port
        self.log_path = log_path
        self.argv: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        # Another process can take the port between free_port() and the server's bind;
        # only that failure is retried, on a fresh port.
        for _ in range(3):
            port = free_port()
            self.argv = self._argv_for_port(port)
            self.url = f"http://{HOST}:{port}"
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT)
            if self._wait_healthy(timeout):
                return
            self.stop()
            if "couldn't bind" not in self.log_tail():
                break
        raise RuntimeError(f"llama-server did not start: {' '.join(self.argv)}\n{self.log_tail()}")

    def _wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if _http(self.url + "/health", timeout=2.0)[0] == 200:
                    return True
            except (urllib.error.URLError, OSError, json.JSONDecodeError):
                pass
            time.sleep(0.1)
        return False

    def complete(self, body: dict) -> dict:
        status, resp = _http(self.url + "/completion", body)
        if status != 200:
            raise RuntimeError(f"llama-server /completion returned {status}: {resp}")
        return resp

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class LlamaServerPool:
    """A server per (draft_max, p_min), all started on ``__enter__`` and stopped on exit."""

    def __init__(self, binary: str, model: str | os.PathLike, keys: Iterable[Key], *, threads: int | None,
                 n_ctx: int, n_batch: int, no_repack: bool | None = None, extra_args: Sequence[str] = ()) -> None:
        if not Path(binary).is_file():
            raise ValueError(f"llama-server binary not found: {binary}")
        self.binary, self.model = str(binary), str(model)
        self.keys = list(dict.fromkeys(keys))
        self.options = dict(threads=threads or os.cpu_count() or 1, n_ctx=n_ctx, n_batch=n_batch,
                            no_repack=cpu_has_amx() if no_repack is None else no_repack,
                            extra_args=tuple(extra_args))
        self.servers: dict[Key, LlamaServer] = {}
        self._logs: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> LlamaServerPool:
        self._logs = tempfile.TemporaryDirectory(prefix="pymtp-llama-server-")
        try:
            for k, p in self.keys:
                server = LlamaServer(lambda port, k=k, p=p: server_command(
                    self.binary, self.model, port=port, draft_max=k, p_min=p, **self.options),
                    Path(self._logs.name) / f"k{k}-p{p:g}.log")
                self.servers[(k, p)] = server
                server.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            for server in self.servers.values():
                server.stop()
        finally:
            self.servers.clear()
            if self._logs is not None:
                self._logs.cleanup()
                self._logs = None

    def commands(self) -> dict[str, str]:
        """The argv of every running server, for the report (ports differ run to run)."""
        return {f"k={k} p_min={p:g}" if k else "no-spec": " ".join(s.argv) for (k, p), s in self.servers.items()}

    def complete(self, key: Key, body: dict) -> Completion:
        server = self.servers[key]
        try:
            return parse_completion(server.complete(body))
        except (OSError, urllib.error.URLError) as exc:
            raise RuntimeError(f"llama-server ({key}) failed: {exc}\n{server.log_tail()}") from exc
