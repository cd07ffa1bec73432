"""What sampling costs per distribution and per k=3 round, by path, at 8,192 and 248,320 tokens.

    python benchmarks/sampling_cost.py [--small GGUF] [--padded GGUF] [--threads N]
                                       [--iters N] [--no-backend] [--json]

Rows are real logits: the last 16 positions of three held-out prompts, decoded by the
small Q8_0 model (8,192 tokens) and by its 248k-padded twin (benchmarks/pad_vocab.py),
so the 248k rows have the padded model's long tail. ``--synthetic`` uses rows of the same
shape instead (a few dozen real-looking logits over a flat N(0, 0.3) tail) where a model
is missing.

Paths (each ends in a ``Dist`` -- sparse ids and float64 probabilities, what rejection
sampling reads -- and one draw):

- numpy: ``make_sampler(path="numpy")``, the pure numpy filters (pymtp/sampling_filters.py).
- C chain, whole row: llama.cpp's sampler chain (llama_sampler_chain_init + top_k, top_p,
  min_p, temp) applied to a llama_token_data_array filled from the whole row, including
  the cost of filling it ("of which: array build" says how much that is).
- C chain on candidates: ``make_sampler(path="chain")``, what pymtp uses: the same chain
  over the top-k candidates a numpy pass finds (the whole row when it is short). A long
  row without top_k takes the numpy path there, and the row says so ("numpy: ...").
- backend: llama.cpp's backend sampling (llama_set_sampler: the chain + dist run inside
  the decode graph; llama_get_sampled_candidates_ith / llama_get_sampled_probs_ith hand
  back the filtered candidates and their probabilities, the sparse p that rejection
  sampling needs). Its cost is a decode's time with the chain attached minus without
  (4-row verify batches and one-row decodes, alternating, the fastest of each), plus
  reading the rows. It works on CPU builds too (every sampler reports "+name", offloaded).

A k=3 round is the worst case: 3 draft distributions q (each with a draw) and all 4
verify rows' p, then ``rejection_accept``; for the backend, one 4-row verify plus three
one-row decodes (the MTP steps) with the chain attached, plus ``rejection_accept`` over
the distributions it hands back (its draws are in the graph). "support" is the median of
the ids a distribution keeps over the 48 rows; the backend's, over its verify's 4 rows.
Times are the best of 3 passes over the rows (the mean per call in each pass), on a
machine that may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import pymtp  # noqa: F401  (loads llama_cpp before numpy, as CUDA builds need)
import numpy as np
from pymtp.acceptance import rejection_accept
from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel
from pymtp.native_samplers import SamplerChain, TokenDataArray
from pymtp.sampling import CHAIN_ROW_MAX, Dist, draw, filter_chain, make_sampler
from pymtp.sampling_filters import softmax

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "models"
SMALL = SHARED / "qwen35-small-mtp" / "gguf" / "model-q8_0.gguf"
PADDED = HERE.parent / "build" / "padded" / "qwen35-small-mtp-q8_0-248k.gguf"   # pad_vocab.py writes it there
PROMPTS = HERE / "prompts_heldout.jsonl"

FILTERS = {
    "llama-server": dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    "qwen": dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0),
    "top_p only": dict(temperature=0.7, top_k=0, top_p=0.95, min_p=0.0),
}
ROWS_PER_PROMPT, N_PROMPTS = 16, 3


# -- rows -----------------------------------------------------------------------------

def model_rows(model: NativeModel, threads: int) -> np.ndarray:
    """[48, V] float32 logits: the last 16 positions of three held-out prompts."""
    ctx = NativeContext(model, ContextConfig(n_ctx=2048, n_batch=512, n_ubatch=512, threads=threads,
                                             n_outputs_max=ROWS_PER_PROMPT, flash_attn="off"))
    batch, rows = Batch(512), []
    for line in PROMPTS.read_text().splitlines()[:N_PROMPTS]:
        ids = np.array(model.tokenize(json.loads(line)["prompt"]), dtype=np.int32)[:400]
        ctx.clear()
        head, tail = ids[:-ROWS_PER_PROMPT], ids[-ROWS_PER_PROMPT:]
        batch.set(head, 0, outputs="none")
        ctx.decode(batch)
        batch.set(tail, len(head), outputs="all")
        ctx.decode(batch)
        rows.append(ctx.logits(ROWS_PER_PROMPT).copy())
    ctx.close()
    return np.concatenate(rows)


def synthetic_rows(n_vocab: int, seed: int = 0) -> np.ndarray:
    """Rows shaped like a padded model's: ~50 real tokens well above a flat tail."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((ROWS_PER_PROMPT * N_PROMPTS, n_vocab)).astype(np.float32) * 0.3
    for r in rows:
        head = rng.choice(min(n_vocab, 8192), 50, replace=False)
        r[head] += rng.uniform(3.0, 12.0, 50).astype(np.float32)
    return rows


# -- timing ---------------------------------------------------------------------------

