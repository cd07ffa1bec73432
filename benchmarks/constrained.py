"""Acceptance and speed with a constraint next to without, and what the constraint costs
per round (issue #17).

For each model, temperature and constraint (none, a JSON schema), every prompt runs with
MTP (draft_max 3) and plainly; the grammar's own calls (pymtp.constraint.Mask: the
masks it answers and the states it moves to) are timed by wrapping them, so the cost per
round is the grammar's time over the MTP runs' rounds. Two models take about 2 minutes on
2 cores; tok/s is the median over the prompts, so run it on a quiet machine.

    python benchmarks/constrained.py ../shared/models/qwen35-tiny-mtp/gguf/model-f16.gguf \
        ../shared/models/qwen35-small-mtp/gguf/model-q8_0.gguf --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pymtp
from pymtp import constraint as constraint_mod

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "import numpy as np\n", "Once upon a time"]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 24},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                         "active": {"type": "boolean"}},
          "required": ["name", "age", "city", "tags", "active"], "additionalProperties": False}


class GrammarClock:
    """Seconds spent in the grammar's calls, by wrapping them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("allows", "then"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        inner = getattr(constraint_mod.Mask, name)

        def timed(mask, *args):
            t0 = time.perf_counter()
            try:
                return inner(mask, *args)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(constraint_mod.Mask, name, timed)


def run(model, clock: GrammarClock, temperature: float, constrained: bool, max_tokens: int) -> dict:
    extra = dict(json_schema=SCHEMA) if constrained else {}
    out = {}
    for spec in ("none", "mtp"):
        tps, drafted, accepted, rounds, tokens, grammar_s = [], 0, 0, 0, 0, 0.0
        for i, prompt in enumerate(PROMPTS):
            kw = dict(max_tokens=max_tokens, temperature=temperature, seed=i, spec=spec, **extra)
            if spec == "mtp":
                kw["draft_max"] = 3
            g0 = clock.seconds
            r = model.generate(prompt, **kw)
            grammar_s += clock.seconds - g0
            tps.append(r.stats.tokens_per_second)
            drafted += r.stats.drafted
            accepted += r.stats.accepted
            rounds += r.stats.rounds if spec == "mtp" else len(r.tokens)
            tokens += len(r.tokens)
        out[spec] = {"tok_s": statistics.median(tps), "tokens": tokens, "rounds": rounds,
                     "acceptance": accepted / drafted if drafted else None,
                     "grammar_ms_per_round": 1e3 * grammar_s / rounds if rounds else 0.0,
                     "grammar_ms_per_token": 1e3 * grammar_s / tokens if tokens else 0.0}
    out["speedup"] = out["mtp"]["tok_s"] / out["none"]["tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    clock = GrammarClock()
    results = []
    for path in args.models:
        model = pymtp.load(path, threads=args.threads, n_ctx=1024)
        run(model, clock, 0.0, True, 8)       # warm-up: contexts, the compiled grammar
        for temperature in (0.0, 0.7):
            for constrained in (False, True):
                r = run(model, clock, temperature, constrained, args.max_tokens)
                row = {"model": path.name if path.parent.name != "gguf" else f"{path.parent.parent.name}/{path.name}",
                       "n_vocab": model.n_vocab, "temperature": temperature,
                       "constraint": "json_schema" if constrained else "none", **r}
                results.append(row)
                m, p = r["mtp"], r["none"]
                print(f"{row['model']:<32} T={temperature:<3} {row['constraint']:<11} "
                      f"accept {m['acceptance']:.3f}  MTP {m['tok_s']:7.1f} tok/s  plain {p['tok_s']:7.1f} tok/s  "
                      f"x{r['speedup']:.2f}  grammar {m['grammar_ms_per_round']:.3f} ms/round "
                      f"({p['grammar_ms_per_token']:.3f} ms/token plain)", flush=True)
        model.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
