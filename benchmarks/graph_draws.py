"""Does the backend chain's own draw follow the distribution it hands back, on every verify
row of one sequence, at a given vocabulary? And is the drafter graph's argmax the host's?

For each of R rows of one decode (a verify batch: one sequence, R output rows) it compares
the chain's probabilities with the host's (same logits, numpy filters), then decodes the
same batch N times and tests the chain's draws (``sampled_token``, each committed as the
engine commits it: backend_sampling.plain_token) against its own probabilities with a
chi-square statistic per row. Prints one line per row.

    python benchmarks/graph_draws.py MODEL.gguf [--rows 4] [--n 300] [--top-k 20 --top-p 0.8]
"""

from __future__ import annotations

import argparse
import collections
import math

import numpy as np

from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel
from pymtp.sampling import filter_chain, make_sampler, sampled_dist


def chi2_p(counts: collections.Counter, ids: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, float]:
    """Chi-square of the draws against probs, cells with expectation < 5 pooled; (stat, p)."""
    exp = probs * n
    big = exp >= 5
    obs = np.array([counts.get(int(t), 0) for t in ids], dtype=float)
    stat_cells = list(zip(obs[big], exp[big]))
    rest_o, rest_e = n - obs[big].sum(), exp[~big].sum()
    if rest_e > 0:
        stat_cells.append((rest_o, rest_e))
    stat = sum((o - e) ** 2 / e for o, e in stat_cells)
    df = max(len(stat_cells) - 1, 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return stat, 0.5 * math.erfc(z / math.sqrt(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    model = NativeModel(args.model)
    cfg = ContextConfig(n_ctx=512, n_batch=64, n_ubatch=64, threads=4, n_outputs_max=args.rows)
    host, graph = NativeContext(model, cfg), NativeContext(model, cfg)
    chain = filter_chain(args.top_k, args.top_p, args.min_p, args.temperature).add_dist(1234)
    assert graph.set_sampler(0, chain), "the chain did not attach"
    prompt = np.asarray(model.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n"), dtype=np.int32)
    outputs = np.zeros(prompt.size, dtype=bool)
    outputs[-args.rows:] = True
    batch = Batch(64)
    sampler = make_sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                           path="numpy")
    batch.set(prompt, 0, outputs=outputs)
    host.decode(batch)
    logits = host.logits(args.rows).copy()
    draws = [collections.Counter() for _ in range(args.rows)]
    dists = None
    for i in range(args.n):
        graph.seq_rm(0, -1, -1)
        batch.set(prompt, 0, outputs=outputs)
        graph.decode(batch)
        if dists is None:
            dists = [sampled_dist(graph, prompt.size - args.rows + r) for r in range(args.rows)]
        for r in range(args.rows):      # read and commit in row order, as the engine does
            token = graph.sampled_token(prompt.size - args.rows + r)
            chain.accept(token)
            draws[r][token] += 1
    for r in range(args.rows):
        want = sampler.dist(logits[r])
        same = want.ids.tolist() == dists[r].ids.tolist() and np.allclose(want.probs, dists[r].probs, atol=1e-4)
        stat, p = chi2_p(draws[r], dists[r].ids, dists[r].probs, args.n)
        top = int(dists[r].ids[np.argmax(dists[r].probs)])
        print(f"row {r}: {dists[r].ids.size} candidates, host's dist {'equal' if same else 'DIFFERENT'}, "
              f"p(top)={dists[r].probs.max():.3f}, drawn top {draws[r][top] / args.n:.3f}, "
              f"chi2 {stat:.1f} p={p:.3g}, draws outside the candidates: "
              f"{sum(c for t, c in draws[r].items() if t not in set(dists[r].ids.tolist()))}")


if __name__ == "__main__":
    main()
