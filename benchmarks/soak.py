"""Soak ``pymtp serve --parallel 4`` with streaming clients that misbehave; check it holds.

    python benchmarks/soak.py                                  # 16 clients, 600 s, demo model
    python benchmarks/soak.py --clients 4 --duration 20 --json soak.json

1. Solo references: a ``--parallel 1`` server answers each distinct request alone.
2. The server under test gets ``--clients`` streaming clients for ``--duration`` seconds.
   Each request draws what its client does: read it to the end (``finish``); stop reading
   for a while after a few chunks, then read on (``stall``); reset the connection after a
   few chunks (``disconnect``, a TCP RST: a crashed client); close it after a few chunks
   (``cancel``, a FIN: a client that called ``stream.close()``); or give up on it before
   its response starts, while it waits for a slot (``abandon``).
3. The server's RSS is sampled every ``--rss-every`` seconds.
4. At the end /metrics must show no busy slot, no queued request and no request in
   flight but the scrape itself, and /slots no slot processing; the server must answer
   /health, and exit 0 on SIGTERM.

Violations: any 5xx or other non-200 status (the clients send valid requests, and no
more of them than the slots and the queue hold), an error event or a missing ``[DONE]``
in a stream, a request past ``--timeout``, a finished greedy response whose text, token
count or finish reason differs from its solo run, RSS growth after the warm-up beyond
``--max-rss-growth``, anything left in a slot or the queue. Exit status 1 on any, 2 when
the setup fails.

Clients speak HTTP/1.1 over their own sockets (not an HTTP library) so that they can
stop reading, reset or close exactly when they choose. A stalling client shrinks its
receive buffer, so the server's writes back up sooner.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_server import PROMPTS, ROUTES, piece, request_body  # noqa: E402
from pymtp.testing.processes import child_env, free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ACTIONS = ("finish", "stall", "disconnect", "cancel", "abandon")
MAX_TOKENS = (24, 64, 128)        # prompt i asks for MAX_TOKENS[i % 3]: short and long streams
STALL_RCVBUF = 4096               # bytes; the kernel doubles it


@dataclass(frozen=True)
class Job:
    route: str
    prompt: str
    max_tokens: int

    def body(self) -> bytes:
        return json.dumps(request_body(self.route, self.prompt, self.max_tokens)).encode()

    def __str__(self) -> str:
        return f"{self.route} {self.prompt!r} max_tokens={self.max_tokens}"


@dataclass(frozen=True)
class Answer:
    """What a finished greedy stream must reproduce."""

    text: str
    completion_tokens: int
    finish_reason: str


@dataclass
class Tally:
    actions: Counter = field(default_factory=Counter)     # what the clients meant to do
    outcomes: Counter = field(default_factory=Counter)    # what happened
    statuses: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    tokens: int = 0

    def violation(self, what: str) -> None:
        self.violations.append(what)


# --- one request on its own socket ----------------------------------------------------


class Conn:
    """One HTTP/1.1 request, read as its client chooses."""

    def __init__(self, sock: socket.socket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.sock, self.reader, self.writer = sock, reader, writer

    @classmethod
    async def open(cls, port: int, path: str, body: bytes, rcvbuf: int | None = None) -> "Conn":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        return cls(sock, reader, writer)

    async def head(self) -> tuple[int, dict[str, str]]:
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        return int(lines[0].split()[1]), headers

    async def body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                yield (await self.reader.readexactly(size + 2))[:-2]
        elif "content-length" in headers:
            yield await self.reader.readexactly(int(headers["content-length"]))
        else:
            yield await self.reader.read()

    async def events(self, headers: dict[str, str]) -> AsyncIterator[str]:
        buf = b""
        async for data in self.body(headers):
            buf += data
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                yield frame.decode()

    def reset(self) -> None:
        """Close with a TCP RST, as a crashed client or a dropped link does."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def request(port: int, job: Job, action: str, rng: random.Random, tally: Tally,
                  stall_max: float) -> Answer | None:
    """Send ``job`` and do ``action``; the answer when the stream was read to its end."""
    conn = await Conn.open(port, job.route, job.body(), STALL_RCVBUF if action == "stall" else None)
    try:
        if action == "abandon":
            try:
                # 10 ms to 1 s, log-uniform: a queue's wait is short on a fast machine
                status, headers = await asyncio.wait_for(conn.head(), 10 ** rng.uniform(-2, 0))
            except asyncio.TimeoutError:
                tally.outcomes["abandoned while waiting"] += 1
                return None
            tally.outcomes["abandon too late, read to the end"] += 1
            action = "finish"
        else:
            status, headers = await conn.head()
        tally.statuses[status] += 1
        if status != 200:
            body = b"".join([b async for b in conn.body(headers)])
            tally.violation(f"{status} for {job}: {body[:300]!r}")
            return None
        cut = rng.randint(1, 8) if action != "finish" else None
        text, chunks, usage, finish, done = [], 0, {}, None, False
        async for frame in conn.events(headers):
            if frame == "data: [DONE]":
                done = True
                break
            obj = json.loads(frame.removeprefix("data: "))
            if "error" in obj:
                tally.violation(f"error event in {job}: {obj['error']}")
                return None
            usage = obj.get("usage") or usage
            text.append(piece(obj))
            ends = [c["finish_reason"] for c in obj.get("choices") or () if c.get("finish_reason")]
            finish = ends[0] if ends else finish
            chunks += 1
            if chunks == cut:
                if action == "stall":
                    tally.outcomes["stalled, then read to the end"] += 1
                    await asyncio.sleep(rng.uniform(1.0, stall_max))
                elif action == "disconnect":
                    tally.outcomes["reset mid-stream"] += 1
                    conn.reset()
                    return None
                else:
                    tally.outcomes["closed mid-stream"] += 1
                    return None
        if not done:
            tally.violation(f"stream without [DONE] for {job} ({chunks} chunks)")
            return None
        tally.outcomes["finished"] += 1
        tally.tokens += usage.get("completion_tokens", 0)
        return Answer("".join(text), usage.get("completion_tokens", -1), finish or "")
    finally:
        await conn.close()


