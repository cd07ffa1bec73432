"""What plain rounds cost right after a batch drafted: per round since the switch, the
host's seconds and what llama.cpp reported for it (CUDA graph warm-ups, replays, graph
reuses).

    python benchmarks/switch_trace.py MODEL [--slots 8] [--schedule 4x40,0x80] [--cycles 3]
        [--mute-log] [--json OUT.json]

A ``Batcher`` of SLOTS sequences (greedy, ignore_eos, draft_max="auto") runs with its
depth forced by a schedule (``4x40,0x80``: 40 rounds at depth 4, then 80 plain, repeated
``--cycles`` times), so every switch lands in a full batch with no prompt rows. Then a
``--spec none`` batcher runs as many rounds for comparison. Printed per phase and per
round since the phase began (its first 32, then by 16): mean ``launch`` and ``land`` ms
(host, unsynced as the server runs them), ms from the landing before it, and per round
the llama.cpp log lines it caused by kind ("reused": ggml-cuda replayed a graph it had
for that llama.cpp graph; "warmup ...": ggml-cuda ran the graph eagerly; "other") and
the target's llama.cpp graph reuses (``llama_perf_context().n_reused``).

Why: under a 16-client load on the H100 (session 18, small model) auto's plain rounds
after k=4 took 7-8.6 ms decaying to 1.5 ms over ~25 rounds, where --spec none's took
1.1-1.5, and the estimate of plain they fed made auto draft. This says whether the batch
alone does that (no server threads), and whether CUDA graphs or llama.cpp's graph reuse
follow it. ``--mute-log`` points llama.cpp's log at a C function that does nothing (no
Python callback, so no GIL, during a decode). Run it again with
GGML_CUDA_DISABLE_GRAPHS=1 to see the rounds without CUDA graphs.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pymtp  # noqa: E402
from pymtp import depth, engine, native  # noqa: E402
from pymtp.bench import read_prompts  # noqa: E402
from pymtp.native import C  # noqa: E402

PROMPTS = Path(__file__).with_name("prompts_heldout.jsonl")
KINDS = (("reused", "CUDA Graph id"), ("warmup complete", "warmup complete"),
         ("warmup reset", "warmup reset"))


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """``4x40,0x80`` -> [(4, 40), (0, 80)]: (depth, rounds) phases."""
    out = []
    for part in text.split(","):
        k, _, n = part.partition("x")
        out.append((int(k), int(n)))
    return out


class Logs:
    """llama.cpp's log lines by kind, counted by a callback of our own."""

    def __init__(self, mute: bool) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        if mute:    # any C function that ignores its arguments: no Python runs in a decode
            self._cb = ctypes.cast(ctypes.CDLL(None).getpid, C.llama_log_callback)
        else:
            self._cb = C.llama_log_callback(self._log)
        C.llama_log_set(self._cb, ctypes.c_void_p(0))

    def _log(self, level: int, text: bytes, user_data) -> None:
        line = text.decode("utf-8", errors="replace")
        kind = next((k for k, mark in KINDS if mark in line), "other")
        self.counts[kind] += 1

    def close(self) -> None:
        C.llama_log_set(native._log_callback, ctypes.c_void_p(0))