def per_call_ms(fn, n_calls: int, passes: int = 3) -> float:
    """Best over ``passes`` of the mean time per call of ``fn()`` (which makes n_calls calls)."""
    fn()
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t) / n_calls)
    return best * 1e3


# -- host paths: each is row -> Dist ----------------------------------------------------

def whole_row_chain(f: dict):
    """llama.cpp's chain over a llama_token_data_array holding the whole row."""
    chain = filter_chain(f["top_k"], f["top_p"], f["min_p"], f["temperature"])
    cur = None

    def dist(row: np.ndarray) -> Dist:
        nonlocal cur
        if cur is None:
            cur = TokenDataArray(row.size)
        cur.set(row)
        chain.apply(cur)
        kept = np.sort(cur.result()["id"])
        return Dist(kept, softmax(row[kept], f["temperature"]))

    def build(row: np.ndarray) -> None:
        nonlocal cur
        if cur is None:
            cur = TokenDataArray(row.size)
        cur.set(row)

    return dist, build


def host_paths(f: dict, n_vocab: int) -> dict:
    numpy_s = make_sampler(**f, seed=0, path="numpy")
    chain_s = make_sampler(**f, seed=0, path="chain")
    whole, build = whole_row_chain(f)
    # pymtp's chain path hands a long row without top_k to numpy (Sampler._chain_dist)
    on_candidates = ("C chain on candidates" if f["top_k"] or n_vocab <= CHAIN_ROW_MAX
                     else "C chain on candidates (numpy: no top_k on a long row)")
    return {"numpy": (numpy_s.dist, None), "C chain, whole row": (whole, build),
            on_candidates: (chain_s.dist, None)}


def measure_host(rows: np.ndarray, f: dict, iters: int) -> list[dict]:
    rng = np.random.default_rng(0)
    n = len(rows)
    out = []
    for name, (dist, build) in host_paths(f, rows.shape[1]).items():
        def per_dist():
            for _ in range(iters):
                for r in rows:
                    draw(dist(r), rng)

        def per_round():
            for it in range(iters):
                for j in range(0, n - 7, 7):
                    q = [dist(rows[j + i]) for i in range(3)]
                    drafts = [draw(d, rng) for d in q]
                    p = [dist(rows[j + 3 + i]) for i in range(4)]
                    rejection_accept(drafts, q, p, rng)

        n_rounds = iters * len(range(0, n - 7, 7))
        row = {"path": name, "dist_ms": per_call_ms(per_dist, iters * n),
               "round_ms": per_call_ms(per_round, n_rounds)}
        if build is not None:
            row["array_build_ms"] = per_call_ms(lambda: [build(r) for r in rows], n)
        row["support_median"] = int(np.median([dist(r).ids.size for r in rows]))
        out.append(row)
    return out


# -- backend sampling -------------------------------------------------------------------

def measure_backend(model: NativeModel, f: dict, threads: int, iters: int) -> dict:
    """Decode time with llama.cpp's chain (+ dist) in the graph, minus without, per row."""
    cfg = ContextConfig(n_ctx=1024, n_batch=512, n_ubatch=512, n_rs_seq=4, threads=threads,
                        n_outputs_max=4, n_outputs_max_per_seq=4, flash_attn="off")
    plain, ctx = NativeContext(model, cfg), NativeContext(model, cfg)
    chain = filter_chain(f["top_k"], f["top_p"], f["min_p"], f["temperature"]).add_dist(1)
    result: dict = {"path": "backend"}
    attached = ctx.set_sampler(0, chain)
    names = chain.names()
    result["offloaded"] = names
    if not attached or not all(n.startswith("+") for n in names):
        result["works"] = False
        return result
    prompt = np.array(model.tokenize(json.loads(PROMPTS.read_text().splitlines()[0])["prompt"]),
                      dtype=np.int32)[:200]
    P = len(prompt)
    batch = Batch(512)
    for c in (plain, ctx):
        batch.set(prompt, 0, outputs="last")
        c.decode(batch)
    verify_tokens = prompt[-4:]

    def decode(c: NativeContext, n_rows: int) -> float:
        c.seq_rm(0, P, -1)
        batch.set(verify_tokens[:n_rows], P, outputs="all")
        t = time.perf_counter()
        c.decode(batch)
        c.logits(1) if c is plain else c.sampled_token(0)   # waits for the graph on a GPU
        return (time.perf_counter() - t) * 1e3

    def read(c: NativeContext, n_rows: int) -> list[Dist]:
        out = []
        for i in range(n_rows):
            ids, probs = c.sampled_candidates(i), c.sampled_probs(i)
            keep = probs > 0
            order = np.argsort(ids[keep])
            out.append(Dist(ids[keep][order], probs[keep][order].astype(np.float64)))
        return out

    for n_rows, key in ((4, "verify4"), (1, "one_row")):
        tp, tb = [], []
        for _ in range(iters):
            tp.append(decode(plain, n_rows))
            tb.append(decode(ctx, n_rows))
        # the fastest decode: the least disturbed by whatever else shares the machine
        result[f"{key}_plain_ms"] = min(tp)
        result[f"{key}_backend_ms"] = min(tb)
        result[f"{key}_read_ms"] = per_call_ms(lambda: read(ctx, n_rows), 1)
        if n_rows == 4:
            dists = read(ctx, 4)
            result["support_median"] = int(np.median([d.ids.size for d in dists]))
            # the acceptance the host paths' rounds include: the 4 rows as p, 3 of them as q
            drafts = [int(d.ids[np.argmax(d.probs)]) for d in dists[:3]]
            rng = np.random.default_rng(0)
            result["accept_ms"] = per_call_ms(
                lambda: [rejection_accept(drafts, dists[:3], dists, rng) for _ in range(iters)], iters)
            result["sample"] = {"candidates": int(ctx.sampled_candidates(0).size),
                                "probs": int(ctx.sampled_probs(0).size),
                                "probs_sum": float(ctx.sampled_probs(0).sum()),
                                "token": ctx.sampled_token(0)}
    d4 = result["verify4_backend_ms"] - result["verify4_plain_ms"]
    d1 = result["one_row_backend_ms"] - result["one_row_plain_ms"]
    result["works"] = True
    result["dist_ms"] = d4 / 4 + result["verify4_read_ms"] / 4
    result["round_ms"] = (d4 + 3 * d1 + result["verify4_read_ms"] + 3 * result["one_row_read_ms"]
                          + result["accept_ms"])
    ctx.set_sampler(0, None)
    for c in (plain, ctx):
        c.close()
    chain.close()
    return result


