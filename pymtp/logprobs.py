"""Log-probabilities of tokens under the target's distribution, from rows of raw logits.

What is reported, everywhere in pymtp: for a token at position i, log softmax of the
target's logits at position i-1, at temperature 1 and with no filter (top_k, top_p,
min_p) applied, which is what plain decoding of the same text computes and what OpenAI's
API and vLLM (its default ``raw_logprobs`` mode) report. It does not depend on how the
token was chosen: an accepted draft, a recovered or a bonus token (acceptance.py) and a
prompt token are all scored on the target's row for their position.

Arithmetic is float64 throughout: the float32 logits are widened, the normaliser is a
max-shifted log-sum-exp, and a logprob is ``logit - normaliser``. The same row gives the
same numbers bit for bit, whatever batch it came from, so equal logits give equal
logprobs. Ranking for the top alternatives is by logit, ties going to the lowest token
id (the greedy sampler's rule); the rank is the same as by logprob.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its logprob and the ``n`` most likely tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()    # (token id, logprob), most likely first


def log_normalizer(row: np.ndarray) -> float:
    """log(sum(exp(row))) of one row of logits, in float64 (max-shifted, so no overflow)."""
    x = np.asarray(row, dtype=np.float64)
    top = x.max()
    return float(top + np.log(np.exp(x - top).sum()))


def log_softmax(row: np.ndarray) -> np.ndarray:
    """The logprobs of every token of one row, float64."""
    return np.asarray(row, dtype=np.float64) - log_normalizer(row)


def top_n(row: np.ndarray, n: int) -> np.ndarray:
    """Ids of the ``n`` largest entries of ``row``, largest first, ties by lowest id.

    O(n_vocab): a partition finds the n-th largest value, and only entries at or above it
    are sorted (all of them, so that a tie at the cut goes to the lowest ids).
    """
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    n = min(n, row.size)
    kth = np.partition(row, row.size - n)[row.size - n]
    candidates = np.flatnonzero(row >= kth)
    order = np.lexsort((candidates, -row[candidates]))   # by value descending, then by id
    return candidates[order[:n]]


def score(row: np.ndarray, token: int, n: int) -> TokenLogprob:
    """``token`` scored on one row of logits, with the ``n`` most likely tokens (none for 0)."""
    norm = log_normalizer(row)
    top = tuple((int(t), float(row[t]) - norm) for t in top_n(row, n))
    return TokenLogprob(int(token), float(row[token]) - norm, top)


def score_rows(logits: np.ndarray, tokens, n: int) -> list[TokenLogprob]:
    """Score ``tokens[i]`` on row i of ``logits`` [>= len(tokens), n_vocab].

    Row by row, so that a row's numbers do not depend on the rows batched with it.
    """
    return [score(logits[i], t, n) for i, t in enumerate(tokens)]
