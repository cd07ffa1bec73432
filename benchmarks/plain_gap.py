"""Where pymtp's plain decoding trails llama-server's: inside llama_decode, or between decodes.

    python benchmarks/plain_gap.py MODEL --llama-server BIN [--limit 16] [-n 128] [--threads 2]
        [--temperature 0.7 --top-k 20 --top-p 0.8 --min-p 0] [--sampling backend]

Each held-out prompt runs once on llama-server (no-spec) and then once in pymtp (spec
"none"), alternating, so both see the same machine state. Per request: llama-server's
milliseconds a token (its ``predicted_per_second``), pymtp's (``Stats``, the same window),
and the mean wall time of pymtp's one-row ``llama_decode`` calls. Where pymtp's decode
takes what llama-server's whole token does, the rest of pymtp's token is its host work
between decodes (issue #9's no-spec bar).

Greedy runs add a floor: the same prompt in a bare loop on a context of its own (one-row
decode, the logits read, numpy's argmax, nothing else), the host work no Python round
can go below. After each decode the host's caches hold the model's weights, not the
interpreter's code and objects: the first logits read and argmax after a decode cost
~10 us each where a second costs ~1.5 (tiny f16, this box), so the loop's floor is
tens of microseconds, and every further function a round calls adds its own misses.

On a GPU llama_decode returns once the graph is queued, before the device has run it:
the decode column there is the launch, and the device's time falls to the first logits
read, inside "between decodes". The split reads as named on CPUs only; no synchronize is
added to the timer, since it would take from pymtp's round the overlap of its host work
with the device that the pymtp column measures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymtp  # noqa: E402  (loads llama_cpp before numpy, as CUDA builds need)
import numpy as np  # noqa: E402
from pymtp import native  # noqa: E402
from pymtp.bench import read_prompts  # noqa: E402
from pymtp.llama_server import LlamaServerPool, completion_body  # noqa: E402

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-server", required=True, metavar="BIN")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--sampling", default="auto", help="pymtp's sampling load option (auto, chain, numpy, backend)")
    args = ap.parse_args(argv)
    if args.n < 2 or args.limit < 1:      # a decode speed needs a token after the prompt's first
        ap.error(f"-n must be at least 2 and --limit at least 1, got -n {args.n}, --limit {args.limit}")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    prompts = read_prompts(PROMPTS)[: args.limit]

    decodes: list[float] = []       # this request's one-row decodes, seconds each
    decode = native.NativeContext.decode

    def timed(ctx, batch):
        t = time.perf_counter()
        decode(ctx, batch)
        if batch.n == 1:
            decodes.append(time.perf_counter() - t)

    native.NativeContext.decode = timed
    greedy = args.temperature == 0.0
    rows = []
    with pymtp.load(args.model, threads=args.threads, sampling=args.sampling) as m, \
            LlamaServerPool(args.llama_server, args.model, [(0, 0.0)], threads=args.threads,
                            n_ctx=4096, n_batch=512) as pool:
        bare = _BareLoop(m, args.threads) if greedy else None
        try:
            for i, p in enumerate([prompts[0], *prompts]):      # the first pair warms both up
                ids = m.tokenize(p, special=True)
                theirs = pool.complete((0, 0.0), completion_body(ids, max_tokens=args.n, seed=i, **sampling))
                decodes.clear()
                r = m.generate(ids, max_tokens=args.n, ignore_eos=True, cache_prompt=False, spec="none",
                               seed=i, **sampling)
                row = (1e3 / theirs.tok_s, 1e3 / r.stats.tokens_per_second, 1e3 * statistics.mean(decodes))
                if bare is not None:
                    row += bare.run(ids, args.n)
                if i:
                    rows.append(row)
                print(f"prompt {i}: llama-server {row[0]:.3f} ms a token, pymtp {row[1]:.3f} (its decodes {row[2]:.3f})"
                      + (f", bare loop {row[3]:.3f} (its decodes {row[4]:.3f})" if bare else ""), file=sys.stderr, flush=True)
        finally:
            if bare is not None:
                bare.close()
    med = [statistics.median(col) for col in zip(*rows)]
    print(f"{Path(args.model).name}, {len(rows)} prompts x {args.n}, temperature {args.temperature:g}, "
          f"{args.threads} threads; medians, ms a token:")
    print(f"llama-server {med[0]:.3f} | pymtp {med[1]:.3f} ({med[0] / med[1]:.3f}x llama-server's speed) | "
          f"pymtp's one-row llama_decode {med[2]:.3f} | pymtp between decodes {med[1] - med[2]:.3f}"
          + (f" | bare loop {med[3]:.3f}, between its decodes {med[3] - med[4]:.3f}" if greedy else ""))
    return 0


class _BareLoop:
    """Greedy plain decoding with nothing around it: one-row decode, logits, argmax."""

    def __init__(self, m, threads: int) -> None:
        self.ctx = native.NativeContext(m._native, native.ContextConfig(
            n_ctx=4096, n_batch=512, n_ubatch=512, threads=threads, flash_attn=m.flash_attn))
        self.batch = native.Batch(512)

    def run(self, ids: list[int], n: int) -> tuple[float, float]:
        """ms a token after the first, and ms a one-row decode."""
        ctx, batch = self.ctx, self.batch
        ctx.clear()
        for start in range(0, len(ids), 512):
            chunk = np.asarray(ids[start:start + 512], dtype=np.int32)
            batch.set(chunk, start)
            ctx.decode(batch)
        token, pos, spent = int(np.argmax(ctx.logits(1)[0])), len(ids), 0.0
        t = time.perf_counter()
        for _ in range(n - 1):
            batch.clear()
            batch.add((token,), pos, 0)
            t0 = time.perf_counter()
            _DECODE(ctx, batch)
            spent += time.perf_counter() - t0
            token, pos = int(np.argmax(ctx.logits(1)[0])), pos + 1
        return 1e3 * (time.perf_counter() - t) / (n - 1), 1e3 * spent / (n - 1)

    def close(self) -> None:
        self.ctx.close()


_DECODE = native.NativeContext.decode     # the loop's decodes are not pymtp's: not timed above


if __name__ == "__main__":
    raise SystemExit(main())