# --- the load ---------------------------------------------------------------------------


def make_jobs(n_prompts: int) -> list[Job]:
    return [Job(route, p, MAX_TOKENS[i % len(MAX_TOKENS)])
            for i, p in enumerate(PROMPTS[:n_prompts]) for route in ROUTES]


async def solo_answers(port: int, jobs: list[Job]) -> dict[Job, Answer]:
    tally, out = Tally(), {}
    for job in jobs:
        answer = await request(port, job, "finish", random.Random(0), tally, 0.0)
        if answer is None:
            raise RuntimeError(f"the solo run of {job} failed: {tally.violations}")
        out[job] = answer
    return out


async def client(i: int, port: int, jobs: list[Job], solo: dict[Job, Answer], args, deadline: float,
                 tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + i)
    weights = [args.finish, args.stall, args.disconnect, args.cancel, args.abandon]
    while time.monotonic() < deadline:
        job, action = rng.choice(jobs), rng.choices(ACTIONS, weights)[0]
        tally.actions[action] += 1
        try:
            answer = await asyncio.wait_for(request(port, job, action, rng, tally, args.stall_max),
                                            args.timeout)
        except asyncio.TimeoutError:
            tally.violation(f"{job} ({action}) took over {args.timeout} s")
            continue
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            tally.violation(f"{job} ({action}): {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.5)
            continue
        if answer is not None and answer != solo[job]:
            tally.violation(f"mismatch for {job}: {answer} != solo {solo[job]}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def sample_rss(pid: int, every: float, t0: float, curve: list, stop: asyncio.Event) -> None:
    while True:
        curve.append([round(time.monotonic() - t0, 1), round(rss_mb(pid), 1)])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
            return


async def soak(server: "Server", jobs: list[Job], solo: dict[Job, Answer], args) -> dict:
    tally, curve, stop = Tally(), [], asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_rss(server.proc.pid, args.rss_every, t0, curve, stop))
    await asyncio.gather(*(client(i, server.port, jobs, solo, args, t0 + args.duration, tally)
                           for i in range(args.clients)))
    elapsed = time.monotonic() - t0
    stop.set()
    await sampler
    curve.append([round(time.monotonic() - t0, 1), round(rss_mb(server.proc.pid), 1)])
    return {"elapsed_s": round(elapsed, 1), "requests": sum(tally.actions.values()),
            "actions": dict(tally.actions), "outcomes": dict(tally.outcomes),
            "statuses": {str(k): v for k, v in tally.statuses.items()},
            "finished_tokens_per_s": round(tally.tokens / elapsed, 1),
            "rss_mb": curve, "rss": rss_summary(curve, args), "violations": tally.violations}


def rss_summary(curve: list, args) -> dict:
    """Growth from the end of the warm-up to the end (median of the last three samples),
    and the slope after the warm-up by least squares."""
    warm = min(args.warmup, args.duration / 4)
    after = [(t, mb) for t, mb in curve if t >= warm] or curve[-1:]
    base, end = after[0][1], statistics.median(mb for _, mb in curve[-3:])
    slope = 0.0
    if len(after) >= 3:
        slope = statistics.linear_regression([t for t, _ in after], [mb for _, mb in after]).slope * 60
    return {"warmup_s": warm, "after_warmup_mb": base, "end_mb": end, "growth_mb": round(end - base, 1),
            "slope_mb_per_min": round(slope, 2), "peak_mb": max(mb for _, mb in curve)}


# --- the server -------------------------------------------------------------------------


@dataclass
class Server:
    port: int
    proc: subprocess.Popen
    log: Path

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.get("/metrics")[1].splitlines():
            if m := re.match(r"^(pymtp_\w+(?:\{[^}]*\})?) (\S+)$", line):
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, as a load balancer's orchestrator sends; the exit status (None: killed)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


@contextlib.contextmanager
def serve(args, parallel: int, log: Path) -> Iterator[Server]:
    port = free_port()
    cmd = [sys.executable, "-m", "pymtp.cli", "serve", *([args.model] if args.model else []),
           "--parallel", str(parallel), "--threads", str(args.threads), "--ctx-size", str(args.ctx_size),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args.server_arg]
    env = child_env(REPO)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = Server(port, proc, log)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                if server.get("/health")[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become healthy in 120 s:\n{log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def final_checks(server: Server, before: dict[str, float], settle: float) -> tuple[dict, list[str]]:
    """Nothing left behind: wait up to ``settle`` s for the slots and the queue to empty."""
    deadline = time.monotonic() + settle
    while True:
        m = server.metrics()
        if (m["pymtp_slots_busy"] == 0 and m["pymtp_queue_waiting"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    delta = {k: v - before.get(k, 0.0) for k, v in m.items()}
    final = {"slots_busy": m["pymtp_slots_busy"], "queue_waiting": m["pymtp_queue_waiting"],
             "requests_in_flight": m["pymtp_requests_in_flight"],
             "server_statuses": {k: v for k, v in delta.items() if k.startswith("pymtp_requests_total") and v},
             "errors": {k: v for k, v in delta.items() if k.startswith("pymtp_errors_total") and v},
             "generations": {k: v for k, v in delta.items() if k.startswith("pymtp_generations_total") and v}}
    bad = []
    if final["slots_busy"] or final["queue_waiting"]:
        bad.append(f"after {settle} s: {final['slots_busy']:.0f} busy slots, {final['queue_waiting']:.0f} queued")
    if final["requests_in_flight"] != 1:        # the scrape itself
        bad.append(f"{final['requests_in_flight']:.0f} requests in flight, not just the scrape")
    for k, v in final["server_statuses"].items():
        if re.search(r'status="5\d\d"', k):
            bad.append(f"the server counted {v:.0f} x {k}")
    if final["errors"].get('pymtp_errors_total{type="server_error"}'):
        bad.append(f"the server counted server errors: {final['errors']}")
    health = server.get("/health")
    if health[0] != 200:
        bad.append(f"/health answers {health}")
    # each slot's last request ended, however its client left (llama-server's /slots)
    status, text = server.get("/slots")
    final["slots_processing"] = [s["id"] for s in json.loads(text) if s["is_processing"]] if status == 200 else None
    if final["slots_processing"] != []:
        bad.append(f"/slots answers {status}: still processing {final['slots_processing']}")
    return final, bad


# --- main -------------------------------------------------------------------------------


def run(args) -> dict:
    jobs = make_jobs(args.prompts)
    work = Path(args.log_dir)
    work.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    with serve(args, 1, work / "soak-solo.log") as solo_server:
        solo = asyncio.run(solo_answers(solo_server.port, jobs))
        solo_server.stop()
    print(f"solo references: {len(jobs)} requests in {time.monotonic() - t:.1f} s", file=sys.stderr)
    with serve(args, args.parallel, work / "soak-server.log") as server:
        before = server.metrics()
        report = asyncio.run(soak(server, jobs, solo, args))
        report["final"], bad = final_checks(server, before, args.settle)
        report["exit_status"] = server.stop()
    report["violations"] += bad
    if report["exit_status"] != 0:
        report["violations"].append(f"on SIGTERM the server exited with {report['exit_status']}, not 0")
    if report["rss"]["growth_mb"] > args.max_rss_growth:
        report["violations"].append(f"RSS grew {report['rss']['growth_mb']} MB after the warm-up "
                                    f"(limit {args.max_rss_growth} MB)")
    unused = [a for a in ACTIONS if getattr(args, a) > 0 and not report["actions"].get(a)]
    report["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    report["unexercised_actions"] = unused
    return report


def print_report(r: dict) -> None:
    print(f"{r['requests']} requests in {r['elapsed_s']} s from {r['settings']['clients']} clients on "
          f"--parallel {r['settings']['parallel']}; finished streams {r['finished_tokens_per_s']} tokens/s")
    print("actions:  " + ", ".join(f"{k} {v}" for k, v in sorted(r["actions"].items())))
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items())))
    print("statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())))
    print(f"server:   {r['final']}  exit status on SIGTERM: {r['exit_status']}")
    s = r["rss"]
    print(f"RSS (MB): {s['after_warmup_mb']} after the {s['warmup_s']} s warm-up, {s['end_mb']} at the end "
          f"(growth {s['growth_mb']}, slope {s['slope_mb_per_min']} MB/min, peak {s['peak_mb']})")
    print("  " + "  ".join(f"{t:g}s:{mb:g}" for t, mb in r["rss_mb"]))
    print(f"{len(r['violations'])} violations")
    for v in r["violations"][:20]:
        print("  VIOLATION", v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="GGUF to serve (default: the embedded demo model)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--parallel", type=int, default=4, help="slots of the server under test")
    p.add_argument("--threads", type=int, default=1, help="per slot, for both servers (equal results)")
    p.add_argument("--ctx-size", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"distinct prompts, 1..{len(PROMPTS)}")
    for action, weight in zip(ACTIONS, (0.45, 0.15, 0.15, 0.15, 0.10)):
        p.add_argument(f"--{action}", type=float, default=weight, help=f"weight of the {action} action")
    p.add_argument("--stall-max", type=float, default=5.0, help="longest stall, seconds")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before RSS must stay flat "
                   "(at most a quarter of the duration)")
    p.add_argument("--max-rss-growth", type=float, default=64.0, help="MB allowed after the warm-up")
    p.add_argument("--settle", type=float, default=10.0, help="seconds for slots and queue to empty")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for pymtp serve (repeat)")
    p.add_argument("--log-dir", default="/tmp", help="where the servers' logs go")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report here")
    args = p.parse_args(argv)
    queue = 4 * args.parallel      # pymtp serve's default --queue
    if args.clients > args.parallel + queue:
        p.error(f"{args.clients} clients exceed {args.parallel} slots + {queue} queue places: "
                "the 503s would be expected")
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be 1..{len(PROMPTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except RuntimeError as exc:
        print(f"setup failed: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
