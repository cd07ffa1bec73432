"""Where a round's Python goes, helper by helper.

    python benchmarks/host_calls.py MODEL [round_profile.py's options] [--cold-warm] [--calls-json OUT]

round_profile.py says how much of a round is Python, and in which step. This names it:
each helper of ``HELPERS`` is wrapped, for the whole process, with a ``perf_counter``
pair, and the table after round_profile's gives its calls and time per call. A helper's
time includes the native calls it makes: the first read of a backend-sampled row waits
for the device to finish the decode, so on a GPU that helper holds the wait. The sums
cover every run of the process (the warm-up and both passes of each pair): profile one
setting (-k) at a time.

``--cold-warm`` builds each backend row's Dist twice, as the round does (right after
the decode, whose host work -- building the graph, launching it -- has evicted numpy's
code and data from the caches) and then again at once. The difference is what a cold
start costs. The second build is extra work in the round, so round_profile's shares are
not the round's own in that run.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_profile  # noqa: E402  (beside this file)

# (module, attribute path there, what it is). A helper imported by name is wrapped where
# it is called from: ``from .sampling import sampled_dist`` binds its own name.
HELPERS: tuple[tuple[str, str, str], ...] = (
    ("pymtp.drafter", "sampled_dist", "q: a drafter row sampled in the graph, as a Dist"),
    ("pymtp.backend_sampling", "sampled_dist", "p: a verify row sampled in the graph, as a Dist"),
    ("pymtp.sampling", "Dist.from_sparse", "a Dist from a row's candidates and probabilities"),
    ("pymtp.sampling", "Sampler.sample", "a draft's token drawn from q"),
    ("pymtp.round_judge", "rejection_accept", "the rejection rule, p's rows read as it goes"),
    ("pymtp.round_judge", "exact_match_draws", "the exact-match rule, each row's token read as it goes"),
    ("pymtp.drafter", "MTPDrafter._fill", "a drafter decode's batch"),
    ("pymtp.drafter", "MTPDrafter._advance", "a drafter decode's outputs: hidden rows, drafts"),
    # the host paths (chain, numpy): a row's distribution built from its logits
    ("pymtp.sampling", "Sampler.dist", "a row's Dist on the host (q in a draft step, p in acceptance)"),
    ("pymtp.sampling", "softmax", "the float64 softmax over a Dist's support"),
    ("pymtp.native_samplers", "SamplerChain.apply", "llama.cpp's filters over a token data array"),
    ("pymtp.native_samplers", "TokenDataArray.set", "a row (or its candidates) into the token data array"),
    ("pymtp.acceptance", "residual", "norm(max(0, p - q)) at a rejection"),
    ("pymtp.native", "NativeContext.logits", "a decode's logits rows (the first read waits for the device)"),
)


@dataclass
class Tally:
    """Per helper, by (module, path): [seconds, calls]; the cold and warm builds of --cold-warm."""

    helpers: dict = field(default_factory=lambda: {(m, path): [0.0, 0] for m, path, _ in HELPERS})
    cold: list = field(default_factory=lambda: [0.0, 0])
    warm: list = field(default_factory=lambda: [0.0, 0])


def _owner(module: str, path: str):
    """The object holding the helper's last name, and that name; exits naming the helper
    that moved (HELPERS must follow pymtp's code)."""
    obj = importlib.import_module(module)
    *outer, name = path.split(".")
    try:
        for part in outer:
            obj = getattr(obj, part)
        getattr(obj, name)
    except AttributeError:
        raise SystemExit(f"{module} has no {path}: update HELPERS in {Path(__file__).name}") from None
    return obj, name


def instrument(tally: Tally, cold_warm: bool) -> None:
    """Wrap every helper (classmethods stay classmethods); with ``cold_warm`` the two
    ``sampled_dist`` bindings build their Dist a second time, timed apart."""
    for module, path, _ in HELPERS:
        owner, name = _owner(module, path)
        raw = owner.__dict__.get(name) if isinstance(owner, type) else None
        is_classmethod = isinstance(raw, classmethod)
        fn = raw.__func__ if is_classmethod else getattr(owner, name)
        if cold_warm and name == "sampled_dist":
            fn = _twice(fn, tally)
        wrapped = _timed(fn, tally.helpers[module, path])
        setattr(owner, name, classmethod(wrapped) if is_classmethod else wrapped)


def _timed(fn, slot: list):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            slot[0] += time.perf_counter() - t
            slot[1] += 1
    return wrapper


def _twice(sampled_dist, tally: Tally):
    """``sampled_dist`` that reads the row (its first read waits for the device), then
    builds the Dist twice: cold, then warm. Returns the first."""
    from pymtp.sampling import Dist

    @functools.wraps(sampled_dist)
    def wrapper(ctx, i):
        ids, probs = ctx.sampled_candidates(i), ctx.sampled_probs(i)
        if ids is None or probs is None:
            return sampled_dist(ctx, i)        # whole-row fallback: no short row to time
        builds = []
        for slot in (tally.cold, tally.warm):
            t = time.perf_counter()
            builds.append(Dist.from_sparse(ids, probs))
            slot[0] += time.perf_counter() - t
            slot[1] += 1
        return builds[0]
    return wrapper


def report(tally: Tally) -> dict:
    us = lambda s, n: round(1e6 * s / n, 2) if n else None
    rows = []
    for module, path, what in HELPERS:
        seconds, calls = tally.helpers[module, path]
        rows.append({"helper": f"{module.removeprefix('pymtp.')}.{path}", "what": what, "calls": calls,
                     "total_ms": round(1e3 * seconds, 3), "us_per_call": us(seconds, calls)})
    out = {"helpers": rows}
    if tally.cold[1]:
        out["dist_builds"] = {"calls": tally.cold[1], "cold_us": us(*tally.cold), "warm_us": us(*tally.warm)}
    return out


def format_calls(rep: dict) -> str:
    head = ["helper", "calls", "total ms", "us per call", "what"]
    body = [[r["helper"], r["calls"], f"{r['total_ms']:.1f}", "-" if r["us_per_call"] is None else
             f"{r['us_per_call']:.1f}", r["what"]] for r in rep["helpers"]]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    row = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    lines = [row(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [row(b) for b in body]
    lines.append("(every run of the process, warm-up included; a helper's time includes its native calls)")
    if "dist_builds" in rep:
        d = rep["dist_builds"]
        lines.append(f"a backend row's Dist, built right after the decode: {d['cold_us']:.1f} us; "
                     f"again at once: {d['warm_us']:.1f} us ({d['calls']} rows)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    ap.add_argument("--cold-warm", action="store_true", help="build each backend row's Dist twice (cold, warm)")
    ap.add_argument("--calls-json", type=Path, default=None, help="also write the helper table here")
    args, rest = ap.parse_known_args(argv)
    if {"-h", "--help"} & set(rest):
        ap.print_help()                 # then round_profile.py's options, and exit
        print()
    tally = Tally()
    instrument(tally, args.cold_warm)
    round_profile.main(rest)
    rep = report(tally)
    print(format_calls(rep))
    if args.calls_json:
        args.calls_json.write_text(json.dumps(rep, indent=2) + "\n")


if __name__ == "__main__":
    main()
