"""Step 1 of a round (rounds.py): what each sequence's drafter is fed and what it drafts.

Every target decode leaves each sequence pairs for its MTP head (a token with the target's
hidden row before it). This decides, per sequence and round, whether those rows are decoded
now, wait for a later round (k=0, a prompt still prefilling, a plain epoch) or are cut to
the newest ones, and then has every decoding sequence propose its drafts: from the head, in
batched MTP decodes (drafter.py), or from its prediction.
"""

from __future__ import annotations

import numpy as np

from .config import drafts_steer_seed
from .constraint import GrammarPath
from .drafter import DraftJob, MTPDrafter
from .native import NativeContext, NativeModel
from .round_state import CatchUp, Chunk, Ring, Round, SeqState
from .sampling import Dist

# a sequence drafting nothing leaves at most this many rows to its drafter for the round
# that drafts (each row holds one hidden state: 16 KB at Qwen3.5-9B's width)
DEFER_ROWS = 64
# prompt positions left to prefill from which the drafter's rows wait for the first token
# (Drafting._catch_up_after_prefill): a chat turn's new tokens are mostly fewer; 4 MB of
# hidden rows at Qwen3.5-9B's width
PREFILL_DEFER = 256


class Drafting:
    """The draft step of one target context's rounds. ``Rounds`` owns one and passes in the
    auto depth (its epochs' and its limit's) with each call, as it stands then."""

    def __init__(self, model: NativeModel, target: NativeContext, drafter: MTPDrafter | None) -> None:
        self.model, self.target, self.drafter = model, target, drafter

    def run(self, seqs: list[SeqState], decoding: list[SeqState], auto: int, limit: int) -> bool:
        """Catch the drafter up on every sequence's pending rows and have each decoding
        sequence propose its drafts (none without a drafter, or at budget 0); an auto
        sequence drafts ``auto`` (the epoch's depth), from its prediction at most ``limit``.
        Returns whether the drafter decoded prompt rows."""
        waiting = [s for s in seqs if s.pending is not None or s.ring is not None]
        # a sequence whose reply runs along its prediction drafts from it: to the drafter
        # its round is a plain one (k=0), its rows kept for the round the head drafts again
        predicted = self._predicted(decoding, limit)
        depth = self._depths(waiting, predicted, auto) if waiting else {}
        jobs: dict[SeqState, DraftJob] = {}
        held: list[DraftJob] = []
        drafter_prompt = False
        first_rounds = []     # the prompt's rows, decoded in the first round after it
        for s in waiting:
            if s.ring is not None:
                if depth.get(s, 0) == 0:        # the plain epoch goes on
                    continue
                s.unring()
            if s.pending is None or self._catch_up_after_prefill(s):
                continue
            if self._plain_prefill(s, auto):     # its chunks' pairs wait (prompt_pairs keeps the newest)
                continue
            k = depth.get(s, 0)
            if k == 0 and self._drops_rows(s):
                self._hold(s)
                continue
            if k == 0 and self._defers(s, self.drafter.end(s.seq)):
                continue
            if s.held is not None:
                held.append(DraftJob(s.seq, s.held.tokens, s.held.hidden, start=s.held.start))
                s.held = None
                drafter_prompt = True
            first = s.pending.start if s.pending.start is not None else self.drafter.end(s.seq)
            prompt_rows = first < len(s.prompt)
            drafter_prompt = drafter_prompt or prompt_rows
            if prompt_rows and s.produced == 1:
                first_rounds.append(s)
            p = s.params
            # drafts are sampled from q only where acceptance reads q (rejection sampling);
            # either way the head's penalties see the same history as the target's
            jobs[s] = DraftJob(s.seq, s.pending.tokens, s.pending.hidden, k, p.p_min, s.draft_sampler,
                               sample=not s.sampler.is_greedy and p.accept != "exact",
                               recent=s.history.recent(), sampled=s.draft_sampled,
                               grammar=None if s.grammar is None else GrammarPath.start(s.grammar),
                               start=s.pending.start)
            s.pending = None
        if held:      # the prompts' rows first: the drafts' rows may lie beyond a gap
            self.drafter.propose(held)
        if jobs:
            self.drafter.propose(list(jobs.values()))
        for s in first_rounds:     # after the catch-up decode, before the chain's steps
            s.stats.t_draft_ready = self.drafter.caught_up_at
        for s in decoding:
            if s in predicted:
                s.rnd = predicted[s]
                continue
            job = jobs.get(s)
            if job is None:      # a plain round
                s.rnd = Round(s.position, np.array([s.last], dtype=np.int32), [],
                              None if s.grammar is None else GrammarPath.start(s.grammar))
                continue
            tokens = np.empty(len(job.drafts) + 1, dtype=np.int32)
            tokens[0] = s.last
            tokens[1:] = job.drafts
            s.rnd = Round(s.position, tokens, job.dists, job.grammar)
        return drafter_prompt

    @staticmethod
    def _defers(s: SeqState, mtp_end: int) -> bool:
        """A decoding sequence at k=0 keeps its rows for the round that drafts: the MTP
        head has nothing to propose now, and a plain round then costs what plain decoding
        does (one MTP decode less; on a GPU about half a target decode). The rows are
        decoded together later, or once DEFER_ROWS of them wait. Not before the drafter
        holds the whole prompt (``mtp_end``): the prompt cache's snapshots at its end keep
        no pairs of their own, and a drafter behind them could not reuse them."""
        return not s.prefilling and len(s.pending.tokens) < DEFER_ROWS and mtp_end > len(s.prompt)

    def _drops_rows(self, s: SeqState) -> bool:
        """A decoding sequence at k=0 keeps only the newest RESUME_ROWS of the rows its
        drafter waits for (``_hold``), and the drafter resumes after a gap when a round
        drafts. Deferring them all (``_defers``) cost a growing concatenation every round
        and MTP decodes of DEFER_ROWS rows at a time: on an H100 with 8 sequences a depth-0
        epoch ran at 0.72x plain decoding. llama.cpp allows the gap only where positions
        may jump."""
        return self.model.positions_jump and not s.prefilling

    def _plain_prefill(self, s: SeqState, auto: int) -> bool:
        """A prompt of an auto sequence prefilled in a plain epoch keeps the newest
        PREFILL_DEFER of its drafter rows (``prompt_pairs``; a round that drafts resumes
        after the gap, ``_hold`` keeps them as the prompt's rows) instead of catching the
        drafter up between its chunks: that is an MTP decode of a new shape in a prompt
        round, one a plain round of ``--spec none`` does not pay, for rows a request that
        never drafts never reads."""
        return (s.auto and s.prefilling and self.model.positions_jump
                and auto == 0)

    def _hold(self, s: SeqState) -> None:
        """Drop all but the newest RESUME_ROWS of a plain round's pending rows, but keep
        the prompt's (``held``) for the first round that drafts: without them the drafts
        after a plain epoch that began at the prompt were accepted 0.850 of the time
        instead of 0.886 (small Q8_0; demo 0.832 instead of 0.902). A prompt's rows
        wait at most PREFILL_DEFER positions (``_catch_up_after_prefill``), and a
        request that never drafts never decodes them."""
        rows = s.pending
        # the prompt's rows lead, after the drafter's KV or after a gap (``prompt_pairs``)
        n_prompt = len(s.prompt) - (self.drafter.end(s.seq) if rows.start is None else rows.start)
        if n_prompt > 0:
            s.held = CatchUp(rows.tokens[:n_prompt], rows.hidden[:n_prompt], rows.start)
            rows = CatchUp(rows.tokens[n_prompt:], rows.hidden[n_prompt:], len(s.prompt))
        s.ring, s.pending = Ring.of(rows, s.position + 1), None

    @staticmethod
    def _catch_up_after_prefill(s: SeqState) -> bool:
        """A prompt with at most PREFILL_DEFER tokens left to prefill keeps its drafter rows
        for the round after its first token: the MTP head has nothing to draft before then,
        and catching it up between chunks put its decodes in the time to first token (a
        cached chat turn of 40 new tokens: 36 rows between the chunks before the
        tail snapshot's 4; a turn's reply and question, hundreds). The rows wait for at
        most PREFILL_DEFER positions, so their memory stays bounded."""
        return s.prefilling and len(s.prompt) - s.prefilled <= PREFILL_DEFER

    def _depths(self, seqs: list[SeqState], predicted: dict[SeqState, Round], auto: int) -> dict[SeqState, int]:
        """Drafts per decoding sequence this round: its draft_max, or for draft_max="auto"
        the epoch's depth (depth_batched.Epochs), within its tokens and room left; none from the
        head where the prediction drafts (``predicted``)."""
        caps = {}
        for s in seqs:
            if s.prefilling:
                continue
            if s in predicted:
                caps[s] = 0
                continue
            most = self._room(s, auto if s.auto else s.params.draft_max)
            caps[s] = most
            s.stats.count_depth(most)
        return caps

    def _room(self, s: SeqState, most: int) -> int:
        """At most ``most`` drafts, within the tokens ``s`` may still make and its context.
        Where the drafts steer a seed's text (config.drafts_steer_seed) max_tokens does
        not bound them: a last round cut short would draw other uniforms, and the seed
        would give a shorter request other tokens than the longer one's first ones."""
        if most:        # a plain epoch's auto sequences need no bounds (most rounds under load)
            room = self.target.n_ctx_seq - s.position - 1
            left = most if drafts_steer_seed(s.params) else s.params.max_tokens - s.produced - 1
            most = max(0, min(most, left, room))
        return most

    def _predicted(self, decoding: list[SeqState], limit: int) -> dict[SeqState, Round]:
        """The rounds of the sequences whose reply runs along their prediction: its next
        tokens as drafts, as many as the sequence's depth allows (an auto sequence's the
        batcher's limit, not the epoch's: they cost no drafter decode), cut where a
        grammar would refuse one. Each draft's q is the point mass on it."""
        out = {}
        for s in decoding:
            if s.prediction is None:
                continue
            drafts = s.prediction.propose(self._room(s, limit if s.auto else s.params.draft_max))
            path = None
            if s.grammar is not None and drafts:
                path = GrammarPath.start(s.grammar)
                for i, t in enumerate(drafts):
                    if not path.last.allows(np.array([t], dtype=np.int32))[0]:
                        drafts = drafts[:i]
                        break
                    path.push(t)
            if not drafts:
                continue
            tokens = np.array([s.last, *drafts], dtype=np.int32)
            dists = [] if s.sampler.is_greedy or s.params.accept == "exact" else [Dist.point(t) for t in drafts]
            out[s] = Round(s.position, tokens, dists, path, predicted=True)
        return out

    def prompt_pairs(self, s: SeqState, c: Chunk, hidden: np.ndarray, auto: int,
                     then: int | None = None) -> CatchUp:
        """``s.pending``, the chunk's pairs (token i with the target's row before it) and,
        after the last chunk, the first token's pair (``then``), as one CatchUp. A plain
        epoch's prompt (``_plain_prefill``) keeps only the newest PREFILL_DEFER, rows a
        chunk landed in a drafting epoch kept included. Each row is copied once: joining every
        chunk's rows, then the first token's, then cutting them copied each row two or three
        times, on the host between a prompt round's readback and the next decode."""
        old = s.pending
        n_old = 0 if old is None else len(old.tokens)
        # no row before the chunk (a snapshot without one: ``Resumes.resume``): its first
        # pair cannot be made, and what came before it is across that gap, so both go
        keep = n_old + c.n if s.hidden_before is not None else c.n - 1
        if self._plain_prefill(s, auto) and not self._catch_up_after_prefill(s):
            keep = min(keep, PREFILL_DEFER)
        cut = n_old + c.n - keep
        extra = then is not None
        tokens = np.empty(keep + extra, dtype=np.int32)
        rows = np.empty((keep + extra, hidden.shape[1]), dtype=np.float32)
        if extra:     # the first token, after the prompt's last row
            tokens[keep], rows[keep] = then, hidden[-1]
        o = max(0, n_old - cut)                  # pending's newest o rows stay
        if o:
            tokens[:o], rows[:o] = old.tokens[n_old - o:], old.hidden[n_old - o:]
        skip = cut - (n_old - o)                 # the chunk's oldest pairs dropped
        tokens[o:keep] = s.prompt[c.start + skip:c.start + c.n]
        if skip == 0:                            # its first pair's row is the one before it
            rows[o] = s.hidden_before[0]
            rows[o + 1:keep] = hidden[:-1]
        else:
            rows[o:keep] = hidden[skip - 1:-1]
        start = None if old is None else old.start
        if cut:
            start = (start if start is not None else self.drafter.end(s.seq)) + cut
        return CatchUp(tokens, rows, start)
