"""Load a running ``pymtp serve`` with concurrent streaming clients, some of which hang up.

    pymtp serve --parallel 4 &                    # the embedded demo model on 127.0.0.1:8080
    python benchmarks/load_server.py --clients 16 --duration 60

Each client loops until the deadline (or ``--max-requests``), sending greedy streamed
completion and chat requests drawn from a fixed set; ``--disconnect-rate`` of them are
closed after a random number of chunks. Every distinct request is first run alone, and
every response that finishes under load must equal its solo text, token for token.

Reports status codes, 5xx other than the deliberate 503, in-band stream errors,
requests/s, tokens/s (seen by clients and counted by the server), latency percentiles,
and MTP acceptance from the /metrics deltas. Only loopback addresses are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import socket
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "Once upon a time", "def fibonacci(n):", "The capital of France is", "import numpy as np\n",
    "In 1492, Columbus", "class Stack:\n    def", "The quick brown fox", "Dear Sir or Madam,",
    "SELECT name FROM users WHERE", "# Install the package with pip\n", "Photosynthesis is",
    "for i in range(10):\n",
]
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)   # finished, disconnected, stream_error, ...
    mismatches: list[str] = field(default_factory=list)
    tokens_seen: int = 0
    latencies: list[float] = field(default_factory=list)     # whole request, finished ones
    first_chunk: list[float] = field(default_factory=list)   # time to first text


def require_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        sys.exit(f"cannot resolve {host!r}")
    if not addr.is_loopback:
        sys.exit(f"{url} is not a loopback address; this load test only runs against 127.0.0.0/8 or ::1")


def request_body(route: str, prompt: str, max_tokens: int) -> dict:
    body: dict = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if route.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def piece(obj: dict) -> str:
    if not obj.get("choices"):
        return ""
    c = obj["choices"][0]
    if "delta" in c:
        return c["delta"].get("content") or ""
    return c.get("text") or ""


async def stream_one(client: httpx.AsyncClient, route: str, body: dict, tally: Tally,
                     hang_up_after: int | None = None) -> str | None:
    """Send one streamed request; the text if it finished, None otherwise."""
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", route, json=body) as r:
            tally.statuses[r.status_code] += 1
            if r.status_code != 200:
                await r.aread()
                tally.outcomes["rejected"] += 1
                if r.status_code == 503:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                return None
            text, chunks, usage = [], 0, None
            async for line in r.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    break
                obj = json.loads(line.removeprefix("data: "))
                if "error" in obj:
                    tally.outcomes["stream_error"] += 1
                    return None
                usage = obj.get("usage") or usage
                if piece(obj):
                    if not text:
                        tally.first_chunk.append(time.perf_counter() - t0)
                    text.append(piece(obj))
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    tally.outcomes["disconnected"] += 1
                    return None          # leaving the block closes the connection mid-stream
            else:
                tally.outcomes["no_done"] += 1
                return None
    except httpx.HTTPError as exc:
        tally.outcomes[f"transport_error:{type(exc).__name__}"] += 1
        return None
    tally.outcomes["finished"] += 1
    tally.latencies.append(time.perf_counter() - t0)
    tally.tokens_seen += (usage or {}).get("completion_tokens", 0)
    return "".join(text)


async def client_loop(i: int, client: httpx.AsyncClient, solo: dict, args, deadline: float, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + i)
    for _ in range(args.max_requests):
        if time.monotonic() >= deadline:
            return
        route, prompt = rng.choice(sorted(solo))
        hang_up = rng.randint(1, 8) if rng.random() < args.disconnect_rate else None
        text = await stream_one(client, route, request_body(route, prompt, args.max_tokens), tally, hang_up)
        if text is not None and text != solo[(route, prompt)]:
            tally.mismatches.append(f"{route} {prompt!r}: {text!r} != {solo[(route, prompt)]!r}")


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    out = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("pymtp_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def acceptance(before: dict, after: dict) -> dict:
    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)   # noqa: E731
    drafted, accepted, rounds = d("pymtp_draft_tokens_total"), d("pymtp_draft_tokens_accepted_total"), \
        d("pymtp_verify_rounds_total")
    positions = []
    for i in range(16):
        dk = d(f'pymtp_draft_position_drafted_total{{position="{i}"}}')
        if not dk:
            break
        positions.append(round(d(f'pymtp_draft_position_accepted_total{{position="{i}"}}') / dk, 3))
    return {"generated_tokens": d("pymtp_generated_tokens_total"), "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accept_len": round((accepted + rounds) / rounds, 3) if rounds else 0.0,
            "accepted_per_position": positions,
            "generations": {k.split('"')[1]: d(k) for k in after if k.startswith("pymtp_generations_total{")},
            "server_errors": {k.split('"')[1]: d(k) for k in after if k.startswith("pymtp_errors_total{")}}


def pct(xs: list[float], q: float) -> float:
    return round(statistics.quantiles(xs, n=100)[q - 1], 4) if len(xs) >= 2 else (xs[0] if xs else 0.0)


async def main(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        solo_tally = Tally()
        solo = {}
        for route in ROUTES:
            for prompt in PROMPTS:
                text = await stream_one(client, route, request_body(route, prompt, args.max_tokens), solo_tally)
                if text is None:
                    print(f"solo run failed: {route} {prompt!r} {solo_tally.statuses}", file=sys.stderr)
                    return 2
                solo[(route, prompt)] = text
        before = await scrape(client)
        tally = Tally()
        t0 = time.monotonic()
        await asyncio.gather(*(client_loop(i, client, solo, args, t0 + args.duration, tally)
                               for i in range(args.clients)))
        elapsed = time.monotonic() - t0
        await asyncio.sleep(0.5)          # let cancelled generations report before the last scrape
        after = await scrape(client)
    sent = sum(tally.statuses.values())
    bad_5xx = sum(n for s, n in tally.statuses.items() if s >= 500 and s != 503)
    acc = acceptance(before, after)
    report = {
        "url": args.url, "clients": args.clients, "duration_s": round(elapsed, 1),
        "max_tokens": args.max_tokens, "disconnect_rate": args.disconnect_rate,
        "requests": sent, "statuses": dict(tally.statuses), "outcomes": dict(tally.outcomes),
        "unexpected_5xx": bad_5xx, "mismatches": len(tally.mismatches),
        "requests_per_s": round(sent / elapsed, 2),
        "finished_per_s": round(tally.outcomes["finished"] / elapsed, 2),
        "client_tokens_per_s": round(tally.tokens_seen / elapsed, 1),
        "server_tokens_per_s": round(acc["generated_tokens"] / elapsed, 1),
        "latency_s": {"p50": pct(tally.latencies, 50), "p95": pct(tally.latencies, 95)},
        "first_text_s": {"p50": pct(tally.first_chunk, 50), "p95": pct(tally.first_chunk, 95)},
        "server": acc,
    }
    print(json.dumps(report, indent=2))
    for m in tally.mismatches[:5]:
        print("MISMATCH", m, file=sys.stderr)
    ok = bad_5xx == 0 and not tally.mismatches and tally.outcomes["stream_error"] == 0
    return 0 if ok else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0, help="seconds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--disconnect-rate", type=float, default=0.2)
    p.add_argument("--max-requests", type=int, default=10_000, help="per client, a bound on the loop")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    require_loopback(a.url)
    sys.exit(asyncio.run(main(a)))
