"""The round loop: prefill, then rounds of draft -> verify -> accept -> roll back -> emit,
as a generator over token ids.

One round (docs/design.md, "One round"), with n the position of ``last`` (sampled, not
yet in any KV):
  1. draft: the drafter catches up on the rows accepted last round and drafts d_1..d_k;
  2. verify: the target decodes [last, d_1..d_k] at n..n+k in one batch, every row an
     output;
  3. accept: a prefix of a drafts is kept, plus one recovered or bonus token: greedy
     keeps the longest prefix where the target's argmax equals the draft; with
     temperature > 0, rejection sampling (or llama.cpp's exact-match rule) on the
     target's p and the drafter's q, both under the same filters, built on the host
     from the logits (sampling.py) or, with ``sampling="backend"``, by llama.cpp's
     filters inside each context's decode graph (``_BackendChains``);
  4. roll back: the target drops positions > n+a: one ``seq_rm`` that the recurrent
     snapshots serve or, where they cannot, a restore of the checkpoint taken before the
     verify followed by a re-decode of the accepted rows;
  5. emit: the accepted drafts and the next token, cut at an end-of-generation token or
     at max_tokens; when asked, each with its logprob, scored on the verify row that
     predicted it before the roll back can overwrite the rows (logprobs.py).

Python work per round is O(k): slices of numpy views over llama.cpp's buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .acceptance import Verdict, exact_match_accept, greedy_accept, rejection_accept
from .config import DecodeParams, ParamError
from .drafter import MTPDrafter
from .logprobs import TokenLogprob, score, score_rows
from .native import Batch, ContextConfig, NativeContext, NativeError, NativeModel, SamplerChain
from .sampling import Dist, History, Sampler, filter_chain, make_sampler, sampled_dist

# Where distributions are built: "chain" and "numpy" are sampling.py's host paths over the
# logits; "backend" runs llama.cpp's filters in the decode graph and reads back only the
# candidates and their probabilities (benchmarks/sampling_cost.py compares them).
SAMPLING_PATHS = ("chain", "numpy", "backend")


def prompt_too_long(n_tokens: int | str, n_ctx: int) -> ParamError:
    """The refusal of a prompt the context cannot hold (``n_tokens`` may say "more than N")."""
    return ParamError("prompt", f"prompt has {n_tokens} tokens but the context holds {n_ctx}; shorten "
                      "the prompt or give the model a larger context (n_ctx, --ctx-size)",
                      code="context_length_exceeded")


class _SampledDists:
    """Target distributions of the verify rows, read from the target's backend sampler."""

    def __init__(self, ctx: NativeContext, n_rows: int) -> None:
        self.ctx, self.n_rows = ctx, n_rows
        self.cache: dict[int, Dist] = {}

    def __len__(self) -> int:
        return self.n_rows

    def __getitem__(self, i: int) -> Dist:
        d = self.cache.get(i)
        if d is None:
            d = self.cache[i] = sampled_dist(self.ctx, i)
        return d


