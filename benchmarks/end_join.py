"""What a request's end and the next one's join cost the rounds of a full batch, by how
the rounds around them are shaped.

    python benchmarks/end_join.py MODEL [--slots 8] [--rows 1] [--rounds 8] [-n 12] [--json OUT.json]

Under load on a GPU (session 20's round traces, H100 demo at 16 clients) the two rounds
after a prompt round cost 2.5-3.5 ms where a full round of one-row decodes costs 0.9-1.0:
ggml-cuda keeps one CUDA graph per llama.cpp graph slot and runs it eagerly for two
decodes after its shape changed, and a request's end (8 sequences to 7) and its
successor's join (7 to 8, its prompt mixed in) each change it. ``join_split.py`` showed
that a prompt decoded apart with no outputs leaves the decoders' graph alone, but in a
server that alone did not pay: the number of rows still changed. Here every seq id of a
full batch decodes one row a round (``--rows``); a cycle takes one id out (its request
ended), runs ``--rounds`` rounds, lets a P-token prompt join in that id, and runs
``--rounds`` more. Ways:

- ``mixed`` (pymtp now): an ended id between others decodes a filler row with no output
  (rounds.Rounds fills gaps: llama.cpp splits a decode at one), the last id none; the
  prompt joins in the round's decode;
- ``apart``: as ``mixed``, but the prompt's first P - 1 tokens are decoded alone with no
  outputs and its last token rides in the round's decode;
- ``padded, mixed``: any ended id decodes a filler row that is an output, as every
  decoding row is, so every round keeps SLOTS rows, all outputs; the prompt joins mixed;
- ``padded, apart``: such fillers, and the prompt apart, its last token where the filler was.

The ended id goes round the ids, cycle by cycle.

``--rows 4`` has every id decode 4 rows a round, as a verify of 3 drafts does (a drafting
context: 3 snapshots, every hidden row out); a filler then takes 4 rows, and a prompt
decoded apart leaves its last 4 tokens to ride. ``steady`` is the same number of rounds
with no end and no join. Printed per way and P: median ms of the rounds while the id is
out, of the join's decodes, of the rounds after it, and of the cycle (each decode synced).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from batch_mix import FILLED, Mix, finish  # noqa: E402
from pymtp.native import NativeModel  # noqa: E402

PROMPTS = (64, 300)
WAYS = ("mixed", "apart", "padded, mixed", "padded, apart")


class Cycles(Mix):
    """A plain target context as ``pymtp serve --parallel SLOTS`` has it (batch_mix.Mix),
    every id decoding."""

    # refills with no outputs: llama.cpp builds those in a graph slot of their own, so a
    # refill leaves the rounds' CUDA graph be
    FILL_OUTPUTS = "none"

    def __init__(self, model: NativeModel, slots: int, rows: int = 1) -> None:
        super().__init__(model, slots, rows=rows, spec=rows > 1, middle=False)
        self.ids = list(range(slots))
        self.pos[self.prompt_seq] = 0
        self._fill(self.prompt_seq)

    def _round(self, out: int | None, filler: str | None, joiner: tuple[int, np.ndarray] | None = None) -> float:
        """One decode of ``rows`` rows for every id but ``out``: there filler rows with
        outputs ``filler`` (None: no rows), or ``joiner`` ((pos, tokens) of the prompt that
        joins: a chunk of other than ``rows`` tokens outputs its last row, a rider all)."""
        b = self.batch
        b.clear()
        for s in self.ids:
            if s == out and joiner is not None:
                pos, toks = joiner
                b.add(toks, pos, s, outputs="all" if len(toks) == self.rows else "last")
                continue
            if s == out and filler is None:
                continue
            if self.pos[s] + self.rows >= self.ctx.n_ctx_seq - 8:
                self._fill(s)
            b.add(self._tokens(self.rows), self.pos[s], s, outputs=filler if s == out else "all")
        dt = self.decode_synced()
        for s in self.ids:
            if s != out or (filler is not None and joiner is None):
                self.pos[s] += self.rows
        return dt

    def _alone(self, seq: int, toks: np.ndarray) -> float:
        self.batch.set(toks, 0, seq, outputs="none")
        return self.decode_synced()

    def cycle(self, way: str, p: int, rounds: int, out: int) -> tuple[float, float, float]:
        """Seconds of the ``rounds`` rounds with ``out`` ended, of the join, and of the
        ``rounds`` rounds after it."""
        if way == "steady":
            return (sum(self._round(None, None) for _ in range(rounds)), self._round(None, None),
                    sum(self._round(None, None) for _ in range(rounds)))
        # the ended id's row: an output where padded, else a gap filler (none after the last id)
        filler = "all" if way.startswith("padded") else None if out == self.ids[-1] else "none"
        ended = sum(self._round(out, filler) for _ in range(rounds))
        self.ctx.seq_rm(out, 0, -1)
        toks = self._tokens(p)
        if way.endswith("mixed"):
            join = self._round(out, filler, (0, toks))
        else:
            ride = p - self.rows
            join = self._alone(out, toks[:ride]) + self._round(out, filler, (ride, toks[ride:]))
        self.pos[out] = p
        after = sum(self._round(None, None) for _ in range(rounds))
        if self.pos[out] < FILLED:       # the next cycle's ids hold what they held at the start
            self._fill(out)
        return ended, join, after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1, help="rows every id decodes a round (4: a verify of 3 drafts)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds with the id out, and after the join")
    ap.add_argument("-n", type=int, default=12, help="timed cycles per cell (after two warm-up ones)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = NativeModel(args.model)
    c = Cycles(model, args.slots, args.rows)
    r = args.rounds
    print(f"{args.slots} ids, {args.rows} row{'s' if args.rows > 1 else ''} each; a cycle: {r} rounds with one id out, the join, {r} rounds after\n")
    print(f"| way | prompt | {r} rounds out ms | join ms | {r} rounds after ms | cycle ms |\n"
          "| --- | --- | --- | --- | --- | --- |")
    out: dict[str, dict] = {}
    i = 0
    for p in PROMPTS:
        for way in ("steady", *WAYS):
            cycles = []
            for _ in range(args.n + 2):
                cycles.append(c.cycle(way, p, r, c.ids[i % args.slots]))
                i += 1
            cycles = cycles[2:]
            cell = {key: 1e3 * statistics.median(x[j] for x in cycles)
                    for j, key in enumerate(("out_ms", "join_ms", "after_ms"))}
            cell["cycle_ms"] = 1e3 * statistics.median(sum(x) for x in cycles)
            out[f"{way}, {p}"] = cell
            print(f"| {way} | {p} | {cell['out_ms']:.3f} | {cell['join_ms']:.3f} | {cell['after_ms']:.3f} "
                  f"| {cell['cycle_ms']:.3f} |", flush=True)
    c.ctx.close()
    return finish(model, out, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
