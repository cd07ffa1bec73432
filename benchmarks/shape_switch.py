"""What a change of decode shape costs: the same decodes in a steady run and interleaved.

    python benchmarks/shape_switch.py MODEL [-n 240] [--json OUT.json]

A draft round decodes different row counts one after another: the MTP head's catch-up
(the rows the last verdict accepted, 1..k+1) and then its one-row chain steps, and under
draft_max="auto" the target's verify rows change with the depth. On a GPU a decode whose
shape differs from the one before it cannot replay the captured CUDA graph (ggml-cuda
runs it eagerly and captures again after two equal ones) and llama.cpp rebuilds its own
graph. This prints, per context and row pattern, the median seconds of a decode at each
row count, so a steady run and an interleaved one of the same rows can be compared.
Run it twice, once with GGML_CUDA_DISABLE_GRAPHS=1, to split the CUDA graph share from
llama.cpp's graph rebuild. "target-plain" is the context a no-spec run decodes on (no
snapshots for rollback, no hidden rows out): against "target" at one row it prices what a
plain round under draft_max="auto" pays for keeping the drafter fed.
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

from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel  # noqa: E402

TARGET_PATTERNS = {"1": [1], "4": [4], "5": [5], "1,4": [1, 4], "1,1,1,4": [1, 1, 1, 4], "2,4,3": [2, 4, 3]}
DRAFTER_PATTERNS = {"1": [1], "3": [3], "4": [4], "3,1,1 (k=3)": [3, 1, 1], "2,1 (k=2)": [2, 1],
                    "4,4,4 (padded k=3)": [4, 4, 4]}


def run_pattern(ctx: NativeContext, pattern: list[int], n: int, mtp: bool) -> dict[int, float]:
    """Median seconds per decode, by row count, over ``n`` decodes cycling ``pattern``."""
    ctx.clear()
    width = ctx.n_embd_out if mtp else 0
    batch = Batch(max(pattern), embd_width=width)
    times: dict[int, list[float]] = {}
    pos = 0
    for i in range(n + 2 * len(pattern)):          # the first two cycles warm up
        rows = pattern[i % len(pattern)]
        if pos + rows >= ctx.n_ctx_seq:
            ctx.clear()
            pos = 0
        batch.set(np.zeros(rows, dtype=np.int32), pos, 0, outputs="last" if mtp else "all",
                  embd=np.zeros((rows, width), dtype=np.float32) if mtp else None)
        t0 = time.perf_counter()
        ctx.decode(batch)
        ctx.logits(batch.n_outputs).sum()
        if mtp:
            ctx.hidden(rows).sum()
        dt = time.perf_counter() - t0
        pos += rows
        if i >= 2 * len(pattern):
            times.setdefault(rows, []).append(dt)
    return {rows: statistics.median(ts) for rows, ts in sorted(times.items())}


def target_context(model: NativeModel) -> NativeContext:
    """The MTP target as a drafting run has it: 4 recurrent snapshots, hidden rows out."""
    ctx = NativeContext(model, ContextConfig(n_ctx=4096, n_batch=512, n_ubatch=512, n_rs_seq=4, n_outputs_max=5))
    ctx.set_nextn_output(True, masked=False)
    return ctx


def plain_context(model: NativeModel) -> NativeContext:
    """The context a no-spec run decodes on: no snapshots, no hidden rows."""
    return NativeContext(model, ContextConfig(n_ctx=4096, n_batch=512, n_ubatch=512, n_outputs_max=5))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=240, help="decodes per pattern (after two warm-up cycles)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = NativeModel(args.model)
    target = target_context(model)
    drafter = NativeContext(model, ContextConfig(n_ctx=4096, n_batch=512, n_ubatch=512, mtp=True,
                                                 n_outputs_max=1))
    drafter.set_nextn_output(True, masked=False)
    plain = plain_context(model)
    out: dict[str, dict[str, dict[int, float]]] = {"target": {}, "drafter": {}, "target-plain": {}}
    print("| context | pattern | ms per decode by rows |\n| --- | --- | --- |")
    for name, ctx, patterns, mtp in (("target", target, TARGET_PATTERNS, False),
                                     ("drafter", drafter, DRAFTER_PATTERNS, True),
                                     ("target-plain", plain, {"1": [1], "4": [4]}, False)):
        for label, pattern in patterns.items():
            med = run_pattern(ctx, pattern, args.n, mtp)
            out[name][label] = med
            cells = ", ".join(f"{rows}: {1e3 * s:.3f}" for rows, s in med.items())
            print(f"| {name} | {label} | {cells} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    plain.close()
    drafter.close()
    target.close()
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
