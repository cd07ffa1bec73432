"""Load a running ``pymtp serve`` with concurrent streaming clients, some of which hang up.

    pymtp serve --parallel 4 &                    # the embedded demo model on 127.0.0.1:8080
    python benchmarks/load_server.py --clients 16 --duration 60

Each client loops until the deadline (or ``--max-requests``), sending greedy streamed
completion and chat requests drawn from a fixed set; ``--disconnect-rate`` of them are
closed after a random number of chunks. Every distinct request is first run alone, and
every response that finishes under load must equal its solo text, token for token.

Reports status codes, 5xx other than the deliberate 503, in-band stream errors,
transport errors (a dropped or refused connection; any of these three fails the run),
requests/s, tokens/s (seen by clients and counted by the server), latency percentiles,
and MTP acceptance from the /metrics deltas. Only loopback addresses are accepted.

``--table MODEL`` instead reproduces issue #10's comparison: it starts each server in turn
on a loopback port (``pymtp serve --parallel P``, and with ``--llama-server BIN`` the same
binary as ``-np P --spec-type draft-mtp --spec-draft-n-max K`` and as ``-np P``), sends
the same clients to each (``--clients`` clients, ``--requests`` non-streamed greedy
completions each, ``--max-tokens`` tokens with ignore_eos, held-out prompts), and prints
aggregate tokens/s and latency percentiles per server, the batch sizes pymtp's rounds had,
and whether every pymtp response equals the same request run alone on that server:

    python benchmarks/load_server.py --table ../shared/models/qwen35-small-mtp/gguf/model-q8_0.gguf \
        --llama-server ~/.cache/pymtp/llama-server/bin/llama-server-cpu --threads 2 --parallel 4 --clients 8

``--pymtp-src DIR`` (repeatable) serves the pymtp package in DIR instead of this
checkout's, each folder's rows in the same passes: an A/B of two trees on one machine
(``git archive REV pymtp | tar x -C DIR``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pymtp.config import cpu_has_amx  # noqa: E402  (needs no llama.cpp)
from pymtp.testing.processes import child_env, free_port, stop, wait_healthy  # noqa: E402

PROMPTS = [
    "Once upon a time", "def fibonacci(n):", "The capital of France is", "import numpy as np\n",
    "In 1492, Columbus", "class Stack:\n    def", "The quick brown fox", "Dear Sir or Madam,",
    "SELECT name FROM users WHERE", "# Install the package with pip\n", "Photosynthesis is",
    "for i in range(10):\n",
]
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Tally:
    sent: int = 0           # every request, answered or not (a refused connection has no status)
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
    tally.sent += 1
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


def by_label(before: dict, after: dict, counter: str) -> dict[int, int]:
    """What a counter with one integer label (batch size, depth) grew by between two
    scrapes, label by label in order; labels that did not grow are left out."""
    out = {}
    for k, v in after.items():
        if k.startswith(counter + "{"):
            grew = int(v - before.get(k, 0.0))
            if grew:
                out[int(k.split('"')[1])] = grew
    return dict(sorted(out.items()))


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile, between the values measured: the default ("exclusive")
    method reads past the largest below 19 values (a p95 of 16 requests above the slowest)."""
    return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 4) if len(xs) >= 2 \
        else (xs[0] if xs else 0.0)


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
    sent = tally.sent
    transport = sum(n for k, n in tally.outcomes.items() if k.startswith("transport_error"))
    bad_5xx = sum(n for s, n in tally.statuses.items() if s >= 500 and s != 503)
    acc = acceptance(before, after)
    report = {
        "url": args.url, "clients": args.clients, "duration_s": round(elapsed, 1),
        "max_tokens": args.max_tokens, "disconnect_rate": args.disconnect_rate,
        "requests": sent, "statuses": dict(tally.statuses), "outcomes": dict(tally.outcomes),
        "unexpected_5xx": bad_5xx, "transport_errors": transport, "mismatches": len(tally.mismatches),
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
    # a connection the server dropped or refused (a crash, say) fails the run as a 5xx does
    ok = bad_5xx == 0 and transport == 0 and not tally.mismatches and tally.outcomes["stream_error"] == 0
    return 0 if ok else 1


# ------------------------------------------------------------------ --table: the #10 comparison

HELD_OUT = Path(__file__).with_name("prompts_heldout.jsonl")


def table_servers(args) -> list[tuple[str, list[str], Path]]:
    """(name, argv without host and port, the folder it runs from) of every server the
    table compares. A pymtp server runs the pymtp package in its folder (``--pymtp-src``);
    where that is not this checkout, or there are several, its name ends in the folder's."""
    p, t = str(args.parallel), str(args.threads)
    depths = args.draft_max or ["3"]
    srcs = [Path(s).resolve() for s in args.pymtp_src or [REPO]]
    model = str(Path(args.table).resolve())      # the servers run from their own folders
    out = []
    for src, extra in ((src, shlex.split(a)) for src in srcs for a in args.pymtp_args or [""]):
        tag = "" if srcs == [REPO] else f" [{src.name}]"
        for d in depths:        # one pymtp row per --draft-max; the name says any depth but the default
            name = f"pymtp serve --parallel {p}" + (f" --draft-max {d}" if depths != ["3"] else "")
            name += "".join(f" {a}" for a in extra) + tag
            # none: pymtp without drafts (--spec none), beside llama-server without them
            depth = ["--spec", "none"] if d == "none" else ["--draft-max", d]
            out.append((name, [sys.executable, "-m", "pymtp.server.cli", model, "--parallel", p,
                               "--threads", t, "--ctx-size", str(args.ctx_size), *depth, "--log-level", "warning",
                               *extra], src))
    # llama-server's MTP twin drafts at the first fixed depth asked for (3 if none is)
    k = next((d for d in depths if d not in ("auto", "none")), "3")
    if args.llama_server:
        # -c is split between the slots; flash attention off as pymtp has it on CPUs. An
        # HTTP thread for every connection the clients keep open: with its default (the
        # cores less one, 15 on the H100 and H200 hosts) 16 clients' keep-alive
        # connections starved the rest, and passes ran at 700 tok/s with a p95 of 2.4 s
        # where its own slots logged no request over 0.72 s
        base = [args.llama_server, "-m", model, "-np", p, "-c", str(args.parallel * args.ctx_size),
                "-b", "512", "-ub", "512", "-t", t, "-tb", t, "-fa", "off",
                "--threads-http", str(args.clients + 4)]
        if cpu_has_amx():
            base.append("--no-repack")
        out.append((f"llama-server -np {p} --spec-type draft-mtp --spec-draft-n-max {k}",
                    base + ["--spec-type", "draft-mtp", "--spec-draft-n-max", k, "--spec-draft-p-min", "0"], REPO))
        out.append((f"llama-server -np {p}", base, REPO))
    twice = sorted(name for name, n in Counter(name for name, _, _ in out).items() if n > 1)
    if twice:   # one row a name: a second server of the name merged its passes into the first's
        raise SystemExit(f"load_server: the options give two servers named {twice[0]!r}: list each "
                         f"--draft-max, --pymtp-args and --pymtp-src once")
    return out


@contextlib.contextmanager
def running(argv: list[str], log: Path, timeout: float = 300.0, src: Path = REPO):
    """A server on a free loopback port, its URL while it runs. ``src`` is the folder it
    runs from and the first entry of its PYTHONPATH: a ``python -m pymtp...`` there runs
    that folder's pymtp, not this checkout's."""
    port = free_port()
    cmd = argv + ["--host", "127.0.0.1", "--port", str(port)]
    env = child_env(src)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=src)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url + "/health", log, timeout=timeout, what=cmd[0])
        yield url
    finally:
        stop(proc, grace=20)


