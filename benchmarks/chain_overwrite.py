"""Does this build's llama.cpp overwrite a backend chain's probabilities when several
sequences have chains? (backend_sampling.reads_probabilities says why pymtp asks.)

    python benchmarks/chain_overwrite.py [MODEL] [--rows 1 2 3 4 5 6]

Attaches the same filters (top_k 20, top_p 0.8, T=0.7) to seq ids 1 and 3 of one context,
prefills both, then decodes ROWS more rows of seq 1, of seq 3, of seq 1, of seq 3 in turn,
all outputs, and prints each decode's per-row probability sums: every sum is 1 where nothing
was overwritten. The same schedule runs with greedy chains, and with none (the raw rows):
each drawn token must lie in its raw row's top 20, each greedy token be its argmax (a GPU
build may round a near-tie the other way; on a CPU build the three contexts decode alike).

On the pinned CPU build with the demo model, at 4 rows, seq 3's last row summed to 0.087
and 2.72 (1, 2, 3, 5 and 6 rows: all 1), and no token was off: each graph leaves the other
sequence's chain out of the computation, and two graphs of as many nodes share one memory
plan.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel  # noqa: E402
from pymtp.native_samplers import SamplerChain  # noqa: E402
from pymtp.sampling import filter_chain  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "pymtp" / "data" / "qwen35-tiny-mtp-q8_0.gguf"


def decode_in_turn(model: NativeModel, rows: int, kind: str | None) -> list[tuple[int, list]]:
    """Each decode's rows: probability sums (kind "dist"), drawn tokens ("dist", "greedy"),
    or the raw rows' argmax and top 20 (None: no chain attached, the reference)."""
    ctx = NativeContext(model, ContextConfig(n_ctx=1024, n_batch=64, n_ubatch=64, n_seq_max=4, n_rs_seq=4,
                                             n_outputs_max=20, n_outputs_max_per_seq=8, flash_attn="off"))
    chains = {}
    if kind is not None:
        chains = {s: (SamplerChain().add_greedy() if kind == "greedy"
                      else filter_chain(20, 0.8, 0.0, 0.7).add_dist(s + 1)) for s in (1, 3)}
    out = []
    try:
        for s, chain in chains.items():
            if not ctx.set_sampler(s, chain):
                raise SystemExit("this build cannot run the chain in its graph")
        prompt = np.asarray(model.tokenize("The quick brown fox jumps over"), dtype=np.int32)
        tokens = np.asarray(model.tokenize(" the lazy dog again and then some"), dtype=np.int32)[:rows]
        batch = Batch(64)
        for s in (1, 3):
            batch.set(prompt, 0, s, outputs="last")
            ctx.decode(batch)
        end = {s: prompt.size for s in (1, 3)}
        for s in (1, 3, 1, 3):
            batch.clear()
            batch.add(tokens, end[s], s, outputs="all")
            end[s] += tokens.size
            ctx.decode(batch)
            if kind is None:
                logits = ctx.logits(batch.n)
                out.append((s, [(int(r.argmax()), set(np.argsort(-r)[:20].tolist())) for r in logits]))
            else:
                out.append((s, [(ctx.sampled_token(i), None if kind == "greedy"
                                 else float(ctx.sampled_probs(i).sum())) for i in range(batch.n)]))
    finally:
        for s in chains:
            ctx.set_sampler(s, None)
        ctx.close()
        for chain in chains.values():
            chain.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(DEMO))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    args = ap.parse_args()
    model = NativeModel(args.model)
    for rows in args.rows:
        ref = decode_in_turn(model, rows, None)
        dist = decode_in_turn(model, rows, "dist")
        greedy = decode_in_turn(model, rows, "greedy")
        sums = [[round(p, 4) for _, p in row] for _, row in dist]
        overwritten = sum(abs(p - 1.0) > 1e-3 for _, row in dist for _, p in row)
        off_top = sum(t not in top for (_, a), (_, b) in zip(dist, ref) for (t, _), (_, top) in zip(a, b))
        wrong_argmax = sum(t != m for (_, a), (_, b) in zip(greedy, ref) for (t, _), (m, _) in zip(a, b))
        print(f"{rows} rows: probability sums {sums}: {overwritten} rows overwritten; drawn tokens outside "
              f"the raw top 20: {off_top}; greedy tokens off the raw argmax: {wrong_argmax}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