class _BackendChains:
    """The llama.cpp chains (the sampler's filters, then dist) attached to contexts, for
    backend sampling; a context keeps its chain while runs ask for the same filters.

    llama.cpp initialises a chain for the graph once, so every attach takes a fresh one;
    a context does not own its chain, so the chain is freed only once detached. Penalties
    need each verify row's own history, which llama.cpp's backend penalties cannot take
    (they refuse more than one output per sequence): such runs, and greedy ones, detach.
    """

    def __init__(self) -> None:
        self.attached: dict[int, tuple[tuple, SamplerChain]] = {}    # id(ctx) -> (filters, chain)
        self.refused: dict[tuple, list[str]] = {}                    # filters -> sampler names

    def set(self, ctx: NativeContext, sampler: Sampler | None) -> bool:
        """Attach the chain for ``sampler``'s filters (None detaches); False when this
        context runs on the host instead (detached, or llama.cpp cannot offload the chain)."""
        key = None if sampler is None else (sampler.top_k, sampler.top_p, sampler.min_p, sampler.temperature)
        now = self.attached.get(id(ctx))
        if now is not None and now[0] == key:
            return True
        if now is not None:
            ctx.set_sampler(0, None)
            now[1].close()
            del self.attached[id(ctx)]
        if key is None or key in self.refused:
            return False
        chain = filter_chain(*key).add_dist(0)     # dist's own draw goes unused: pymtp draws
        # "+name": the sampler runs in the graph; anything else would leave filters undone
        if not ctx.set_sampler(0, chain) or not all(n.startswith("+") for n in chain.names()):
            self.refused[key] = chain.names()
            ctx.set_sampler(0, None)
            chain.close()
            return False
        self.attached[id(ctx)] = (key, chain)
        return True

    def close(self) -> None:
        """Free the chains; call after closing the contexts they were attached to."""
        for _, chain in self.attached.values():
            chain.close()
        self.attached.clear()


class _LazyDists:
    """Target distributions of the verify rows, computed only for the rows acceptance reads.

    Row i predicts the token after d_i, so its penalties see the history and d_1..d_i.
    Building every row at once (sharing the numpy work around llama.cpp's filter calls)
    measured slower: it saves ~10 us per 4 rows at 8,192 tokens, and a rejection at the
    first draft, common, then leaves 2-3 rows unread (~20 us each).
    """

    def __init__(self, sampler: Sampler, logits: np.ndarray, history: History, drafts: np.ndarray) -> None:
        self.sampler, self.logits, self.history, self.drafts = sampler, logits, history, drafts
        self.cache: dict[int, Dist] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> Dist:
        d = self.cache.get(i)
        if d is None:
            d = self.cache[i] = self.sampler.dist(self.logits[i], self.history.recent(self.drafts[:i]))
        return d


@dataclass
class Step:
    """What one round emitted. ``tokens`` excludes an end-of-generation token."""

    tokens: list[int]
    finish: str | None = None        # "stop" (EOG), "length" (max_tokens or context full)
    logprobs: list[TokenLogprob] | None = None          # one per token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None   # first Step only, when asked


@dataclass
class Prefill:
    """What the prefill hands the first round."""

    last: int                          # the first generated token
    catch_up: CatchUp | None           # the drafter's first rows (None without a drafter)
    logits: np.ndarray | None          # [n_vocab] the row ``last`` came from, a view of llama.cpp's
                                       # buffer; None where a backend chain sampled it
    prompt_logprobs: list[TokenLogprob | None] | None = None   # per prompt token, None for the first


@dataclass
class CatchUp:
    """Rows the drafter has yet to decode: token i with the target's hidden row of the
    position before it (the MTP KV at q holds the pair (h_{q-1}, x_q))."""

    tokens: np.ndarray    # [m] int32, the last one the token to draft after
    hidden: np.ndarray    # [m, n_embd_out] float32


@dataclass
class Round:
    """One round's data, handed from step to step."""

    position: int                     # n: where ``last`` goes, the first verify row
    tokens: np.ndarray                # [k + 1] int32: last, then the drafts d_1..d_k
    draft_dists: list[Dist]           # [k] q_i, only when the drafts were sampled from q
    checkpointed: bool = False        # the target's state was saved before the verify
    sampled: bool = False             # p comes from the target's backend chain, not from logits
    logits: np.ndarray | None = None  # [k + 1, n_vocab] verify logits, a view of llama.cpp's buffer
    verdict: Verdict | None = None
    logprobs: list[TokenLogprob] | None = None   # [a + 1] of the emitted tokens, when asked

    @property
    def drafts(self) -> np.ndarray:   # [k]
        return self.tokens[1:]

    @property
    def n_drafts(self) -> int:
        return len(self.tokens) - 1


