"""Where a batched round's time goes when it admits a prompt, by llama.cpp call.

    python benchmarks/admission_cost.py MODEL [--slots 8] [--requests 24] [-n 128]
        [--spec none --spec 3 --spec auto0] [--no-cache] [--speed]

A ``pymtp serve --parallel SLOTS`` engine (``Batcher``) runs the held-out prompts, all
queued at once, greedy, ``-n`` tokens each with ignore_eos, as ``load_server.py`` sends
them. Every ``llama_decode`` is followed by ``llama_synchronize`` so that a round's
device time falls inside the round that queued it (the real loop overlaps the two:
this is a breakdown, not a speed). A round is its ``launch`` (admission, drafting, the
verify decode) and the ``land`` after it (readback, acceptance, prompt-cache snapshots).
Rounds are grouped by whether they carried a prompt chunk; each group prints its
rounds, mean ms, and the mean ms per round of each llama.cpp call, the rest being the
host's Python.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymtp  # noqa: E402
from pymtp.bench import read_prompts  # noqa: E402
from pymtp.native import C, NativeContext, NativeModel  # noqa: E402

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")


def _address(ptr) -> int | None:
    """A context pointer as an int, whether ctypes hands it over boxed or not."""
    return getattr(ptr, "value", ptr)


class Tally:
    """Per-round seconds of each llama.cpp call, and the rounds' wall time."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.rounds: list[tuple[str, float, collections.Counter[str]]] = []

    def wrap(self) -> None:
        """Time every llama.cpp call; a decode is named by its context, the target's or the
        MTP head's (a prompt round decodes both: which one its time is in)."""
        real, real_init = NativeModel.run, NativeContext.__init__
        calls = self.calls
        mtp: set[int] = set()

        def init(ctx, model, cfg, *a, **kw):
            real_init(ctx, model, cfg, *a, **kw)
            if cfg.mtp:
                mtp.add(_address(ctx.ptr))

        def timed(model, fn, *a):
            t0 = time.perf_counter()
            r = real(model, fn, *a)
            name = getattr(fn, "__name__", str(fn))
            if fn is C.llama_free:      # a context made later may get its address
                mtp.discard(_address(a[0]))
            if fn is C.llama_decode:
                real(model, C.llama_synchronize, a[0])
                name += " (MTP)" if _address(a[0]) in mtp else " (target)"
            calls[name] += time.perf_counter() - t0
            return r

        NativeModel.run, NativeContext.__init__ = timed, init

    def report(self) -> None:
        groups: dict[str, list[tuple[float, collections.Counter[str]]]] = collections.defaultdict(list)
        for kind, wall, calls in self.rounds:
            groups[kind].append((wall, calls))
        for kind, rows in sorted(groups.items()):
            n = len(rows)
            walls = [w for w, _ in rows]
            total = collections.Counter()
            for _, c in rows:
                total.update(c)
            native = sum(total.values())
            print(f"  {kind}: {n} rounds, {sum(walls):.3f} s, mean {1e3 * statistics.mean(walls):.3f} ms "
                  f"(median {1e3 * statistics.median(walls):.3f}), Python {1e3 * (sum(walls) - native) / n:.3f} ms")
            for name, s in total.most_common(8):
                print(f"    {name:34s} {1e3 * s / n:8.3f} ms")


def run(model, prompts: list[str], slots: int, n: int, spec: str, tally: Tally) -> float:
    """Generated tok/s of one batcher over ``prompts``; every round booked in ``tally``."""
    b = model.batcher(slots)
    engine = b.engine
    launch, land = engine.launch, engine.land
    open_round: list = []      # the round in flight: [kind, seconds, calls]

    def timed_launch():
        tally.calls.clear()
        t0 = time.perf_counter()
        out = launch()
        flight = engine.rounds.flight
        if flight is not None:
            open_round[:] = ["prompt" if flight.chunks else "decode", time.perf_counter() - t0,
                             collections.Counter(tally.calls)]
        return out

    def timed_land():
        if not open_round:
            return land()
        tally.calls.clear()
        t0 = time.perf_counter()
        out = land()
        kind, seconds, calls = open_round
        calls.update(tally.calls)
        tally.rounds.append((kind, seconds + time.perf_counter() - t0, calls))
        open_round.clear()
        return out

    engine.launch, engine.land = timed_launch, timed_land
    kw = dict(max_tokens=n, temperature=0.0, ignore_eos=True)
    if spec == "none":
        kw.update(spec="none")
    elif spec in ("auto", "auto0"):
        kw.update(spec="mtp", draft_max="auto")
        if spec == "auto0":       # auto held at depth 0: what its plain epochs cost
            epochs = engine.rounds.epochs
            epochs.k, epochs.pick = 0, lambda bucket: 0
    else:
        kw.update(spec="mtp", draft_max=int(spec))
    for p in prompts:
        b.submit(p, **kw)
    t0 = time.perf_counter()
    while b.busy:
        b.step()
    elapsed = time.perf_counter() - t0
    b.close()
    return len(prompts) * n / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--spec", action="append",
                    help="none, a depth, auto, or auto0 (auto held at depth 0); repeatable, default none and 3")
    ap.add_argument("--no-cache", action="store_true", help="prompt cache off")
    ap.add_argument("--speed", action="store_true",
                    help="no sync and no breakdown: the batcher's own tok/s (no server around it)")
    args = ap.parse_args(argv)
    opts = {} if not args.no_cache else {"prompt_cache_mib": 0}
    model = pymtp.load(args.model, **opts)
    prompts = (read_prompts(PROMPTS) * 4)[: args.requests]
    tally = Tally()
    if not args.speed:
        tally.wrap()
    for spec in args.spec or ["none", "3"]:
        run(model, prompts[:8], args.slots, 16, spec, Tally())    # warm-up (a batcher's prompt cache is its own)
        tally.rounds.clear()
        tps = run(model, prompts, args.slots, args.n, spec, tally)
        if args.speed:
            print(f"spec {spec}: {tps:.1f} tok/s")
            continue
        print(f"spec {spec}: {tps:.1f} tok/s with a sync after every decode")
        tally.report()
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
