"""What a short sampled generation costs on each host sampling path, and where it goes.

    python benchmarks/path_cost.py [--n 200] [--top 12]

The stochastic tests run thousands of 4-token generations (temperature 1, top_k 4, k=3)
on the dense fixture. On an H200's CUDA build the host chain's took ~20 ms each against
~7.5 ms for numpy's, where a CPU runs both alike (session 43). This times the same
generation on the paths "chain" and "numpy", with and without drafts, and prints each
one's heaviest functions (cProfile, own time) and its native calls by llama.cpp function
(``NativeModel.run``'s ``fn``), so the gap can be placed.

On the H200 (session 44) both paths cost the same on fresh models (k=3: 6.23 against 6.18
ms): the suite's gap is its six pytest processes sharing one GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time

import pymtp
from pymtp.native import NativeModel
from pymtp.testing.fixtures import fixture_path

SAMPLING = dict(temperature=1.0, top_k=4, draft_max=3, max_tokens=4, ignore_eos=True)


def by_native_call(model, n: int, call) -> list[tuple[str, float, int]]:
    """(llama.cpp function, ms a generation, calls a generation), heaviest first."""
    tally: dict[str, list] = {}
    real = NativeModel.run

    def run(self, fn, *a):
        t = time.perf_counter()
        try:
            return real(self, fn, *a)
        finally:
            e = tally.setdefault(getattr(fn, "__name__", str(fn)), [0.0, 0])
            e[0] += time.perf_counter() - t
            e[1] += 1

    NativeModel.run = run
    try:
        for s in range(n):
            call(s)
    finally:
        NativeModel.run = real
    return sorted(((k, v[0] / n * 1e3, v[1] / n) for k, v in tally.items()), key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="generations per setting")
    ap.add_argument("--top", type=int, default=12, help="functions listed per setting")
    args = ap.parse_args()
    path = fixture_path("dense", cache_dir=tempfile.mkdtemp())
    for sampling in ("chain", "numpy"):
        model = pymtp.load(path, threads=1, n_ctx=1024, sampling=sampling)
        prompt = model.tokenize("The quick brown fox")
        for spec in ("mtp", "none"):
            kw = dict(SAMPLING, spec=spec)
            for s in range(10):
                model.generate(prompt, seed=s, **kw)
            t0 = time.perf_counter()
            for s in range(args.n):
                model.generate(prompt, seed=s, **kw)
            ms = (time.perf_counter() - t0) / args.n * 1e3
            prof = cProfile.Profile()
            prof.enable()
            for s in range(args.n):
                model.generate(prompt, seed=s, **kw)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            body = out.getvalue()
            print(f"## sampling={sampling} spec={spec}: {ms:.2f} ms a generation ({args.n})")
            print(body[body.find("ncalls"):].rstrip())
            rows = by_native_call(model, args.n, lambda s: model.generate(prompt, seed=s, **kw))
            print("native calls (ms, calls a generation): "
                  + ", ".join(f"{k} {ms:.3f} {c:.1f}" for k, ms, c in rows[:args.top]), flush=True)
        model.close()


if __name__ == "__main__":
    main()
