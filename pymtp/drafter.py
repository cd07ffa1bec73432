"""The MTP drafter: feeds (target hidden state, token) pairs to the MTP context and chains drafts.

Invariant (docs/design.md, "The MTP cache"): the MTP KV at position q holds the pair
(h_{q-1}, x_q), where h_{q-1} is the *target's* hidden row at q-1. Rows built from the MTP's own hidden state
(draft steps 1..k-1) live only until the next ``propose``, which drops them first. So a
rejected draft never has to be re-decoded: the next round decodes only the accepted rows,
fused with its own first draft step into one MTP decode.

Several sequences share the context, each under its own seq id with its own KV stream
(a ``_Lane`` here). ``propose`` takes one ``DraftJob`` per sequence and drafts for all of
them in batched decodes: the catch-up rows, then one decode per chain step with one row
per sequence still drafting. A sequence's rows and results are the ones it would get
alone; only the decodes are shared.

Nothing about acceptance lives here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .native import Batch, ContextConfig, NativeContext, NativeError, NativeModel
from .constraint import GrammarPath
from .draft_vocab import DraftHead, DraftVocab
from .sampling import Dist, Sampler, sampled_dist
from .sampling_filters import NothingToDraw
from .token_masks import constrained_argmax


ROW_BY_ROW_MAX = 4   # catch-ups longer than this (a prompt) go in one decode


def top_prob(logits: np.ndarray) -> float:
    """Softmax probability of the argmax, without materialising the distribution."""
    m = logits.max()
    return float(1.0 / np.exp(logits - m, dtype=np.float64).sum())


def token_prob(logits: np.ndarray, token: int) -> float:
    """Softmax probability of one token."""
    m = logits.max()
    return float(np.exp(np.float64(logits[token]) - m) / np.exp(logits - m, dtype=np.float64).sum())


@dataclass(eq=False)
class DraftJob:
    """One sequence's part of a draft phase; ``drafts`` and ``dists`` are its results."""

    seq: int
    tokens: np.ndarray                 # [m] int32 catch-up rows; the last is the token to draft after
    hidden: np.ndarray                 # [m, n_embd_out] float32: the target's row before each token
    k: int = 0                         # drafts wanted; 0 only feeds the rows into the KV
    p_min: float = 0.0
    sampler: Sampler | None = None
    sample: bool = False               # draw from q (rejection sampling) instead of the argmax
    recent: np.ndarray | None = None   # the history the sampler's penalties look back on
    # q (or, without ``sample``, the argmax draft) comes from the backend sampler chain
    # attached to this seq id in the MTP context (the engine attaches it), not from the
    # logits, which llama.cpp then does not copy out
    sampled: bool = False
    # constrained decoding: the grammar states along the drafts; draft i is taken from q
    # masked by the state after d_1..d_{i-1}, and the state after it is pushed
    grammar: GrammarPath | None = None
    # the position of tokens[0] where it lies beyond what the KV holds (positions must be
    # able to jump: NativeModel.positions_jump); None: right after it
    start: int | None = None
    drafts: list[int] = field(default_factory=list)
    dists: list[Dist] = field(default_factory=list)   # q per draft, only when sampled


@dataclass
class _Lane:
    """What the MTP KV holds for one sequence."""

    end: int = 0         # the next committed pair goes here; those before it hold pairs,
                         # but for the gaps a job's ``start`` left
    gap_at: int | None = None   # where the first of those gaps begins (None: no gap)
    dirty: bool = False  # chain rows beyond `end` are in the KV
    n_chain: int = 0     # chain rows decoded by the last propose, at end, end+1, ...


@dataclass(eq=False)
class LaneState:
    """One sequence's MTP KV as ``MTPDrafter.save`` copies it out (a shelved conversation:
    prompt_cache.Shelved)."""

    data: np.ndarray        # [size] uint8, llama_state_seq_get_data_ext with flags 0
    end: int
    whole: int              # the pairs before its first gap (``MTPDrafter.whole``)