async def complete(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    """One greedy non-streamed completion: (text, completion tokens, seconds)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False, "stream": False}
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=body)
    r.raise_for_status()
    obj = r.json()
    return obj["choices"][0]["text"], obj["usage"]["completion_tokens"], time.perf_counter() - t0


def request_tokens(args, n: int) -> int:
    """Tokens request ``n`` asks for: ``--max-tokens``, or with ``--min-tokens`` a length
    drawn between the two (seeded by ``--seed`` and ``n``, so every server gets the same).
    With one length for all, requests that start together end together and a server
    refills its slots at once; with lengths that differ, as in real traffic, they join a
    running batch one at a time."""
    if not args.min_tokens:
        return args.max_tokens
    return random.Random(args.seed * 100_003 + n).randint(args.min_tokens, args.max_tokens)


async def load(url: str, prompts: list[str], args, *, check_solo: bool) -> dict:
    """``args.clients`` clients, each sending its ``args.requests`` prompts one after another."""
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(args.timeout)) as client:
        await complete(client, prompts[0][:200], 8)          # warm-up
        before = await scrape(client)
        texts: dict[int, str] = {}
        results: list[tuple[int, float]] = []

        async def one_client(i: int) -> None:
            for j in range(args.requests):
                n = i * args.requests + j
                text, tokens, seconds = await complete(client, prompts[n], request_tokens(args, n))
                texts[n] = text
                results.append((tokens, seconds))

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(i) for i in range(args.clients)))
        wall = time.perf_counter() - t0
        after = await scrape(client)
        solo, parted = None, []
        if check_solo and any(k.startswith("pymtp_") for k in after):
            for n, p in enumerate(prompts):
                alone = (await complete(client, p, request_tokens(args, n)))[0]
                at = first_difference(texts[n], alone)
                if at is not None:
                    parted.append({"request": n, "at": at, "load": texts[n][max(0, at - 30): at + 30],
                                   "solo": alone[max(0, at - 30): at + 30]})
            solo = len(prompts) - len(parted)
    latencies = [s for _, s in results]
    sizes = by_label(before, after, "pymtp_batch_rounds_total")
    return {"requests": len(results), "tokens": sum(t for t, _ in results), "wall_s": round(wall, 2),
            "tok_s": round(sum(t for t, _ in results) / wall, 1),
            "p50_s": round(statistics.median(latencies), 2), "p95_s": round(pct(latencies, 95), 2),
            "batch_sizes": sizes,
            "depths": by_label(before, after, "pymtp_draft_depth_rounds_total"),
            "identical_to_solo": None if solo is None else f"{solo}/{len(prompts)}",
            "parted": parted,           # where each response that differs leaves its solo run
            "acceptance": acceptance(before, after)["acceptance_rate"] if sizes else None,
            # draft_max=auto: what it measured so far, by occupancy, gap and depth
            "auto_estimates": {k.split("{", 1)[1].rstrip("}"): round(v) for k, v in after.items()
                               if k.startswith("pymtp_auto_estimated_tokens_per_second{")}}


def first_difference(a: str, b: str) -> int | None:
    """The first character index where two texts differ (the shorter one's end if one is
    the other's start); None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def table_prompts(held_out: list[str], n: int) -> list[str]:
    """``n`` prompts: the held-out ones, then again, each under a first line of its own
    (``# request N``) so that no prompt cache reuses a prefix of one sent before: issue #10's
    16 clients x 2 requests need 32, and the file has 24."""
    return [p if i < len(held_out) else f"# request {i + 1}\n{p}"
            for i, p in ((i, held_out[i % len(held_out)]) for i in range(n))]


def row_notes(runs: dict[str, list[dict]], n: int) -> tuple[list[str], bool]:
    """What the table prints under its rows, per server over its passes (batch sizes,
    parted requests, auto's depths), and whether every pymtp row's last pass answered all
    ``n`` requests as their solo runs did. A server without batch metrics (pymtp before
    the batched engine) gets its solo check alone."""
    lines, solo_ok = [], True
    for name, rs in runs.items():
        sizes = Counter()
        for r in rs:
            sizes.update(r["batch_sizes"])
        last = rs[-1]
        solo_ok = solo_ok and last["identical_to_solo"] in (None, f"{n}/{n}")
        if not sizes:
            if last["identical_to_solo"] is not None:
                lines += ["", f"{name}: responses identical to solo runs {last['identical_to_solo']}"]
            continue
        lines += ["", f"{name}: rounds by sequences decoded together {dict(sorted(sizes.items()))}, "
                      f"acceptance {last['acceptance']}, responses identical to solo runs {last['identical_to_solo']}"]
        for d in last.get("parted", []):
            lines.append(f"{name}: request {d['request']} parts from its solo run at character {d['at']}: "
                         f"{d['load']!r} under load, {d['solo']!r} alone")
        if last.get("auto_estimates"):     # auto (a fixed depth has none): does its depth settle?
            lines.append(f"{name}: sequence-rounds by depth, pass by pass: {[r['depths'] for r in rs]}")
            lines.append(f"{name}: auto's estimated tok/s after the last pass: {last['auto_estimates']}")
    return lines, solo_ok


def table(args) -> int:
    """Every server up at once (an idle one waits on its socket), then ``--repeat`` passes
    over them in turn, so that a change in the machine's load falls on all of them."""
    held_out = [json.loads(line)["prompt"] for line in HELD_OUT.read_text().splitlines() if line.strip()]
    n = args.clients * args.requests
    prompts = table_prompts(held_out, n)
    # a SIGTERM runs the finally blocks that stop the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log = Path(tempfile.gettempdir()) / f"load_server_table_{os.getpid()}.log"
    servers = table_servers(args)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in servers}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(running(argv, log, src=src)) for name, argv, src in servers}
        for rep in range(args.repeat):
            for name, url in urls.items():
                r = asyncio.run(load(url, prompts, args, check_solo=args.check_solo and rep == args.repeat - 1))
                runs[name].append(r)
                print(f"{name}: {json.dumps(r)}", file=sys.stderr)
    lengths = f"{args.min_tokens}-{args.max_tokens}" if args.min_tokens else f"{args.max_tokens}"
    print(f"\n{args.clients} clients x {args.requests} requests x {lengths} tokens, greedy, "
          f"non-streamed, held-out prompts; {args.threads} threads; {Path(args.table).name}"
          f"{f'; median of {args.repeat} passes' if args.repeat > 1 else ''}\n")
    print("| server | aggregate tok/s | p50 latency | p95 latency |")
    print("| --- | --- | --- | --- |")
    for name, rs in runs.items():
        med = lambda key: statistics.median(r[key] for r in rs)   # noqa: E731
        print(f"| `{name}` | {med('tok_s'):.1f} | {med('p50_s'):.2f} s | {med('p95_s'):.2f} s |")
    lines, solo_ok = row_notes(runs, n)
    print("\n".join(lines))
    return 0 if solo_ok else 1


