"""What one sequence and one round carry between the steps of the round (rounds.py).

A sequence's ``SeqState`` lives from its admission to its end; its ``Round`` from the draft
to the emit of one round; the drafter's pending rows travel as a ``CatchUp`` (or, in a plain
epoch, in place as a ``Ring``). ``RunStats`` counts what a run did, ``Step`` is what a round
hands its caller. Nothing here decodes or decides: the steps that do are ``Rounds``'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .acceptance import Verdict
from .config import DecodeParams
from .constraint import GrammarPath, Mask
from .logprobs import TokenLogprob
from .native import NativeContext
from .prediction import Prediction
from .prompt_cache import Snapshot
from .sampling import Dist, History, Sampler

# a sequence drafting nothing keeps only this many of its drafter's pending rows, and its
# prompt's, where positions may jump (NativeModel.positions_jump, Drafting._hold): the
# drafter resumes after a gap in its KV. Acceptance
# of k=3 epochs that follow 32 plain rounds (8 slots, 16 held-out prompts x 256 tokens,
# greedy, CPU), every row kept -> 16: small Q8_0 0.893 -> 0.886, demo 0.906 -> 0.900
RESUME_ROWS = 16


@dataclass
class Step:
    """What one round emitted. ``tokens`` excludes an end-of-generation token."""

    tokens: list[int]
    finish: str | None = None        # "stop" (EOG), "length" (max_tokens or context full), "error"
    logprobs: list[TokenLogprob] | None = None          # one per token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None   # first Step only, when asked
    # The verify round behind ``tokens``: drafts it verified and accepted (0, 0 for a plain
    # decode and for the prompt's first token). ``tokens`` are the accepted drafts, then
    # the recovered or bonus token, cut by the stop rules (pymtp/origins.py names each).
    drafted: int = 0
    accepted: int = 0
    # its drafts were the request's prediction's (prediction.py), not the head's: the run's
    # stats count them apart, and draft_max="auto" does not price a depth by them
    predicted: bool = False


# What Engine.run yields for a round that emitted nothing (a chunk of the prompt): its
# caller may leave the native guard there, so a close() in another thread waits one round
# of a long prompt, not all of them
PROMPT_ROUND = Step([])


@dataclass
class CatchUp:
    """Rows the drafter has yet to decode: token i with the target's hidden row of the
    position before it (the MTP KV at q holds the pair (h_{q-1}, x_q))."""

    tokens: np.ndarray    # [m] int32, the last one the token to draft after
    hidden: np.ndarray    # [m, n_embd_out] float32
    # the position of tokens[0] where the pairs before it were dropped (``Ring.rows``, a
    # prompt-cache tail); None: right after what the drafter holds
    start: int | None = None

    def then(self, other: CatchUp) -> CatchUp:
        return CatchUp(np.concatenate([self.tokens, other.tokens]), np.concatenate([self.hidden, other.hidden]),
                       self.start)


@dataclass(eq=False)
class Ring:
    """A plain epoch's pending rows for the drafter (``Drafting._hold``), kept in place: the
    newest RESUME_ROWS pairs before a round and the round's own, which it adds with two
    stores. As a CatchUp grown with ``then`` and cut to its newest pairs every round they cost
    three objects and two array concatenations a sequence: on the H100 a depth-0 round
    of 8 auto sequences spent 0.19 ms more in Python than a round of plain decoding
    (benchmarks/admission_cost.py, auto0 against none)."""

    tokens: np.ndarray    # [RESUME_ROWS + 1] int32, the i-th pair's token at i % (RESUME_ROWS + 1)
    hidden: np.ndarray    # [RESUME_ROWS + 1, n_embd_out] float32
    n: int                # pairs added in all
    end: int              # the position after the newest pair

    @classmethod
    def of(cls, rows: CatchUp, end: int) -> Ring:
        """The newest RESUME_ROWS of ``rows``, whose last pair is at ``end - 1``."""
        m = min(len(rows.tokens), RESUME_ROWS)
        ring = cls(np.empty(RESUME_ROWS + 1, dtype=np.int32),
                   np.empty((RESUME_ROWS + 1, rows.hidden.shape[1]), dtype=np.float32), m, end)
        ring.tokens[:m] = rows.tokens[len(rows.tokens) - m:]
        ring.hidden[:m] = rows.hidden[len(rows.tokens) - m:]
        return ring

    def add(self, token: int, row: np.ndarray) -> None:
        """A plain round's pair, over the oldest once full."""
        i = self.n % len(self.tokens)
        self.tokens[i] = token
        self.hidden[i] = row
        self.n += 1
        self.end += 1

    def rows(self) -> CatchUp:
        """Its pairs in order, after a gap where the drafter's KV ends before them."""
        m = min(self.n, len(self.tokens))
        order = np.arange(self.n - m, self.n) % len(self.tokens)
        return CatchUp(self.tokens[order], self.hidden[order], self.end - m)


