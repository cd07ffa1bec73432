"""What a logit bias costs a request: the same requests with and without one.

    python benchmarks/bias_cost.py MODEL [--limit 8] [-n 128] [--passes 2]

A biased request reads its rows through the bias: greedy on the host takes each verify
row's biased argmax (sampling_filters.biased_argmax), llama.cpp's draw chain and the graph's
chains take a logit_bias sampler first; before those, it left them for the host's
row-by-row path (sampling.Sampler.adjusts). The bias here bans the vocabulary's last id, which none of
these texts reach, so both runs emit the same tokens (checked for greedy) and the
difference is the path alone. Prints tok/s per setting, median over the passes, the
passes alternating the two.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymtp  # noqa: E402
from pymtp.bench import read_prompts  # noqa: E402

SETTINGS = {
    "greedy k=3": dict(draft_max=3),
    "greedy no-spec": dict(spec="none"),
    "T=0.7 k=3": dict(draft_max=3, temperature=0.7, top_k=20, top_p=0.8, seed=0),
    "T=0.7 no-spec": dict(spec="none", temperature=0.7, top_k=20, top_p=0.8, seed=0),
    # OpenAI's default temperature: llama.cpp's temp is then its empty sampler ("?temp"),
    # which the graph's chains refused until backend_sampling read it as a no-op
    "T=1.0 no-spec": dict(spec="none", temperature=1.0, top_k=40, seed=0),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    prompts = read_prompts(Path(__file__).with_name("prompts_heldout.jsonl"))[: args.limit]
    m = pymtp.load(args.model)
    ban = {m.n_vocab - 1: -100.0}
    print(f"{Path(args.model).name}: {m.n_vocab} tokens, {len(prompts)} prompts x {args.max_tokens}, "
          f"bias {ban}", flush=True)
    rates: dict[tuple[str, bool], list[float]] = {}
    same: dict[str, bool] = {}
    for name, kw in SETTINGS.items():
        m.generate(prompts[0], max_tokens=16, **kw)            # warm-up
        for _ in range(args.passes):
            for biased in (False, True):
                extra = {"logit_bias": ban} if biased else {}
                t0, n, toks = time.perf_counter(), 0, []
                for p in prompts:
                    r = m.generate(p, max_tokens=args.max_tokens, ignore_eos=True, **kw, **extra)
                    n += len(r.tokens)
                    toks.append(r.tokens)
                rates.setdefault((name, biased), []).append(n / (time.perf_counter() - t0))
                same.setdefault(name, True)
                if biased:
                    same[name] = same[name] and toks == last
                last = toks
    print("| setting | tok/s | with the bias | ratio | same tokens |")
    print("| --- | --- | --- | --- | --- |")
    for name in SETTINGS:
        a, b = statistics.median(rates[(name, False)]), statistics.median(rates[(name, True)])
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.3f} | {same[name]} |")
    m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
