"""Slots split among batched engines: one engine of N slots against G engines of N/G,
each stepped by its own thread, on the same model and the same queue of requests.

    python benchmarks/engine_split.py MODEL [--slots 8] [--engines 1 --engines 2 ...]
        [--spec 3 --spec none] [--requests 32] [-n 128] [--repeat 2]

Why: on an H100 the pre-batching server (eight slots, each its own contexts and thread)
beat the one batched engine by up to 1.5x on the small models (benchmarks/README.md,
session 33): a batched round runs its MTP decodes, target decode and Python one after
the other, with the device idle under the host's work. Engines in their own threads
overlap one's host work with another's decodes (llama.cpp releases the GIL in a
decode). On a CPU they contend for the same cores instead.

Every engine takes the next request from one shared queue whenever it has a free slot,
as a server's slots would; requests are the held-out prompts, greedy, ``-n`` tokens with
ignore_eos. Prints generated tok/s per (engines, spec), alternating the settings each
pass, and the median over the passes.
"""

from __future__ import annotations

import argparse
import collections
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymtp  # noqa: E402
from pymtp.batch import engine_sizes  # noqa: E402
from pymtp.bench import read_prompts  # noqa: E402

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")


def spec_params(spec: str) -> dict:
    """``Session.stream`` keywords of a spec name: none, a depth, auto, or auto0: auto held
    at depth 0 (what auto's plain epochs cost beside --spec none's rounds: the target's
    hidden rows and recurrent snapshots for drafts that may come)."""
    if spec == "none":
        return {"spec": "none"}
    if spec in ("auto", "auto0"):
        return {"spec": "mtp", "draft_max": "auto"}
    if not spec.isdigit() or int(spec) < 1:
        raise ValueError(f"--spec {spec!r}: use none, auto, auto0 or a depth >= 1")
    return {"spec": "mtp", "draft_max": int(spec)}


def hold_plain(batcher) -> None:
    """--spec auto0: the batcher's auto epochs (its own or the ones it follows) stay at depth 0."""
    epochs = batcher.engine.rounds.epochs
    epochs = getattr(epochs, "leader", epochs)
    epochs.k = 0
    epochs.pick = lambda bucket: 0


def drive(batcher, work: "queue.SimpleQueue[str]", kw: dict, tokens: list[int]) -> None:
    """Step ``batcher`` until the shared queue is empty and its requests are done,
    taking a request whenever a slot is free."""
    running = []
    while True:
        running = [r for r in running if not r.done]
        while len(running) < batcher.slots:
            try:
                running.append(batcher.submit(work.get_nowait(), **kw))
            except queue.Empty:
                break
        if not running:
            return
        for _run, chunk in batcher.step():
            tokens[0] += len(chunk.tokens)


def run(model, prompts: list[str], slots: int, engines: int, spec: str, n: int) -> float:
    """Generated tok/s of ``engines`` batchers sharing ``slots`` over ``prompts``."""
    sizes = engine_sizes(slots, engines)
    batchers = [model.batcher(sizes[0])]
    batchers += [model.batcher(size, follow=batchers[0]) for size in sizes[1:]]     # as pymtp serve
    work: queue.SimpleQueue[str] = queue.SimpleQueue()
    for p in prompts:
        work.put(p)
    kw = dict(max_tokens=n, temperature=0.0, ignore_eos=True, **spec_params(spec))
    if spec == "auto0":
        hold_plain(batchers[0])
    counts = [[0] for _ in batchers]
    failed: list[BaseException] = []

    def one(b, c) -> None:
        try:
            drive(b, work, kw, c)
        except BaseException as exc:       # re-raised below: a row of 0 tok/s says nothing
            failed.append(exc)

    threads = [threading.Thread(target=one, args=(b, c)) for b, c in zip(batchers, counts)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for b in batchers:
        b.close()
    if failed:
        raise failed[0]
    return sum(c[0] for c in counts) / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--engines", type=int, action="append", help="repeatable; default 1 and 2")
    ap.add_argument("--spec", action="append", help="none, a depth, auto or auto0 (auto held at depth 0); "
                    "repeatable, default 3 and none")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2, help="passes over the settings, in turn")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of each context")
    ap.add_argument("--switch-interval", type=float, action="append", default=None, metavar="S",
                    help="sys.setswitchinterval for the engines' threads (repeatable: rows of each; "
                         "default: Python's 0.005): how long a thread that returns from a decode may "
                         "wait for another's Python to hand over the GIL")
    args = ap.parse_args(argv)
    engines = args.engines or [1, 2]
    specs = args.spec or ["3", "none"]
    for g in engines:
        try:
            engine_sizes(args.slots, g)        # a bad --engines or --spec fails before the model loads
        except ValueError as exc:
            ap.error(f"--engines {g}: {exc}")
    for s in specs:
        try:
            spec_params(s)
        except ValueError as exc:
            ap.error(str(exc))
    model = pymtp.load(args.model, **({} if args.threads is None else {"threads": args.threads}))
    held = read_prompts(PROMPTS)
    # as load_server.py's table: a first line of their own so no prompt cache reuses them
    prompts = [p if i < len(held) else f"# request {i + 1}\n{p}"
               for i, p in ((i, held[i % len(held)]) for i in range(args.requests))]
    run(model, prompts[: args.slots], args.slots, 1, specs[0], 16)       # warm-up
    rates: dict[tuple[int, float, str], list[float]] = collections.defaultdict(list)
    switches = args.switch_interval or [sys.getswitchinterval()]
    for p in range(args.repeat):
        for spec in specs:
            for g in engines:
                for sw in switches:
                    sys.setswitchinterval(sw)
                    tps = run(model, prompts, args.slots, g, spec, args.n)
                    rates[(g, sw, spec)].append(tps)
                    print(f"pass {p + 1}: {g} engine(s) of {engine_sizes(args.slots, g)} slots, switch interval "
                          f"{sw * 1e3:g} ms, spec {spec}: {tps:.1f} tok/s", flush=True)
    print(f"\n{args.requests} requests x {args.n} tokens, greedy, {args.slots} slots, "
          f"{Path(args.model).name}, median of {args.repeat} passes, tok/s\n")
    print("| engines | switch interval | " + " | ".join(f"spec {s}" for s in specs) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in specs) + " |")
    for g in engines:
        for sw in switches:
            print(f"| {g} x {engine_sizes(args.slots, g)[0]} | {sw * 1e3:g} ms | "
                  + " | ".join(f"{statistics.median(rates[(g, sw, s)]):.1f}" for s in specs) + " |")
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
