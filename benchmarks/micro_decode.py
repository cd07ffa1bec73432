"""Time the pieces of a round in isolation, to see where a round's time goes.

    python benchmarks/micro_decode.py MODEL.gguf [--threads N] [--iters N]

Rows: a plain one-token target decode; a verify of k+1 rows with its rollback; one MTP
step (decode, logits, hidden row); MTP steps alternating with a 3-row catch-up (what a
k>1 round does: llama.cpp rebuilds its graph when the batch shape changes); a whole
``propose`` of k drafts; and the Python side of one step with no decode at all.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pymtp  # noqa: F401  (loads llama_cpp before numpy, as CUDA builds need)
import numpy as np
from pymtp.config import DEFAULT_DRAFT_LIMIT, DEFAULT_N_BATCH, DEFAULT_N_CTX
from pymtp.drafter import DraftJob
from pymtp.engine import Engine
from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel


def per_call_ms(fn, iters: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    # a row's positions: the 3-row catch-up row takes 2 a call, after a warm-up call
    if not 1 <= args.iters <= (DEFAULT_N_CTX - 16) // 2:
        ap.error(f"--iters must be 1-{(DEFAULT_N_CTX - 16) // 2}: a row's decodes must fit one context "
                 f"of {DEFAULT_N_CTX} positions, got {args.iters}")
    # The native layer and the engine directly: this times their pieces, not the Model API.
    # The drafter gets the settings pymtp.load picks for this backend.
    nm, it = NativeModel(args.model), args.iters
    gpu = nm.offloaded
    engine = Engine(nm, n_ctx=DEFAULT_N_CTX, n_batch=DEFAULT_N_BATCH, threads=args.threads,
                    draft_limit=DEFAULT_DRAFT_LIMIT, draft_kv="keep" if gpu else "target", row_by_row=gpu,
                    flash_attn="auto" if gpu else "off")
    prompt = np.array(nm.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n"), dtype=np.int32)
    P = len(prompt)
    rows: list[tuple[str, float]] = []

    tgt = NativeContext(nm, ContextConfig(n_ctx=8192, n_rs_seq=4, threads=args.threads, n_outputs_max=5))
    tgt.set_nextn_output(True)
    pre = Batch(512)

    def reset():
        tgt.clear()
        pre.set(prompt, 0, outputs="last")
        tgt.decode(pre)

    reset()
    one = Batch(8)
    pos = [P]

    def target1():
        one.set(prompt[:1], pos[0], outputs="all")
        tgt.decode(one)
        tgt.logits(1)[0].argmax()
        pos[0] += 1
    rows.append(("target decode, 1 row", per_call_ms(target1, it)))

    for k in (1, 3):
        reset()
        pos = [P]

        def verify():
            one.set(prompt[: k + 1], pos[0], outputs="all")
            tgt.decode(one)
            tgt.logits(k + 1).argmax(axis=1)
            tgt.hidden(k + 1)
            tgt.seq_rm(0, pos[0] + 1, -1)      # keep one row: a full rejection
            pos[0] += 1
        rows.append((f"verify {k + 1} rows + rollback", per_call_ms(verify, it)))

    d = engine.drafter()
    d.reset()
    h = np.zeros((4, nm.n_embd_out), dtype=np.float32)
    mb = d.batch
    mpos = [0]

    def mtp_row(name: str, fn, iters: int) -> None:
        """A drafter row from an empty context: each row's steps attend over the same
        positions, and a row after ``propose`` (which resets the drafter) starts where
        llama.cpp lets it (a position past the last one kept; a stale count failed there)."""
        d.reset()
        mpos[0] = 0
        rows.append((name, per_call_ms(fn, iters)))

    def mtp1():
        mb.set(prompt[:1], mpos[0], outputs="last", embd=h[:1])
        d.ctx.decode(mb)
        d.ctx.logits(1)[0].argmax()
        d.ctx.hidden(1)[0]
        mpos[0] += 1
    mtp_row("MTP step, 1 row", mtp1, it)

    def mtp_alt():
        mb.set(prompt[:3], mpos[0], outputs="last", embd=h[:3])
        d.ctx.decode(mb)
        d.ctx.logits(1)[0].argmax()
        mpos[0] += 3
        mtp1()
    mtp_row("MTP 3-row catch-up + 1 step", mtp_alt, it // 2)

    for k in (1, 3):
        d.reset()
        d.propose([DraftJob(0, prompt[:-1], np.zeros((P - 1, nm.n_embd_out), np.float32))])
        lane = d.lanes[0]
        state = {"end": lane.end}

        def propose():
            lane.end = state["end"]
            lane.dirty = True
            d.propose([DraftJob(0, prompt[-1:], h[:1], k)])
        rows.append((f"propose k={k}", per_call_ms(propose, it)))

    # The same step on a context asking for masked nextn rows (what upstream uses), and
    # with one CPU thread (on a GPU the CPU only does the embedding lookup).
    d.ctx.set_nextn_output(True, masked=True)
    mtp_row("MTP step, 1 row, masked nextn", mtp1, it)
    d.ctx.set_nextn_output(True, masked=False)
    d.ctx.set_threads(1)
    mtp_row("MTP step, 1 row, 1 thread", mtp1, it)
    d.ctx.set_threads(args.threads or __import__("os").cpu_count())

    def mtp_no_read():
        mb.set(prompt[:1], mpos[0], outputs="last", embd=h[:1])
        d.ctx.decode(mb)
        mpos[0] += 1
    mtp_row("MTP step, decode only (no reads)", mtp_no_read, it)

    def python_only():
        mb.set(prompt[:1], 0, outputs="last", embd=h[:1])
        d.ctx.logits(1)[0].argmax()
        d.ctx.hidden(1)[0]
    rows.append(("Python side of a step, no decode", per_call_ms(python_only, it)))

    width = max(len(r[0]) for r in rows)
    print(f"model {Path(args.model).name}, threads {args.threads}, {it} iterations")
    print(f"| {'piece'.ljust(width)} | ms/call |")
    print(f"|{'-' * (width + 2)}|---------|")
    for name, ms in rows:
        print(f"| {name.ljust(width)} | {ms:7.3f} |")


if __name__ == "__main__":
    main()
