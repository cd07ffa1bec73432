"""What a prediction (OpenAI's Predicted Outputs) buys: tok/s with and without one.

    python benchmarks/prediction_speed.py MODEL [--limit 8] [-n 128] [-k 3] [--threads N] [--reps 3]

A prediction is worth most where the reply repeats a text the caller has: a file
regenerated with a small edit. These models write no such replies on request, so each
held-out prompt's own greedy reply stands in for the file: per prompt and pass, greedy,
``draft_max=K``, ignore_eos, interleaved (the order rotates each pass):

- ``none``: no prediction (the MTP head drafts every round), the baseline;
- ``rewrite``: the reply itself as the prediction (the upper bound);
- ``edit``: the reply with one line in its middle rewritten (what an edit request sends);
- ``unrelated``: another prompt's reply (a prediction that never fits: what it costs);
- ``plain``: ``spec="none"``, plain decoding.

Prints the median decode tok/s (``Stats.tokens_per_second``, llama-server's window: from
the first token once the MTP head has read the prompt) and the median whole-request tok/s
(tokens over the call's wall time, prompt included) over prompts and passes, each over
``none``'s; the prediction's drafts kept out of those made, the head's drafts, and whether
every output equals plain decoding's (greedy identity; on a GPU near-ties can part it,
docs/exactness.md). The two speeds differ where a prediction defers the head's pass over
the prompt: a run that never leaves the prediction never makes it, and one that leaves
makes it then, inside the decode window.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pymtp
from pymtp.bench import read_prompts

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")
SETTINGS = ("none", "rewrite", "edit", "unrelated", "plain")


def edited(text: str) -> str:
    """The text with its middle line rewritten (or, with no line, a word put in its middle)."""
    lines = text.split("\n")
    if len(lines) >= 3:
        i = len(lines) // 2
        lines[i] = lines[i][: len(lines[i]) // 2] + " result = compute(value)  # changed"
        return "\n".join(lines)
    mid = len(text) // 2
    return text[:mid] + " changed " + text[mid:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-k", "--draft-max", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    opts = {} if args.threads is None else {"threads": args.threads}
    model = pymtp.load(args.model, **opts)
    prompts = [model.tokenize(p) for p in read_prompts(PROMPTS)[: args.limit]]
    kw = dict(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, cache_prompt=False)
    plain = [model.generate(p, spec="none", **kw) for p in prompts]
    predictions = {
        "rewrite": [r.text for r in plain],
        "edit": [edited(r.text) for r in plain],
        "unrelated": [plain[(i + 1) % len(plain)].text for i in range(len(plain))],
    }
    speed = {s: [] for s in SETTINGS}
    whole = {s: [] for s in SETTINGS}
    kept = {s: [0, 0, 0] for s in SETTINGS}        # prediction drafts kept, made; head drafts
    same = {s: 0 for s in SETTINGS}
    runs = 0
    for rep in range(args.reps + 1):                # pass 0 warms up
        for i, prompt in enumerate(prompts):
            order = SETTINGS[(rep + i) % len(SETTINGS):] + SETTINGS[: (rep + i) % len(SETTINGS)]
            for s in order:
                t0 = time.perf_counter()
                if s == "plain":
                    r = model.generate(prompt, spec="none", **kw)
                else:
                    extra = {} if s == "none" else {"prediction": predictions[s][i]}
                    r = model.generate(prompt, draft_max=args.draft_max, **kw, **extra)
                wall = time.perf_counter() - t0
                if rep == 0:
                    continue
                speed[s].append(r.stats.tokens_per_second)
                whole[s].append(len(r.tokens) / wall)
                kept[s][0] += r.stats.predicted_accepted
                kept[s][1] += r.stats.predicted_drafted
                kept[s][2] += r.stats.drafted
                same[s] += r.tokens == plain[i].tokens
            runs += rep > 0
    print(f"{Path(args.model).name}: {len(prompts)} prompts x {args.max_tokens} tokens, greedy, "
          f"draft_max {args.draft_max}, {args.reps} passes")
    base, base_w = statistics.median(speed["none"]), statistics.median(whole["none"])
    print("| setting | decode tok/s | / none | request tok/s | / none | prediction drafts kept / made "
          "| head drafts | equal to plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in SETTINGS:
        med, med_w = statistics.median(speed[s]), statistics.median(whole[s])
        k, m, h = kept[s]
        print(f"| {s} | {med:.1f} | {med / base:.2f}x | {med_w:.1f} | {med_w / base_w:.2f}x | {k} / {m} | {h} "
              f"| {same[s]}/{runs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
