"""Decode speed of a model split across llama.cpp RPC workers on loopback, against the
same model on this host alone, and whether greedy MTP output stays the local output.

    python benchmarks/rpc_split.py MODEL.gguf [--workers 1 --workers 2 ...] [--json]

Starts rpc-server processes on 127.0.0.1 (found as the tests find them: $PYMTP_RPC_SERVER,
or beside $PYMTP_LLAMA_SERVER), splits the layers evenly between this host and N of them,
and runs plain decoding and MTP at depth 3 on a few prompts. Loopback measures the cost of
the RPC hops (serialisation, syscalls, one round trip per host boundary and decode), not
of a network; on one machine the workers also share its cores.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import click

import pymtp
from pymtp.testing.rpc_workers import find_rpc_server, rpc_workers

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "The capital of France is",
           "class Stack:\n    def __init__(self):"]


def measure(model, max_tokens: int) -> dict:
    out = {}
    for name, kw in (("none", {"spec": "none"}), ("mtp k=3", {"draft_max": 3})):
        runs = [model.generate(p, max_tokens=max_tokens, ignore_eos=True, **kw) for p in PROMPTS]
        out[name] = {"tok_s": statistics.median(r.stats.tokens_per_second for r in runs),
                     "tokens": [r.tokens for r in runs]}
    return out


@click.command()
@click.argument("model", required=False)
@click.option("--workers", "counts", multiple=True, type=click.IntRange(1, 8), help="Worker counts (default 1, 2, 3).")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--threads", default=1, show_default=True, help="Threads of the head and of each worker.")
@click.option("--json", "as_json", is_flag=True)
def main(model, counts, max_tokens, threads, as_json) -> None:
    binary = find_rpc_server()
    if binary is None:
        raise click.ClickException("no rpc-server: set PYMTP_RPC_SERVER (benchmarks/build_llama_server.sh builds it)")
    counts = sorted(set(counts)) or [1, 2, 3]
    load = dict(threads=threads, n_ctx=1024)
    local = pymtp.load(model, **load)
    rows = {"local": measure(local, max_tokens)}
    plain = rows["local"]["none"]["tokens"]
    local.close()
    with tempfile.TemporaryDirectory() as tmp, rpc_workers(max(counts), binary, Path(tmp), threads) as procs:
        for n in counts:
            endpoints = [ep for ep, _ in procs[:n]]
            m = pymtp.load(model, rpc=endpoints, tensor_split=(1,) * (n + 1), **load)
            rows[f"{n} worker(s)"] = measure(m, max_tokens) | {"split": m.placement.describe()}
            m.close()
    if as_json:
        click.echo(json.dumps({k: {s: v[s]["tok_s"] if isinstance(v[s], dict) else v[s] for s in v}
                               for k, v in rows.items()}, indent=2))
    click.echo(f"{Path(model).name if model else 'demo model'}: {len(PROMPTS)} prompts x {max_tokens} tokens, "
               f"{threads} thread(s) each, median tok/s", file=sys.stderr)
    click.echo(f"{'':<14}{'plain':>8}{'mtp k=3':>9}  identical to local plain (mtp / plain)", file=sys.stderr)
    for name, r in rows.items():
        same = [sum(a == b for a, b in zip(r[s]["tokens"], plain)) for s in ("mtp k=3", "none")]
        click.echo(f"{name:<14}{r['none']['tok_s']:>8.1f}{r['mtp k=3']['tok_s']:>9.1f}  "
                   f"{same[0]}/{len(PROMPTS)} / {same[1]}/{len(PROMPTS)}  {r.get('split', '')}", file=sys.stderr)


if __name__ == "__main__":
    main()
