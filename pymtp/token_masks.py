"""The grammar stage (constrained decoding, constraint.py) keeps only the tokens a grammar
state allows, before any filter, as llama.cpp's sampler does with its grammar applied first:
the constrained distribution is the filtered softmax over the allowed tokens. It reads the
state through a ``TokenMask`` (``allows(ids)``, ``allowed()``), so the policy here works on
hand-made sets too. Asking a grammar about a whole row is its dearest step (~1-2 ms at
8,192 tokens), so greedy asks about the best few candidates first (``constrained_argmax``)
and top_k about a few times k of them (``constrained_support``); the answer is the same.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .sampling_filters import NothingToDraw, finite_max, top_indices


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


def narrowing(mask: TokenMask) -> TokenMask | None:
    """``mask``, or None where it allows every token just now (a reasoning budget that is
    only counting: reasoning_budget.BudgetMask), so the row is not asked about at all."""
    return None if getattr(mask, "allows_all", False) else mask


def ending(mask: TokenMask, exc: NothingToDraw) -> TokenMask:
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
        cand = np.array([np.argmax(logits)]) if n == 1 else top_indices(logits, n)
        good = cand[mask.allows(cand.astype(np.int32))]
        if good.size:
            best = int(good[np.argmax(logits[good])])
            finite_max(logits[best:best + 1])      # an allowed token the bias bans is no token
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
            cand = top_indices(logits, n).astype(np.int32)
            good = cand[mask.allows(cand)]
            if good.size >= top_k:
                return good
            n *= ARGMAX_GROWTH
    ids = mask.allowed()
    if ids.size == 0:
        raise _no_token_allowed()
    return ids
