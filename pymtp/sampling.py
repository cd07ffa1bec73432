"""Turn one row of logits into the distribution we sample from, and sample it.

A distribution is a sparse `Dist`: the token ids of its support (ascending) and their
probabilities (float64, summing to 1). Acceptance needs both the target's p and the
drafter's q in this form, so the sampler hands out the distribution, not only a token.

Order: penalties -> [grammar] -> top_k -> top_p -> min_p -> temperature. This is the order of llama.cpp's
default chain (`common_params_sampling::samplers`, common/common.h:263-273, built into a
chain at common/sampling.cpp:340-398; the other samplers in that default chain -- DRY,
top-n-sigma, typical-p, XTC -- are no-ops at their default values).
Following it gives a user comparing with llama-server the same distribution for the same
settings. Two consequences of that order are easy to miss:

- top_p and min_p look at the temperature-1 distribution. top_p renormalises over the
  top_k survivors, sorts, and keeps the shortest prefix whose mass reaches top_p, the
  token that crosses included (src/llama-sampler.cpp:1549-1602); min_p keeps logits
  >= max_logit + log(min_p) (src/llama-sampler.cpp:1749-1802).
- temperature only reshapes the survivors: the final softmax is over logits / temperature
  on the support the filters left (src/llama-sampler.cpp:265-291, then `dist` at :1150).

Our defaults disable every filter; llama-server's are top_k=40, top_p=0.95, min_p=0.05,
temperature=0.8 (common/common.h:232-238), so pass those to compare. Where we differ:
temperature 0 is greedy with ties going to the lowest id (llama.cpp keeps the first
maximum it meets), ties at a top_k or top_p cut also go to the lowest id, and top_p
weighs the nucleus in float64 where llama.cpp uses float32, which can move the cut only
when the cumulative mass lands within float32 rounding (~1e-7) of top_p.

A logit bias (OpenAI's `logit_bias`, llama.cpp's `logit_bias` sampler, which llama-server
puts first in its chain) adds each named token's bias to its logit in float32, before the
penalties: `bias_logits`. A bias of -inf bans the token.

Penalties (llama.cpp's `penalties` sampler, src/llama-sampler.cpp:2950-2980, first in its
chain): each token seen c > 0 times among the last `repeat_last_n` tokens before the one
being predicted (prompt included, as llama-server counts it; -1 looks at all of them) has
its logit divided by `repeat_penalty` (multiplied when <= 0), then lowered by
c * `frequency_penalty` + `presence_penalty`, in float32 as llama.cpp does. Greedy
decoding takes the argmax of the penalised row. The caller says which tokens came before
(`recent`): for speculative decoding that includes the drafts before the row, so every
row sees exactly the history plain decoding would.

Cost: a real vocabulary has 248,320 tokens, and a k=3 round asks for up to 7
distributions, so no step here sorts or copies a whole row in float64 when the filters
leave a few dozen tokens: top_k finds its cut among group maxima (`_top_indices`), top_p
on a short support sorts only that, and a draw from a full-vocabulary distribution walks
a blocked CDF (`draw`). benchmarks/sampling_cost.py measures each path.

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
- "numpy" is the pure numpy path above, the reference the tests hold the chain to.

At 8,192 tokens the chain costs ~0.03 ms a distribution against ~0.09 ms in numpy (a dozen
small numpy calls); at 248k both are bound by the one pass over the row.

llama.cpp's infill sampler (``DecodeParams.infill``, for code completion) goes after
min_p, before the temperature, on the chain path only: it has no numpy twin. In the
pinned llama.cpp it only chooses the support (its merged probabilities are recomputed by
dist from the logits), so a row's distribution is still the softmax of its own logits on
what the chain kept.

The grammar stage (constrained decoding, constraint.py) keeps only the tokens a grammar
state allows, before any filter, as llama.cpp's sampler does with its grammar applied first:
the constrained distribution is the filtered softmax over the allowed tokens. It reads the
state through a ``TokenMask`` (``allows(ids)``, ``allowed()``), so the policy here works on
hand-made sets too. Asking a grammar about a whole row is its dearest step (~1-2 ms at
8,192 tokens), so greedy asks about the best few candidates first (``constrained_argmax``)
and top_k about a few times k of them (``constrained_support``); the answer is the same.

Reproducibility: `Sampler.sample` (and `draw`) consume exactly one `rng.random()` per
call, whatever the support size, so the same seed and the same sequence of calls give the
same tokens (``draw_chain`` is seeded from a child of the seed, not from the generator).
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, Protocol, get_args

import numpy as np

from .config import (DEFAULTS, ParamError, check_frequency_penalty, check_logit_bias, check_min_p,
                     check_presence_penalty, check_repeat_last_n, check_repeat_penalty, check_temperature,
                     check_top_k, check_top_p)
from .native import NativeContext, NativeError, SamplerChain, TokenDataArray

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


class NothingToDraw(ValueError):
    """A row leaves no token to draw: its logits are all -inf once the request's grammar,
    bias and filters have had their say (a grammar whose every token the logit_bias
    bans, say), or hold NaN or +inf. The request's own doing: the server answers 400."""


