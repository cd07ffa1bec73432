"""What gaps in a round's seq ids cost, and what filling them saves (verify_batch.VerifyBatch.fill_width).

    python benchmarks/gap_fill.py MODEL [--passes 3]

An 8-slot batcher runs the first 8 held-out prompts, greedy, ignore_eos: the odd ones
stop after 16 tokens, the even ones go on to 128, so every later round has the ids 0, 2,
4 and 6 (three gaps; llama.cpp decodes such a round in four ubatches when nothing fills
them). Passes alternate fillers as this build has them (drafter.fill_width: any rows on a
GPU, one-row gaps on a CPU) and none, for spec "none" and draft_max 3, and it prints tok/s (all tokens over the wall time, the prompts' prefill included),
the median of the passes, and the tokens' agreement between the two.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pymtp
from pymtp.bench import read_prompts
from pymtp.drafter import fill_width

LONG, SHORT = 128, 16


def one_pass(b, prompts: list[str], fill: bool, kw: dict) -> tuple[float, list[list[int]]]:
    rounds = b.engine.rounds
    rounds.verify_batch.fill_width = fill_width(rounds.model) if fill else 0
    if rounds.drafter is not None:
        rounds.drafter.fill_width = rounds.verify_batch.fill_width
    t0 = time.perf_counter()
    runs = [b.submit(p, max_tokens=SHORT if i % 2 else LONG, **kw) for i, p in enumerate(prompts)]
    tokens = {r: [] for r in runs}
    while any(not r.done for r in runs):
        for run, chunk in b.step():
            tokens[run] += chunk.tokens
    wall = time.perf_counter() - t0
    return sum(len(t) for t in tokens.values()) / wall, [tokens[r] for r in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    prompts = read_prompts(Path(__file__).with_name("prompts_heldout.jsonl"))[:8]
    m = pymtp.load(args.model)
    for name, kw in (("none", dict(spec="none")), ("k=3", dict(draft_max=3))):
        kw |= dict(ignore_eos=True, cache_prompt=False)
        b = m.batcher(8)
        one_pass(b, prompts, True, kw)          # warm-up: graphs, allocations
        speed = {True: [], False: []}
        out = {}
        for _ in range(args.passes):
            for fill in (True, False):
                tok_s, out[fill] = one_pass(b, prompts, fill, kw)
                speed[fill].append(tok_s)
        b.close()
        on, off = statistics.median(speed[True]), statistics.median(speed[False])
        print(f"{name}: fillers on (at most {fill_width(m._native)} rows an id) {on:.0f} tok/s {[round(x) for x in speed[True]]}, "
              f"off {off:.0f} {[round(x) for x in speed[False]]}, on/off {on / off:.2f}, "
              f"same tokens {sum(a == c for a, c in zip(out[True], out[False]))}/{len(prompts)}", flush=True)
    m.close()


if __name__ == "__main__":
    main()
