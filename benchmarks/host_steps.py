"""Where a batched round's host time goes, by engine step, and what its decodes are.

    python benchmarks/host_steps.py MODEL [--spec none --spec auto0] [--slots 8]
        [--requests 24] [-n 128] [--repeat 2]

A ``pymtp serve --parallel SLOTS`` engine (``Batcher``) runs the held-out prompts, as
``admission_cost.py`` does (``--spec auto0`` is auto held at depth 0: what its plain
epochs cost the host). Three passes per spec and repeat, each printed on lines of its own:

- ``steps``: the mean host microseconds a round of each ``rounds.Rounds`` step (and of
  ``depth_batched.Epochs.tally`` and ``seq_resume.Resumes.snapshot``), unsynced, as the server
  runs them; ``land`` includes the wait for the device in ``_read``.
- ``gap``: the host's critical path, from the end of one round's logits read to the next
  ``llama_decode`` call (median, p10, p90): what the device waits for.
- ``decodes``: every ``llama_decode`` with a ``llama_synchronize`` after it, grouped by
  context and batch shape (rows, output rows, sequences): whether two specs decode the
  same batches in the same device time.

Each pass is timed on its own: the wrappers of one do not slow the others.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import admission_cost  # noqa: E402
import pymtp  # noqa: E402
from pymtp import depth_batched, rounds, seq_resume  # noqa: E402
from pymtp import native  # noqa: E402
from pymtp.native import C, NativeModel  # noqa: E402

STEPS = ("launch", "land", "_draft", "_depths", "_plan", "_fill", "_read", "_prefilled", "_judge",
         "_roll_back", "_emit", "_launch_lone", "_land_lone")


def _patch(owner, name: str, wrapper) -> Callable[[], None]:
    """Replace ``owner.name`` with ``wrapper(original)``; returns the undo."""
    real = getattr(owner, name)
    setattr(owner, name, wrapper(real))
    return lambda: setattr(owner, name, real)


def _run_with(patches: list[tuple[object, str, Callable]], model, prompts: list[str], slots: int, n: int,
              spec: str) -> float:
    """One batcher run over ``prompts`` (tok/s) with each (owner, name, wrapper) in place."""
    undo = [_patch(owner, name, wrapper) for owner, name, wrapper in patches]
    try:
        return admission_cost.run(model, prompts, slots, n, spec, admission_cost.Tally())
    finally:
        for u in reversed(undo):
            u()


def _timer(seconds: collections.Counter, name: str):
    def wrap(real):
        @functools.wraps(real)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                seconds[name] += time.perf_counter() - t0
        return timed
    return wrap


def steps(model, prompts: list[str], slots: int, n: int, spec: str) -> str:
    seconds: collections.Counter[str] = collections.Counter()
    patches = [(rounds.Rounds, s, _timer(seconds, s)) for s in STEPS]
    patches += [(depth_batched.Epochs, "tally", _timer(seconds, "tally")),
                (seq_resume.Resumes, "snapshot", _timer(seconds, "snapshot"))]
    tps = _run_with(patches, model, prompts, slots, n, spec)
    n_rounds = len(prompts) * n / slots     # rounds of a full batch, one token each
    return f"{tps:.0f} tok/s; us a round: " + " ".join(f"{k}={1e6 * v / n_rounds:.0f}" for k, v in sorted(seconds.items()))


def gap(model, prompts: list[str], slots: int, n: int, spec: str) -> str:
    marks: list[tuple[str, float]] = []

    def wrap(real):
        def run(m, fn, *a):
            if fn is C.llama_decode:
                marks.append(("decode", time.perf_counter()))
            r = real(m, fn, *a)
            if fn is native._LOGITS_AT:
                marks.append(("read", time.perf_counter()))
            return r
        return run

    _run_with([(NativeModel, "run", wrap)], model, prompts, slots, n, spec)
    gaps = sorted(b[1] - a[1] for a, b in zip(marks, marks[1:]) if a[0] == "read" and b[0] == "decode")
    return (f"{len(gaps)} gaps, median {1e6 * statistics.median(gaps):.0f} us, "
            f"p10 {1e6 * gaps[len(gaps) // 10]:.0f}, p90 {1e6 * gaps[9 * len(gaps) // 10]:.0f}")


def decodes(model, prompts: list[str], slots: int, n: int, spec: str) -> str:
    calls: dict[tuple, list[float]] = collections.defaultdict(list)
    contexts: dict[int, str] = {}

    def wrap(real):
        def run(m, fn, *a):
            if fn is not C.llama_decode:
                return real(m, fn, *a)
            t0 = time.perf_counter()
            r = real(m, fn, *a)
            real(m, C.llama_synchronize, a[0])
            b = a[1]
            rows = b.n_tokens
            ctx = contexts.setdefault(getattr(a[0], "value", a[0]), f"context {len(contexts)}")
            seqs = len({b.seq_id[i][0] for i in range(rows)})
            calls[(ctx, rows, sum(b.logits[i] for i in range(rows)), seqs)].append(time.perf_counter() - t0)
            return r
        return run

    _run_with([(NativeModel, "run", wrap)], model, prompts, slots, n, spec)
    lines = [f"{sum(map(len, calls.values()))} decodes"]
    for (ctx, rows, outs, seqs), s in sorted(calls.items(), key=lambda kv: -len(kv[1]))[:6]:
        lines.append(f"    {ctx}, {rows} rows, {outs} outputs, {seqs} sequences: {len(s)} calls, "
                     f"median {1e3 * statistics.median(s):.3f} ms, mean {1e3 * statistics.mean(s):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--spec", action="append", help="as admission_cost.py's; default none and auto0")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2, help="passes over the specs, in turn")
    args = ap.parse_args(argv)
    model = pymtp.load(args.model)
    prompts = (admission_cost.read_prompts(admission_cost.PROMPTS) * 4)[: args.requests]
    try:
        for rep in range(args.repeat):
            for spec in args.spec or ["none", "auto0"]:
                admission_cost.run(model, prompts[:8], args.slots, 16, spec, admission_cost.Tally())  # warm-up
                for name, measure in (("steps", steps), ("gap", gap), ("decodes", decodes)):
                    print(f"pass {rep + 1}, spec {spec}, {name}: {measure(model, prompts, args.slots, args.n, spec)}",
                          flush=True)
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