def draft_max(value: str) -> str:
    if value not in ("auto", "none") and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"--draft-max must be a positive integer, auto or none, got {value!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=None, help="16; with --table 8")
    p.add_argument("--duration", type=float, default=60.0, help="seconds")
    p.add_argument("--max-tokens", type=int, default=None, help="64; with --table 128")
    p.add_argument("--disconnect-rate", type=float, default=0.2)
    p.add_argument("--max-requests", type=int, default=10_000, help="per client, a bound on the loop")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    t = p.add_argument_group("--table: the issue #10 comparison")
    t.add_argument("--table", metavar="MODEL", default=None, help="GGUF to serve with each server in turn")
    t.add_argument("--llama-server", default=None, metavar="BIN", help="also measure this llama-server binary")
    t.add_argument("--parallel", type=int, default=4, help="slots of every server")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--requests", type=int, default=2, help="per client")
    t.add_argument("--draft-max", type=draft_max, action="append", default=None,
                   help="pymtp's depth: an integer, auto, or none (--spec none); repeat it for a row per value (default 3)")
    t.add_argument("--min-tokens", type=int, default=0,
                   help="each request asks for a length drawn from --min-tokens to --max-tokens "
                        "(seeded, the same for every server); 0: all ask for --max-tokens")
    t.add_argument("--ctx-size", type=int, default=4096, help="per slot")
    t.add_argument("--pymtp-args", action="append", default=None, metavar="'ARGS'",
                   help="more options for the pymtp servers, in one string (--pymtp-args='--cache-ram 0'); "
                        "repeat it for rows of each, in the same passes; the rows' names carry them")
    t.add_argument("--pymtp-src", action="append", default=None, metavar="DIR",
                   help="serve the pymtp package in DIR (an older copy: git archive REV | tar x -C DIR); "
                        "repeat it for rows of each, in the same passes (default: this checkout)")
    t.add_argument("--repeat", type=int, default=1, help="passes over the servers, in turn")
    t.add_argument("--no-check-solo", dest="check_solo", action="store_false",
                   help="skip rerunning pymtp's requests alone to compare")
    a = p.parse_args(argv)
    # the table's defaults differ from a load run's; None: not given, in any spelling
    a.clients = a.clients if a.clients is not None else 8 if a.table else 16
    a.max_tokens = a.max_tokens if a.max_tokens is not None else 128 if a.table else 64
    if a.table and a.min_tokens and not 1 <= a.min_tokens <= a.max_tokens:
        p.error(f"--min-tokens must be between 1 and --max-tokens ({a.max_tokens}), got {a.min_tokens}")
    return a


if __name__ == "__main__":
    a = parse_args()
    if a.table:
        sys.exit(table(a))
    require_loopback(a.url)
    sys.exit(asyncio.run(main(a)))