@dataclass
class Round:
    """One sequence's round, handed from step to step."""

    position: int                     # n: where ``last`` goes, the first verify row
    tokens: np.ndarray                # [k + 1] int32: last, then the drafts d_1..d_k
    draft_dists: list[Dist]           # [k] q_i, only when the drafts were sampled from q
    path: GrammarPath | None = None   # [k + 1] grammar states along the drafts, when constrained
    rows: int = 0                     # rows in the verify batch: k + 1, or more with padding
    checkpointed: bool = False        # the target's state was saved before the verify
    first_row: int = 0                # where its rows start in the verify batch
    first_output: int = 0             # ... and its logits rows in the verify's outputs
    sampled: bool = False             # p comes from its backend chain, not from logits
    logits: np.ndarray | None = None  # [k + 1, n_vocab] verify logits, a view of llama.cpp's
                                      # buffer; None where a backend chain samples p
    verdict: Verdict | None = None
    emitted: list[int] | None = None  # the verdict's tokens, before the stop rules
    keep: int = 0                     # drafts the target keeps: a, or fewer where the stop rules
                                      # end the sequence inside them
    logprobs: list[TokenLogprob] | None = None   # [a + 1] of the emitted tokens, when asked
    predicted: bool = False           # the drafts are the request's prediction's, not the head's

    @property
    def drafts(self) -> np.ndarray:   # [k]
        return self.tokens[1:]

    @property
    def n_drafts(self) -> int:
        return len(self.tokens) - 1


