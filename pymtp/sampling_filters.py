"""The row's transforms before a draw: logit bias, penalties, top_k, top_p, min_p and
temperature, each on (ids, logits) pairs whose ids stay ascending.

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
leave a few dozen tokens: top_k finds its cut among group maxima (`top_indices`), top_p
on a short support sorts only that, and a draw from a full-vocabulary distribution walks
a blocked CDF (`sampling.draw`). benchmarks/sampling_cost.py measures each path.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .config import (check_frequency_penalty, check_logit_bias, check_min_p, check_presence_penalty,
                     check_repeat_penalty, check_top_k, check_top_p)


class NothingToDraw(ValueError):
    """A row leaves no token to draw: its logits are all -inf once the request's grammar,
    bias and filters have had their say (a grammar whose every token the logit_bias
    bans, say), or hold NaN or +inf. The request's own doing: the server answers 400."""


def finite_max(logits: np.ndarray) -> float:
    top = float(logits.max())  # NaN propagates through max
    if not math.isfinite(top):
        raise NothingToDraw("logits contain NaN or +inf, or are all -inf: nothing is left to draw (does the "
                            "logit_bias ban every token the grammar allows?)")
    return top


class Scratch(threading.local):
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


scratch = Scratch()


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


def top_candidates(values: np.ndarray, n: int) -> np.ndarray | None:
    """Ascending indices holding the n largest values (and any tie at the cut), or None
    when the row is too short for the shortcut to pay."""
    rows = min(GROUP_VALUES, values.size // (4 * n))
    if rows < 8:
        return None
    groups = values.size // rows
    grid = values[: rows * groups].reshape(rows, groups)    # column g: group g
    maxima = grid.max(axis=0)       # the one pass over the whole row
    finite_max(maxima)             # NaN propagates into its group's maximum
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


def top_indices(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, ascending; ties at the cut go to lower indices."""
    if n >= values.size:
        return np.arange(values.size)
    cand = top_candidates(values, n)
    if cand is not None and cand.size < values.size:
        return cand[top_indices(values[cand], n)]
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
    keep = top_indices(logits, int(top_k))
    if keep.size < top_k:  # NaN compares false to the cut, so it goes missing
        raise ValueError("logits contain NaN")
    return ids[keep], logits[keep]


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
    top = finite_max(logits)
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
    weights = np.subtract(logits, top, out=scratch.get("weights", size, f32))
    scaled = np.multiply(weights, -NUCLEUS_BINS / span, out=scratch.get("scaled", size, f32))
    np.minimum(scaled, NUCLEUS_BINS, out=scaled)
    bins = scratch.get("bins", size, np.int32)
    np.copyto(bins, scaled, casting="unsafe")             # truncates: bin 0 holds the top
    np.exp(weights, out=weights)
    goal = top_p * float(weights.sum(dtype=np.float64))
    counts = np.bincount(bins, minlength=NUCLEUS_BINS + 1)[:NUCLEUS_BINS]
    most, least = _bin_weights(span)
    # The crossing bin lies in [lo, hi]; one bin of slack each way for float32 rounding
    # of a token's bin at an edge.
    lo = max(int(np.searchsorted(np.cumsum(counts * most), goal, side="left")) - 1, 0)
    hi = int(np.searchsorted(np.cumsum(counts * least), goal, side="left")) + 1
    keep = np.less(bins, lo, out=scratch.get("mask", size, bool))
    # (a masked reduce, where=keep, measured 20x slower than multiply-then-sum)
    below = float(np.multiply(weights, keep, out=scaled).sum(dtype=np.float64))
    # The tokens of bins lo..hi, weighed in float64 in order (ties -> lower id).
    middle = np.less_equal(bins, hi, out=scratch.get("mask2", size, bool))
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
    keep = np.flatnonzero(logits >= finite_max(logits) + math.log(min_p))
    return ids[keep], logits[keep]


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
    weights = np.subtract(logits, finite_max(logits), dtype=np.float64)  # a new array
    if temperature != 1.0:
        weights /= temperature
    np.exp(weights, out=weights)
    weights /= weights.sum()
    return weights