@dataclass(eq=False)
class _Rows:
    """Rows of one job waiting for a decode."""

    job: DraftJob
    tokens: np.ndarray    # [m]
    hidden: np.ndarray    # [m, n_embd_out]
    chain: bool = False   # draft-chain rows (built from the head's own hidden state)


def catch_up_plan(lengths: list[int], drafting: list[bool], row_by_row: bool) -> list[int]:
    """How many pending rows each job decodes next (a pure policy; 0 = it waits).

    A drafting job's last row carries its output. llama.cpp splits a multi-sequence batch
    into ubatches of equal rows per sequence, and each ubatch pays the LM head again, so
    the output rows should all fall in one ubatch: when the jobs' rows differ in number,
    everything but those last rows goes first, without outputs, then one row per job.
    ``row_by_row`` (one graph shape for the whole round, for CUDA graphs) decodes short
    catch-ups one row at a time.
    """
    live = [n for n in lengths if n]
    if not live:
        return [0] * len(lengths)
    if row_by_row:
        return [(n if n > ROW_BY_ROW_MAX else 1) if n else 0 for n in lengths]
    same = len(set(live)) == 1 and all(d for n, d in zip(lengths, drafting) if n)
    if same or len(live) == 1:
        return list(lengths)
    heads = [n - 1 if d else n for n, d in zip(lengths, drafting)]
    if any(heads):
        return heads
    return list(lengths)     # only output rows are left, one per job


def has_gap(ids: list[int]) -> bool:
    """Whether sorted, distinct seq ids skip one: llama.cpp then splits their decode."""
    return len(ids) > 1 and ids[-1] - ids[0] + 1 > len(ids)


def gap_fillers(ids: list[int], busy: set[int]) -> list[int]:
    """The free seq ids a round fills with rows of its own so that its ids have no gap.

    ``ids``: the round's sequences, sorted; ``busy``: the ids whose state filler rows must
    not touch. With a KV stream per sequence llama.cpp puts only consecutive ids in one
    ubatch (scheduler.py), so a finished sequence between two running ones splits every
    round in two until a new request takes its id. Empty where there is no gap, or where
    a busy id sits in one (the target: a live sequence without rows this round).
    """
    if not has_gap(ids):
        return []
    holes = sorted(set(range(ids[0], ids[-1])) - set(ids))
    return [] if busy.intersection(holes) else holes


def fill_width(model: NativeModel) -> int | None:
    """The most filler rows an id takes in one decode here (None: any): on a GPU a
    ubatch costs a launch-bound decode and a row next to nothing; on a CPU a row costs a
    share of the decode, and only one-row gaps are worth filling (rounds.Rounds)."""
    return None if model.offloaded else 1


def filler_ends(ctx: NativeContext, ids: list[int], busy: set[int], widths: set[int],
                most: int | None) -> dict[int, int]:
    """The ids a decode fills (gap_fillers), each with the position after what its KV
    holds, where every sequence in it takes the same rows (``widths``; otherwise
    llama.cpp splits the decode anyway), those rows are at most ``most`` (None: any) and
    every filled id has room for them. Empty: no fillers."""
    if len(widths) != 1:
        return {}
    width = next(iter(widths))
    if most is not None and width > most:
        return {}
    ends = {seq: ctx.seq_pos_max(seq) + 1 for seq in gap_fillers(ids, busy)}
    return {} if any(end + width > ctx.n_ctx_seq for end in ends.values()) else ends


