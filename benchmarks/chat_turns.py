"""A scripted multi-turn chat against ``pymtp serve`` and llama-server, both with their
prompt caches on: time to first token per turn, and what each reused (issue #11).

    python benchmarks/chat_turns.py MODEL.gguf --threads 2 \
        --llama-server ~/.cache/pymtp/llama-server/bin/llama-server-cpu

The chat is a long system prompt (``--system-rules`` numbered rules, about 34 tokens each
with the Qwen3.5 tokenizer: the default 56 make a first prompt of about 2,000 tokens) and then ``--turns`` short user turns, greedy, through
``/v1/chat/completions`` streamed. pymtp runs it first; every turn sends the conversation so
far, its replies included. After the chat each pymtp turn is sent again with
``cache_prompt: false`` (a cold run): its reply must be the same. llama-server (one slot, ``cache_prompt`` on, its
default) gets the same transcript, pymtp's replies included, so both see the same prompts.

Per turn the table has the prompt's tokens, the tokens each server reused (``timings.cache_n``),
the time to first token each client saw (from sending the request to the first streamed
choice event, which both servers send with the first token even when its text is held
back for a possible stop string) and whether pymtp's reply equals
its cold run. Both servers run one slot, with ``--threads`` threads, one after the other.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from pymtp.config import cpu_has_amx  # noqa: E402  (needs no llama.cpp)
from load_server import running  # noqa: E402  (a server on a free port until the block ends)

ASKS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Make it iterative instead of recursive.",
    "Add a docstring and type hints.",
    "Now write a pytest test for it.",
    "How would you memoize the recursive version?",
    "Write a function that checks whether a string is a palindrome.",
    "Make it ignore case and punctuation.",
    "Summarise the rules you followed in one sentence.",
]


CHATML_END = "<|im_end|>"


def system_prompt(rules: int) -> str:
    """A long, fixed system prompt: ``rules`` numbered rules of about 34 tokens each."""
    lines = ["You are a careful senior Python engineer. Follow every rule below."]
    topics = ["naming", "testing", "errors", "types", "docs", "imports", "logging", "style"]
    for i in range(1, rules + 1):
        t = topics[i % len(topics)]
        lines.append(f"Rule {i}: on {t}, prefer the simplest clear code for case {i * 7 % 97}, "
                     f"and explain any trade-off in one short line.")
    return "\n".join(lines)


@dataclass
class Turn:
    prompt_tokens: int = 0
    cached: int = 0
    ttft_ms: float = 0.0
    prompt_ms: float = 0.0       # timings.prompt_ms, the server's own
    text: str = ""
    completion_tokens: int = 0


def chat(client: httpx.Client, messages: list[dict], max_tokens: int, *, stream: bool = True,
         cache_prompt: bool = True) -> Turn:
    """One greedy chat request; streamed: TTFT is measured at the first choice event."""
    # the ChatML end as a stop string for both servers: pymtp stops there by itself (its
    # ChatML fallback, for models whose vocabulary spells <|im_end|> in plain tokens),
    # llama-server would stream it as text and go on, and the turns would not compare
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "top_k": 1,
            "stream": stream, "cache_prompt": cache_prompt, "stop": [CHATML_END]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    out = Turn()
    t0 = time.perf_counter()
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        obj = r.json()
        out.text = obj["choices"][0]["message"]["content"] or ""
        _usage(out, obj)
        return out
    pieces = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            for choice in obj.get("choices") or []:
                # both servers send their first choice event (the role) with the first
                # token, whatever its text: a reply that starts inside a possible stop
                # string (these models spell <|im_end|> in plain tokens) shows no text
                # until the end, and timing the first text would time the whole reply
                if not out.ttft_ms:
                    out.ttft_ms = (time.perf_counter() - t0) * 1e3
                pieces.append((choice.get("delta") or {}).get("content") or "")
            _usage(out, obj)
    out.text = "".join(pieces)
    return out


def _usage(out: Turn, obj: dict) -> None:
    """Counts from whichever of usage and timings a response object carries."""
    usage, timings = obj.get("usage"), obj.get("timings")
    if usage:
        out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
        out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        out.cached = details.get("cached_tokens", out.cached)
    if timings:
        out.cached = timings.get("cache_n", out.cached)
        out.prompt_ms = timings.get("prompt_ms", out.prompt_ms)


def pymtp_argv(args) -> list[str]:
    return [sys.executable, "-m", "pymtp.server.cli", *([args.model] if args.model else []),
            "--parallel", "1", "--threads", str(args.threads), "--ctx-size", str(args.ctx_size),
            "--draft-max", str(args.draft_max), "--cache-ram", str(args.cache_ram), "--log-level", "warning"]


def llama_argv(args) -> list[str]:
    # flash attention off as pymtp has it on CPUs; prompt cache and context checkpoints at
    # llama-server's defaults (cache_prompt is on per request by default)
    argv = [args.llama_server, "-m", args.model, "-np", "1", "-c", str(args.ctx_size), "-b", "512",
            "-ub", "512", "-t", str(args.threads), "-tb", str(args.threads), "-fa", "off",
            "--spec-type", "draft-mtp", "--spec-draft-n-max", str(args.draft_max), "--spec-draft-p-min", "0"]
    if cpu_has_amx():
        argv.append("--no-repack")
    return argv


def client_for(url: str, timeout: float) -> httpx.Client:
    """A new connection per request: llama-server may close a kept-alive one after a
    stream, which the next request would meet as a dropped connection."""
    return httpx.Client(base_url=url, timeout=timeout, headers={"Connection": "close"})


def run_pymtp(args, log: Path) -> tuple[list[list[dict]], list[Turn], list[bool]]:
    """The chat on pymtp: the messages of every turn, each turn's numbers, and whether
    each reply equals its cold run."""
    messages = [{"role": "system", "content": system_prompt(args.system_rules)}]
    sent, turns, same = [], [], []
    with running(pymtp_argv(args), log) as url, client_for(url, args.timeout) as client:
        warm_up(client)
        for ask in ASKS[: args.turns]:
            messages.append({"role": "user", "content": ask})
            sent.append([dict(m) for m in messages])
            warm = chat(client, messages, args.max_tokens)
            turns.append(warm)
            messages.append({"role": "assistant", "content": warm.text})
        # after the chat: a cold run on the one slot would empty what the next turn reuses
        for msgs, warm in zip(sent, turns):
            cold = chat(client, msgs, args.max_tokens, stream=False, cache_prompt=False)
            same.append(warm.text == cold.text and warm.completion_tokens == cold.completion_tokens)
    return sent, turns, same


def run_llama(args, sent: list[list[dict]], log: Path) -> list[Turn]:
    with running(llama_argv(args), log) as url, client_for(url, args.timeout) as client:
        warm_up(client)
        return [chat(client, msgs, args.max_tokens) for msgs in sent]


def warm_up(client: httpx.Client) -> None:
    """One short request first, so that turn 1 does not pay a server's first-request costs."""
    chat(client, [{"role": "user", "content": "Hello."}], 4, stream=False, cache_prompt=False)


