"""Why one plain request runs slower than the others: its gaps between tokens, and Python's GC.

    python benchmarks/request_gaps.py MODEL [--passes 3] [--limit 16] [-n 128] [--temperature 0.7 ...]

Each pass streams every held-out prompt plain (and, between them, at k=3, so the contexts
alternate as in ``pymtp bench``), timing each token. A request under 0.85x of the median
speed is printed with its median gap, its largest gap, the time its gaps spent over 3x
the median (``excess_ms``) and the Python GC collections inside it. Slow requests whose
gaps are wider throughout, with little excess and no GC, were slowed by the host, not by
a pause: what ``depth.SLOW_CLIP`` guards auto's prices against (benchmarks/README.md,
session 38).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import pymtp

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")


def _gc_log() -> list[tuple[float, float, int]]:
    """(start, seconds, generation) of every collection from now on."""
    events: list[tuple[float, float, int]] = []
    start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            events.append((start[0], time.perf_counter() - start[0], info["generation"]))
    gc.callbacks.append(on_gc)
    return events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.8)
    a = ap.parse_args()
    m = pymtp.load(a.model)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][: a.limit]
    kw = dict(max_tokens=a.max_tokens, ignore_eos=True, cache_prompt=False, temperature=a.temperature,
              top_k=a.top_k, top_p=a.top_p)
    gcs = _gc_log()
    rows = []
    for p in range(a.passes):
        for i, prompt in enumerate(prompts):
            for spec in ("none", "mtp"):
                stamps = [time.perf_counter() for _ in m.stream(prompt, spec=spec, draft_max=3, seed=i, **kw)]
                if spec != "none" or len(stamps) < 3:
                    continue
                gaps = [b - a_ for a_, b in zip(stamps, stamps[1:])]
                med = statistics.median(gaps)
                inside = [g for g in gcs if stamps[0] <= g[0] <= stamps[-1]]
                rows.append({"pass": p, "prompt": i, "tok_s": round(len(gaps) / (stamps[-1] - stamps[0]), 1),
                             "median_gap_ms": round(med * 1e3, 3), "max_gap_ms": round(max(gaps) * 1e3, 3),
                             "excess_ms": round(sum(g - 3 * med for g in gaps if g > 3 * med) * 1e3, 2),
                             "gc_ms": round(sum(g[1] for g in inside) * 1e3, 2)})
    median = statistics.median(r["tok_s"] for r in rows)
    print(f"{len(rows)} plain requests, median {median:.0f} tok/s, range {min(r['tok_s'] for r in rows):.0f}-"
          f"{max(r['tok_s'] for r in rows):.0f}; GC collections {len(gcs)} (generation 2: "
          f"{sum(g[2] == 2 for g in gcs)}), longest {max((g[1] for g in gcs), default=0.0) * 1e3:.1f} ms")
    for r in rows:
        if r["tok_s"] < 0.85 * median:
            print(r)


if __name__ == "__main__":
    main()