class MTPDrafter:
    """Proposes up to k draft tokens per round and sequence with the model's MTP head."""

    def __init__(self, model: NativeModel, cfg: ContextConfig, *, keep_accepted: bool = False,
                 row_by_row: bool = False, draft: DraftHead | None = None) -> None:
        # the target's MTP head, or the head of a draft file over fewer ids (draft_vocab.py)
        if draft is not None:
            model = draft.model
        self.ctx = NativeContext(model, cfg)
        self.vocab: DraftVocab | None = None if draft is None else draft.vocab
        # Unmasked: one hidden row per batch row, so the fused catch-up decode can output
        # logits for its last row only and still read that row's hidden state.
        self.ctx.set_nextn_output(True, masked=False)
        self.batch = Batch(self.ctx.n_batch, embd_width=model.n_embd_out)
        self.keep_accepted = keep_accepted
        self.row_by_row = row_by_row
        self.lanes: dict[int, _Lane] = {}
        # fill the ids between a decode's with rows removed right after it, so that
        # llama.cpp keeps the decode in one ubatch (verify_batch.VerifyBatch.fill_width says where)
        self.fill_width = fill_width(model)
        self._fillers: dict[int, int] = {}     # the last decode's: seq id -> its first filler position
        # when ``propose`` last read a catch-up decode back (perf_counter): its chain steps
        # come after it (round_state.RunStats.t_draft_ready)
        self.caught_up_at = 0.0

    def reset(self, seq: int | None = None) -> None:
        """Forget one sequence (its seq id may be reused at once), or all of them."""
        if seq is None:
            self.ctx.clear()
            self.lanes.clear()
        else:
            self.ctx.seq_rm(seq, -1, -1)
            self.lanes.pop(seq, None)

    def close(self) -> None:
        self.ctx.close()

    def end(self, seq: int) -> int:
        """Where the sequence's next committed pair goes (its pairs lie before it)."""
        lane = self.lanes.get(seq)
        return lane.end if lane is not None else 0

    def whole(self, seq: int) -> int:
        """How many of the sequence's first pairs it holds with no gap between: ``end``
        unless a job jumped ahead (a drafter that catches up from there drafts otherwise
        than a cold run's, which a seeded request's text must not see)."""
        lane = self.lanes.get(seq)
        return 0 if lane is None else lane.end if lane.gap_at is None else lane.gap_at

    def trim(self, seq: int, pos: int) -> int:
        """Keep at most the sequence's first ``pos`` pairs (a prompt-cache restore: the
        target's KV was cut there too); returns how many it holds now."""
        lane = self._lane(seq)
        lane.end = min(lane.end, pos)
        if lane.gap_at is not None and lane.gap_at >= lane.end:
            lane.gap_at = None
        self.ctx.seq_rm(seq, lane.end, -1)
        lane.dirty, lane.n_chain = False, 0
        return lane.end

    def save(self, seq: int) -> LaneState:
        """A copy of what the MTP KV holds for ``seq``, draft-chain rows dropped."""
        end = self.trim(seq, self.end(seq))
        buf = np.empty(self.ctx.state_size(seq, flags=0), dtype=np.uint8)
        n = self.ctx.state_get(seq, buf, flags=0)
        return LaneState(buf[:n], end, self.whole(seq))

    def load(self, seq: int, state: LaneState) -> None:
        """``seq`` holds what ``state`` was saved from (its KV replaced)."""
        self.reset(seq)
        self.ctx.state_set(seq, state.data, state.data.nbytes, flags=0)
        self.lanes[seq] = _Lane(end=state.end, gap_at=state.whole if state.whole < state.end else None)

    def _lane(self, seq: int) -> _Lane:
        return self.lanes.setdefault(seq, _Lane())

    def _drop_chain(self, seq: int) -> None:
        lane = self._lane(seq)
        if lane.dirty:
            self.ctx.seq_rm(seq, lane.end, -1)
            lane.dirty = False

    def _jump(self, seq: int, start: int) -> None:
        """The lane's next pair goes at ``start``: the positions between stay empty."""
        lane = self._lane(seq)
        if start < lane.end:
            raise ValueError(f"a job for seq {seq} starts at {start}, inside the {lane.end} positions its KV holds")
        if start > lane.end and lane.gap_at is None:
            lane.gap_at = lane.end
        lane.end = start

    def propose(self, jobs: list[DraftJob]) -> None:
        """Catch every job up on its rows and draft up to its k tokens; fills ``job.drafts``.

        hidden[i] must be the target hidden row of the position before tokens[i].
        Without ``sample`` the drafts are the head's argmax (greedy and exact-match modes);
        with it, each draft is sampled from q, the head's distribution under the sampler's
        filters (the target's), and q is kept for rejection sampling. ``recent`` is the
        history the sampler's penalties look back on; draft i sees it and d_1..d_{i-1},
        as the target's row for draft i does. A job drafts fewer than k when the head's
        top probability falls below p_min.
        """
        pending: list[_Rows] = []
        for job in jobs:
            self._drop_chain(job.seq)
            if job.start is not None:
                self._jump(job.seq, job.start)
            job.drafts, job.dists = [], []
            if len(job.tokens):
                pending.append(_Rows(job, job.tokens, job.hidden))
        cap = self.batch.capacity
        while pending:
            chain = any(r.chain for r in pending)
            if chain:
                takes = [1] * len(pending)     # chain steps: one row per job, all outputs
            else:
                takes = catch_up_plan([len(r.tokens) for r in pending],
                                      [r.job.k > 0 for r in pending], self.row_by_row)
            outputs = self._fill(pending, takes, cap)
            self.ctx.decode(self.batch)
            for seq, start in self._fillers.items():
                if not self.ctx.seq_rm(seq, start, -1):
                    raise NativeError(f"could not remove the filler rows of seq {seq} from the MTP KV")
            pending = self._advance(pending, outputs)
            if not chain:
                self.caught_up_at = time.perf_counter()

    def _fill(self, pending: list[_Rows], takes: list[int], cap: int) -> list[tuple[_Rows, int, int]]:
        """Put the planned rows in the batch (as many as fit); returns (rows, batch row, n taken).
        Jobs come in seq id order; the ids between theirs get filler rows (``_plan_fillers``)."""
        self.batch.clear()
        out = []
        fill = self._plan_fillers(pending, takes, cap)
        for r, n in zip(pending, takes):
            n = min(n, cap - self.batch.n)
            if n <= 0:
                continue
            while fill and fill[0] < r.job.seq:
                seq = fill.pop(0)
                self.batch.add(np.zeros(n, dtype=np.int32), self._fillers[seq], seq, outputs="none",
                               embd=np.zeros((n, self.batch.embd.shape[1]), dtype=np.float32))
            lane = self._lane(r.job.seq)
            last = n == len(r.tokens) and r.job.k > 0     # the row the next draft comes from
            pos = lane.end + (len(r.job.drafts) - 1 if r.chain else 0)
            tokens = r.tokens[:n] if self.vocab is None else self.vocab.inputs(r.tokens[:n])
            i = self.batch.add(tokens, pos, r.job.seq, outputs="last" if last else "none", embd=r.hidden[:n])
            out.append((r, i + n - 1, n))
        return out

    def _plan_fillers(self, pending: list[_Rows], takes: list[int], cap: int) -> list[int]:
        """The ids between this decode's that get filler rows, each as many as every job
        takes (``_fillers``: id -> the position after what its KV holds). Any id may take
        them, a running sequence's too: they are removed right after the decode, and
        the MTP KV holds no state that rows could change. None where the jobs take
        different numbers of rows (llama.cpp splits such a decode anyway), where they
        would not fit the batch, or where an id has no room left."""
        live = [(r.job.seq, n) for r, n in zip(pending, takes) if n > 0]
        if len(live) < 2:      # one job has no gap to fill
            self._fillers = {}
            return []
        ids = [seq for seq, _ in live]
        ends = {} if ids != sorted(ids) else filler_ends(self.ctx, ids, set(), {n for _, n in live},
                                                          self.fill_width)
        if ends and live[0][1] * (len(live) + len(ends)) > cap:
            ends = {}
        self._fillers = ends
        return sorted(ends)

    def _advance(self, pending: list[_Rows], decoded: list[tuple[_Rows, int, int]]) -> list[_Rows]:
        """After a decode: move each lane on, take a draft from every output row."""
        logits = hidden = None
        n_out = 0
        taken = {r: (row, n) for r, row, n in decoded}
        nxt: list[_Rows] = []
        for r in pending:
            if r not in taken:
                nxt.append(r)
                continue
            row, n = taken[r]
            job, lane = r.job, self._lane(r.job.seq)
            if r.chain:
                lane.dirty = True
            else:
                lane.end += n
            if n < len(r.tokens):
                nxt.append(_Rows(job, r.tokens[n:], r.hidden[n:], r.chain))
                continue
            if job.k == 0:
                continue
            if hidden is None:
                hidden = self.ctx.hidden(self.batch.n)
            if logits is None and not job.sampled:     # a sampled job reads its chain's rows
                logits = self.ctx.logits(self.batch.n_outputs)
            tok = self._draft(job, None if job.sampled else logits[n_out], row)
            n_out += 1
            if tok is None or len(job.drafts) == job.k:
                # the last draft is never fed back: its successor would not be verified
                lane.n_chain = len(job.drafts) - (len(job.drafts) == job.k)
                continue
            nxt.append(_Rows(job, np.array([tok], dtype=np.int32), hidden[row][None, :], chain=True))
        return nxt

    def _draft(self, job: DraftJob, logits: np.ndarray | None, row: int) -> int | None:
        """The job's next draft from its output row (``row`` in the batch, ``logits`` its
        logits, None for a job ``sampled`` in the graph); None when p_min stops it, or
        where nothing is left to draw from.

        With a draft vocabulary the row covers the file's ids: a logit bias, penalties,
        the infill sampler (it reads each token's text) and a grammar's mask speak the
        model's, so for them the row is widened first; otherwise the draft (and q) is
        taken over the file's ids and mapped to the model's."""
        vocab = self.vocab
        speaks_model_ids = job.grammar is not None or (
            job.sampler is not None and (job.sampler.adjusts or job.sampler.infill))
        if vocab is not None and logits is not None and speaks_model_ids:
            logits, vocab = vocab.widen(logits), None
        before = None if job.recent is None else np.concatenate([job.recent, job.drafts]).astype(np.int32)
        mask = None if job.grammar is None else job.grammar.last
        if not job.sample and job.sampled:      # the graph's argmax (the engine attaches it only at p_min 0)
            tok = self.ctx.sampled_token(row)
            if vocab is not None:
                tok = vocab.token(tok)
        elif not job.sample:
            if job.sampler is not None:
                logits = job.sampler.adjusted(logits, before)   # the raw row without bias or penalties
            if mask is None:
                tok = int(logits.argmax())
                if job.p_min > 0.0 and top_prob(logits) < job.p_min:
                    return None
            else:
                try:
                    tok = constrained_argmax(logits, mask)
                except NothingToDraw:     # as a sampled draft's: no draft
                    return None
                # its probability without the mask: a lower bound of the masked one, which
                # would cost the grammar a pass over the whole row
                if job.p_min > 0.0 and token_prob(logits, tok) < job.p_min:
                    return None
            if vocab is not None:
                tok = vocab.token(tok)
        else:
            try:
                q = sampled_dist(self.ctx, row) if job.sampled else job.sampler.dist(logits, before, mask)
            except NothingToDraw:   # no draft here; the verify, which draws from the target, says
                return None         # what the request gets
            if vocab is not None:
                q = vocab.dist(q)
            if job.p_min > 0.0 and float(q.probs.max()) < job.p_min:
                return None
            tok = job.sampler.sample(q)
            job.dists.append(q)
        job.drafts.append(tok)
        if job.grammar is not None:
            job.grammar.push(tok)
        return tok

    def commit(self, seq: int, n_accepted: int) -> int:
        """After verification: how many catch-up rows the sequence's next ``propose`` can skip.

        With ``keep_accepted`` the chain rows of accepted drafts stay in the KV (built from
        the head's own hidden state instead of the target's), so the next round decodes
        only the rows the chain never reached; otherwise every accepted row is decoded
        again with the target's hidden state (docs/design.md, "The MTP cache").
        """
        if not self.keep_accepted:
            return 0
        lane = self._lane(seq)
        kept = min(n_accepted, lane.n_chain)
        lane.end += kept
        lane.n_chain = 0      # chain rows past the kept ones stay dirty: the next propose drops them
        return kept
