"""Does this build's llama.cpp overwrite a backend chain's probabilities when several
sequences have chains? (backend_sampling.reads_probabilities says why pymtp asks.)

    python benchmarks/chain_overwrite.py [MODEL] [--rows 2 3 4 5]

Attaches the same filters (top_k 20, top_p 0.8, T=0.7) to seq ids 1 and 3 of one context,
prefills both, then decodes ROWS more rows of seq 1, of seq 3, of seq 1, of seq 3 in turn,
all outputs, and prints each decode's per-row probability sums. Every sum is 1 where nothing
was overwritten. On the pinned CPU build with the demo model, at 4 rows, seq 3's last row
summed to 0.087 and 2.72 (2, 3, 5 and 6 rows: all 1): each graph leaves the other sequence's chain out of the
computation, and two graphs of as many nodes share one memory plan.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel  # noqa: E402
from pymtp.sampling import filter_chain  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "pymtp" / "data" / "qwen35-tiny-mtp-q8_0.gguf"


def sums(model: NativeModel, rows: int) -> list[tuple[int, list[float]]]:
    ctx = NativeContext(model, ContextConfig(n_ctx=1024, n_batch=64, n_ubatch=64, n_seq_max=4, n_rs_seq=4,
                                             n_outputs_max=20, n_outputs_max_per_seq=8, flash_attn="off"))
    chains = {s: filter_chain(20, 0.8, 0.0, 0.7).add_dist(s + 1) for s in (1, 3)}
    out = []
    try:
        for s, chain in chains.items():
            if not ctx.set_sampler(s, chain):
                raise SystemExit("this build cannot run the chain in its graph")
        prompt = np.asarray(model.tokenize("The quick brown fox jumps over"), dtype=np.int32)
        tokens = np.asarray(model.tokenize(" the lazy dog again and then some"), dtype=np.int32)[:rows]
        batch = Batch(64)
        for s in chains:
            batch.set(prompt, 0, s, outputs="last")
            ctx.decode(batch)
        end = {s: prompt.size for s in chains}
        for s in (1, 3, 1, 3):
            batch.clear()
            batch.add(tokens, end[s], s, outputs="all")
            end[s] += tokens.size
            ctx.decode(batch)
            out.append((s, [round(float(ctx.sampled_probs(i).sum()), 4) for i in range(batch.n)]))
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
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 3, 4, 5])
    args = ap.parse_args()
    model = NativeModel(args.model)
    for rows in args.rows:
        decodes = sums(model, rows)
        bad = sum(any(abs(x - 1.0) > 1e-3 for x in row) for _, row in decodes)
        print(f"{rows} rows: " + "  ".join(f"seq {s} {row}" for s, row in decodes) + f"  -> {bad} overwritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
