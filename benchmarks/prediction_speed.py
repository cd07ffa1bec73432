"""What a prediction (OpenAI's Predicted Outputs) buys: tok/s with and without one.

    python benchmarks/prediction_speed.py MODEL [--limit 8] [-n 128] [-k 3] [--threads N] [--reps 3]
        [--llama-server BIN [--llama-server-args "-ngl all"]]

A prediction is worth most where the reply repeats a text the caller has: a file
regenerated with a small edit. These models write no such replies on request, so each
held-out prompt's own greedy reply stands in for the file: per prompt and pass, greedy,
``draft_max=K``, ignore_eos, interleaved (the order rotates each pass):

- ``none``: no prediction (the MTP head drafts every round), the baseline;
- ``rewrite``: the reply itself as the prediction (the upper bound);
- ``edit``: the reply with one line in its middle rewritten (what an edit request sends);
- ``unrelated``: another prompt's reply (a prediction that never fits: what it costs);
- ``plain``: ``spec="none"``, plain decoding;
- with ``--llama-server BIN``, in the same passes: llama-server (the pinned build) on the
  same prompt ids, plain (``llama no-spec``) and with its MTP at depth K (``llama mtp``),
  one single-slot server each, started as ``pymtp bench`` starts them. It has no
  predicted outputs: its fastest setting is what a prediction has to beat.

Prints the median decode tok/s (``Stats.tokens_per_second``, llama-server's window: from
the first token once the MTP head has read the prompt; llama-server's own
``predicted_per_second``) and the median whole-request tok/s (tokens over the call's wall
time, prompt included) over prompts and passes, each over ``none``'s; the prediction's
drafts kept out of those made, the head's drafts, and whether every output equals plain
decoding's (greedy identity; on a GPU near-ties can part it, docs/exactness.md). The two
speeds differ where a prediction defers the head's pass over the prompt: a run that never
leaves the prediction never makes it, and one that leaves makes it then, inside the
decode window.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pymtp
from pymtp.bench import read_prompts
from pymtp.llama_server import LlamaServerPool, completion_body

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")
SETTINGS = ("none", "rewrite", "edit", "unrelated", "plain")
PREDICTED = ("rewrite", "edit", "unrelated")


@dataclass
class Tally:
    """One setting's measured runs."""

    decode: list[float] = field(default_factory=list)     # tok/s in llama-server's window
    request: list[float] = field(default_factory=list)    # tokens over the call's wall time
    kept: int = 0                                          # prediction drafts kept ...
    made: int = 0                                          # ... and made
    head: int = 0                                          # the MTP head's drafts
    same: int = 0                                          # outputs equal to plain decoding's


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
    ap.add_argument("--llama-server", default=None, help="also measure this llama-server binary")
    ap.add_argument("--llama-server-args", default="", help='its extra flags, e.g. "-ngl all" on a GPU build')
    args = ap.parse_args()
    model = pymtp.load(args.model, **({} if args.threads is None else {"threads": args.threads}))
    prompts = [model.tokenize(p) for p in read_prompts(PROMPTS)[: args.limit]]
    kw = dict(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, cache_prompt=False)
    plain = [model.generate(p, spec="none", **kw) for p in prompts]
    predictions = {"rewrite": [r.text for r in plain], "edit": [edited(r.text) for r in plain],
                   "unrelated": [plain[(i + 1) % len(plain)].text for i in range(len(plain))]}
    llama = {"llama no-spec": (0, 0.0), "llama mtp": (args.draft_max, 0.0)} if args.llama_server else {}
    settings = SETTINGS + tuple(llama)
    tally = {s: Tally() for s in settings}

    def run(s: str, i: int) -> tuple[list[int], float, float, tuple[int, int, int]]:
        """One request: its tokens, decode and request tok/s, and (kept, made, head drafts)."""
        if s in llama:
            c = pool.complete(llama[s], completion_body(prompts[i], max_tokens=args.max_tokens, ignore_eos=True))
            return c.tokens, c.tok_s, len(c.tokens) / c.request_s, (0, 0, c.drafted)
        t0 = time.perf_counter()
        if s == "plain":
            r = model.generate(prompts[i], spec="none", **kw)
        else:
            extra = {"prediction": predictions[s][i]} if s in PREDICTED else {}
            r = model.generate(prompts[i], draft_max=args.draft_max, **kw, **extra)
        st = r.stats
        return (r.tokens, st.tokens_per_second, len(r.tokens) / (time.perf_counter() - t0),
                (st.predicted_accepted, st.predicted_drafted, st.drafted))

    pool = LlamaServerPool(args.llama_server, args.model, list(llama.values()), threads=args.threads,
                           n_ctx=model.options.n_ctx, n_batch=model.options.n_batch,
                           extra_args=args.llama_server_args.split()) if llama else None
    runs = 0
    try:
        if pool is not None:
            pool.__enter__()
        for rep in range(args.reps + 1):                # pass 0 warms up
            for i in range(len(prompts)):
                shift = (rep + i) % len(settings)
                for s in settings[shift:] + settings[:shift]:
                    tokens, decode, request, (kept, made, head) = run(s, i)
                    if rep == 0:
                        continue
                    t = tally[s]
                    t.decode.append(decode)
                    t.request.append(request)
                    t.kept, t.made, t.head = t.kept + kept, t.made + made, t.head + head
                    t.same += tokens == plain[i].tokens
                runs += rep > 0
    finally:
        if pool is not None:
            pool.close()
    report(Path(args.model).name, args, tally, runs)
    return 0


def report(name: str, args, tally: dict[str, Tally], runs: int) -> None:
    print(f"{name}: {args.limit} prompts x {args.max_tokens} tokens, greedy, draft_max {args.draft_max}, "
          f"{args.reps} passes")
    med = {s: (statistics.median(t.decode), statistics.median(t.request)) for s, t in tally.items()}
    base, base_w = med["none"]
    print("| setting | decode tok/s | / none | request tok/s | / none | prediction drafts kept / made "
          "| head drafts | equal to plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s, t in tally.items():
        d, w = med[s]
        print(f"| {s} | {d:.1f} | {d / base:.2f}x | {w:.1f} | {w / base_w:.2f}x | {t.kept} / {t.made} | {t.head} "
              f"| {t.same}/{runs} |")
    theirs = [s for s in tally if s.startswith("llama")]
    if theirs:
        best = max(theirs, key=lambda s: med[s][0])
        top = med[best][0]
        print(f"against llama-server's fastest ({best}, {top:.1f} decode tok/s): "
              + ", ".join(f"{s} {med[s][0] / top:.2f}x" for s in ("none", *PREDICTED, "plain")))


if __name__ == "__main__":
    sys.exit(main())
