"""How often a seeded, sampled request decoded in a batch parts from its solo run.

    python benchmarks/batch_seeded.py MODEL [--seeds 32] [-n 40] [--temperature 0.9]

Greedy requests in a batch give their solo tokens on CPUs (docs/exactness.md, "Batched
rounds"), but the logits behind them differ in the last bits where the batch takes
another mat-mul kernel than the solo run (f16 and f32 weights, up to ~0.007 on the tiny
f16 model). A sampled draw sits on those logits: where its uniform lands that close to a
boundary between two tokens, the batch picks the other one and the texts part. This
counts it: per seed, one request alone (``generate``) against the same request first in
a two-prompt ``generate_batch`` beside an unrelated prompt, and prints the first token
where they part.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymtp  # noqa: E402

PROMPTS = ("Once upon a time", "def fibonacci(n):")
COMPANION = "import numpy as np\n"


def parted_at(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ, or None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--seeds", type=int, default=32, help="seeds per prompt")
    ap.add_argument("-n", type=int, default=40, help="max_tokens per request")
    ap.add_argument("--temperature", type=float, default=0.9)
    args = ap.parse_args()
    model = pymtp.load(args.model, n_ctx=512)
    parted = total = 0
    for prompt in PROMPTS:
        for seed in range(args.seeds):
            kw = dict(max_tokens=args.n, temperature=args.temperature, seed=seed, cache_prompt=False)
            alone = model.generate(prompt, **kw).tokens
            batched = model.generate_batch([prompt, COMPANION], **kw)[0].tokens
            at = parted_at(alone, batched)
            total += 1
            if at is not None:
                parted += 1
                print(f"{prompt!r} seed {seed}: parted at token {at}")
    print(f"{Path(args.model).name}: {parted}/{total} seeded requests parted from their solo run "
          f"(T={args.temperature}, {args.n} tokens)")


if __name__ == "__main__":
    main()