def _finite_max(logits: np.ndarray) -> float:
    top = float(logits.max())  # NaN propagates through max
    if not math.isfinite(top):
        raise NothingToDraw("logits contain NaN or +inf, or are all -inf: nothing is left to draw (does the "
                            "logit_bias ban every token the grammar allows?)")
    return top


class _Scratch(threading.local):
    """Full-row work arrays, reused call after call (one set per thread). A fresh 1 MB
    array pays its page faults every time: on a 248k row that measured ~0.5 ms per array,
    ten times the pass that fills it. Nothing handed to a caller lives here."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int, dtype) -> np.ndarray:
        a = self.arrays.get(name)
        if a is None or a.size < size or a.dtype != dtype:
            a = self.arrays[name] = np.empty(size, dtype=dtype)
        return a[:size]


_scratch = _Scratch()


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


# --- logit bias: fixed amounts added to chosen tokens' logits ---------------------------

@dataclass(frozen=True, eq=False)
class LogitBias:
    """A request's logit_bias as arrays: distinct token ids and the bias each gets."""

    ids: np.ndarray        # [m] int64, ascending
    values: np.ndarray     # [m] float32
    # a bias that only lowers (ignore_eos's ban, say) leaves an unbiased argmax where it is
    # (``biased_argmax``): its ids as a set, for that test a token at a time
    lowers: bool = field(init=False, repr=False)
    members: frozenset = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lowers", bool((self.values <= 0).all()))
        object.__setattr__(self, "members", frozenset(self.ids.tolist()))

    @classmethod
    def of(cls, mapping: dict[int, float] | None) -> LogitBias | None:
        """None for no bias (or only zeros, which change nothing)."""
        check_logit_bias(mapping)
        pairs = sorted((int(t), float(b)) for t, b in (mapping or {}).items() if b != 0.0)
        if not pairs:
            return None
        return cls(np.array([t for t, _ in pairs], dtype=np.int64), np.array([b for _, b in pairs], dtype=np.float32))


def bias_logits(logits: np.ndarray, bias: LogitBias, out: np.ndarray | None = None) -> np.ndarray:
    """A copy of the row [V] (into ``out`` if given) with ``bias`` added, in float32 as
    llama.cpp's logit_bias sampler adds it (src/llama-sampler.cpp,
    ``llama_sampler_logit_bias_apply``). llama.cpp's own buffer stays as decoded."""
    logits = np.asarray(logits)
    if out is None:
        out = np.empty(logits.shape, dtype=np.result_type(logits.dtype, np.float32))
    np.copyto(out, logits)
    out[bias.ids] += bias.values.astype(out.dtype, copy=False)
    return out


