"""How much of a round's wall time is Python/policy, and how much is llama.cpp.

    python benchmarks/round_profile.py MODEL [-k 3] [--temperature 0.7 --top-k 40 --top-p 0.95
        --min-p 0.05] [--sampling auto|chain|numpy|backend] [--limit 4] [-n 128] [--threads N]
        [--passes N] [--json OUT.json]

Prints, per setting, the share of the decode phase's wall time spent outside native
calls -- "Python/policy": the engine's steps, sampling and acceptance, the generator and
``Model.generate``'s per-step work (detokenizing, stop rules) -- and writes the numbers
as JSON. The issue #9 figure is the k=3 row at 248k vocabulary on the H100 (<= 5%).

How it measures: every ``NativeContext`` method that calls into llama.cpp (decode,
logits and hidden-row reads, backend-sampled reads, seq_rm, state save/restore, sampler
attach) is wrapped, on the class, with a ``perf_counter`` pair; what they add up to is
"native", including their ctypes marshalling. On a GPU ``llama_decode`` returns before
the graph has run and the next read waits for it; to keep that wait inside the decode
call that caused it, the wrapper calls ``llama_synchronize`` right after each decode
(``--no-sync`` leaves it out: then Python that overlaps the GPU is counted as Python,
which can only overstate its share). The decode phase runs from the first generated
token to the end (``RunStats``; the bench's tok/s starts later, after round 1's drafter
decode of the prompt's rows, as llama-server's timings do); native time is counted from
the end of the prefill. Python = decode wall - native. The engine's steps (``rounds.Rounds``:
draft, verify, accept, roll back, catch up) are wrapped the same way, so each step's own
Python time is reported too, counted from the end of the prefill (the prompt's decode
is a ``_verify`` too); "outside the steps" is the round loop, the generator hand-off and
``Model.generate``'s per-step work.

That Python is all the host's work, including what runs while the device works: on a
GPU the next round's verify is queued before the caller reads this round's tokens
(``Rounds.overlapped``), so the caller's per-step work overlaps it. The "critical path"
columns count only the Python the round waits for: each setting runs a second time
without the synchronisation, and critical Python = that pass's decode wall - the first
pass's native time (the round as it would run with no Python at all, its decodes back to
back). Both passes must emit the same tokens (seeded, same batches), or the figure is
left out ("same work" in the JSON). On a CPU a decode is synchronous, nothing overlaps,
and the two passes differ only by noise. The difference of two passes moves with the
host: on lent H100s one pair's critical share ranged from -11% to 33% for one setting
and tree (session 21), where the synchronised pass's Python share stayed within a few
points. ``--passes N`` runs N pairs in turn and reports the median pair, every pair's
shares beside it; quote the critical share only where its passes agree.

Greedy and sampled settings, any model; one warm-up generation is not counted. The
"path" column is where the runs built their distributions (RunStats.sampling): with
``--sampling backend`` a chain the device cannot run whole falls back to "chain" there.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pymtp
from pymtp.bench import read_prompts
from pymtp.config import DEFAULTS, draft_limit_for
from pymtp.engine import Engine
from pymtp.rounds import Rounds
from pymtp.native import C, NativeContext

NATIVE_METHODS = ("decode", "logits", "hidden", "sample", "seq_rm", "clear", "state_size", "state_get", "state_set",
                  "set_sampler", "set_nextn_output", "sampled_token", "sampled_candidates", "sampled_probs",
                  "sampled_logits")
# a lone plain round (no-spec) takes its own two steps instead (Rounds._lone)
STEPS = ("_draft", "_verify", "_accept", "_roll_back", "_catch_up_after", "_launch_lone", "_land_lone")


@dataclass
class Clock:
    """Native time and per-step (wall, native) sums; one per process, filled by the wrappers."""

    native: float = 0.0
    native_calls: int = 0
    sync: bool = True                   # llama_synchronize after each decode
    steps: dict = field(default_factory=lambda: {s: [0.0, 0.0, 0] for s in STEPS})   # wall, native, calls
    prefill_native_end: float = 0.0     # ``native`` when the last prefill finished
    prefill_calls_end: int = 0          # ... and ``native_calls``
    run_stats: object = None            # the engine's RunStats of the last run (which path it took)

    def timed_native(self, fn):
        @functools.wraps(fn)
        def wrapper(ctx, *args, **kwargs):
            t = time.perf_counter()
            try:
                out = fn(ctx, *args, **kwargs)
                if self.sync and fn.__name__ == "decode":
                    C.llama_synchronize(ctx.ptr)
                return out
            finally:
                self.native += time.perf_counter() - t
                self.native_calls += 1
        return wrapper

    def timed_step(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            n0, t = self.native, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                s = self.steps[fn.__name__]
                s[0] += time.perf_counter() - t
                s[1] += self.native - n0
                s[2] += 1
        return wrapper

    def timed_prefill(self, fn):
        """Rounds._prefilled: after the prompt's last chunk (it returns the first token's
        Step) the decode phase starts; the prompt's own _verify is not a round's."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            step = fn(*args, **kwargs)
            if step is not None:
                self.prefill_native_end, self.prefill_calls_end = self.native, self.native_calls
                self.steps = {s: [0.0, 0.0, 0] for s in STEPS}
            return step
        return wrapper

    def recording_run(self, fn):
        @functools.wraps(fn)
        def wrapper(engine, prompt, p, stats=None):
            self.run_stats = stats
            return fn(engine, prompt, p, stats)
        return wrapper

    def reset(self) -> None:
        self.native, self.native_calls = 0.0, 0
        self.steps = {s: [0.0, 0.0, 0] for s in STEPS}