def table(turns: list[Turn], same: list[bool], llama: list[Turn] | None) -> str:
    head = f"{'turn':>4} {'prompt':>7} {'pymtp cached':>12} {'pymtp TTFT ms':>13} {'prompt_ms':>9}"
    if llama:
        head += f" {'llama cached':>12} {'llama TTFT ms':>13} {'prompt_ms':>9} {'ratio':>6}"
    rows = [head + f" {'= cold':>6}"]
    for i, t in enumerate(turns):
        row = f"{i + 1:>4} {t.prompt_tokens:>7} {t.cached:>12} {t.ttft_ms:>13.1f} {t.prompt_ms:>9.1f}"
        if llama:
            q = llama[i]
            ratio = t.ttft_ms / q.ttft_ms if q.ttft_ms else float("nan")
            row += f" {q.cached:>12} {q.ttft_ms:>13.1f} {q.prompt_ms:>9.1f} {ratio:>6.2f}"
        rows.append(row + f" {'yes' if same[i] else 'NO':>6}")
    return "\n".join(rows)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="GGUF (default: pymtp's embedded demo model)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary to compare with")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8, choices=range(1, len(ASKS) + 1), metavar=f"1..{len(ASKS)}")
    ap.add_argument("--system-rules", type=int, default=56, help="rules in the system prompt (~34 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--cache-ram", type=float, default=2048, help="pymtp serve --cache-ram MIB")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args(argv)
    if args.llama_server and not args.model:
        ap.error("--llama-server needs MODEL (the demo model lives inside the package)")
    if args.model:      # both servers run from the repository's root
        args.model = str(Path(args.model).resolve())
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="chat-turns-"))
    sent, turns, same = run_pymtp(args, logs / "pymtp.log")
    llama = run_llama(args, sent, logs / "llama-server.log") if args.llama_server else None
    print(table(turns, same, llama))
    print(f"pymtp replies equal to their cold runs: {sum(same)}/{len(same)}; logs in {logs}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "equal_cold": same,
            "pymtp": [vars(t) for t in turns], "llama_server": [vars(t) for t in llama] if llama else None,
        }, indent=1))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
