"""How much host work a decode can hide: the time between llama_decode returning and its
logits being ready.

    python benchmarks/host_window.py MODEL [-n 200] [--json OUT.json]

On a GPU ``llama_decode`` queues the graph and returns; the first read of the logits
waits for the device. Host work placed between the two (handing the last round's tokens
to the caller, detokenizing, stop rules, bookkeeping) is then free up to that wait. This
decodes one row at a time on the context a no-spec run uses (and four rows on the MTP
target's), with a busy wait of W microseconds between the decode call and the logits
read, and prints the median milliseconds per decode for each W, beside how long the
decode call itself took. Where the total stays flat as W grows, W fits in the window.
On a CPU the decode computes before it returns: the total grows by W from the start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pymtp.native import Batch, NativeContext, NativeModel  # noqa: E402
from shape_switch import plain_context, target_context  # noqa: E402  (beside this script)

WAITS_US = (0, 50, 100, 150, 200, 300, 400)


def spin(seconds: float) -> None:
    """Busy host work of a known length (sleep would hand the core away)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(ctx: NativeContext, rows: int, wait_s: float, n: int) -> tuple[float, float]:
    """Median seconds per decode and of the llama_decode call alone, over ``n`` decodes
    of ``rows`` rows with ``wait_s`` of host work before the logits are read."""
    ctx.clear()
    batch = Batch(rows)
    tokens = np.zeros(rows, dtype=np.int32)
    totals, calls = [], []
    pos = 0
    for i in range(n + 8):            # eight to warm up (CUDA graph capture)
        if pos + rows >= ctx.n_ctx_seq:
            ctx.clear()
            pos = 0
        batch.set(tokens, pos, 0, outputs="all")
        t0 = time.perf_counter()
        ctx.decode(batch)
        t1 = time.perf_counter()
        spin(wait_s)
        ctx.logits(rows).sum()
        t2 = time.perf_counter()
        pos += rows
        if i >= 8:
            totals.append(t2 - t0)
            calls.append(t1 - t0)
    return statistics.median(totals), statistics.median(calls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=200, help="decodes per setting (after eight warm-up ones)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = NativeModel(args.model)
    plain, target = plain_context(model), target_context(model)
    out: dict[str, dict[int, dict[str, float]]] = {}
    print("| context | rows | host work us | ms per decode | decode call ms |\n| --- | --- | --- | --- | --- |")
    for name, ctx, rows in (("no-spec", plain, 1), ("target", target, 1), ("target", target, 4)):
        key = f"{name} {rows}"
        out[key] = {}
        for w in WAITS_US:
            total, call = run(ctx, rows, w * 1e-6, args.n)
            out[key][w] = {"total_s": total, "call_s": call}
            print(f"| {name} | {rows} | {w} | {1e3 * total:.3f} | {1e3 * call:.3f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    target.close()
    plain.close()
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