def biased_argmax(rows: np.ndarray, bias: LogitBias) -> np.ndarray:
    """Each row's argmax [n] once ``bias`` is added, ties to the lowest id: what
    ``np.argmax(bias_logits(row, bias))`` gives, without copying the rows. A row's
    unbiased maximum bounds every id the bias leaves alone, so only it and the biased ids
    compete; a row whose raw top is itself biased is biased whole (a ban of the top).

    Why: greedy with a bias took every verify row through a biased copy, one row at a
    time (0.93-0.98x of an unbiased request's speed on an H200, demo model). A bias that
    only lowers needs less still: a row whose raw top it leaves alone keeps that top (the
    others only fell or stayed below it, ties after it), so only a row whose top it
    lowered is biased whole. ignore_eos bans the end tokens of every benchmark request:
    greedy plain decoding on an H200's host then paid ~0.1 ms a token for the general case.
    """
    rows = np.atleast_2d(rows)
    tops = rows.argmax(axis=1)
    if bias.lowers:
        for i, top in enumerate(tops.tolist()):
            if top in bias.members:
                tops[i] = np.argmax(bias_logits(rows[i], bias))
        return tops
    n = len(rows)
    at = np.arange(n)
    dtype = np.result_type(rows.dtype, np.float32)
    # the biased ids' values in float32, summed as bias_logits sums them
    x = rows[:, bias.ids].astype(dtype, copy=False) + bias.values.astype(dtype, copy=False)
    j = x.argmax(axis=1)
    best, raw = x[at, j], rows[at, tops].astype(dtype, copy=False)
    ids = bias.ids[j]
    out = np.where((best > raw) | ((best == raw) & (ids < tops)), ids, tops)
    for i in np.flatnonzero(np.isin(tops, bias.ids)):
        out[i] = np.argmax(bias_logits(rows[i], bias))
    return out


# --- penalties: a penalised copy of the row, the tokens before it given ----------------

def apply_penalties(logits: np.ndarray, recent: np.ndarray, repeat_penalty: float,
                    frequency_penalty: float, presence_penalty: float,
                    out: np.ndarray | None = None) -> np.ndarray:
    """A copy of the row [V] (into ``out`` if given; ``out`` may be the row itself) with
    every token of ``recent`` (the
    ids before the predicted one, already cut to the window) penalised as llama.cpp does,
    in float32 (or the row's wider dtype). llama.cpp's own buffer stays as decoded."""
    check_repeat_penalty(repeat_penalty)
    check_frequency_penalty(frequency_penalty)
    check_presence_penalty(presence_penalty)
    logits = np.asarray(logits)
    dtype = np.result_type(logits.dtype, np.float32)
    if out is None:
        out = np.empty(logits.shape, dtype=dtype)
    if out is not logits:      # a biased row in the scratch row is penalised where it lies
        np.copyto(out, logits)
    if len(recent) == 0:
        return out
    tokens, counts = np.unique(np.asarray(recent), return_counts=True)
    x = out[tokens]
    x = np.where(x <= 0, x * np.float32(repeat_penalty), x / np.float32(repeat_penalty))
    x -= counts.astype(np.float32) * np.float32(frequency_penalty) + np.float32(presence_penalty)
    out[tokens] = x
    return out


# --- filters: (ids [m], logits [m]) -> (ids [m'], logits [m']), ids stay ascending -----

# The top-n search splits a row into interleaved groups (values[j::G]) and takes the n-th
# largest group maximum: n groups hold a value at least that large, so the n-th largest
# value is too, and the candidates at or above it are all a partition needs to see. The
# groups are the columns of a [rows, G] view, whose max along axis 0 numpy streams once
# (~35 us at 248k, where a partition of the row takes ~2 ms). 128 values per group leave
# about 2,000 groups at 248k: top-40 tokens rarely share one, so few extra candidates.
GROUP_VALUES = 128