class _Checkpoint:
    """The target's recurrent state, saved before a verify whose rollback the snapshots
    cannot serve; one buffer, grown when needed, for the whole run."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)
        self.size = 0

    def save(self, ctx: NativeContext) -> None:
        need = ctx.state_size(0)
        if self.buf.nbytes < need:
            self.buf = np.empty(need, dtype=np.uint8)
        self.size = ctx.state_get(0, self.buf)

    def restore(self, ctx: NativeContext) -> None:
        ctx.state_set(0, self.buf, self.size)


def _stop_rules(tokens: list[int], produced: int, max_tokens: int,
                is_eog: Callable[[int], bool]) -> tuple[list[int], str | None]:
    """Cut a run of emitted tokens at its first end-of-generation token, then at max_tokens."""
    for i, token in enumerate(tokens):
        if is_eog(token):
            return tokens[:i], "stop"
    if produced + len(tokens) >= max_tokens:
        return tokens[: max_tokens - produced], "length"
    return tokens, None


@dataclass
class RunStats:
    """Counters of one run, filled as the generator advances."""

    prompt_tokens: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    drafted_at: list[int] = field(default_factory=list)    # per draft position
    accepted_at: list[int] = field(default_factory=list)
    checkpoint_restores: int = 0
    sampling: str = ""        # where distributions were built: "greedy", "chain", "numpy", "backend"
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    t_end: float = 0.0

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


class Engine:
    """Owns one target context (and one MTP drafter) for one sequence at a time."""

    def __init__(self, model: NativeModel, *, n_ctx: int, n_batch: int, threads: int | None,
                 draft_limit: int, draft_kv: str = "target", row_by_row: bool = False,
                 flash_attn: str = "auto", sampling: str = "chain") -> None:
        if sampling not in SAMPLING_PATHS:
            raise ValueError(f"sampling must be 'chain', 'numpy' or 'backend', got {sampling!r}")
        self.model = model
        self.draft_limit = draft_limit
        self.draft_kv = draft_kv
        self.row_by_row = row_by_row
        self.sampling = sampling
        self._cfg = dict(n_ctx=n_ctx, n_batch=n_batch, threads=threads, flash_attn=flash_attn)
        self._targets: dict[int, NativeContext] = {}
        self._drafter: MTPDrafter | None = None
        self._chains = _BackendChains()

    # -- contexts are made lazily: no-spec runs never pay for snapshots or the MTP KV
    def target(self, n_rs_seq: int) -> NativeContext:
        ctx = self._targets.get(n_rs_seq)
        if ctx is None:
            nb = self._cfg["n_batch"]
            # Outputs per decode never exceed a verify batch (prefill asks for one row), and
            # llama.cpp sizes its logits buffer by this: n_batch x n_vocab would be ~0.5 GB
            # for a 248k vocabulary.
            ctx = NativeContext(self.model, ContextConfig(
                n_ctx=self._cfg["n_ctx"], n_batch=nb, n_ubatch=nb, n_rs_seq=n_rs_seq,
                threads=self._cfg["threads"], n_outputs_max=self.draft_limit + 1,
                flash_attn=self._cfg["flash_attn"]))
            self._targets[n_rs_seq] = ctx
        return ctx

    def drafter(self) -> MTPDrafter:
        if self._drafter is None:
            self._drafter = MTPDrafter(self.model, ContextConfig(
                n_ctx=self._cfg["n_ctx"], n_batch=self._cfg["n_batch"],
                n_ubatch=self._cfg["n_batch"], threads=self._cfg["threads"], mtp=True,
                n_outputs_max=1, flash_attn=self._cfg["flash_attn"]),
                keep_accepted=self.draft_kv == "keep", row_by_row=self.row_by_row)
        return self._drafter

    def close(self) -> None:
        for ctx in self._targets.values():
            ctx.close()
        self._targets.clear()
        if self._drafter is not None:
            self._drafter.close()
            self._drafter = None
        self._chains.close()

    # -- the loop
    def run(self, prompt: list[int], p: DecodeParams, stats: RunStats | None = None) -> Iterator[Step]:
        """Yield one Step per round until EOG, max_tokens or a full context.

        ``prompt`` is non-empty and inside the vocabulary (Session.stream checks both); one
        too long for the context raises ``ParamError`` at the first step.
        """
        stats = stats if stats is not None else RunStats()
        spec = p.spec == "mtp"
        # The MTP target keeps draft_limit snapshots whatever this request's draft_max, so
        # requests with different depths share one context. rollback="checkpoint" uses a
        # target with none, which is what an architecture without snapshots gets.
        target = self.target(self.draft_limit if (spec and p.rollback == "auto") else 0)
        target.set_nextn_output(spec, masked=False)
        target.clear()
        drafter = self.drafter() if spec else None
        if drafter is not None:
            drafter.reset()
        if len(prompt) >= target.n_ctx:
            # here, not earlier: llama.cpp rounds n_ctx up, and the context says by how much
            raise prompt_too_long(len(prompt), target.n_ctx)
        stats.prompt_tokens = len(prompt)
        stats.t_start = time.perf_counter()
        try:
            yield from self._rounds(target, drafter, np.asarray(prompt, dtype=np.int32), p, stats)
        finally:
            stats.t_end = time.perf_counter()

    def _rounds(self, target: NativeContext, drafter: MTPDrafter | None, prompt: np.ndarray,
                p: DecodeParams, stats: RunStats) -> Iterator[Step]:
        """The whole generation: the prefill's token, then one Step per round."""
        sampler = make_sampler(p.temperature, p.top_k, p.top_p, p.min_p, seed=p.seed,
                               repeat_penalty=p.repeat_penalty, frequency_penalty=p.frequency_penalty,
                               presence_penalty=p.presence_penalty, repeat_last_n=p.repeat_last_n,
                               path="numpy" if self.sampling == "numpy" else "chain")
        sampled = self._sample_on_backend(target, drafter, sampler, p)
        stats.sampling = "greedy" if sampler.is_greedy else ("backend" if sampled else sampler.path)
        history = History(prompt, sampler.lookback)   # what the penalties look back on
        is_eog = (lambda t: False) if p.ignore_eos else self.model.is_eog
        pre = self._prefill(target, drafter, prompt, sampler, history, p.prompt_logprobs, sampled)
        last, catch_up = pre.last, pre.catch_up
        stats.t_prompt_done = time.perf_counter()
        emitted, finish = _stop_rules([last], 0, p.max_tokens, is_eog)
        produced = stats.generated = len(emitted)
        history.extend(emitted)
        scored = None if p.logprobs is None else [score(pre.logits, last, p.logprobs)][: len(emitted)]
        yield Step(emitted, finish, scored, pre.prompt_logprobs)
        if finish:
            return

        checkpoint = _Checkpoint()
        verify_batch = Batch(max(self.draft_limit, p.draft_max) + 1)
        position = len(prompt)                        # of `last`
        while True:
            room = target.n_ctx - position - 1        # positions left after `last`
            if room < 0:
                yield Step([], "length")
                return
            budget = min(p.draft_max, p.max_tokens - produced - 1, room)
            rnd = self._draft(drafter, catch_up, last, position, budget, p, sampler, history)
            rnd.sampled = sampled
            self._verify(target, verify_batch, rnd, checkpoint)
            rnd.verdict = self._accept(target, rnd, sampler, history, p.accept)
            if p.logprobs is not None:    # now: a checkpoint restore re-decodes over the rows
                rnd.logprobs = score_rows(rnd.logits, rnd.verdict.emitted(rnd.drafts), p.logprobs)
            if rnd.n_drafts:
                stats.count_round(rnd.n_drafts, rnd.verdict.n_accepted)
            self._roll_back(target, verify_batch, rnd, checkpoint, stats)
            emitted, finish = _stop_rules(rnd.verdict.emitted(rnd.drafts), produced, p.max_tokens, is_eog)
            produced = stats.generated = produced + len(emitted)
            history.extend(emitted)
            yield Step(emitted, finish, None if rnd.logprobs is None else rnd.logprobs[: len(emitted)])
            if finish:
                return
            if drafter is not None:
                catch_up = self._catch_up_after(target, drafter, rnd)
            position += rnd.verdict.n_accepted + 1
            last = rnd.verdict.next_token

    def _sample_on_backend(self, target: NativeContext, drafter: MTPDrafter | None, sampler: Sampler,
                           p: DecodeParams) -> bool:
        """Attach or detach the backend chains this run needs; True when the target's
        distributions come from its chain. The drafter samples from its own chain only
        where acceptance reads q (rejection sampling); for argmax drafts it keeps logits."""
        wanted = (self.sampling == "backend" and not sampler.is_greedy and not sampler.lookback
                  and p.logprobs is None and p.prompt_logprobs is None)   # logprobs read the logits
        on_target = self._chains.set(target, sampler if wanted else None)
        if drafter is not None:
            drafter.sampled = self._chains.set(drafter.ctx, sampler if on_target and p.accept != "exact"
                                               else None)
        return on_target

    # -- the steps of a round, in order
    def _prefill(self, target: NativeContext, drafter: MTPDrafter | None, prompt: np.ndarray,
                 sampler: Sampler, history: History, prompt_top: int | None = None,
                 sampled: bool = False) -> Prefill:
        """Decode the prompt in n_batch chunks and take the first token from its last row.

        With a drafter, every chunk but the last is mirrored into the MTP KV at once (the
        next chunk's decode overwrites its hidden rows); the last chunk is returned, with
        the first token, as the catch-up the first draft step decodes in the same batch.

        ``prompt_top`` not None asks for the prompt's logprobs: every row is then an
        output, so chunks hold only as many rows as the target outputs per decode.
        """
        batch = Batch(target.n_batch)
        hidden_before = np.zeros((1, self.model.n_embd_out), dtype=np.float32)   # h_{-1} = 0
        tail, tail_hidden = prompt, hidden_before
        step = target.n_batch if prompt_top is None else target.n_outputs_max
        scored: list[TokenLogprob | None] | None = None if prompt_top is None else [None]
        for start in range(0, len(prompt), step):
            chunk = prompt[start:start + step]
            batch.set(chunk, start, outputs="last" if scored is None else "all")
            target.decode(batch)
            if scored is not None:    # row i predicts prompt token start + i + 1
                scored += score_rows(target.logits(len(chunk)), prompt[start + 1:start + 1 + len(chunk)],
                                     prompt_top)
            if drafter is not None:
                hidden = target.hidden(len(chunk))                      # [len(chunk), n_embd_out]
                pairs = np.concatenate([hidden_before, hidden[:-1]])   # the row before each token
                if start + len(chunk) < len(prompt):
                    drafter.feed(chunk, pairs)
                else:
                    tail, tail_hidden = chunk, pairs
                hidden_before = hidden[-1:].copy()
        if sampled:        # no logits come out with a backend chain (never with logprobs)
            logits = None
            last = sampler.sample(sampled_dist(target, len(chunk) - 1))
        else:
            logits = target.logits(1 if scored is None else len(chunk))[-1]
            recent = history.recent()
            last = sampler.argmax(logits, recent) if sampler.is_greedy else sampler(logits, recent)
        if drafter is None:
            return Prefill(last, None, logits, scored)
        return Prefill(last, CatchUp(np.append(tail, last).astype(np.int32),
                                     np.concatenate([tail_hidden, hidden_before])), logits, scored)

    def _draft(self, drafter: MTPDrafter | None, catch_up: CatchUp | None, last: int, position: int,
               budget: int, p: DecodeParams, sampler: Sampler, history: History) -> Round:
        """Catch the drafter up and have it propose at most ``budget`` drafts (none without one)."""
        drafts, draft_dists = np.empty(0, dtype=np.int32), []
        if drafter is not None and budget > 0:
            # drafts are sampled from q only where acceptance reads q (rejection sampling);
            # either way the head's penalties see the same history as the target's
            sample = not sampler.is_greedy and p.accept != "exact"
            drafts, draft_dists = drafter.propose(catch_up.tokens, catch_up.hidden, budget, p.p_min,
                                                  sampler, sample=sample, recent=history.recent())
        tokens = np.empty(len(drafts) + 1, dtype=np.int32)
        tokens[0] = last
        tokens[1:] = drafts
        return Round(position, tokens, draft_dists)

    def _verify(self, target: NativeContext, batch: Batch, rnd: Round, checkpoint: _Checkpoint) -> None:
        """Decode [last, drafts] in one batch, every row an output; first save the target's
        state when its snapshots cannot roll back that many rows."""
        if rnd.n_drafts > target.n_rs_seq:
            checkpoint.save(target)
            rnd.checkpointed = True
        batch.set(rnd.tokens, rnd.position, outputs="all")
        target.decode(batch)
        if not rnd.sampled:        # with a backend chain llama.cpp copies no logits out
            rnd.logits = target.logits(rnd.n_drafts + 1)

    def _accept(self, target: NativeContext, rnd: Round, sampler: Sampler, history: History,
                rule: str) -> Verdict:
        """Which drafts the target keeps, and the recovered or bonus token (acceptance.py)."""
        if sampler.is_greedy and not sampler.lookback:
            return greedy_accept(rnd.drafts, rnd.logits.argmax(axis=1))
        if sampler.is_greedy:      # penalties move the argmax, row by row
            return greedy_accept(rnd.drafts, [sampler.argmax(row, history.recent(rnd.drafts[:i]))
                                              for i, row in enumerate(rnd.logits)])
        target_dists = (_SampledDists(target, rnd.n_drafts + 1) if rnd.sampled
                        else _LazyDists(sampler, rnd.logits, history, rnd.drafts))
        if rule == "exact" or not rnd.n_drafts:
            return exact_match_accept(rnd.drafts, target_dists, sampler.rng)
        return rejection_accept(rnd.drafts, rnd.draft_dists, target_dists, sampler.rng)

    def _roll_back(self, target: NativeContext, batch: Batch, rnd: Round, checkpoint: _Checkpoint,
                   stats: RunStats) -> None:
        """Drop the target's rows of the rejected drafts, positions > n + a."""
        k, a, n = rnd.n_drafts, rnd.verdict.n_accepted, rnd.position
        if a == k:
            return
        if not rnd.checkpointed:
            if not target.seq_rm(0, n + a + 1, -1):
                raise NativeError(f"rollback of {k - a} rows refused with {target.n_rs_seq} snapshots")
            return
        checkpoint.restore(target)
        if not target.seq_rm(0, n, -1):
            raise NativeError("could not trim the attention KV after a restore")
        batch.set(rnd.tokens[: a + 1], n, outputs="last")
        target.decode(batch)
        stats.checkpoint_restores += 1

    def _catch_up_after(self, target: NativeContext, drafter: MTPDrafter, rnd: Round) -> CatchUp:
        """The next round's catch-up: the accepted drafts then the next token, at n+1..n+a+1,
        each with the target's hidden row before it (the verify's rows n..n+a). ``last``
        itself is in the MTP KV already: draft step 0 decoded it."""
        a = rnd.verdict.n_accepted
        skip = drafter.commit(a)       # rows the drafter kept from its own chain
        tokens = np.empty(a + 1 - skip, dtype=np.int32)
        tokens[: a - skip] = rnd.drafts[skip:a]
        tokens[a - skip] = rnd.verdict.next_token
        return CatchUp(tokens, target.hidden(a + 1)[skip: a + 1])