def instrument(clock: Clock) -> None:
    for name in NATIVE_METHODS:
        setattr(NativeContext, name, clock.timed_native(getattr(NativeContext, name)))
    for name in STEPS:
        setattr(Rounds, name, clock.timed_step(getattr(Rounds, name)))
    Rounds._prefilled = clock.timed_prefill(Rounds._prefilled)
    Engine.run = clock.recording_run(Engine.run)


def profile_setting(model, clock: Clock, prompts: list[list[int]], kwargs: dict) -> dict:
    """Sum over prompts of the decode phase's wall, native and per-step times."""
    model.generate(prompts[0], **kwargs)           # warm-up: graphs, chains, caches
    wall = native = 0.0
    rounds = tokens = drafted = accepted = calls = 0
    steps = {s: [0.0, 0.0] for s in STEPS}
    paths = set()
    emitted = []
    for ids in prompts:
        clock.reset()
        r = model.generate(ids, **kwargs)
        emitted.append(r.tokens)
        paths.add(clock.run_stats.sampling)
        rs = clock.run_stats       # from the first token on: round 1's drafter decode of
        wall += rs.t_end - rs.t_prompt_done     # the prompt's rows is a round's (native) work
        native += clock.native - clock.prefill_native_end
        calls += clock.native_calls - clock.prefill_calls_end
        # one verify (or lone launch) per round; the prefill is none
        rounds += clock.steps["_verify"][2] + clock.steps["_launch_lone"][2]
        # the first token came from the prompt's decode, before the window: not counted,
        # as Stats.tokens_per_second leaves it out
        tokens += max(r.stats.generated_tokens - 1, 0)
        drafted += r.stats.drafted
        accepted += r.stats.accepted
        for s in STEPS:
            steps[s][0] += clock.steps[s][0]
            steps[s][1] += clock.steps[s][1]
    return {"wall": wall, "native": native, "tokens": tokens, "rounds": rounds, "drafted": drafted,
            "accepted": accepted, "steps": steps, "native_calls": calls, "sampling": "+".join(sorted(paths)),
            "emitted": emitted}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=Path, default=Path(__file__).with_name("prompts_heldout.jsonl"))
    ap.add_argument("--limit", type=int, default=4, help="prompts to run (default 4)")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-k", "--draft-max", type=lambda v: v if v == "auto" else int(v), action="append",
                    help="draft depth(s) to profile: an integer (0 is no-spec) or auto (default: 0 and 3)")
    ap.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    ap.add_argument("--top-k", type=int, default=DEFAULTS.top_k)
    ap.add_argument("--top-p", type=float, default=DEFAULTS.top_p)
    ap.add_argument("--min-p", type=float, default=DEFAULTS.min_p)
    ap.add_argument("--accept", choices=("rejection", "exact"), default=DEFAULTS.accept)
    ap.add_argument("--sampling", default="auto", choices=("auto", "chain", "numpy", "backend"))
    ap.add_argument("--threads", "-t", type=int, default=None)
    ap.add_argument("--no-sync", action="store_true", help="do not synchronize after each decode")
    ap.add_argument("--passes", type=int, default=1,
                    help="pairs of passes (synchronised, then not) per setting; the row is the median pair's")
    ap.add_argument("--json", dest="json_out", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    depths = args.draft_max or [0, 3]
    clock = Clock()
    instrument(clock)
    model = pymtp.load(args.model, threads=args.threads, sampling=args.sampling,
                       draft_limit=draft_limit_for(max((k for k in depths if k != "auto"), default="auto")))
    prompts = [model.tokenize(p, special=True) for p in read_prompts(args.prompts)[: args.limit]]
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    rows = []
    for k in depths:
        kwargs = dict(max_tokens=args.max_tokens, ignore_eos=True, seed=0, accept=args.accept, **sampling,
                      **(dict(spec="mtp", draft_max=k) if k else dict(spec="none")))
        pairs = []
        for _ in range(args.passes):       # in turn, so that a slow spell of the host hits both
            clock.sync = not args.no_sync
            synced = profile_setting(model, clock, prompts, kwargs)
            clock.sync = False
            free = profile_setting(model, clock, prompts, kwargs) if not args.no_sync else None
            pairs.append(summarise(k, synced, free))
        rows.append(median_pass(pairs))
    report = {"model": str(args.model), "n_vocab": model.n_vocab, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "threads": args.threads, "sync_after_decode": not args.no_sync,
              "sampling_option": model.sampling, **sampling, "accept": args.accept,
              "device": "gpu" if model._native.offloaded else "cpu", "results": rows}
    print(format_report(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}", file=sys.stderr)


def median_pass(pairs: list[dict]) -> dict:
    """The row of the pair whose critical share (else Python share) is the median, with
    every pair's shares beside it: one pass of a few hundred rounds moves with the host."""
    key = lambda r: r.get("critical_python_share") if r.get("critical_python_share") is not None else r["python_share"]
    row = dict(sorted(pairs, key=key)[(len(pairs) - 1) // 2])
    row["passes"] = [{"python_share": r["python_share"], "critical_python_share": r.get("critical_python_share")}
                     for r in pairs]
    return row


def summarise(k: int, r: dict, free: dict | None = None) -> dict:
    """One setting's row: ``r`` the synchronised pass, ``free`` the same runs without the
    synchronisation (None: not run), for the Python on the critical path."""
    ms = lambda s: round(s * 1e3, 4)
    rounds = r["rounds"]
    python = r["wall"] - r["native"]
    critical = {}
    if free is not None:
        same = free["emitted"] == r["emitted"] and free["rounds"] == rounds
        critical = {"same_work": same, "free_round_ms": ms(free["wall"] / max(rounds, 1))}
        if same:
            on_path = free["wall"] - r["native"]
            critical.update(critical_python_ms_per_round=ms(on_path / max(rounds, 1)),
                            critical_python_share=round(on_path / free["wall"], 4) if free["wall"] else None)
    steps = {s.lstrip("_"): {"python_ms_per_round": ms((w - n) / max(rounds, 1)),
                             "native_ms_per_round": ms(n / max(rounds, 1))}
             for s, (w, n) in r["steps"].items()}
    in_steps = sum(w for w, _ in r["steps"].values())
    return {"setting": f"mtp k={k}" if k else "no-spec", "draft_max": k, "sampling": r["sampling"],
            "tokens": r["tokens"], "rounds": rounds,
            "tok_s": round(r["tokens"] / r["wall"], 2) if r["wall"] else None,
            "acceptance": round(r["accepted"] / r["drafted"], 4) if r["drafted"] else None,
            "round_ms": ms(r["wall"] / max(rounds, 1)), "native_ms_per_round": ms(r["native"] / max(rounds, 1)),
            "python_ms_per_round": ms(python / max(rounds, 1)),
            "python_share": round(python / r["wall"], 4) if r["wall"] else None,
            "native_calls_per_round": round(r["native_calls"] / max(rounds, 1), 1),
            "steps": steps, "outside_steps_ms_per_round": ms((r["wall"] - in_steps) / max(rounds, 1)),
            **critical}


def format_report(rep: dict) -> str:
    lines = [f"{Path(rep['model']).name}: {rep['n_vocab']} tokens, {rep['device']}, {rep['prompts']} prompts x "
             f"{rep['max_tokens']} tokens, temperature {rep['temperature']:g}"
             + (f" top_k {rep['top_k']} top_p {rep['top_p']:g} min_p {rep['min_p']:g}, sampling "
                f"{rep['sampling_option']}" if rep["temperature"] else " (greedy)")]
    head = ["setting", "path", "tok/s", "round ms", "native ms", "python ms", "python share", "draft", "verify",
            "accept", "roll back", "catch-up", "outside steps", "unsynced round ms", "critical python ms",
            "critical share"]
    body = []
    for r in rep["results"]:
        st = r["steps"]
        body.append([r["setting"], r["sampling"], r["tok_s"], f"{r['round_ms']:.3f}",
                     f"{r['native_ms_per_round']:.3f}", f"{r['python_ms_per_round']:.3f}",
                     f"{100 * r['python_share']:.1f}%",
                     *(f"{st[s]['python_ms_per_round']:.3f}" for s in ("draft", "verify", "accept", "roll_back",
                                                                       "catch_up_after")),
                     f"{r['outside_steps_ms_per_round']:.3f}", *_critical_cells(r)])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    row = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    lines += [row(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [row(b) for b in body]
    lines.append("(per round; the step columns are each step's Python ms, native calls excluded; critical: the "
                 "Python an unsynchronised pass waits for)")
    for r in rep["results"]:
        if r["draft_max"] == 3:
            lines.append(f"Python/policy share of a k=3 round: {100 * r['python_share']:.1f}% "
                         f"({r['python_ms_per_round']:.3f} of {r['round_ms']:.3f} ms)")
            if r.get("critical_python_share") is not None:
                lines.append(f"on its critical path: {100 * r['critical_python_share']:.1f}% "
                             f"({r['critical_python_ms_per_round']:.3f} of {r['free_round_ms']:.3f} ms)")
            if len(r["passes"]) > 1:
                pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
                lines.append("every pass (python share / critical share): "
                             + ", ".join(f"{pct(x['python_share'])} / {pct(x['critical_python_share'])}"
                                         for x in r["passes"]))
    return "\n".join(lines)


def _critical_cells(r: dict) -> list[str]:
    if "same_work" not in r:
        return ["-", "-", "-"]
    if not r["same_work"]:
        return [f"{r['free_round_ms']:.3f}", "other tokens", "-"]
    return [f"{r['free_round_ms']:.3f}", f"{r['critical_python_ms_per_round']:.3f}",
            f"{100 * r['critical_python_share']:.1f}%"]


if __name__ == "__main__":
    main()
