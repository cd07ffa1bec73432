"""What draft_max="auto" chose and why: per request its depth histogram and speed, and
after each the depth policy's state (depth.Arms: seconds a round per measured depth, the
pooled acceptance by position, each depth's estimated tokens a second, the re-check wait).

    python benchmarks/depth_trace.py MODEL [--temperature 0.7 --top-k 20 --top-p 0.8 --min-p 0]
        [--limit 8] [-n 128]

One model, one engine: the requests run one after another as in ``pymtp bench -k auto``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymtp  # noqa: E402
from pymtp.bench import read_prompts  # noqa: E402

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
    args = ap.parse_args(argv)
    prompts = read_prompts(PROMPTS)[: args.limit]
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    with pymtp.load(args.model) as m:
        engine = m._default.engine
        print(f"T={args.temperature}")
        for p in prompts:
            r = m.generate(p, max_tokens=args.n, draft_max="auto", ignore_eos=True, **kw)
            tok_s = len(r.tokens) / max(r.stats.decode_seconds, 1e-9)
            (arms,) = engine.arms.values()
            est = {k: round(arms.rate(k)) for k in sorted(arms.round_s)}
            print(f"depths {dict(sorted(r.stats.depths.items()))}  tok/s {tok_s:.0f}  "
                  f"round ms {ms(arms.round_s)}  estimated tok/s {est}  "
                  f"gains {[None if g is None else round(g, 3) for g in arms.gains]}  "
                  f"wait {arms.wait} since {arms.since}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