def _top_candidates(values: np.ndarray, n: int) -> np.ndarray | None:
    """Ascending indices holding the n largest values (and any tie at the cut), or None
    when the row is too short for the shortcut to pay."""
    rows = min(GROUP_VALUES, values.size // (4 * n))
    if rows < 8:
        return None
    groups = values.size // rows
    grid = values[: rows * groups].reshape(rows, groups)    # column g: group g
    maxima = grid.max(axis=0)       # the one pass over the whole row
    _finite_max(maxima)             # NaN propagates into its group's maximum
    floor = np.partition(maxima, groups - n)[groups - n]
    # Only groups whose maximum reaches the floor hold candidates: a few times n of them,
    # so gathering their columns costs far less than comparing the whole row.
    good = np.flatnonzero(maxima >= floor)
    r, c = np.nonzero(grid[:, good] >= floor)
    found = r * groups + good[c]
    tail = values[rows * groups:]   # shorter than a row of the grid
    if tail.size:
        if np.isnan(tail).any():
            raise ValueError("logits contain NaN")
        found = np.concatenate([found, rows * groups + np.flatnonzero(tail >= floor)])
    found.sort()
    return found


def _top_indices(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, ascending; ties at the cut go to lower indices."""
    if n >= values.size:
        return np.arange(values.size)
    cand = _top_candidates(values, n)
    if cand is not None and cand.size < values.size:
        return cand[_top_indices(values[cand], n)]
    # np.partition is O(m); argpartition alone would break ties at the cut arbitrarily.
    cut = np.partition(values, values.size - n)[values.size - n]
    above = np.flatnonzero(values > cut)
    at_cut = np.flatnonzero(values == cut)[: n - above.size]
    return np.sort(np.concatenate([above, at_cut]))


def apply_top_k(ids: np.ndarray, logits: np.ndarray, top_k: int):
    """Keep the top_k largest logits (ties -> lowest id). top_k=0 keeps all."""
    check_top_k(top_k)
    if top_k == 0 or top_k >= logits.size:
        return ids, logits
    keep = _top_indices(logits, int(top_k))
    if keep.size < top_k:  # NaN compares false to the cut, so it goes missing
        raise ValueError("logits contain NaN")
    return ids[keep], logits[keep]


# Rows up to this long go to llama.cpp's chain whole: filling the array costs less than
# the numpy passes there. Longer ones go through the top-k candidates first (~1 us per
# 1,000 tokens to fill, measured at 8k and 248k by benchmarks/sampling_cost.py).
CHAIN_ROW_MAX = 16384


# top_p on a long support buckets the row by logit into NUCLEUS_BINS equal bins below
# the top and counts them; a bin's tokens weigh between exp(-(j+1) w) and exp(-j w) each
# (w the bin width), which brackets the bins where the mass can reach top_p to a few, and
# only their tokens are sorted. A flat 248k row can have a 0.95-nucleus of 100k+ tokens,
# which a sort pays ~40 ms for; counting costs less than summing weights per bin
# (numpy's weighted bincount is ~6x slower than its plain one).
NUCLEUS_BINS = 8192


@lru_cache(maxsize=8)
def _bin_weights(span: float) -> tuple[np.ndarray, np.ndarray]:
    """The largest and smallest weight exp(logit - top) a token of each bin can have."""
    edges = np.exp(-(span / NUCLEUS_BINS) * np.arange(NUCLEUS_BINS + 1))
    return edges[:-1], edges[1:]


def apply_top_p(ids: np.ndarray, logits: np.ndarray, top_p: float):
    """Keep the shortest highest-probability prefix whose mass (temperature 1) reaches top_p."""
    check_top_p(top_p)
    if top_p >= 1.0 or logits.size <= 1:
        return ids, logits
    top = _finite_max(logits)
    if logits.size <= 1024:
        # A short support (after top_k, as in every common setting): sort it all.
        order = np.argsort(-logits, kind="stable")   # ties -> lower id
        weights = np.exp(logits[order].astype(np.float64) - top)
        n = int(np.searchsorted(np.cumsum(weights), top_p * weights.sum(), side="left")) + 1
        keep = np.sort(order[: min(n, order.size)])
        return ids[keep], logits[keep]
    # Every token with logit < top - span has probability < exp(-span), so together they
    # hold < m * exp(-span) <= 1 - top_p: the nucleus lies in bins 0..NUCLEUS_BINS-1 of
    # [top - span, top]; the rest share bin NUCLEUS_BINS. Each step streams the whole row
    # in float32 (gathering candidates first would cost as much: on a flat row nearly
    # every token is one).
    span = math.log(logits.size / (1.0 - top_p))
    f32, size = np.result_type(logits.dtype, np.float32), logits.size
    weights = np.subtract(logits, top, out=_scratch.get("weights", size, f32))
    scaled = np.multiply(weights, -NUCLEUS_BINS / span, out=_scratch.get("scaled", size, f32))
    np.minimum(scaled, NUCLEUS_BINS, out=scaled)
    bins = _scratch.get("bins", size, np.int32)
    np.copyto(bins, scaled, casting="unsafe")             # truncates: bin 0 holds the top
    np.exp(weights, out=weights)
    goal = top_p * float(weights.sum(dtype=np.float64))
    counts = np.bincount(bins, minlength=NUCLEUS_BINS + 1)[:NUCLEUS_BINS]
    most, least = _bin_weights(span)
    # The crossing bin lies in [lo, hi]; one bin of slack each way for float32 rounding
    # of a token's bin at an edge.
    lo = max(int(np.searchsorted(np.cumsum(counts * most), goal, side="left")) - 1, 0)
    hi = int(np.searchsorted(np.cumsum(counts * least), goal, side="left")) + 1
    keep = np.less(bins, lo, out=_scratch.get("mask", size, bool))
    # (a masked reduce, where=keep, measured 20x slower than multiply-then-sum)
    below = float(np.multiply(weights, keep, out=scaled).sum(dtype=np.float64))
    # The tokens of bins lo..hi, weighed in float64 in order (ties -> lower id).
    middle = np.less_equal(bins, hi, out=_scratch.get("mask2", size, bool))
    middle ^= keep                       # bins lo..hi: at most hi and not below lo
    middle = np.flatnonzero(middle)
    middle = middle[np.argsort(-logits[middle], kind="stable")]
    mass = below + np.cumsum(np.exp(logits[middle].astype(np.float64) - top))
    n = int(np.searchsorted(mass, goal, side="left")) + 1
    if n > middle.size:     # rounding left the bins short of top_p: cut nothing
        return ids, logits
    keep[middle[:n]] = True
    keep = np.flatnonzero(keep)
    return ids[keep], logits[keep]


def apply_min_p(ids: np.ndarray, logits: np.ndarray, min_p: float):
    """Keep tokens whose probability is >= min_p times the top token's."""
    check_min_p(min_p)
    if min_p == 0.0 or logits.size <= 1:
        return ids, logits
    keep = np.flatnonzero(logits >= _finite_max(logits) + math.log(min_p))
    return ids[keep], logits[keep]


# --- the grammar stage: the candidates a grammar state allows ------------------------

class TokenMask(Protocol):
    """Which token ids may come next (a grammar state, constraint.Mask; or a fixed set)."""

    def allows(self, ids: np.ndarray) -> np.ndarray:
        """[m] bool: which of ``ids`` (int32) are allowed."""

    def allowed(self) -> np.ndarray:
        """Every allowed id, ascending (int32)."""


class TokenSet:
    """A fixed set of allowed ids: a ``TokenMask`` that no parse state moves (tests, and a
    reference for the grammar's)."""

    def __init__(self, ids, n_vocab: int) -> None:
        self.ok = np.zeros(n_vocab, dtype=bool)
        self.ok[np.asarray(ids, dtype=np.int64)] = True

    def allows(self, ids: np.ndarray) -> np.ndarray:
        return self.ok[ids]

    def allowed(self) -> np.ndarray:
        return np.flatnonzero(self.ok).astype(np.int32)


# Candidates greedy decoding asks a grammar about before it asks about the whole row:
# the argmax first (allowed most of the time: ~10 us), then ever wider top-n sets.
ARGMAX_GROWTH = 16


def _narrowing(mask: TokenMask) -> TokenMask | None:
    """``mask``, or None where it allows every token just now (a reasoning budget that is
    only counting: reasoning_budget.BudgetMask), so the row is not asked about at all."""
    return None if getattr(mask, "allows_all", False) else mask


def _ending(mask: TokenMask, exc: NothingToDraw) -> TokenMask:
    """The grammar's own mask where ignore_eos's (constraint.Mask.keep_going) left no token
    to draw: it leaves the end tokens out while the grammar allows anything else, and the
    bias may have banned all else. The grammar's end then ends the text."""
    if not getattr(mask, "keep_going", False):
        raise exc
    return mask.ending()


def _no_token_allowed() -> NothingToDraw:
    """The request's grammar dead-ends (``root ::= "ab" [b-a]`` after "ab"): its own doing."""
    return NothingToDraw("the grammar allows no token here: every token of the vocabulary would break it")


def constrained_argmax(logits: np.ndarray, mask: TokenMask) -> int:
    """The argmax over the allowed tokens (ties -> lowest id), asking ``mask`` about the
    top 1, 16, 256 ... candidates: the best allowed among the top n is the best allowed
    of all, since every other token's logit is at most the n-th (and ties at the cut go
    to lower ids, as here)."""
    n = 1
    while True:
        cand = np.array([np.argmax(logits)]) if n == 1 else _top_indices(logits, n)
        good = cand[mask.allows(cand.astype(np.int32))]
        if good.size:
            best = int(good[np.argmax(logits[good])])
            _finite_max(logits[best:best + 1])      # an allowed token the bias bans is no token
            return best
        if n >= logits.size:
            raise _no_token_allowed()
        n *= ARGMAX_GROWTH


def constrained_support(logits: np.ndarray, mask: TokenMask, top_k: int = 0) -> np.ndarray:
    """Ascending ids of the allowed tokens the filters need to see: all of them, or with
    top_k > 0 the allowed ones among the top 4 * top_k candidates (at least 64) when that
    holds top_k of them, which then are the top_k allowed tokens of the whole row."""
    if top_k > 0:
        n = max(4 * top_k, 64)
        while n < logits.size:
            cand = _top_indices(logits, n).astype(np.int32)
            good = cand[mask.allows(cand)]
            if good.size >= top_k:
                return good
            n *= ARGMAX_GROWTH
    ids = mask.allowed()
    if ids.size == 0:
        raise _no_token_allowed()
    return ids


def _check_scaling(temperature: float, caller: str) -> None:
    # Not a parameter check (that is config.check_temperature): temperature 0 is greedy,
    # which never scales, so 0 here is a caller's mistake.
    if not 0.0 < temperature < math.inf:
        raise ValueError(f"{caller} needs a finite temperature > 0, got {temperature!r}")


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Scale logits by 1 / temperature, in float64."""
    _check_scaling(temperature, "apply_temperature")
    return logits.astype(np.float64) / temperature


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float64 softmax of logits / temperature, with max-subtraction.

    One float64 array, worked in place: on a 248k row every extra temporary costs about
    as much as the exp itself."""
    _check_scaling(temperature, "softmax")
    weights = np.subtract(logits, _finite_max(logits), dtype=np.float64)  # a new array
    if temperature != 1.0:
        weights /= temperature
    np.exp(weights, out=weights)
    weights /= weights.sum()
    return weights


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
        out = _scratch.get("adjusted", logits.size, np.result_type(logits.dtype, np.float32))
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
            mask = _narrowing(mask)
        if mask is None and (self.lookback == 0 or recent is None):
            return int(self.argmaxes(logits)[0])
        logits = self.adjusted(logits, recent)
        if mask is not None:
            try:
                return constrained_argmax(logits, mask)
            except NothingToDraw as exc:
                return constrained_argmax(logits, _ending(mask, exc))
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
            mask = _narrowing(mask)
        try:
            return self._filtered(logits, mask)
        except NothingToDraw as exc:
            if mask is None:
                raise
            return self._filtered(logits, _ending(mask, exc))

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
            _finite_max(x)
        elif logits.size <= CHAIN_ROW_MAX:
            _finite_max(logits)
            ids, x = None, logits
        else:
            cand = _top_candidates(logits, self.top_k) if self.top_k else None
            if cand is not None:
                ids, x = cand, logits[cand]
            elif self.infill:
                _finite_max(logits)
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
    if bias is not None and n_vocab is not None and np.count_nonzero(bias.values == -np.inf) >= n_vocab:
        # each path went its own way: llama.cpp's draw took a banned token, numpy's raised
        raise ParamError("logit_bias", f"logit_bias bans every token of the vocabulary ({n_vocab}), so nothing is "
                         "left to draw: leave at least one token unbanned (ignore_eos bans the end tokens too)")
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
