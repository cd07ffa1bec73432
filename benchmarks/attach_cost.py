"""What attaching a backend sampler chain costs a request: seeded against unseeded requests.

    python benchmarks/attach_cost.py MODEL [--limit 8] [-n 32] [--passes 3] [--slots 4]

Attaching a chain to a seq id (llama_set_sampler) makes llama.cpp reserve the context's
graphs again at its next decode. A seeded request attaches a chain of its own seed; an
unseeded one keeps the chain its seq id holds (backend_sampling.BackendChains). So the two
kinds of request run the same path but for that reservation, and the difference between
their times is what it costs. Two shapes:

- one stream: each held-out prompt in turn, ms a request (median over the passes);
- batched: all the prompts through one batcher of ``--slots``, where every admission of a
  seeded request stalls the whole decode; tok/s of the batch.

Sampling "backend" (every sampled request in the graph), T=0.7 with Qwen's filters; passes
alternate seeded and unseeded. The one-stream times include each request's prompt.
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

FILTERS = dict(temperature=0.7, top_k=20, top_p=0.8, ignore_eos=True, cache_prompt=False)
# k=3 with the exact rule: it reads drawn tokens only, so it samples in the graph in a
# batch too (rejection sampling does so alone only: backend_sampling.reads_probabilities)
SPECS = {"no-spec": dict(spec="none"), "k=3 exact": dict(spec="mtp", draft_max=3, accept="exact")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", type=int, default=32, help="tokens a request")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    model = pymtp.load(args.model, sampling="backend", **({} if args.threads is None else {"threads": args.threads}))
    texts = read_prompts(Path(__file__).with_name("prompts_heldout.jsonl"))[: args.limit]
    prompts = [model.tokenize(p) for p in texts]
    print(f"{Path(args.model).name}, {len(prompts)} prompts x {args.n} tokens, T=0.7 top_k 20 top_p 0.8, "
          f"sampling backend, {args.passes} passes")
    for name, spec in SPECS.items():
        kw = dict(max_tokens=args.n, **FILTERS, **spec)
        model.generate(prompts[0], seed=None, **kw)         # warm up
        b = model.batcher(args.slots)
        solo = {"seeded": [], "unseeded": []}
        batch = {"seeded": [], "unseeded": []}
        for p in range(args.passes):
            for kind in ("seeded", "unseeded"):
                seeds = [1000 * p + i if kind == "seeded" else None for i in range(len(prompts))]
                for prompt, seed in zip(prompts, seeds):
                    t = time.perf_counter()
                    model.generate(prompt, seed=seed, **kw)
                    solo[kind].append(time.perf_counter() - t)
                t = time.perf_counter()
                runs = [b.submit(prompt, seed=seed, **kw) for prompt, seed in zip(prompts, seeds)]
                results = b.results(runs)
                batch[kind].append(sum(len(r.tokens) for r in results) / (time.perf_counter() - t))
        s, u = statistics.median(solo["seeded"]), statistics.median(solo["unseeded"])
        bs, bu = statistics.median(batch["seeded"]), statistics.median(batch["unseeded"])
        print(f"{name:9s} one stream: seeded {s * 1e3:7.2f} ms, unseeded {u * 1e3:7.2f} ms a request "
              f"(difference {(s - u) * 1e3:6.2f} ms); batched x{args.slots}: seeded {bs:8.1f}, "
              f"unseeded {bu:8.1f} tok/s ({bu / bs:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
