"""Turn one row of logits into the distribution we sample from, and sample it.

A distribution is a sparse `Dist`: the token ids of its support (ascending) and their
probabilities (float64, summing to 1). Acceptance needs both the target's p and the
drafter's q in this form, so the sampler hands out the distribution, not only a token.

Filter order: top_k -> top_p -> min_p -> temperature. This is the order of llama.cpp's
default chain (`common_params_sampling::samplers`, common/common.h:263-273, built into a
chain at common/sampling.cpp:340-398; the other samplers in that default chain --
penalties, DRY, top-n-sigma, typical-p, XTC -- are no-ops at their default values).
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

Reproducibility: `Sampler.sample` (and `draw`) consume exactly one `rng.random()` per
call, whatever the support size, so the same seed and the same sequence of calls give the
same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .config import DEFAULTS, check_min_p, check_temperature, check_top_k, check_top_p


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


def _finite_max(logits: np.ndarray) -> float:
    top = float(logits.max())  # NaN propagates through max
    if not math.isfinite(top):
        raise ValueError("logits contain NaN or +inf, or are all -inf")
    return top


# --- filters: (ids [m], logits [m]) -> (ids [m'], logits [m']), ids stay ascending -----

def _top_indices(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, ascending; ties at the cut go to lower indices."""
    if n >= values.size:
        return np.arange(values.size)
    # np.partition is O(m); argpartition alone would break ties at the cut arbitrarily.
    cut = np.partition(values, values.size - n)[values.size - n]
    above = np.flatnonzero(values > cut)
    at_cut = np.flatnonzero(values == cut)[: n - above.size]
    return np.sort(np.concatenate([above, at_cut]))


def _growing_pools(logits: np.ndarray, cand: np.ndarray):
    """Index pools for the top_p search: top 1024, 4096, ... of cand, cand, everything."""
    for n in (1024, 4096, 16384, 65536):
        if n < cand.size:
            yield cand[_top_indices(logits[cand], n)]
    yield cand
    yield np.arange(logits.size)


def apply_top_k(ids: np.ndarray, logits: np.ndarray, top_k: int):
    """Keep the top_k largest logits (ties -> lowest id). top_k=0 keeps all."""
    check_top_k(top_k)
    if top_k == 0 or top_k >= logits.size:
        return ids, logits
    keep = _top_indices(logits, int(top_k))
    if keep.size < top_k:  # NaN compares false to the cut, so it goes missing
        raise ValueError("logits contain NaN")
    return ids[keep], logits[keep]


def apply_top_p(ids: np.ndarray, logits: np.ndarray, top_p: float):
    """Keep the shortest highest-probability prefix whose mass (temperature 1) reaches top_p."""
    check_top_p(top_p)
    if top_p >= 1.0 or logits.size <= 1:
        return ids, logits
    top = _finite_max(logits)
    # The normaliser needs every token, but only through a sum: exp in the logits' own
    # dtype (float32, half the memory traffic of float64) and accumulate in float64.
    # The nucleus itself is weighed in float64 below.
    tail = np.subtract(logits, top, dtype=np.result_type(logits.dtype, np.float32))
    total = float(np.exp(tail, out=tail).sum(dtype=np.float64))
    # Every token with logit < top - span has probability < exp(-span), so together they
    # hold < m * exp(-span) <= 1 - top_p: the nucleus lies among the candidates.
    span = math.log(logits.size / (1.0 - top_p))
    cand = np.flatnonzero(logits >= top - span)
    # Sorting is the cost (tens of thousands of candidates on a real 250k row, while the
    # nucleus is usually far smaller), so sort the top 1024, 4096, ... then all of them,
    # stopping at the first pool that reaches top_p. The last pool is only for rounding.
    for pool in _growing_pools(logits, cand):
        order = pool[np.argsort(-logits[pool], kind="stable")]  # ties -> lower id
        mass = np.cumsum(np.exp(logits[order].astype(np.float64) - top)) / total
        n = int(np.searchsorted(mass, top_p, side="left")) + 1
        if n <= order.size:
            break
    keep = np.sort(order[: min(n, order.size)])
    return ids[keep], logits[keep]


def apply_min_p(ids: np.ndarray, logits: np.ndarray, min_p: float):
    """Keep tokens whose probability is >= min_p times the top token's."""
    check_min_p(min_p)
    if min_p == 0.0 or logits.size <= 1:
        return ids, logits
    keep = np.flatnonzero(logits >= _finite_max(logits) + math.log(min_p))
    return ids[keep], logits[keep]


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Scale logits by 1 / temperature, in float64."""
    # Not a parameter check (that is config.check_temperature): temperature 0 is greedy,
    # which never scales, so 0 here is a caller's mistake.
    if not 0.0 < temperature < math.inf:
        raise ValueError(f"apply_temperature needs a finite temperature > 0, got {temperature!r}")
    return logits.astype(np.float64) / temperature


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 softmax with max-subtraction."""
    weights = np.array(logits, dtype=np.float64)  # a copy: the steps below work in place
    weights -= _finite_max(weights)
    np.exp(weights, out=weights)
    weights /= weights.sum()
    return weights


@lru_cache(maxsize=4)
def _all_ids(n_vocab: int) -> np.ndarray:
    ids = np.arange(n_vocab, dtype=np.int32)
    ids.flags.writeable = False
    return ids


def draw(dist: Dist, rng: np.random.Generator) -> int:
    """Sample one token from dist by inverse CDF, consuming exactly one rng.random()."""
    u = rng.random()
    if dist.ids.size == 1:
        return int(dist.ids[0])
    cdf = np.cumsum(dist.probs)
    # side="right" never lands on a zero-probability entry.
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if i >= dist.ids.size:  # u * cdf[-1] rounded up to cdf[-1]
        i = int(np.flatnonzero(dist.probs)[-1])
    return int(dist.ids[i])


@dataclass(frozen=True, eq=False)
class Sampler:
    """Sampling settings plus the generator that draws from them; build with make_sampler."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    rng: np.random.Generator

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def dist(self, logits: np.ndarray) -> Dist:
        """The filtered, renormalised distribution of one row of logits [V]."""
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
        if self.is_greedy:
            # Every filter keeps the top token, so greedy is the argmax of the raw row.
            return Dist(np.array([np.argmax(logits)], dtype=np.int32), np.ones(1))
        ids, x = _all_ids(logits.size), logits
        ids, x = apply_top_k(ids, x, self.top_k)
        ids, x = apply_top_p(ids, x, self.top_p)
        ids, x = apply_min_p(ids, x, self.min_p)
        return Dist(ids, softmax(apply_temperature(x, self.temperature)))

    def sample(self, dist: Dist) -> int:
        return draw(dist, self.rng)

    def __call__(self, logits: np.ndarray) -> int:
        return self.sample(self.dist(logits))


def make_sampler(
    temperature: float = DEFAULTS.temperature,
    top_k: int = DEFAULTS.top_k,
    top_p: float = DEFAULTS.top_p,
    min_p: float = DEFAULTS.min_p,
    seed: int | None = None,
) -> Sampler:
    """A Sampler for these settings; temperature 0 is greedy. seed=None draws fresh entropy."""
    check_temperature(temperature)
    check_top_k(top_k)
    check_top_p(top_p)
    check_min_p(min_p)
    return Sampler(float(temperature), int(top_k), float(top_p), float(min_p),
                   np.random.default_rng(seed))
