"""The round loop: prefill, then rounds of draft -> verify -> accept -> roll back -> emit,
over one sequence or several sharing one target context and one MTP context.

One round (docs/design.md, "One round"), with n the position of a sequence's ``last``
(sampled, not yet in any KV):
  1. draft: the drafter catches every sequence up on the rows it accepted last round and
     drafts d_1..d_k for it, in batched MTP decodes (round_draft.py, drafter.py);
  2. verify: ONE target decode holds every sequence's [last, d_1..d_k] at n..n+k, every
     row an output, and the next chunk of every prompt still being prefilled;
  3. accept, per sequence (round_judge.py): a prefix of a drafts is kept, plus one
     recovered or bonus token: greedy keeps the longest prefix where the target's argmax
     equals the draft; with temperature > 0, rejection sampling (or llama.cpp's
     exact-match rule) on the target's p and the drafter's q, both under the same
     filters, built on the host from the logits (sampling.py) or, with
     ``sampling="backend"``, by llama.cpp's filters inside each context's decode graph, a
     chain per seq id (``BackendChains``);
  4. roll back, per sequence: the target drops positions > n+a: one ``seq_rm`` that the
     recurrent snapshots serve or, where they cannot, a restore of the checkpoint taken
     before the verify followed by a re-decode of the accepted rows;
  5. emit, per sequence: the accepted drafts and the next token, cut at an
     end-of-generation token or at max_tokens; when asked, each with its logprob, scored
     on the verify row that predicted it before the roll back can overwrite the rows
     (logprobs.py).

A sequence's state lives in its ``SeqState``; ``Rounds.step`` runs one round over a list
of them, and a single generation (``Engine.run``) is the list of one. A round is two
halves, ``launch`` (1 and queuing the verify decode of 2) and ``land`` (reading the
verify back, 3-5): the callers launch round n+1 before they hand round n's tokens on, so
on a GPU their host work runs while the device decodes (benchmarks/host_window.py).
Each sequence has its own seq id in both contexts, its own sampler and seed, depth,
filters and limits, so what it emits is what it would emit alone (tests/test_batch.py
holds us to that).

Python work per round is O(k) per sequence: slices of numpy views over llama.cpp's buffers.
"""


from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from .acceptance import Verdict
from .backend_sampling import BackendChains
from .config import DecodeParams, ParamError
from .constraint import constraint_for
from .depth_batched import Epochs, Following
from .drafter import MTPDrafter, has_gap
from .logprobs import TokenLogprob, score, score_rows
from .native import Batch, NativeContext, NativeError, NativeModel
from .prediction import Prediction
from .prefix_cache import prefill_stops
from .prompt_cache import PromptCache
from .reasoning_budget import PROMPT_TAIL_TOKENS, Budget, opened_in
from .round_draft import Drafting
from .round_judge import Judge
from .round_plan import kept_drafts, stop_rules
from .round_state import CatchUp, Chunk, RunStats, SeqState, Step
from .rpc import RpcError
from .sampling import History, make_sampler
from .sampling_filters import LogitBias
from .sampling_route import SAMPLING_PATHS, Router
from .seq_resume import Resumes
from .verify_batch import VerifyBatch

def prompt_too_long(n_tokens: int | str, n_ctx: int) -> ParamError:
    """The refusal of a prompt the context cannot hold (``n_tokens`` may say "more than N")."""
    # at most n_ctx - 1: the reply's first token needs a position too (a prompt of exactly
    # n_ctx tokens read as fitting: "has 256 tokens but the context holds 256")
    return ParamError("prompt", f"prompt has {n_tokens} tokens but the context holds {n_ctx} (a prompt of at "
                      f"most {n_ctx - 1}, leaving room for the reply); shorten the prompt or give the model a "
                      "larger context (n_ctx, --ctx-size)",
                      code="context_length_exceeded",
                      details={"n_prompt_tokens": n_tokens, "n_ctx": n_ctx} if isinstance(n_tokens, int) else
                      {"n_ctx": n_ctx})


@dataclass
class _Flight:
    """A round between ``Rounds.launch`` and ``Rounds.land``."""

    decoding: list[SeqState]
    out: list[tuple[SeqState, Step]]       # the Steps launch already knows (a full context)
    chunks: list[Chunk]
    n_out: int                             # output rows of its verify decode
    since: float                           # when its cycle began (``Rounds.idle``)
    gap: bool                              # its seq ids had a gap: llama.cpp split it
    drafter_prompt: bool                   # its drafter decoded a new prompt's rows (depth_batched.Epochs)
    lone: bool = False                     # a lone plain round (Rounds._lone)


