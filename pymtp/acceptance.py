"""Decide which drafted tokens to keep: pure functions over numpy arrays and `Dist`s.

Vocabulary (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv 2211.17192), used with exactly these meanings below:

- **accepted** token: a draft token the target keeps. Accepted tokens always form a
  prefix of the draft: the first refusal ends the round.
- **recovered** token: the token emitted at the first rejected position instead of the
  draft. Under rejection sampling it is sampled from the residual distribution
  norm(max(0, p - q)); under greedy acceptance it is the target's argmax there.
- **bonus** token: when every draft token is accepted, one more token taken from the
  target's distribution after the last draft (row k of the verify), for free.

So a round with k drafts emits `n_accepted` accepted tokens and one recovered or bonus
token: between 1 and k + 1 tokens. With k = 0 the single token counts as a bonus.

Here p_i is the target's distribution at draft position i (verify row i, the row whose
logits predict draft i) and q_i the drafter's. For stochastic decoding the drafter must
*sample* draft i from q_i (not take its argmax); that is what makes rejection sampling
lossless: every emitted token is distributed exactly as if the target had sampled it.

Randomness: each function takes the `np.random.Generator` to use and documents how many
`rng.random()` calls it makes, so a seeded run replays exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

from .sampling import Dist, draw


@dataclass(frozen=True)
class Verdict:
    """The outcome of one round: how many drafts were accepted and what comes next."""

    n_accepted: int                         # accepted drafts, a prefix of the draft
    next_token: int                         # the recovered or bonus token
    kind: Literal["recovered", "bonus"]

    def emitted(self, draft_tokens) -> list[int]:
        """The tokens this round emits: accepted drafts then the next token."""
        if not self.n_accepted:
            return [self.next_token]
        return [int(t) for t in draft_tokens[: self.n_accepted]] + [self.next_token]


def _check_lengths(k: int, n_draft_dists: int | None, n_target: int, what: str) -> None:
    if n_draft_dists is not None and n_draft_dists != k:
        raise ValueError(f"need one draft dist per draft token ({k}), got {n_draft_dists}")
    if n_target != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} {what} for {k} draft tokens, got {n_target}")


def greedy_accept(draft_tokens, target_argmax) -> Verdict:
    """Accept the longest prefix where the target's argmax equals the draft.

    draft_tokens: [k] ints. target_argmax: [k + 1] ints, the argmax of each verify row.
    The recovered token is the argmax at the first mismatch; the bonus is target_argmax[k].
    Uses no randomness.
    """
    draft = np.asarray(draft_tokens).reshape(-1)
    target = np.asarray(target_argmax).reshape(-1)
    k = draft.size
    _check_lengths(k, None, target.size, "target argmaxes")
    mismatch = np.flatnonzero(target[:k] != draft)
    if mismatch.size == 0:
        return Verdict(k, int(target[k]), "bonus")
    a = int(mismatch[0])
    return Verdict(a, int(target[a]), "recovered")


def residual(p: Dist, q: Dist) -> Dist | None:
    """norm(max(0, p - q)), or None when it is all zero (p <= q everywhere, i.e. p == q).

    max(0, p - q) vanishes wherever p does, so it lives on p's support: computing it
    there, with q looked up at p's ids, covers the union of the two supports.
    """
    if q.ids.size == p.ids.size and np.array_equal(q.ids, p.ids):
        q_at_p = q.probs  # same support (e.g. both unfiltered): skip the lookups
    else:
        q_at_p = q.probs_at(p.ids)
    weights = np.maximum(p.probs - q_at_p, 0.0)
    total = weights.sum()
    if total <= 0.0:
        return None
    return Dist(p.ids, weights / total)


def rejection_accept(
    draft_tokens,
    draft_dists: Sequence[Dist],
    target_dists: Sequence[Dist],
    rng: np.random.Generator,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1): lossless for temperature > 0.

    draft_tokens: [k] ints, draft i sampled from draft_dists[i] = q_i.
    target_dists: k + 1 Dists p_0..p_k (p_k gives the bonus).
    Draft i is accepted with probability min(1, p_i(x) / q_i(x)). At the first rejection
    the recovered token is sampled from norm(max(0, p_i - q_i)); if all are accepted the
    bonus token is sampled from p_k.
    Randomness: one rng.random() per examined draft, plus one for the next token.
    """
    draft = np.asarray(draft_tokens).reshape(-1)
    k = draft.size
    _check_lengths(k, len(draft_dists), len(target_dists), "target dists")
    for i in range(k):
        x = int(draft[i])
        p, q = target_dists[i], draft_dists[i]
        p_x, q_x = p.prob(x), q.prob(x)
        u = rng.random()
        if q_x <= 0.0:
            # Cannot happen when x was sampled from q. Such a draft carries no information,
            # so emit a fresh sample of p_i: that keeps the output distributed as the target.
            return Verdict(i, draw(p, rng), "recovered")
        if u * q_x < p_x:  # u < p(x) / q(x), without dividing
            continue
        # p_x < q_x here, so p - q is positive somewhere unless rounding ate it: then p == q
        # in all but name, and p itself is the right distribution.
        rest = residual(p, q)
        return Verdict(i, draw(rest if rest is not None else p, rng), "recovered")
    return Verdict(k, draw(target_dists[k], rng), "bonus")


def exact_match_accept(
    draft_tokens,
    target_dists: Sequence[Dist],
    rng: np.random.Generator,
) -> Verdict:
    """llama.cpp's rule (common/sampling.cpp:678-710); where the host's work outweighs the
    decode (small models on a GPU) it is the faster one, as each row is only drawn.

    At each position the target samples its own token from p_i; draft i is accepted only
    if the two are equal, and the sampled token at the first mismatch is the recovered
    token; if all match, the bonus is sampled from p_k. Lossless too, but it ignores q and
    so accepts less often than rejection_accept (sum_x p(x) q(x) against
    sum_x min(p(x), q(x)) per position).
    Randomness: one rng.random() per examined position, including the bonus.
    """
    draft = np.asarray(draft_tokens).reshape(-1)
    _check_lengths(draft.size, None, len(target_dists), "target dists")
    return exact_match_draws(draft, lambda i: draw(target_dists[i], rng))


def exact_match_draws(draft_tokens, sample_row: Callable[[int], int]) -> Verdict:
    """``exact_match_accept`` with the target's samples drawn by ``sample_row(i)``, a token
    from p_i (llama.cpp's own draw, or ``draw`` on a Dist); rows past the first mismatch
    are never asked for."""
    draft = np.asarray(draft_tokens).reshape(-1)
    k = draft.size
    for i in range(k):
        token = int(sample_row(i))
        if token != int(draft[i]):
            return Verdict(i, token, "recovered")
    return Verdict(k, int(sample_row(k)), "bonus")
