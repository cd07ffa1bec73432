"""What draft_max="auto" chose and why: per request its depth histogram and speed, and
after each the depth policy's state (depth.Arms: seconds a round per measured depth, the
pooled acceptance by position, each depth's estimated tokens a second, the re-check wait).

    python benchmarks/depth_trace.py MODEL [--temperature 0.7 --top-k 20 --top-p 0.8 --min-p 0]
        [--limit 8] [-n 128] [--batch N [--passes 3]]

One model, one engine: the requests run one after another as in ``pymtp bench -k auto``.

``--batch N``: batched rounds (depth_batched.Epochs) on a batcher of N slots, N prompts at a time.
First each fixed setting on a fresh batcher -- spec "none", then auto with every epoch
pinned to depth 0, 1, ..., the limit -- for ``--passes`` passes: the tok/s the passes
really gave (wall time of the batch, prompts included) beside what the epochs measured
for that depth at a full batch (seconds a sequence-round, and the tokens a second the
occupancy's ``Arms`` estimates).
Then auto unpinned for 4 x ``--passes`` passes: each pass's depths. Where the two columns
disagree on the order of the depths, auto picks wrong.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymtp  # noqa: E402
from pymtp.bench import read_prompts  # noqa: E402
from pymtp.depth_batched import occupancy  # noqa: E402

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")


def ms(d: dict[int, float]) -> dict[int, float]:
    return {k: round(v * 1e3, 3) for k, v in sorted(d.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--min-p", type=float, default=0.05)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--batch", type=int, default=0, metavar="N", help="batched rounds on N slots (see above)")
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args(argv)
    prompts = read_prompts(PROMPTS)[: args.limit]
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    if args.batch:
        return batch_trace(args, kw)
    with pymtp.load(args.model) as m:
        engine = m._default.engine
        print(f"T={args.temperature}")
        for p in prompts:
            r = m.generate(p, max_tokens=args.n, draft_max="auto", ignore_eos=True, **kw)
            tok_s = r.stats.tokens_per_second
            (arms,) = engine.arms.values()
            est = {k: round(arms.rate(k)) for k in sorted(arms.round_s)}
            print(f"depths {dict(sorted(r.stats.depths.items()))}  tok/s {tok_s:.0f}  "
                  f"round ms {ms(arms.round_s)}  estimated tok/s {est}  "
                  f"gains {[None if g is None else round(g, 3) for g in arms.gains]}  "
                  f"wait {arms.wait} since {arms.since}", flush=True)
    return 0


def _passes(batcher, prompts: list[str], n: int, passes: int, **kw) -> Iterator[tuple[float, dict[int, int]]]:
    """(tok/s, sequence-rounds by depth) of each pass of the prompts through the batcher,
    as it ends."""
    for _ in range(passes):
        t0 = time.perf_counter()
        rs = batcher.generate(prompts, max_tokens=n, ignore_eos=True, cache_prompt=False, **kw)
        wall = time.perf_counter() - t0
        depths: dict[int, int] = {}
        for r in rs:
            for k, c in r.stats.depths.items():
                depths[k] = depths.get(k, 0) + c
        yield sum(len(r.tokens) for r in rs) / wall, dict(sorted(depths.items()))


def batch_trace(args, kw: dict) -> int:
    prompts = read_prompts(PROMPTS)[: args.batch]
    if len(prompts) < args.batch:
        sys.exit(f"--batch {args.batch} needs {args.batch} prompts; {PROMPTS.name} has {len(prompts)}")
    print(f"T={args.temperature}, {args.batch} slots, {args.batch} prompts x {args.n} tokens, "
          f"{args.passes} passes per setting (tok/s: median pass, prompts included)")
    with pymtp.load(args.model) as m:
        settings: list[int | str] = ["none", *range(m.draft_limit + 1)]
        for setting in settings:
            b = m.batcher(args.batch)
            try:
                if setting == "none":
                    runs = list(_passes(b, prompts, args.n, args.passes, spec="none", **kw))
                    print(f"none      tok/s {statistics.median(t for t, _ in runs):7.0f}", flush=True)
                    continue
                epochs = b.engine.rounds.epochs
                epochs.pick = lambda bucket, k=setting: k      # every epoch at this depth
                epochs.k = setting
                runs = list(_passes(b, prompts, args.n, args.passes, draft_max="auto", **kw))
                arms = epochs.arms_for((occupancy(args.batch), False))
                measured = (f"{arms.round_s[setting] * 1e3:.3f} ms/seq-round, estimated {arms.rate(setting):.0f} tok/s"
                            if setting in arms.round_s else "not measured (fewer than PROBE rounds)")
                print(f"pinned {setting}  tok/s {statistics.median(t for t, _ in runs):7.0f}   epochs: {measured}   "
                      f"gains {[None if g is None else round(g, 3) for g in arms.gains]}", flush=True)
            finally:
                b.close()
        b = m.batcher(args.batch)
        try:
            for i, (tok_s, depths) in enumerate(_passes(b, prompts, args.n, 4 * args.passes, draft_max="auto", **kw)):
                arms = b.engine.rounds.epochs.arms_for((occupancy(args.batch), False))
                est = {k: round(arms.rate(k)) for k in sorted(arms.round_s)}
                print(f"auto pass {i}: tok/s {tok_s:.0f}  depths {depths}  round ms {ms(arms.round_s)}  "
                      f"estimated tok/s {est}  wait {arms.wait} since {arms.since}", flush=True)
        finally:
            b.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
