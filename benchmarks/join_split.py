"""What a prompt joining a running batch costs the rounds around it, mixed into the
decoders' batch or decoded apart with no outputs.

    python benchmarks/join_split.py MODEL [--slots 8] [--after 8] [-n 12] [--json OUT.json]

Under load a prompt joins a batch whose other sequences decode one row each (session 19's
traces: auto's server, once drafting spread the requests' ends). On a GPU, ggml-cuda keeps
a CUDA graph per key, the key being the first node of llama.cpp's graph, and llama.cpp
builds a decode with outputs and one without in separate slots (``gf_res_prev``, indexed
by n_outputs > 0). So a chunk mixed into the decoders' batch changes the graph their
rounds replay, and the two decode rounds after it run eagerly; a chunk decoded in a
``llama_decode`` of its own with no outputs lands in the other slot. Each cycle here is
one join and the ``--after`` decode rounds after it, in one of three ways:

- ``mixed``: the decoders' rows and the prompt's P tokens in one decode (as pymtp does);
- ``apart``: the prompt's P tokens alone with no outputs, then the decoders' rows;
- ``apart, last rides``: the prompt's first P - 1 tokens alone with no outputs, then the
  decoders' rows with its last token as one more one-row sequence (its logits row is the
  first token's), so the rounds after it have the shape that round had.

Printed per way and P: median ms of the join's decodes and of the rounds after it (each
synced), and the cycle's total. Run it again with GGML_CUDA_DISABLE_GRAPHS=1 to see the
share of CUDA graphs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from batch_mix import Mix, finish  # noqa: E402
from pymtp.native import NativeModel  # noqa: E402

PROMPTS = (4, 64, 300)
WAYS = ("mixed", "apart", "apart, last rides")


class Joins(Mix):
    """A plain target context as ``pymtp serve --parallel SLOTS`` has it (batch_mix.Mix):
    SLOTS - 1 decoding sequences and the last id for the prompt that joins."""

    def __init__(self, model: NativeModel, slots: int) -> None:
        super().__init__(model, slots, rows=1, spec=False, middle=False)
        self.joiner = self.prompt_seq

    def _round(self, seqs: list[int], extra: tuple[int, np.ndarray] | None = None) -> float:
        """One decode of a row for each of ``seqs`` (and ``extra``: (pos, tokens) of the
        joiner, outputs on its last row only)."""
        b = self.batch
        b.clear()
        for s in sorted(seqs + ([self.joiner] if extra is not None else [])):
            if s == self.joiner and extra is not None:
                pos, toks = extra
                b.add(toks, pos, s, outputs="last" if len(toks) == 1 else "none")
                continue
            if self.pos[s] + 1 >= self.ctx.n_ctx_seq - 8:
                self._fill(s)
            b.add(self._tokens(1), self.pos[s], s, outputs="all")
        dt = self.decode_synced()
        for s in seqs:
            self.pos[s] += 1
        return dt

    def _prompt_alone(self, toks: np.ndarray) -> float:
        self.batch.set(toks, 0, self.joiner, outputs="none")
        return self.decode_synced()

    def cycle(self, way: str, p: int, after: int) -> tuple[float, float]:
        """Seconds of one join (its decodes) and of the ``after`` decode rounds after it;
        the joiner then decodes with the others, and leaves at the end."""
        self.ctx.seq_rm(self.joiner, 0, -1)
        toks = self._tokens(p)
        if way == "mixed":
            join = self._round(self.decoders, (0, toks))
            self.pos[self.joiner] = p
        elif way == "apart":
            join = self._prompt_alone(toks) + self._round(self.decoders)
            self.pos[self.joiner] = p
        else:
            join = self._prompt_alone(toks[:-1]) + self._round(self.decoders, (p - 1, toks[-1:]))
            self.pos[self.joiner] = p
        rest = sum(self._round(self.decoders + [self.joiner]) for _ in range(after))
        return join, rest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--after", type=int, default=8, help="decode rounds after each join")
    ap.add_argument("-n", type=int, default=12, help="timed cycles per cell (after two warm-up ones)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = NativeModel(args.model)
    joins = Joins(model, args.slots)
    steady = statistics.median(joins._round(joins.decoders) for _ in range(args.n + 3))
    print(f"steady round of {len(joins.decoders)} one-row sequences: {1e3 * steady:.3f} ms\n")
    print(f"| way | prompt | join ms | {args.after} rounds after ms | cycle ms |\n| --- | --- | --- | --- | --- |")
    out: dict[str, dict] = {"steady_ms": 1e3 * steady}
    for p in PROMPTS:
        for way in WAYS:
            cycles = [joins.cycle(way, p, args.after) for _ in range(args.n + 2)][2:]
            join = statistics.median(j for j, _ in cycles)
            rest = statistics.median(r for _, r in cycles)
            total = statistics.median(j + r for j, r in cycles)
            out[f"{way}, {p}"] = {"join_ms": 1e3 * join, "after_ms": 1e3 * rest, "cycle_ms": 1e3 * total}
            print(f"| {way} | {p} | {1e3 * join:.3f} | {1e3 * rest:.3f} | {1e3 * total:.3f} |", flush=True)
    joins.ctx.close()
    return finish(model, out, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