class Checkpoint:
    """One sequence's recurrent state, saved before a verify whose rollback the snapshots
    cannot serve; one buffer, grown when needed, for the whole run."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)
        self.size = 0

    def save(self, ctx: NativeContext, seq: int) -> None:
        need = ctx.state_size(seq)
        if self.buf.nbytes < need:
            self.buf = np.empty(need, dtype=np.uint8)
        self.size = ctx.state_get(seq, self.buf)

    def restore(self, ctx: NativeContext, seq: int) -> None:
        ctx.state_set(seq, self.buf, self.size)


def tail_from(snap: Snapshot, end: int, width: int) -> CatchUp:
    """The pairs of ``snap``'s tail a drafter holding positions up to ``end`` lacks: from
    ``end`` on, or, where the tail starts beyond ``end``, all of it after a gap."""
    if snap.tail is None:
        tail = CatchUp(np.empty(0, dtype=np.int32), np.empty((0, width), dtype=np.float32))
    else:
        tail = snap.tail
    if end >= snap.tail_start:
        skip = end - snap.tail_start
        return CatchUp(tail.tokens[skip:], tail.hidden[skip:])
    return CatchUp(tail.tokens, tail.hidden, snap.tail_start)


@dataclass
class RunStats:
    """Counters of one run, filled as the generator advances."""

    prompt_tokens: int = 0
    generated: int = 0
    # tokens a round made after a stop string's end: never output, so not the request's
    # (``Stats.generated_tokens``, a response's usage); plain decoding would not have made them
    past_stop: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    drafted_at: list[int] = field(default_factory=list)    # per draft position
    accepted_at: list[int] = field(default_factory=list)
    depths: dict[int, int] = field(default_factory=dict)   # rounds by drafts proposed (0 included)
    checkpoint_restores: int = 0
    cached_tokens: int = 0    # prompt tokens the prompt cache spared decoding
    prompt_processed: int = 0  # prompt tokens the target decoded (fewer than the rest for a run cut in its prompt)
    # rounds whose drafts came from the request's prediction (prediction.py), apart from the
    # head's above: their acceptance says how close the prediction was, not how good the head is
    prediction_tokens: int = 0    # the request's prediction, in tokens (plain runs ignore it)
    predicted_rounds: int = 0
    predicted_drafted: int = 0
    predicted_accepted: int = 0
    sampling: str = ""        # where distributions were built: "greedy", "chain", "numpy", "backend"
    arm: int | None = None    # draft_max="auto" on one stream: the request's depth (depth.Arms)
    t_start: float = 0.0
    t_prompt_done: float = 0.0       # the first token is out
    # MTP runs: when the drafter had decoded the prompt's rows, where the first round after
    # the prompt did (``_catch_up_after_prefill`` moves them past the first token). The
    # prompt's processing ends there, as llama-server's timings end it (its MTP hook
    # decodes each prompt batch before the first token is sampled).
    t_draft_ready: float = 0.0
    t_end: float = 0.0

    @property
    def decode_from(self) -> float:
        """Where the decode phase starts (0.0 before the first token): after the first
        token and, in MTP runs, the drafter's pass over the prompt. Stats' speed and
        draft_max="auto"'s prices (depth.Arms) both time from here."""
        return max(self.t_prompt_done, self.t_draft_ready) if self.t_prompt_done else 0.0

    def count_depth(self, k: int) -> None:
        self.depths[k] = self.depths.get(k, 0) + 1

    def stopped_inside(self, step: Step, past: int) -> None:
        """A stop string ended the text ``past`` tokens before the end of ``step``: those
        are not the request's tokens (``Stats.generated_tokens``), and none of them is a
        prediction's draft the output kept."""
        self.past_stop = past
        if step.predicted:
            n = len(step.tokens)
            self.predicted_accepted -= min(step.accepted, n) - min(step.accepted, n - past)

    def count_predicted(self, k: int, a: int) -> None:
        self.predicted_rounds += 1
        self.predicted_drafted += k
        self.predicted_accepted += a

    def count_round(self, k: int, a: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += a
        while len(self.drafted_at) < k:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(k):
            self.drafted_at[i] += 1
            if i < a:
                self.accepted_at[i] += 1


@dataclass(eq=False)
class Chunk:
    """A piece of one sequence's prompt in a verify batch."""

    seq: SeqState
    start: int                         # its first token's position
    n: int
    pads: int = 0                      # rows after it, rolled back once decoded (shaped_chunks)
    first_row: int = 0                 # in the batch
    output: int | None = None          # its first logits row among the outputs, if any
    logits: np.ndarray | None = None   # [n_vocab] its last row's (the prompt's last chunk), a
                                       # view; None where a backend chain samples the sequence


@dataclass(eq=False)
class SeqState:
    """Everything one sequence carries from round to round."""

    seq: int                          # its seq id in the target and MTP contexts
    prompt: np.ndarray                # [n_prompt] int32
    params: DecodeParams
    sampler: Sampler
    history: History                  # what the penalties look back on
    is_eog: Callable[[int], bool]
    stats: RunStats
    spec: bool                        # drafts with the MTP head
    sampled: bool                     # p comes from its backend chain in the target (not logits)
    draft_sampled: bool               # q, or the argmax draft, comes from its chain in the MTP context
    # [1, n_embd_out] the target's row before the next prompt chunk; None after resuming
    # from a snapshot that kept none (a plain run's), where the drafter resumes after a gap
    hidden_before: np.ndarray | None
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    prefilled: int = 0                # prompt tokens the target has decoded
    caching: bool = False             # snapshots are taken for the prompt cache
    stops: list[int] = field(default_factory=list)   # prefill pauses for snapshots (prefix_cache)
    committed: list[int] = field(default_factory=list)   # tokens after the prompt in the target's KV
    pending: CatchUp | None = None    # rows the drafter has yet to decode
    held: CatchUp | None = None       # the prompt's last rows, kept for the first round that
                                      # drafts while plain rounds drop the rest (Drafting._hold)
    ring: Ring | None = None         # in a plain epoch, the newest pending rows, in place of
                                      # ``pending`` (Drafting._hold)
    # per prompt token, None for the first; None when not asked (DecodeParams.prompt_logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    last: int = -1                    # sampled, not yet in any KV
    position: int = 0                 # of ``last``
    produced: int = 0
    finish: str | None = None         # "error" with ``error``: its own draw failed (Rounds.land)
    error: Exception | None = None
    rnd: Round | None = None          # this round's, while it runs
    auto: bool = False                # draft_max="auto": drafts the epoch's depth (depth_batched.Epochs)
    # constrained decoding: the grammar state after every emitted token, ``last`` included
    # (before the first token, the grammar's start)
    grammar: Mask | None = None
    prediction: Prediction | None = None    # the request's predicted tokens, where it drafts from them
    draft_sampler: Sampler | None = None    # the drafter's: ``sampler`` without ignore_eos's ban

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    def unring(self) -> None:
        """Back from a plain epoch's ring to ``pending`` (a round that drafts, the end)."""
        if self.ring is not None:
            self.pending, self.ring = self.ring.rows(), None

    @property
    def all_outputs(self) -> bool:
        """Its prompt chunks output every row (to score the prompt's tokens)."""
        return self.params.prompt_logprobs is not None