# -- report ----------------------------------------------------------------------------

def greedy_ms(rows: np.ndarray, iters: int) -> float:
    four = rows[:4]
    return per_call_ms(lambda: [four.argmax(axis=1) for _ in range(iters)], iters)


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(results: list[dict]) -> str:
    head = ["vocab", "filters", "path", "per dist ms", "per k=3 round ms", "array build ms", "support"]
    body = []
    for r in results:
        if r["path"] == "backend" and not r.get("works"):
            body.append([r["n_vocab"], r["filters"], "backend", "unusable", "-", "-",
                         " ".join(r.get("offloaded", []))])
            continue
        body.append([r["n_vocab"], r["filters"], r["path"], fmt(r.get("dist_ms")), fmt(r.get("round_ms")),
                     fmt(r.get("array_build_ms")), r.get("support_median", "-")])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=Path, default=SMALL, help="8,192-token model (rows + backend)")
    ap.add_argument("--padded", type=Path, default=PADDED, help="248,320-token model (rows + backend)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3, help="passes over the 48 rows per measurement")
    ap.add_argument("--backend-iters", type=int, default=15, help="decodes per backend timing (fastest kept)")
    ap.add_argument("--no-backend", action="store_true", help="skip backend sampling (needs decodes)")
    ap.add_argument("--synthetic", action="store_true", help="synthetic rows where a model is missing")
    ap.add_argument("--filters", action="append", choices=list(FILTERS), help="default: all")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    results, notes = [], []
    for path, n_vocab in ((args.small, 8192), (args.padded, 248320)):
        model = None
        if path.exists():
            model = NativeModel(str(path), verbose=False)
            rows = model_rows(model, args.threads)
            source = f"{path.name}: last {ROWS_PER_PROMPT} positions of {N_PROMPTS} held-out prompts"
        elif args.synthetic:
            rows, source = synthetic_rows(n_vocab), "synthetic long-tail rows"
        else:
            sys.exit(f"{path} not found: pass --small/--padded, or --synthetic for made-up rows")
        notes.append({"n_vocab": int(rows.shape[1]), "rows": source,
                      "greedy_argmax_4_rows_ms": greedy_ms(rows, 50)})
        for name in args.filters or list(FILTERS):
            f = FILTERS[name]
            for r in measure_host(rows, f, args.iters):
                results.append({"n_vocab": int(rows.shape[1]), "filters": name, **r})
            if model is not None and not args.no_backend:
                results.append({"n_vocab": int(rows.shape[1]), "filters": name,
                                **measure_backend(model, f, args.threads, args.backend_iters)})
        if model is not None:
            model.close()

    meta = {"threads": args.threads, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "filters": FILTERS, "inputs": notes}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=1))
        return
    print(table(results))
    for n in notes:
        print(f"\n{n['n_vocab']} tokens: rows from {n['rows']}; greedy (argmax of 4 rows): "
              f"{n['greedy_argmax_4_rows_ms']:.3f} ms")
    for r in results:
        if r["path"] == "backend" and r.get("works"):
            print(f"backend {r['n_vocab']} {r['filters']}: verify 4 rows {r['verify4_plain_ms']:.2f} -> "
                  f"{r['verify4_backend_ms']:.2f} ms, one row {r['one_row_plain_ms']:.2f} -> "
                  f"{r['one_row_backend_ms']:.2f} ms; row 0 returns {r['sample']['candidates']} candidates "
                  f"and {r['sample']['probs']} probs (sum {r['sample']['probs_sum']:.4f}); samplers {r['offloaded']}")


if __name__ == "__main__":
    main()