def run(model, prompts: list[str], slots: int, spec: str, phases: list[tuple[int, int]], cycles: int,
        logs: Logs) -> list[dict]:
    """One batcher over ``slots`` prompts; a record per round (its phase's depth, the
    round's index in the phase, seconds, log lines by kind, target graph reuses)."""
    total = cycles * sum(n for _, n in phases)
    b = model.batcher(slots)
    rounds = b.engine.rounds
    target = rounds.target
    schedule = [(k, i) for _ in range(cycles) for k, n in phases for i in range(n)]
    records: list[dict] = []
    kw = dict(max_tokens=cycles * sum((k + 1) * n for k, n in phases) + 8, temperature=0.0, ignore_eos=True)
    if spec == "none":
        kw.update(spec="none")
    else:
        kw.update(spec="mtp", draft_max="auto")
    for p in prompts[:slots]:
        b.submit(p, **kw)
    epochs = rounds.epochs
    if epochs is not None:
        epochs.k = 0
        epochs.tally = lambda *a, **kw: None     # the schedule decides
    launch, land = rounds.launch, rounds.land
    state = {"last": None, "launch": 0.0}
    n_done = 0

    def timed_launch(*a, **kw):
        t0 = time.perf_counter()
        out = launch(*a, **kw)
        state["launch"] = time.perf_counter() - t0
        return out

    def timed_land(*a, **kw):
        nonlocal n_done
        decoding = len(rounds.flight.decoding) if rounds.flight is not None else 0
        chunks = bool(rounds.flight.chunks) if rounds.flight is not None else False
        reused0 = C.llama_perf_context(target.ptr).n_reused
        t0 = time.perf_counter()
        out = land(*a, **kw)
        t1 = time.perf_counter()
        if decoding == slots and not chunks and n_done < total:
            k, i = schedule[n_done]
            records.append({"k": k, "i": i, "launch": state["launch"], "land": t1 - t0,
                            "dt": (t1 - state["last"]) if state["last"] else None,
                            "logs": dict(logs.counts),
                            "reused": C.llama_perf_context(target.ptr).n_reused - reused0 + state.get("r_launch", 0)})
            n_done += 1
            if epochs is not None and n_done < total:
                epochs.k = schedule[n_done][0]
        logs.counts.clear()
        state["last"] = t1
        return out

    def counted_launch(*a, **kw):
        logs.counts.clear()
        r0 = C.llama_perf_context(target.ptr).n_reused
        out = timed_launch(*a, **kw)
        state["r_launch"] = C.llama_perf_context(target.ptr).n_reused - r0
        return out

    rounds.launch, rounds.land = counted_launch, timed_land
    try:
        while b.busy and n_done < total:
            b.step()
    finally:
        b.close()
    return records


def report(label: str, records: list[dict]) -> list[str]:
    out = [f"== {label}: {len(records)} full rounds"]
    by: dict[tuple[int, int], list[dict]] = collections.defaultdict(list)
    for r in records:
        bucket = r["i"] if r["i"] < 32 else 32 + 16 * ((r["i"] - 32) // 16)
        by[(r["k"], bucket)].append(r)
    order = []
    for r in records:      # phases in schedule order
        if r["k"] not in order:
            order.append(r["k"])
    for k in order:
        for (kk, bucket), rs in sorted(by.items()):
            if kk != k:
                continue
            dts = [r["dt"] for r in rs if r["dt"] is not None]
            logs = collections.Counter()
            for r in rs:
                logs.update(r["logs"])
            per = " ".join(f"{name}={logs[name] / len(rs):.1f}" for name in ("reused", "warmup complete",
                                                                              "warmup reset", "other") if logs[name])
            out.append(f"   k={k} round {bucket:3d}{'+' if bucket >= 32 else ' '} n={len(rs):3d}  "
                       f"launch {1e3 * statistics.mean(r['launch'] for r in rs):6.3f} ms  "
                       f"land {1e3 * statistics.mean(r['land'] for r in rs):6.3f}  "
                       f"dt {1e3 * statistics.mean(dts) if dts else float('nan'):6.3f}  "
                       f"graph reuses {statistics.mean(r['reused'] for r in rs):.2f}  logs/round: {per or '-'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--schedule", default="4x40,0x80")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--n-ctx", type=int, default=16384)
    ap.add_argument("--mute-log", action="store_true", help="llama.cpp's log to a C no-op (no Python callback)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    phases = parse_schedule(args.schedule)
    model = pymtp.load(args.model, n_ctx=args.n_ctx)
    prompts = (read_prompts(PROMPTS) * 4)[: args.slots]
    logs = Logs(args.mute_log)
    results = {}
    try:
        run(model, prompts, args.slots, "auto", [(0, 8)], 1, logs)      # warm-up
        results["auto"] = run(model, prompts, args.slots, "auto", phases, args.cycles, logs)
        plain = [(0, sum(n for _, n in phases))]
        results["none"] = run(model, prompts, args.slots, "none", plain, args.cycles, logs)
    finally:
        logs.close()
        model.close()
    for label, recs in results.items():
        print("\n".join(report(f"{label} {args.schedule if label == 'auto' else 'plain'}"
                               f"{' (log muted)' if args.mute_log else ''}", recs)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
