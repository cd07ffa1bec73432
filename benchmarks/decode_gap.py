"""The host's time between one target decode and the next, on plain (no-spec) decoding.

    python benchmarks/decode_gap.py MODEL [--limit 8] [-n 128] [--threads 2]

On a CPU ``llama_decode`` blocks, so everything pymtp does per token (read the logits,
accept, emit, detokenize, the generator hand-off, stop rules) adds to the token's time:
the gap from the end of one ``llama_decode`` call to the start of the next. Prints its
median (and p10/p90) and the median decode call, greedy and at T=0.7 with llama-server's
filters. Each ``NativeModel.run`` call is timestamped (a few us of its own per call).
Compare two trees by running it from each (``PYTHONPATH=OTHER_TREE``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pymtp
from pymtp.bench import read_prompts
from pymtp.native import NativeModel

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")
SETTINGS = {"greedy": dict(temperature=0.0),
            "T=0.7": dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", "-t", type=int, default=2)
    args = ap.parse_args()
    calls: list[tuple[str, float, float]] = []
    real = NativeModel.run

    def timed(self, fn, *a):
        t0 = time.perf_counter()
        r = real(self, fn, *a)
        calls.append((getattr(fn, "__name__", ""), t0, time.perf_counter()))
        return r

    NativeModel.run = timed
    m = pymtp.load(args.model, threads=args.threads, flash_attn="off")
    s = m.session()
    prompts = read_prompts(PROMPTS)[: args.limit]
    for name, kw in SETTINGS.items():
        gaps, decodes = [], []
        for i, p in enumerate(prompts):
            calls.clear()
            s.generate(p, max_tokens=args.n, spec="none", ignore_eos=True, seed=i, **kw)
            d = [(t0, t1) for fn, t0, t1 in calls if fn == "llama_decode"]
            for (_, end), (start, stop) in zip(d[2:], d[3:]):     # past the prompt's decodes
                gaps.append(start - end)
                decodes.append(stop - start)
        q = statistics.quantiles(gaps, n=10)
        print(f"{name:7s} decode call median {statistics.median(decodes) * 1e3:.3f} ms, gap between decodes "
              f"median {statistics.median(gaps) * 1e6:.1f} us (p10 {q[0] * 1e6:.1f}, p90 {q[-1] * 1e6:.1f})",
              flush=True)


if __name__ == "__main__":
    main()
