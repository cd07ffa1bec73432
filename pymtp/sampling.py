"""Turn one row of logits into the distribution we sample from, and sample it.

A distribution is a sparse `Dist`: the token ids of its support (ascending) and their
probabilities (float64, summing to 1). Acceptance needs both the target's p and the
drafter's q in this form, so the sampler hands out the distribution, not only a token.

The row's transforms (logit bias, penalties, top_k, top_p, min_p, temperature), in the
order of llama.cpp's default chain, are in sampling_filters.py; the grammar stage's
candidates in token_masks.py. This module builds the distribution from them and draws.

Two host paths build a distribution (``make_sampler(path=...)``):

- "chain" (the default) runs llama.cpp's own filters, its C sampler chain (top_k, top_p,
  min_p, temp), over a ``llama_token_data_array``: on a long row with top_k, over the
  candidates the group-maxima pass finds, since filling the array with a whole 248k row
  costs more (~0.35 ms) than the numpy filters it replaces; a long row without top_k
  takes the numpy path. The probabilities are then the float64 softmax of the row's own
  logits on the support the chain kept, as below. llama.cpp breaks ties at a top_k or
  top_p cut in no defined order and sums top_p's nucleus in float32, as llama-server does.
  Where only a token is wanted (a round without drafts, a prompt's first token, the
  rows of exact-match acceptance), the chain path draws inside llama.cpp instead
  (``Sampler.draws_natively``): ``draw_chain`` is the same filters ending in llama.cpp's
  dist, seeded from the same seed, so a seed still replays exactly.
- "numpy" is the pure numpy filters (sampling_filters.py), the reference the tests hold
  the chain to.

At 8,192 tokens the chain costs ~0.03 ms a distribution against ~0.09 ms in numpy (a dozen
small numpy calls); at 248k both are bound by the one pass over the row.

llama.cpp's infill sampler (``DecodeParams.infill``, for code completion) goes after
min_p, before the temperature, on the chain path only: it has no numpy twin. In the
pinned llama.cpp it only chooses the support (its merged probabilities are recomputed by
dist from the logits), so a row's distribution is still the softmax of its own logits on
what the chain kept.

The grammar stage (constrained decoding, constraint.py) keeps only the tokens a grammar
state allows, before any filter (token_masks.py says how it is asked).

Reproducibility: `Sampler.sample` (and `draw`) consume exactly one `rng.random()` per
call, whatever the support size, so the same seed and the same sequence of calls give the
same tokens (``draw_chain`` is seeded from a child of the seed, not from the generator).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, get_args

import numpy as np

from .config import (DEFAULTS, check_bans, check_frequency_penalty, check_min_p, check_presence_penalty,
                     check_repeat_last_n, check_repeat_penalty, check_temperature, check_top_k, check_top_p)
from .native import NativeContext, NativeError
from .native_samplers import SamplerChain, TokenDataArray
from .sampling_filters import (LogitBias, NothingToDraw, apply_min_p, apply_penalties, apply_top_k, apply_top_p,
                               bias_logits, biased_argmax, finite_max, scratch, softmax, top_candidates)
from .token_masks import TokenMask, constrained_argmax, constrained_support, ending, narrowing

SamplePath = Literal["chain", "numpy"]


@dataclass(frozen=True, eq=False)
class Dist:
    """A distribution over token ids, stored on its support only."""

    ids: np.ndarray    # [m] int32, strictly ascending
    probs: np.ndarray  # [m] float64, sums to 1 (entries may be 0)

    @classmethod
    def from_dense(cls, probs) -> Dist:
        """Build from a dense [V] vector of non-negative weights (renormalised)."""
        probs = np.asarray(probs, dtype=np.float64)
        ids = np.flatnonzero(probs > 0).astype(np.int32)
        weights = probs[ids]
        return cls(ids, weights / weights.sum())

    @classmethod
    def from_sparse(cls, ids: np.ndarray, weights: np.ndarray) -> Dist:
        """Build from token ids in any order and their weights (zeros dropped, renormalised
        in float64): what llama.cpp's backend sampling hands back for a row. A k=3
        round builds up to seven, each of a few numpy calls (~1 us apiece) on a short row:
        the boolean mask and in-place division keep those calls few."""
        keep = weights > 0
        kept_ids = ids[keep]                          # a copy: the inputs may be llama.cpp's
        order = kept_ids.argsort()
        probs = weights[keep][order].astype(np.float64)
        probs /= probs.sum()
        return cls(kept_ids[order].astype(np.int32, copy=False), probs)

    @classmethod
    def point(cls, token: int) -> Dist:
        """All the mass on one token: the q of a draft nobody sampled (a prediction's), so
        that rejection sampling keeps it with probability p(token)."""
        return cls(np.array([token], dtype=np.int32), np.ones(1))

    def to_dense(self, n_vocab: int) -> np.ndarray:
        dense = np.zeros(n_vocab, dtype=np.float64)
        dense[self.ids] = self.probs
        return dense

    def prob(self, token: int) -> float:
        """Probability of one token; 0.0 off the support."""
        i = int(np.searchsorted(self.ids, token))
        if i < self.ids.size and self.ids[i] == token:
            return float(self.probs[i])
        return 0.0

    def probs_at(self, tokens: np.ndarray) -> np.ndarray:
        """Probabilities of several tokens (any order); 0.0 off the support."""
        tokens = np.asarray(tokens)
        i = np.minimum(np.searchsorted(self.ids, tokens), self.ids.size - 1)
        return np.where(self.ids[i] == tokens, self.probs[i], 0.0)


class ThreadTokenData(threading.local):
    """One llama_token_data_array per thread and instance, grown to the longest row it has
    held (an instance per user: the grammar asks its questions in an array of its own)."""

    def __init__(self) -> None:
        self.array: TokenDataArray | None = None

    def get(self, size: int) -> TokenDataArray:
        if self.array is None or self.array.buf.size < size:
            self.array = TokenDataArray(size)
        return self.array


_token_data = ThreadTokenData()


# Rows up to this long go to llama.cpp's chain whole: filling the array costs less than
# the numpy passes there. Longer ones go through the top-k candidates first (~1 us per
# 1,000 tokens to fill, measured at 8k and 248k by benchmarks/sampling_cost.py).
CHAIN_ROW_MAX = 16384


@lru_cache(maxsize=4)
def _all_ids(n_vocab: int) -> np.ndarray:
    ids = np.arange(n_vocab, dtype=np.int32)
    ids.flags.writeable = False
    return ids


# A draw from a wide support finds its block of DRAW_BLOCK probabilities first, then the
# token inside it: np.cumsum does not vectorise (1.2 ms over 248k float64), block sums do.
DRAW_BLOCK = 1024


# Up to this many probabilities a draw walks them in Python: numpy's calls (~6 us for
# the walk) cost ten times the walk over the few candidates a filtered row keeps.
SHORT_DRAW = 32


def _inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The first index whose cumulative probability exceeds u times the total; never a
    zero-probability entry."""
    if probs.size <= SHORT_DRAW and probs.dtype == np.float64:
        # the same float64 sums in the same order as np.cumsum, so the same index
        values = probs.tolist()
        cums = list(itertools.accumulate(values))
        i = bisect.bisect_right(cums, u * cums[-1])
        if i >= len(cums):      # u * total rounded up to the total
            i = max(j for j, x in enumerate(values) if x > 0)
        return i
    cdf = np.cumsum(probs)
    # side="right" never lands on a zero-probability entry.
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if i >= probs.size:  # u * cdf[-1] rounded up to cdf[-1]
        i = int(np.flatnonzero(probs)[-1])
    return i


def draw(dist: Dist, rng: np.random.Generator) -> int:
    """Sample one token from dist by inverse CDF, consuming exactly one rng.random()."""
    u = rng.random()
    probs = dist.probs
    if probs.size == 1:
        return int(dist.ids[0])
    if probs.size <= 4 * DRAW_BLOCK:
        return int(dist.ids[_inverse_cdf(probs, u)])
    # The same inverse CDF in two steps: the block u falls in, then where in that block,
    # u rescaled to the block's own mass (equal to the one-step walk up to rounding).
    starts = np.arange(0, probs.size, DRAW_BLOCK)
    sums = np.add.reduceat(probs, starts)
    b = _inverse_cdf(sums, u)
    below = float(sums[:b].sum())
    inner = min(max((u * sums.sum() - below) / sums[b], 0.0), 1.0)
    return int(dist.ids[starts[b] + _inverse_cdf(probs[starts[b]: starts[b] + DRAW_BLOCK], inner)])


def sampled_dist(ctx: NativeContext, i: int) -> Dist:
    """The distribution a backend sampler chain (llama.cpp's filters and dist, run in the
    decode graph) built for batch row i of ``ctx``'s last decode: its candidates and their
    probabilities, which is all rejection sampling reads.

    A chain that cuts nothing by rank (temperature alone, or min_p alone, which zeroes
    probabilities in place) hands back no candidates: its probabilities then cover the
    whole vocabulary in token id order (llama.cpp's own fallback for the candidates)."""
    ids, probs = ctx.sampled_candidates(i), ctx.sampled_probs(i)
    if probs is None:
        raise NativeError(f"no backend-sampled probabilities for row {i}: is a sampler chain attached?")
    if ids is None:
        ids = np.arange(probs.size, dtype=np.int32)
    return Dist.from_sparse(ids, probs)


class History:
    """The token ids a generation has seen (prompt, then every emitted token), kept for
    the penalties; ``recent`` hands out the window they look back on."""

    def __init__(self, prompt, lookback: int) -> None:
        self.lookback = lookback              # 0: no penalties; -1: everything
        self.ids = np.asarray(prompt, dtype=np.int32).copy()
        self.n = self.ids.size

    def extend(self, tokens) -> None:
        if self.lookback == 0:
            return
        tokens = np.asarray(tokens, dtype=np.int32)
        if self.n + tokens.size > self.ids.size:
            grown = np.empty(max(2 * self.ids.size, self.n + tokens.size), dtype=np.int32)
            grown[: self.n] = self.ids[: self.n]
            self.ids = grown
        self.ids[self.n: self.n + tokens.size] = tokens
        self.n += tokens.size

    def recent(self, then=()) -> np.ndarray | None:
        """The window before a token that follows history and then ``then``; None without
        penalties. (The sampler cuts it to its last ``repeat_last_n``.)"""
        if self.lookback == 0:
            return None
        start = 0 if self.lookback < 0 else max(0, self.n - self.lookback)
        if len(then) == 0:
            return self.ids[start: self.n]
        return np.concatenate([self.ids[start: self.n], np.asarray(then, dtype=np.int32)])


@dataclass(frozen=True, eq=False)
class Sampler:
    """Sampling settings plus the generator that draws from them; build with make_sampler."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    rng: np.random.Generator
    repeat_penalty: float = DEFAULTS.repeat_penalty
    frequency_penalty: float = DEFAULTS.frequency_penalty
    presence_penalty: float = DEFAULTS.presence_penalty
    repeat_last_n: int = DEFAULTS.repeat_last_n
    path: SamplePath = "chain"
    logit_bias: LogitBias | None = None
    # llama.cpp's filters for the "chain" path; like ``rng``, one generation's own
    # (top_p keeps a sort buffer inside it)
    chain: SamplerChain | None = field(default=None, repr=False)
    # the same filters ending in llama.cpp's dist, seeded from a child of the seed: the
    # "chain" path's draw where only a token is wanted (``draws_natively``)
    draw_chain: SamplerChain | None = field(default=None, repr=False)
    # that child's seed, for a dist llama.cpp runs in the decode graph; None when the
    # generation is unseeded (fresh entropy). Never drawn from ``rng``, whose stream is
    # the same whichever path draws the tokens
    draw_seed: int | None = None
    # llama.cpp's infill sampler is in ``chain`` and ``draw_chain`` (DecodeParams.infill):
    # every distribution then goes through the chain, whatever the row's length
    infill: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def lookback(self) -> int:
        """How many past tokens the penalties read: 0 when they are off, -1 for all."""
        neutral = (self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0
                   and self.presence_penalty == 0.0)
        return 0 if neutral else self.repeat_last_n

    @property
    def adjusts(self) -> bool:
        """Whether the filters see another row than the decoded one (a logit bias or
        penalties): then no path may take the raw row's argmax or its distribution.
        llama.cpp's chains take a bias themselves (the draw chain: draws_natively; the
        graph's: backend_sampling.BackendChains); penalties keep a row on the host."""
        return self.logit_bias is not None or self.lookback != 0

    def argmaxes(self, rows: np.ndarray) -> np.ndarray:
        """The greedy token of each row [n, V] (or of one row [V]) where no penalties apply:
        the raw argmax, or the biased one (``biased_argmax``, no copy of the rows)."""
        if self.logit_bias is None:
            return np.atleast_2d(rows).argmax(axis=1)
        return biased_argmax(rows, self.logit_bias)

    def adjusted(self, logits: np.ndarray, recent: np.ndarray | None) -> np.ndarray:
        """The row the filters see: biased where a logit bias is set, then penalised when
        penalties are on and the window is given (llama.cpp's order)."""
        n = self.lookback
        penalise = n != 0 and recent is not None
        if self.logit_bias is None and not penalise:
            return logits
        # into a scratch row: the filters read it and hand out copies, never the row itself
        out = scratch.get("adjusted", logits.size, np.result_type(logits.dtype, np.float32))
        if self.logit_bias is not None:
            logits = bias_logits(logits, self.logit_bias, out=out)
        if not penalise:
            return logits
        window = recent if n < 0 else recent[-n:]
        return apply_penalties(logits, window, self.repeat_penalty, self.frequency_penalty,
                               self.presence_penalty, out=out)

    def argmax(self, logits: np.ndarray, recent: np.ndarray | None = None,
               mask: TokenMask | None = None) -> int:
        """The greedy token (ties -> lowest id): the raw row's argmax unless a logit bias
        or penalties apply, or a ``mask`` (a grammar state) allows only some tokens."""
        if mask is not None:
            mask = narrowing(mask)
        if mask is None and (self.lookback == 0 or recent is None):
            return int(self.argmaxes(logits)[0])
        logits = self.adjusted(logits, recent)
        if mask is not None:
            try:
                return constrained_argmax(logits, mask)
            except NothingToDraw as exc:
                return constrained_argmax(logits, ending(mask, exc))
        return int(np.argmax(logits))

    def dist(self, logits: np.ndarray, recent: np.ndarray | None = None,
             mask: TokenMask | None = None) -> Dist:
        """The filtered, renormalised distribution of one row of logits [V]; ``recent`` is
        the ids before the predicted token, for the penalties; ``mask`` the tokens a
        grammar allows, the only ones the filters then see."""
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
        logits = self.adjusted(logits, recent)
        if mask is not None:
            mask = narrowing(mask)
        try:
            return self._filtered(logits, mask)
        except NothingToDraw as exc:
            if mask is None:
                raise
            return self._filtered(logits, ending(mask, exc))

    def _filtered(self, logits: np.ndarray, mask: TokenMask | None) -> Dist:
        if self.is_greedy:
            # Every filter keeps the top token, so greedy is the argmax of the (biased,
            # penalised, allowed) row.
            top = np.argmax(logits) if mask is None else constrained_argmax(logits, mask)
            return Dist(np.array([top], dtype=np.int32), np.ones(1))
        ids = None if mask is None else constrained_support(logits, mask, self.top_k)
        if self.chain is not None:
            d = self._chain_dist(logits, ids)
            if d is not None:
                return d
        ids, x = (_all_ids(logits.size), logits) if ids is None else (ids, logits[ids])
        ids, x = apply_top_k(ids, x, self.top_k)
        ids, x = apply_top_p(ids, x, self.top_p)
        ids, x = apply_min_p(ids, x, self.min_p)
        return Dist(ids, softmax(x, self.temperature))

    def _chain_dist(self, logits: np.ndarray, ids: np.ndarray | None = None) -> Dist | None:
        """The distribution through llama.cpp's filters (over the candidates ``ids`` when
        given), or None where the numpy path is cheaper (a long row without top_k; the
        infill sampler has no numpy twin, so with it the chain takes the whole row)."""
        if ids is not None:
            x = logits[ids]
            finite_max(x)
        elif logits.size <= CHAIN_ROW_MAX:
            finite_max(logits)
            ids, x = None, logits
        else:
            cand = top_candidates(logits, self.top_k) if self.top_k else None
            if cand is not None:
                ids, x = cand, logits[cand]
            elif self.infill:
                finite_max(logits)
                ids, x = None, logits
            else:
                return None
        cur = _token_data.get(x.size)
        cur.set(x, ids)
        self.chain.apply(cur)
        kept = np.sort(cur.result()["id"])
        if kept.size == 1:      # certain: so is the infill sampler's end-of-text, which may be no candidate
            return Dist(kept, np.ones(1))
        # the float64 softmax of the row's own values: the numpy path's numbers, on the
        # support llama.cpp's filters kept
        return Dist(kept, softmax(logits[kept], self.temperature))

    def draws_natively(self, n_vocab: int, constrained: bool) -> bool:
        """Whether a row of which only the token is wanted (no drafts to judge against it)
        is drawn by ``draw_chain`` inside llama.cpp: ~9 us against ~32 for the distribution
        in numpy then ``draw`` (8k row, CPU). A logit bias is the chain's first sampler;
        not with penalties (``draw_chain`` has none: they need the history), a grammar's
        mask, or rows past CHAIN_ROW_MAX, where the numpy path first cuts the row to its
        top-k. H200, demo model, T=0.7 no-spec with a bias: 0.884x unbiased on the host's
        path (benchmarks/bias_cost.py)."""
        return (self.draw_chain is not None and not constrained and not self.lookback
                and n_vocab <= CHAIN_ROW_MAX)

    def sample(self, dist: Dist) -> int:
        return draw(dist, self.rng)

    def __call__(self, logits: np.ndarray, recent: np.ndarray | None = None) -> int:
        return self.sample(self.dist(logits, recent))


def make_sampler(
    temperature: float = DEFAULTS.temperature,
    top_k: int = DEFAULTS.top_k,
    top_p: float = DEFAULTS.top_p,
    min_p: float = DEFAULTS.min_p,
    seed: int | None = None,
    *,
    repeat_penalty: float = DEFAULTS.repeat_penalty,
    frequency_penalty: float = DEFAULTS.frequency_penalty,
    presence_penalty: float = DEFAULTS.presence_penalty,
    repeat_last_n: int = DEFAULTS.repeat_last_n,
    path: SamplePath = "chain",
    logit_bias: dict[int, float] | None = None,
    n_vocab: int | None = None,
    infill_vocab=None,
) -> Sampler:
    """A Sampler for these settings; temperature 0 is greedy. seed=None draws fresh entropy.
    ``path`` picks how a distribution is built (the module docstring); both give the same
    distribution up to ties and float32 rounding at a cut. A Sampler belongs to one thread.
    ``n_vocab`` (the model's) lets llama.cpp's draw chain take a ``logit_bias`` too; without
    it a biased sampler draws on the host, and a ``top_k`` at or past it is off (it keeps
    every token, as llama.cpp's host top_k does; its top_k in a decode graph aborts the
    process on a k past the row). ``infill_vocab`` (the model's ``llama_vocab``)
    adds llama.cpp's infill sampler after the filters (``DecodeParams.infill``): it runs
    on the chain path only, at temperature > 0."""
    check_temperature(temperature)
    check_top_k(top_k)
    if n_vocab is not None and top_k >= n_vocab and infill_vocab is None:
        top_k = 0
    check_top_p(top_p)
    check_min_p(min_p)
    check_repeat_penalty(repeat_penalty)
    check_frequency_penalty(frequency_penalty)
    check_presence_penalty(presence_penalty)
    check_repeat_last_n(repeat_last_n)
    bias = LogitBias.of(logit_bias)
    if bias is not None and n_vocab is not None:
        check_bans(int(np.count_nonzero(bias.values == -np.inf)), n_vocab)
    if path not in get_args(SamplePath):
        raise ValueError(f"path must be 'chain' or 'numpy', got {path!r}")
    if infill_vocab is not None and (path != "chain" or temperature == 0.0):
        raise ValueError("the infill sampler is llama.cpp's: it needs path='chain' and temperature > 0")
    chain = draw_chain = None
    seeds = np.random.SeedSequence(seed)
    rng = np.random.default_rng(seeds)      # the stream default_rng(seed) gives
    # a child of the seed, so ``rng``'s own draws stay those of the numpy path
    draw_seed = int(seeds.spawn(1)[0].generate_state(1)[0]) if temperature > 0.0 else None
    if path == "chain" and temperature > 0.0:
        if (top_k, top_p, min_p) != (0, 1.0, 0.0) or infill_vocab is not None:
            chain = filter_chain(top_k, top_p, min_p, temperature, infill_vocab=infill_vocab)
        if bias is None or n_vocab is not None:
            draw_chain = filter_chain(top_k, top_p, min_p, temperature, bias, n_vocab,
                                      infill_vocab=infill_vocab).add_dist(draw_seed)
    return Sampler(float(temperature), int(top_k), float(top_p), float(min_p),
                   rng, float(repeat_penalty), float(frequency_penalty),
                   float(presence_penalty), int(repeat_last_n), path, bias, chain, draw_chain,
                   None if seed is None else draw_seed, infill_vocab is not None)


def filter_chain(top_k: int, top_p: float, min_p: float, temperature: float,
                 bias: LogitBias | None = None, n_vocab: int | None = None, *,
                 infill_vocab=None) -> SamplerChain:
    """llama.cpp's chain for these filters, in llama-server's order (the module docstring),
    after ``bias`` where given (a draw from the raw row), with the infill sampler last
    before the temperature where ``infill_vocab`` is given; a filter at its neutral value
    is left out."""
    chain = SamplerChain()
    if bias is not None:
        chain.add_logit_bias(n_vocab, bias.ids, bias.values)
    if top_k > 0:
        chain.add_top_k(top_k)
    if top_p < 1.0:
        chain.add_top_p(top_p)
    if min_p > 0.0:
        chain.add_min_p(min_p)
    if infill_vocab is not None:
        chain.add_infill(infill_vocab)
    return chain.add_temp(temperature)