class Rounds:
    """A target context and an optional drafter, shared by the sequences ``step`` is given.

    It owns no sequence: callers start them (``start``), pass the active ones to each
    ``step`` and, when one is done, ``park`` it (its seq id keeps what it decoded for the
    prompt cache, when there is one) or ``release_id`` its seq id; either way the id is
    free again at once, and ``start`` on it reuses what it holds of the new prompt.
    """

    def __init__(self, model: NativeModel, target: NativeContext, drafter: MTPDrafter | None, *,
                 sampling: str = "chain", chains: BackendChains | None = None,
                 cache: PromptCache | None = None, auto_limit: int = 0,
                 epochs: Epochs | Following | None = None) -> None:
        if sampling not in SAMPLING_PATHS:
            raise ValueError(f"sampling must be 'auto', 'chain', 'numpy' or 'backend', got {sampling!r}")
        self.model, self.target, self.drafter = model, target, drafter
        self.cache = cache
        self.resumes = Resumes(model, target, drafter, cache)     # what a seq id keeps between requests
        self.drafting = Drafting(model, target, drafter)          # step 1: what each drafter is fed
        self.sampling = sampling
        # the owner of the contexts owns the chains too: it frees them after the contexts
        self.chains = chains if chains is not None else BackendChains()
        self.router = Router(self.chains, model, target, drafter, sampling)     # where each samples
        self.judge = Judge(model, target, self.chains)      # step 3: which rule judges, on what
        # the verify decode's plan and batch (its filler rows included); the lone rounds and
        # the roll back's re-decodes use its batch too
        self.verify_batch = VerifyBatch(model, target)
        self.batch = self.verify_batch.batch
        self.verify_rows = 0
        # draft_max="auto": the most drafts an auto sequence may make, and the depth they
        # all draft, one epoch at a time (depth_batched.Epochs). One stream runs auto requests at
        # a fixed depth each instead (Engine.run, depth.Arms).
        self.auto_limit, self.epochs = auto_limit, epochs
        self.flight: _Flight | None = None         # a launched round not landed yet
        self._landed: float | None = None          # when the last round landed, if one follows at once
        # a launch hands the round to a device that decodes it while the host goes on (a
        # GPU): the caller launches the next round before it hands the landed Steps on.
        # Elsewhere the launch is the decode, and the Steps go first: launching ahead
        # held each one back for a whole round (the first token of a cached chat turn by
        # 33 ms of 150 on two CPU threads).
        self.overlapped = model.offloaded
        # the last target decode's hidden rows, once read (_verify_rows); every target
        # decode drops them (_decode)
        self._rows: np.ndarray | None = None
        self._budgets: dict[tuple, Budget] = {}   # the latest reasoning budget's tokens

    def start(self, seq: int, prompt: list[int], p: DecodeParams, stats: RunStats) -> SeqState:
        """A new sequence under ``seq`` (whatever that id held is dropped); nothing is
        decoded until its first ``step``. A prompt too long for one sequence's context
        raises ``ParamError``."""
        spec = p.spec == "mtp" and self.drafter is not None   # a drafter may serve plain runs too
        if len(prompt) >= self.target.n_ctx_seq:
            # here, not earlier: llama.cpp rounds n_ctx up, and the context says by how much
            raise prompt_too_long(len(prompt), self.target.n_ctx_seq)
        constraint = constraint_for(self.model, p.grammar, p.json_schema)
        ban = p.bans_end        # ignore_eos, as llama-server's: the text goes on
        bias = {**(p.logit_bias or {}), **dict.fromkeys(self.model.eog_ids, -math.inf)} if ban else p.logit_bias
        sampler = make_sampler(p.temperature, p.top_k, p.top_p, p.min_p, seed=p.seed,
                               repeat_penalty=p.repeat_penalty, frequency_penalty=p.frequency_penalty,
                               presence_penalty=p.presence_penalty, repeat_last_n=p.repeat_last_n,
                               # the infill sampler is llama.cpp's: the chain path whatever the setting
                               path="numpy" if self.sampling == "numpy" and not p.infill else "chain",
                               logit_bias=bias, n_vocab=self.model.n_vocab,
                               infill_vocab=self.model.vocab if p.infill else None)
        # the drafter's q needs no ban (the verify rejects a drafted end token), which
        # would cost it a biased path: a copy of each row, a draft vocabulary's widening
        draft_sampler = replace(sampler, logit_bias=LogitBias.of(p.logit_bias)) if ban else sampler
        ids = np.asarray(prompt, dtype=np.int32)
        stats.t_start = time.perf_counter()
        snap = self.resumes.reusable(seq, ids, p, spec)
        if snap is None:
            self.release_id(seq)
        mask = constraint.start(keep_going=p.ignore_eos) if constraint is not None else None
        if p.budgeted:      # its forced tokens are a mask too: the grammar's path (reasoning_budget.py)
            opened = p.reasoning_opened if p.reasoning_opened is not None else opened_in(self._tail_bytes(prompt))
            mask = self._budget(p).start(opened, mask)
        sampled, draft_sampled, off_graph = self.router.attach(seq, sampler, draft_sampler, p, spec, mask is not None)
        if off_graph:
            # alone, its plain rows would be drawn on the host from the graph's distribution
            # with the request's generator (backend_sampling.plain_token); here, kept off the
            # graph by its company, it draws from the host's with that generator too, not with
            # llama.cpp's dist, which a seed would take elsewhere in the stream
            shared = draft_sampler is sampler
            sampler = replace(sampler, draw_chain=None)
            draft_sampler = sampler if shared else replace(draft_sampler, draw_chain=None)
        stats.sampling = "backend" if sampled else ("greedy" if sampler.is_greedy else sampler.path)
        stats.prompt_tokens = len(ids)
        stats.prediction_tokens = len(p.prediction or ())
        auto = spec and p.draft_max == "auto"
        if auto and self.epochs is None:
            raise ValueError('draft_max="auto" needs Rounds made with epochs (depth_batched.Epochs); '
                             'Engine.run gives each auto request a fixed depth instead')
        s = SeqState(seq, ids, p, sampler, History(ids, sampler.lookback), self.model.is_eog, stats, spec,
                     sampled, draft_sampled,
                     np.zeros((1, self.model.n_embd_out), dtype=np.float32),   # h_{-1} = 0
                     prompt_logprobs=None if p.prompt_logprobs is None else [None],
                     auto=auto,
                     grammar=mask,
                     draft_sampler=draft_sampler,
                     prediction=Prediction(p.prediction) if spec and p.prediction else None)
        if snap is not None:
            self.resumes.resume(s, snap)
        if self.cache is not None:
            # the pauses do not depend on the request's cache_prompt, so that a cold run
            # decodes its prompt in the chunks a cached one does
            s.stops = prefill_stops(s.prefilled, len(ids), self.cache.every)
            s.caching = p.cache_prompt
        return s

    def _budget(self, p: DecodeParams) -> Budget:
        """``p``'s reasoning budget in this model's tokens (its forced text tokenized once)."""
        key = (p.reasoning_budget, p.reasoning_budget_message)
        if self._budgets.get(key) is None:
            self._budgets = {key: Budget.of(self.model, *key)}     # the latest only: servers send one
        return self._budgets[key]

    def _tail_bytes(self, prompt: list[int]) -> bytes:
        """The prompt's last tokens as bytes: where it left a think block open."""
        return b"".join(self.model.token_to_bytes(int(t), special=True) for t in prompt[-PROMPT_TAIL_TOKENS:])

    def park(self, s: SeqState) -> None:
        """A sequence stopped between rounds (cancelled, or its consumer went away): its
        seq id keeps what it decoded, snapshotted for the next request to reuse."""
        if self.cache is None or not s.caching or s.rnd is not None:
            self.release_id(s.seq)
            return
        if s.finish is None:
            self.resumes.snapshot(s)

    def release_id(self, seq: int) -> None:
        """Drop what both contexts hold for ``seq``."""
        self.target.seq_rm(seq, -1, -1)
        if self.drafter is not None:
            self.drafter.reset(seq)
        if self.cache is not None:
            self.cache.forget(seq)

    # -- the round
    def step(self, seqs: list[SeqState], prefill_budget: int | None = None) -> list[tuple[SeqState, Step]]:
        """One round over ``seqs`` (distinct seq ids, none finished); returns the Step of
        every sequence that emitted or finished. A sequence still prefilling decodes its
        next prompt chunk in the same target decode, within ``prefill_budget`` tokens
        (default: what the batch has room for)."""
        self.launch(seqs, prefill_budget)
        return self.land()

    def launch(self, seqs: list[SeqState], prefill_budget: int | None = None) -> None:
        """A round's first half, ``step``'s arguments: draft, then queue the verify decode.
        On a GPU llama_decode returns before the device has run it, so what the caller
        does before ``land`` (hand the last round's tokens on, detokenize them) is done
        while the device works instead of after it."""
        if self.flight is not None:
            raise RuntimeError("a round is in flight: land() it before launching the next")
        since, self._landed = (time.perf_counter() if self._landed is None else self._landed), None
        busy = {s.seq for s in seqs}
        # in seq id order: llama.cpp puts only consecutive ids in one ubatch (scheduler.py)
        seqs = sorted((s for s in seqs if s.finish is None), key=lambda s: s.seq)
        out: list[tuple[SeqState, Step]] = []
        decoding = []
        for s in seqs:
            room = self.target.n_ctx_seq - s.position - 1      # positions left after `last`
            if not s.prefilling and room < 0:
                s.finish = "length"
                out.append((s, Step([], "length")))
            elif not s.prefilling:
                decoding.append(s)
        seqs = [s for s in seqs if s.finish is None]
        if self.epochs is not None:
            self.epochs.launched(len(decoding))
        if len(seqs) == 1 and decoding and self._lone(decoding[0]):
            self._launch_lone(decoding[0])
            self.flight = _Flight(decoding, out, [], 1, since, False, False, lone=True)
            return
        drafter_prompt = self._draft(seqs, decoding)
        chunks, n_out, gap = self._verify(seqs, decoding, prefill_budget, busy)
        self.flight = _Flight(decoding, out, chunks, n_out, since, gap, drafter_prompt)

    def land(self) -> list[tuple[SeqState, Step]]:
        """A round's second half, after ``launch``: read the verify back, accept, roll
        back and emit; returns what ``step`` does."""
        f, self.flight = self.flight, None
        if f is None:
            raise RuntimeError("no round in flight: launch() one first")
        decoding, out = f.decoding, f.out
        if f.lone:
            out.append((decoding[0], self._land_lone(decoding[0])))
        else:
            self._read(decoding, f.chunks, f.n_out)
            for c in f.chunks:
                step = self._alone(c.seq, self._prefilled, c)
                if step is not None:
                    out.append((c.seq, step))
            judged = []
            for s in decoding:
                failed = self._alone(s, self._judge, s)
                if failed is not None:
                    out.append((s, failed))
                else:
                    judged.append(s)
            self._roll_back(judged)
            for s in judged:
                out.append((s, self._emit(s)))
        for s, step in out:
            if step.finish and step.finish != "error" and self.cache is not None:
                self.resumes.snapshot(s)        # the end of a generation
        self._landed = time.perf_counter()
        if self.epochs is not None and decoding:
            self.epochs.tally(self._landed - f.since,
                              [(len(st.tokens), st.drafted, st.accepted) for ss, st in out
                               if ss.auto and not st.predicted],
                              len(decoding), f.gap, sum(c.n for c in f.chunks), f.drafter_prompt)
        return out

    @staticmethod
    def _alone(s: SeqState, work: Callable, *args) -> Step | None:
        """``work(*args)`` for sequence ``s``; where it raises (its own draw failed: a
        grammar whose every token its logit bias bans, say; llama.cpp's and the RPC
        workers' errors are the round's and raise), ``s`` ends alone with an
        "error" Step and the error on it, and the round goes on for the others (the
        owner drops its seq id: what its contexts hold is half a round)."""
        try:
            return work(*args)
        except (NativeError, RpcError):      # the contexts' or a worker's: the round's, raised
            raise
        except Exception as exc:
            s.finish, s.error, s.rnd = "error", exc, None
            return Step([], "error")

    def idle(self) -> None:
        """No round follows the one that landed last at once (no sequence is left to
        decode): the next round's time starts at its launch, not at that landing.

        A round is timed (depth_batched.Epochs) from the landing of the one before it to its own,
        so that it counts all the loop spends a round: on a GPU the caller hands the last
        round's Steps on between launch and land, and that time, more for a round that
        emits more tokens, went uncounted when a round was timed by launch and land alone."""
        self._landed = None
        if self.epochs is not None:
            self.epochs.launched(0)

    # -- a lone plain round
    @staticmethod
    def _lone(s: SeqState) -> bool:
        """Whether ``s``, the round's only sequence, decodes a plain round that needs
        nothing but its one row decoded and its token drawn: no drafter rows to keep, no
        grammar, no logprobs. Such a round skips the draft, plan, fill, verdict and roll
        back steps, each a few microseconds that, right after a decode, pay cache misses:
        on two CPU threads the general round spent 0.2 ms a token between plain decodes
        (small Q8_0, T=0.7), 5% of the token."""
        return not s.spec and s.grammar is None and s.params.logprobs is None

    def _launch_lone(self, s: SeqState) -> None:
        """Queue a lone plain round's decode: its ``last`` at its position."""
        batch = self.batch
        batch.clear()
        batch.add((s.last,), s.position, s.seq, outputs="all")
        self.verify_rows = 1
        self._decode(batch)

    def _land_lone(self, s: SeqState) -> Step:
        """A lone plain round's token, drawn from its one row as a verify's plain row is
        (``_accept``), and the sequence moved past ``last`` (``_emit``)."""
        token = self.judge.draw(s, 0)
        s.committed.append(s.last)
        s.position += 1
        s.last = token
        return self._finish_step(s, [token], None)

    # -- the steps of a round, in order
    def _draft(self, seqs: list[SeqState], decoding: list[SeqState]) -> bool:
        """Step 1 (round_draft.Drafting): returns whether the drafter decoded prompt rows."""
        return self.drafting.run(seqs, decoding, self._auto_depth(), self.auto_limit)

    def _auto_depth(self) -> int:
        """Drafts an auto sequence may take this round: the epoch's depth within the
        batcher's limit (0 without epochs, which then has no auto sequence to ask)."""
        return min(self.auto_limit, self.epochs.k) if self.epochs is not None else 0

    def _verify(self, seqs: list[SeqState], decoding: list[SeqState], prefill_budget: int | None,
                busy: set[int]) -> tuple[list[Chunk], int, bool]:
        """Queue one target decode: every decoding sequence's [last, drafts] (each row an
        output, pads not), the next prompt chunk of every prefilling one, and the rows
        that fill the free ids between them. Returns the prompt chunks in it, its output
        rows, and whether its seq ids still have a gap."""
        vb = self.verify_batch
        rows, chunks = vb.plan(seqs, decoding, prefill_budget, busy)
        n_out = vb.fill(seqs, rows, chunks)
        self.verify_rows = self.batch.n     # pads and fillers included, for the scheduler's metrics
        gap = False
        if self.epochs is not None:        # only batched auto times gap rounds apart
            ids = [s.seq for s in seqs if s in rows or s in chunks]      # seqs are in id order
            gap = has_gap(sorted(ids + list(vb.fillers)) if vb.fillers else ids)
        if self.batch.n == 0:
            return [], 0, gap
        self._decode(self.batch)
        for c in chunks.values():     # counted once queued, as llama-server's: a run cancelled
            c.seq.stats.prompt_processed += c.n    # before it lands took its stats already
        return list(chunks.values()), n_out, gap

    def _read(self, decoding: list[SeqState], chunks: list[Chunk], n_out: int) -> None:
        """Hand every sequence its logits rows (views of llama.cpp's buffer, by output row),
        and score the prompt chunks that asked for it. The read waits for the device; where
        every sequence samples in the graph, its first token read waits instead."""
        # a sequence with a backend chain gets no logits (llama.cpp copies none for its
        # rows); it never scores (logprobs keep a sequence on the host)
        on_host = any(not s.sampled for s in decoding) or any(not c.seq.sampled for c in chunks)
        logits = self.target.logits(n_out) if n_out and on_host else None
        for s in decoding:
            r = s.rnd
            r.sampled = s.sampled
            if not s.sampled:
                r.logits = logits[r.first_output: r.first_output + r.n_drafts + 1]
        for c in chunks:
            if c.seq.all_outputs:     # row i predicts prompt token start + i + 1
                c.seq.prompt_logprobs += score_rows(logits[c.output: c.output + c.n],
                                                    c.seq.prompt[c.start + 1:c.start + 1 + c.n],
                                                    c.seq.params.prompt_logprobs)
            if c.start + c.n == len(c.seq.prompt) and not c.seq.sampled:
                c.logits = logits[c.output + (c.n - 1 if c.seq.all_outputs else 0)]

    def _prefilled(self, c: Chunk) -> Step | None:
        """After a prompt chunk: its rows go to the drafter (each token with the target's
        row before it); after the last chunk, the first token comes from its last row."""
        s = c.seq
        if c.pads and not self.target.seq_rm(s.seq, c.start + c.n, -1):
            raise NativeError(f"rollback of a prompt chunk's {c.pads} pad rows refused with "
                              f"{self.target.n_rs_seq} snapshots")
        s.prefilled += c.n
        if s.spec:
            hidden = self._verify_rows()[c.first_row: c.first_row + c.n]   # [n, n_embd_out]
            if s.prefilling:      # (the last chunk's pairs wait for the first token's)
                s.pending = self.drafting.prompt_pairs(s, c, hidden, self._auto_depth())
                s.hidden_before = hidden[-1:].copy()
        if s.caching and s.prefilled in s.stops:
            # the drafter gets these pairs next round, before anything can reuse this
            self.cache.save(self.target, s.seq, s.prompt[: s.prefilled], hidden[-1:] if s.spec else None)
        if s.prefilling:
            return None
        s.last = self.judge.draw(s, c.first_row + c.n - 1, c.logits)     # the prompt's last row
        if s.grammar is not None:
            s.grammar = s.grammar.then(s.last)
        s.position = len(s.prompt)
        s.stats.t_prompt_done = time.perf_counter()
        if s.spec:
            s.pending = self.drafting.prompt_pairs(s, c, hidden, self._auto_depth(), then=s.last)
            s.hidden_before = hidden[-1:].copy()
        scored = None if s.params.logprobs is None else [score(c.logits, s.last, s.params.logprobs)]
        step = self._finish_step(s, [s.last], scored)
        step.prompt_logprobs = s.prompt_logprobs
        return step


    def _decode(self, batch: Batch) -> None:
        """A target decode; what ``_verify_rows`` read of the one before is gone."""
        self._rows = None
        self.target.decode(batch)

    def _verify_rows(self) -> np.ndarray:
        """The verify decode's hidden rows, one per batch row, read once a land: a read is
        a llama.cpp call, and a round of 8 auto sequences made 8 (36 us on the H100)."""
        if self._rows is None:
            self._rows = self.target.hidden(self.batch.n)
        return self._rows

    def _judge(self, s: SeqState) -> None:
        """Everything a sequence takes from its verify rows before any roll back can
        overwrite them: the verdict, the logprobs, the drafter's next rows."""
        rnd = s.rnd
        rnd.verdict = self._accept(s)
        if rnd.path is not None:     # the next round starts after the accepted drafts and next token
            s.grammar = rnd.path.settle(rnd.verdict.n_accepted, rnd.verdict.next_token)
        rnd.emitted = rnd.verdict.emitted(rnd.drafts)
        if s.params.logprobs is not None:
            rnd.logprobs = score_rows(rnd.logits, rnd.emitted, s.params.logprobs)
        emitted, finish = stop_rules(rnd.emitted, s.produced, s.params.max_tokens, s.is_eog)
        rnd.keep = kept_drafts(rnd.verdict.n_accepted, len(emitted), finish)
        if rnd.predicted:      # its drafts the output holds (an end-of-generation one is not output)
            s.stats.count_predicted(rnd.n_drafts, min(rnd.verdict.n_accepted, len(emitted)))
        elif rnd.n_drafts:
            s.stats.count_round(rnd.n_drafts, rnd.verdict.n_accepted)
        if s.spec and s.ring is not None and finish is None:     # a plain epoch: its pairs
            # (no drafter.commit: nothing was drafted since the round that made the ring;
            # a round of predicted drafts adds one pair a token it emits)
            rows = self._verify_rows()
            for i in range(rnd.keep):
                s.ring.add(int(rnd.drafts[i]), rows[rnd.first_row + i])
            s.ring.add(rnd.verdict.next_token, rows[rnd.first_row + rnd.keep])
        elif s.spec:     # after any rows a k=0 round left (``_defers``)
            s.unring()
            rows = self._catch_up_after(s) if finish is None else self._tail_after(s)
            s.pending = rows if s.pending is None else s.pending.then(rows)

    def _accept(self, s: SeqState) -> Verdict:
        """Step 3 (round_judge.Judge): which drafts the target keeps, and the next token."""
        return self.judge.verdict(s)

    def _catch_up_after(self, s: SeqState) -> CatchUp:
        """The next round's catch-up: the accepted drafts then the next token, at n+1..n+a+1,
        each with the target's hidden row before it (the verify's rows n..n+a, copied now:
        a roll back's re-decode or the next verify overwrites them). ``last`` itself is in
        the MTP KV already: draft step 0 decoded it."""
        rnd = s.rnd
        a = rnd.verdict.n_accepted
        skip = self.drafter.commit(s.seq, a)       # rows the drafter kept from its own chain
        tokens = np.empty(a + 1 - skip, dtype=np.int32)
        tokens[: a - skip] = rnd.drafts[skip:a]
        tokens[a - skip] = rnd.verdict.next_token
        rows = self._verify_rows()[rnd.first_row + skip: rnd.first_row + a + 1]
        return CatchUp(tokens, rows.copy())

    def _tail_after(self, s: SeqState) -> CatchUp:
        """A finishing sequence's pairs the drafter has not decoded, as ``_catch_up_after``
        makes them but from n + 1 and for the kept drafts only: the prompt cache's
        snapshot at its end keeps them (all but the last row, whose token is not in the
        KV; its hidden row is the snapshot's ``hidden_before``)."""
        rnd = s.rnd
        self.drafter.commit(s.seq, rnd.verdict.n_accepted)
        tokens = np.empty(rnd.keep + 1, dtype=np.int32)
        tokens[: rnd.keep] = rnd.drafts[: rnd.keep]
        tokens[rnd.keep] = -1     # never decoded
        rows = self._verify_rows()[rnd.first_row: rnd.first_row + rnd.keep + 1]
        return CatchUp(tokens, rows.copy())

    def _roll_back(self, decoding: list[SeqState]) -> None:
        """Drop every sequence's rows past its accepted ones, positions > n + a: through
        the snapshots, or by restoring its checkpoint and decoding its accepted rows again
        (all such sequences in one decode)."""
        batch = self.batch
        batch.clear()
        for s in decoding:
            r = s.rnd
            a, n = r.keep, r.position
            if a + 1 == r.rows:
                continue
            if not r.checkpointed:
                if not self.target.seq_rm(s.seq, n + a + 1, -1):
                    raise NativeError(f"rollback of {r.rows - 1 - a} rows refused with "
                                      f"{self.target.n_rs_seq} snapshots")
                continue
            s.checkpoint.restore(self.target, s.seq)
            if not self.target.seq_rm(s.seq, n, -1):
                raise NativeError("could not trim the attention KV after a restore")
            batch.add(r.tokens[: a + 1], n, s.seq, outputs="last")
            s.stats.checkpoint_restores += 1
        if batch.n:       # its rows overwrite the verify's
            self._decode(batch)

    def _emit(self, s: SeqState) -> Step:
        """The round's tokens after the stop rules; the sequence moves past them."""
        rnd = s.rnd
        s.committed.append(s.last)
        if rnd.keep:
            s.committed.extend(int(t) for t in rnd.drafts[: rnd.keep])
        step = self._finish_step(s, rnd.emitted, rnd.logprobs)
        step.drafted, step.accepted, step.predicted = rnd.n_drafts, rnd.verdict.n_accepted, rnd.predicted
        s.position += rnd.keep + 1
        s.last = rnd.verdict.next_token
        s.rnd = None
        return step

    def _finish_step(self, s: SeqState, tokens: list[int], logprobs: list[TokenLogprob] | None) -> Step:
        emitted, finish = stop_rules(tokens, s.produced, s.params.max_tokens, s.is_eog)
        s.produced = s.stats.generated = s.produced + len(emitted)
        s.history.extend(emitted)
        if s.prediction is not None:
            s.prediction.advance(emitted)
        s.finish = finish
        return Step(emitted, finish, None if logprobs is None else logprobs[: len(emitted)])
