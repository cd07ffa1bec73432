"""What a prompt chunk adds to a batched round: one target decode by what it holds.

    python benchmarks/batch_mix.py MODEL [--slots 8] [-n 30] [--json OUT.json]

Under load (``load_server.py``, round_trace) a round that carries a prompt chunk cost
5-20 ms on an H100 where a full round of one-row decodes cost 1.1 ms, even for chunks of
1-4 rows. This builds the target context a ``pymtp serve --parallel SLOTS`` run decodes
on (``scheduler.BatchEngine``'s settings: a KV stream per sequence, n_ubatch = n_batch),
once plain and once as a drafting run has it (draft_limit snapshots, every hidden row
out), and times one ``llama_decode`` to its end (``llama_synchronize``) for:

- ``decode``: SLOTS - 1 sequences decoding ``r`` rows each (1 plain, 4 drafting);
- ``prompt n``: one sequence's first n prompt tokens alone;
- ``decode + prompt n``: both in one batch, as the engine builds a round;

each both steady (the same batch again and again: ggml-cuda replays its captured graph
after two equal decodes) and interleaved with a decode-only round, as under load. The
prompt's sequence takes the last id, or with ``--middle`` one between the decoders (llama.cpp
puts only consecutive ids in one ubatch). "extra" is what the mixed batch costs beyond
its two parts decoded alone. Median ms over ``-n`` decodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pymtp.native import C, Batch, ContextConfig, NativeContext, NativeModel  # noqa: E402

PROMPT_ROWS = (1, 4, 16, 64, 256)
FILLED = 300          # tokens each decoding sequence holds before the timing starts


class Mix:
    """A target context with SLOTS - 1 decoding sequences and one prompt sequence."""

    FILL_OUTPUTS = "last"      # a refill's outputs (``_fill``)

    def __init__(self, model: NativeModel, slots: int, rows: int, spec: bool, middle: bool) -> None:
        self.ctx = NativeContext(model, ContextConfig(
            n_ctx=slots * 4096, n_batch=512, n_ubatch=512, n_seq_max=slots, n_rs_seq=rows - 1 if spec else 0,
            n_outputs_max=slots * rows, n_outputs_max_per_seq=rows))
        self.ctx.set_nextn_output(spec, masked=False)
        self.rows = rows
        self.prompt_seq = slots // 2 if middle else slots - 1
        self.decoders = [s for s in range(slots) if s != self.prompt_seq]
        self.pos = {s: 0 for s in self.decoders}
        self.batch = Batch(512)
        self.rng = np.random.default_rng(0)
        for s in self.decoders:
            self._fill(s)

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(100, 8000, size=n, dtype=np.int32)

    def _fill(self, s: int) -> None:
        self.ctx.seq_rm(s, 0, -1)
        self.batch.set(self._tokens(FILLED), 0, s, outputs=self.FILL_OUTPUTS)
        self.ctx.decode(self.batch)
        self.pos[s] = FILLED

    def decode_synced(self) -> float:
        """Seconds of one decode of ``batch`` to its end on the device."""
        t0 = time.perf_counter()
        self.ctx.decode(self.batch)
        self.ctx.model.run(C.llama_synchronize, self.ctx.ptr)
        return time.perf_counter() - t0

    def timed(self, decode: bool, prompt: int) -> float:
        """Seconds of one decode of the decoders' rows and/or a fresh prompt's first ``prompt`` rows."""
        if decode:      # refills first: a refill decodes through the batch built below
            for s in self.decoders:
                if self.pos[s] + self.rows >= self.ctx.n_ctx_seq - 8:
                    self._fill(s)
        b = self.batch
        b.clear()
        if prompt:
            self.ctx.seq_rm(self.prompt_seq, 0, -1)
        for s in sorted(self.decoders + ([self.prompt_seq] if prompt else [])):
            if s == self.prompt_seq:
                b.add(self._tokens(prompt), 0, s, outputs="last")
            elif decode:
                b.add(self._tokens(self.rows), self.pos[s], s, outputs="all")
        dt = self.decode_synced()
        if decode:
            for s in self.decoders:
                self.pos[s] += self.rows
        return dt

    def median_ms(self, decode: bool, prompt: int, n: int, interleaved: bool) -> float:
        times = []
        for i in range(n + 3):
            if interleaved:
                self.timed(True, 0)
            dt = self.timed(decode, prompt)
            if i >= 3:
                times.append(dt)
        return 1e3 * statistics.median(times)


def finish(model: NativeModel, out: dict, json_path: Path | None) -> int:
    """The end of a Mix benchmark's main: write ``out`` where --json asks, free the model."""
    if json_path:
        json_path.write_text(json.dumps(out, indent=1))
    model.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("-n", type=int, default=30, help="timed decodes per cell (after three warm-up ones)")
    ap.add_argument("--middle", action="store_true", help="the prompt's seq id between the decoders'")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = NativeModel(args.model)
    out = {}
    print("| context | mode | batch | ms | extra ms |\n| --- | --- | --- | --- | --- |")
    for label, rows, spec in (("plain", 1, False), ("drafting k=3", 4, True)):
        mix = Mix(model, args.slots, rows, spec, args.middle)
        for mode in ("steady", "interleaved"):
            dec = mix.median_ms(True, 0, args.n, False)
            cells = {"decode": dec}
            print(f"| {label} | {mode} | decode {len(mix.decoders)}x{rows} | {dec:.3f} | |", flush=True)
            for n in PROMPT_ROWS:
                alone = mix.median_ms(False, n, args.n, mode == "interleaved")
                both = mix.median_ms(True, n, args.n, mode == "interleaved")
                cells[f"prompt {n}"], cells[f"decode + prompt {n}"] = alone, both
                print(f"| {label} | {mode} | prompt {n} | {alone:.3f} | |")
                print(f"| {label} | {mode} | decode + prompt {n} | {both:.3f} | {both - alone - dec:+.3f} |",
                      flush=True)
            out[f"{label} {mode}"] = cells
        mix.ctx.close()
    return finish(model, out, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
