"""The verify decode's batch: how many rows each sequence puts in it and which ones it
outputs, the prompt chunks beside them, and filler rows in the free seq ids between.

``round_plan.py`` holds the arithmetic as pure functions over ints; this applies it to a
round's sequences and writes the ``Batch`` (``Rounds._verify`` then decodes it).
"""

from __future__ import annotations

import numpy as np

from .drafter import fill_width, filler_ends
from .native import Batch, NativeContext, NativeModel
from .prefix_cache import clip_chunk
from .round_plan import prefill_chunks, shaped_chunks, verify_rows
from .round_state import Chunk, SeqState


class VerifyBatch:
    """One target context's verify batch, planned and filled afresh each round."""

    def __init__(self, model: NativeModel, target: NativeContext) -> None:
        self.target = target
        self.batch = Batch(target.n_batch)
        # Decode filler rows in free ids between the round's (gap_fillers), at most
        # ``fill_width`` rows each (None: any; 0: never). benchmarks/gap_fill.py, three
        # gaps in every round, fillers on over off: H100 demo 3.83x plain, 2.08x at k=3.
        # On 2 CPU threads a row costs a share of the decode: filling every gap gave 0.99x
        # at k=3 (demo and small Q8_0), so there only one-row gaps are filled: plain
        # 1.11x (demo), 1.11-1.25x (small), k=3 (the MTP decodes' gaps) 1.05x and 1.02x.
        self.fill_width = fill_width(model)
        self.fillers: dict[int, int] = {}       # this round's: free id -> its first filler position

    def _plan_fillers(self, seqs: list[SeqState], rows: dict[SeqState, int], busy: set[int]) -> int:
        """Pick the free ids this round fills (``fillers``: id -> its first free position)
        and return the rows they take. Only where every decoding sequence has the same
        rows (otherwise the round splits anyway) and each filled id has room for them:
        fillers pile up in an id until it is taken again, so a gap that outlasts its
        stream (n_ctx_seq filler rows) is split again, as before fillers."""
        if len(seqs) < 2:      # one sequence has no gap to fill
            self.fillers = {}
            return 0
        self.fillers = filler_ends(self.target, [s.seq for s in seqs], busy, set(rows.values()),
                                    self.fill_width)
        return len(self.fillers) * next(iter(rows.values()), 0)

    def plan(self, seqs: list[SeqState], decoding: list[SeqState], prefill_budget: int | None,
              busy: set[int]) -> tuple[dict[SeqState, int], dict[SeqState, Chunk]]:
        """Rows per decoding sequence (padding included), the free ids to fill, and the
        prompt chunks that fit."""
        target = self.target
        for s in decoding:
            r = s.rnd
            r.checkpointed = r.n_drafts > 0 and (s.params.rollback == "checkpoint"
                                                 or r.n_drafts > target.n_rs_seq)
        rows = dict(zip(decoding, verify_rows([s.rnd.n_drafts + 1 for s in decoding],
                                              [s.rnd.checkpointed for s in decoding], target.n_rs_seq,
                                              [target.n_ctx_seq - s.position for s in decoding])))
        fill_rows = self._plan_fillers(seqs, rows, busy)
        filling = [s for s in seqs if s.prefilling]
        if not filling:
            return rows, {}
        budget = target.n_batch - sum(rows.values()) - fill_rows
        if prefill_budget is not None:
            budget = min(budget, prefill_budget)
        sizes = prefill_chunks([len(s.prompt) - s.prefilled for s in filling], [s.all_outputs for s in filling],
                               budget, target.n_outputs_max - sum(s.rnd.n_drafts + 1 for s in decoding))
        # a chunk pauses where the prompt cache snapshots the recurrent state
        sizes = [clip_chunk(s.prefilled, n, s.stops) for s, n in zip(filling, sizes)]
        shared = set(rows.values())
        shaped = shaped_chunks(sizes, [s.all_outputs for s in filling],
                               shared.pop() if len(shared) == 1 else None, target.n_rs_seq, budget,
                               [target.n_ctx_seq - s.prefilled for s in filling])
        return rows, {s: Chunk(s, s.prefilled, n, pads) for s, (n, pads) in zip(filling, shaped) if n}

    def fill(self, seqs: list[SeqState], rows: dict[SeqState, int], chunks: dict[SeqState, Chunk]) -> int:
        """The verify batch, in seq id order; first save the state of each sequence whose
        snapshots cannot roll back its rows. Returns how many rows are outputs.

        A filled free id gets rows after what it holds, never outputs: what a parked
        sequence left there is reused only through its prompt-cache snapshot, whose
        restore cuts the KV back (``Resumes.resume``), and a new request on a cold id clears it."""
        batch = self.batch
        batch.clear()
        n_out = 0
        fill = sorted(self.fillers)
        width = next(iter(rows.values()), 0)
        # outputs the plan left free, for shaped chunks that output every row (rides)
        spare = self.target.n_outputs_max - sum(s.rnd.n_drafts + 1 for s in rows) - sum(
            c.n if c.seq.all_outputs else int(c.start + c.n == len(c.seq.prompt)) for c in chunks.values())
        rides = not self.fillers and all(n == s.rnd.n_drafts + 1 for s, n in rows.items())
        for s in seqs:
            while fill and fill[0] < s.seq:
                seq = fill.pop(0)
                batch.add(np.zeros(width, dtype=np.int32), self.fillers[seq], seq, outputs="none")
            if s in rows:
                r = s.rnd
                if r.checkpointed:
                    s.checkpoint.save(self.target, s.seq)
                r.rows, r.first_output = rows[s], n_out
                if r.rows == r.n_drafts + 1:      # no pads: every row an output
                    r.first_row = batch.add(r.tokens, r.position, s.seq, outputs="all")
                else:
                    tokens = np.full(r.rows, s.last, dtype=np.int32)   # pads repeat `last`: never read
                    tokens[: r.n_drafts + 1] = r.tokens
                    r.first_row = batch.add(tokens, r.position, s.seq, outputs=np.arange(r.rows) <= r.n_drafts)
                n_out += r.n_drafts + 1
            elif s in chunks:
                c = chunks[s]
                final = c.start + c.n == len(s.prompt)
                extra = c.n + c.pads - int(final)
                if rides and self.rides(c, width) and extra <= spare:
                    spare -= extra
                    tokens = s.prompt[c.start:c.start + c.n]
                    if c.pads:        # pads repeat the chunk's last token: never read
                        tokens = np.concatenate([tokens, np.full(c.pads, tokens[-1], dtype=np.int32)])
                    c.first_row = batch.add(tokens, c.start, s.seq, outputs="all")
                    c.output = n_out + c.n - 1 if final else None
                    n_out += c.n + c.pads
                    continue
                rule = "all" if s.all_outputs else "last" if final else "none"
                outputs = c.n if rule == "all" else int(rule == "last")
                tokens, mask = s.prompt[c.start:c.start + c.n], rule
                if c.pads:        # pads repeat the chunk's last token: never read
                    tokens = np.concatenate([tokens, np.full(c.pads, tokens[-1], dtype=np.int32)])
                    mask = np.arange(c.n + c.pads) == c.n - 1 if final else "none"
                c.first_row = batch.add(tokens, c.start, s.seq, outputs=mask)
                c.output = n_out if outputs else None
                n_out += outputs
        return n_out

    @staticmethod
    def rides(c: Chunk, width: int) -> bool:
        """Whether a prompt chunk outputs every row, as the decoding rows beside it do: one
        of ``width`` rows (a shaped chunk, engine.shaped_chunks) where every decoding row
        is an output. Its round then decodes the graph of the rounds after the prompt
        joins (n_outputs == n_tokens), and on a GPU replays their CUDA graph: a prompt's
        last TAIL_TOKENS ride one a round, and with no outputs but the last, each one
        changed the graph (H100 traces, small Q8_0 at 16 clients: the tail's last round
        and the first decode round after it ran eagerly, 2-4 ms against 1.4). Not for a
        sequence a backend chain samples at temperature > 0 (llama.cpp's dist would draw
        on every output row, moving its random state; the greedy sampler has none) or one
        scoring its prompt (all its rows are outputs already)."""
        return (width > 0 and c.n + c.pads == width
                and not (c.seq.sampled and not c.seq.sampler.is_greedy)
                and not c.seq.all_outputs)
