"""Acceptance rules: scripted outcomes, and statistical proof that sampling stays lossless."""

import math

import numpy as np
import pytest

from pymtp.acceptance import (
    Verdict,
    exact_match_accept,
    exact_match_draws,
    greedy_accept,
    rejection_accept,
    residual,
)
from pymtp.sampling import Dist, draw, make_sampler

D = Dist.from_dense


# --- greedy -------------------------------------------------------------------------

def test_early_mismatch():
    v = greedy_accept(np.array([5, 6, 7]), np.array([5, 9, 7, 8]))
    assert v == Verdict(n_accepted=1, next_token=9, kind="recovered")
    assert v.emitted([5, 6, 7]) == [5, 9]


def test_first_draft_rejected():
    assert greedy_accept([5, 6], [4, 6, 7]) == Verdict(0, 4, "recovered")


def test_all_accepted_gets_bonus():
    v = greedy_accept(np.array([5, 6, 7], dtype=np.int32), np.array([5, 6, 7, 8]))
    assert v == Verdict(n_accepted=3, next_token=8, kind="bonus")
    assert v.emitted([5, 6, 7]) == [5, 6, 7, 8]


def test_no_drafts_is_a_bonus_from_row_zero():
    assert greedy_accept(np.empty(0, dtype=np.int32), np.array([4])) == Verdict(0, 4, "bonus")


def test_lengths_are_checked():
    with pytest.raises(ValueError, match=r"k \+ 1 = 3"):
        greedy_accept([1, 2], [1, 2])
    with pytest.raises(ValueError, match="one draft dist per draft token"):
        rejection_accept([1, 2], [D([1, 1])], [D([1, 1])] * 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"k \+ 1 = 2"):
        exact_match_accept([1], [D([1, 1])], np.random.default_rng(0))


# --- rejection sampling, scripted ---------------------------------------------------

def test_equal_p_and_q_always_accepts():
    p = D([0.1, 0.2, 0.3, 0.4])
    for seed in range(200):
        rng = np.random.default_rng(seed)
        drafts = [draw(p, rng) for _ in range(3)]
        v = rejection_accept(drafts, [p] * 3, [p] * 4, rng)
        assert v.n_accepted == 3 and v.kind == "bonus"


def test_draft_where_p_is_zero_is_always_rejected():
    # Draft 2 has q = 0.4 and p = 0: reject. The residual max(0, p - q) is 0.4 on token 1
    # only, so the recovered token is 1, never the draft.
    p, q = D([0.6, 0.4, 0.0, 0.0]), D([0.6, 0.0, 0.4, 0.0])
    for seed in range(200):
        v = rejection_accept([2], [q], [p, p], np.random.default_rng(seed))
        assert v == Verdict(0, 1, "recovered")


def test_draft_where_p_exceeds_q_is_always_accepted():
    p, q = D([0.2, 0.8]), D([0.5, 0.5])
    for seed in range(200):
        assert rejection_accept([1], [q], [p, p], np.random.default_rng(seed)).n_accepted == 1


def test_accepts_with_probability_p_over_q():
    # p(x)/q(x) = 0.25/0.5: accepted iff the first uniform is < 0.5.
    p, q = D([0.25, 0.75]), D([0.5, 0.5])
    for seed in range(100):
        u = np.random.default_rng(seed).random()
        v = rejection_accept([0], [q], [p, D([0, 0, 1])], np.random.default_rng(seed))
        expected = Verdict(1, 2, "bonus") if u < 0.5 else Verdict(0, 1, "recovered")
        assert v == expected


def test_uniforms_consumed():
    # One per examined draft plus one for the next token: all 3 accepted -> 4 draws.
    p = D([0.1, 0.2, 0.3, 0.4])
    rng, replay = np.random.default_rng(9), np.random.default_rng(9)
    rejection_accept([3, 3, 3], [p] * 3, [p] * 4, rng)
    replay.random(4)
    assert rng.random() == replay.random()


def test_draft_outside_q_support_emits_a_sample_of_p():
    # A drafter bug (draft not sampled from q) must not crash or bias: emit p's own sample.
    p, q = D([0.0, 0.0, 1.0]), D([1.0, 0.0, 0.0])
    v = rejection_accept([1], [q], [p, p], np.random.default_rng(0))
    assert v == Verdict(0, 2, "recovered")


def test_residual_on_sparse_supports():
    p = Dist(np.array([0, 2, 5], dtype=np.int32), np.array([0.5, 0.3, 0.2]))
    q = Dist(np.array([2, 3, 5], dtype=np.int32), np.array([0.1, 0.6, 0.3]))
    r = residual(p, q)   # max(0, p - q) = {0: 0.5, 2: 0.2, 5: 0}, over 0.7
    assert r.ids.tolist() == [0, 2, 5]
    np.testing.assert_allclose(r.probs, [0.5 / 0.7, 0.2 / 0.7, 0.0], rtol=1e-12)
    assert residual(p, p) is None


def test_same_rng_seed_same_verdicts():
    p, q = D([0.1, 0.2, 0.3, 0.4]), D([0.4, 0.3, 0.2, 0.1])
    def run(seed):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(50):
            drafts = [draw(q, rng), draw(q, rng)]
            out.append(rejection_accept(drafts, [q, q], [p, p, p], rng))
        return out
    assert run(1) == run(1)
    assert run(1) != run(2)


# --- exact match, scripted ----------------------------------------------------------

def test_exact_match_keeps_drafts_equal_to_the_targets_samples():
    one = lambda t: D(np.eye(4)[t])  # noqa: E731 -- a one-point dist at token t
    rng = np.random.default_rng(0)
    assert exact_match_accept([1, 2], [one(1), one(2), one(3)], rng) == Verdict(2, 3, "bonus")
    assert exact_match_accept([1, 2], [one(1), one(0), one(3)], rng) == Verdict(1, 0, "recovered")


def test_exact_match_draws_asks_for_rows_up_to_the_first_mismatch():
    # The rows llama.cpp draws itself: a row past the first mismatch is never drawn.
    asked = []

    def row_tokens(tokens):
        def sample_row(i):
            asked.append(i)
            return tokens[i]
        return sample_row

    assert exact_match_draws([5, 6, 7], row_tokens([5, 9, 7, 8])) == Verdict(1, 9, "recovered")
    assert asked == [0, 1]
    asked.clear()
    assert exact_match_draws(np.array([5, 6], dtype=np.int32), row_tokens([5, 6, 2])) == Verdict(2, 2, "bonus")
    assert asked == [0, 1, 2]
    asked.clear()
    assert exact_match_draws([], row_tokens([4])) == Verdict(0, 4, "bonus")     # a round without drafts
    assert asked == [0]


# --- statistical: the emitted tokens follow the target ------------------------------
#
# A rule is lossless iff, drafting from q, the tokens it emits are distributed as p.
# Each check below is a chi-square goodness-of-fit test at the 0.001 level, with a fixed
# seed so it is deterministic. The same check is run on deliberately biased rules to show
# it is sharp enough to fail them.

N_ROUNDS = 20_000
P = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.00])  # target; token 7 impossible
Q = np.array([0.05, 0.25, 0.30, 0.10, 0.05, 0.10, 0.05, 0.10])  # draft; proposes token 7


def chi2_critical(dof, z=3.0902):
    """Wilson-Hilferty approximation of the chi-square quantile; z=3.09 is the 0.999 level."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


def fits(counts, probs):
    """True when counts pass a chi-square test against probs (cells with p = 0 must be empty)."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    if counts[probs == 0].any():
        return False
    live = probs > 0
    expected = counts.sum() * probs[live]
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    return stat < chi2_critical(int(live.sum()) - 1)


def accept_iff_p_at_least_q(draft_tokens, draft_dists, target_dists, rng):
    """Biased: accepts deterministically instead of with probability p/q."""
    for i, x in enumerate(draft_tokens):
        p, q = target_dists[i], draft_dists[i]
        if p.prob(x) < q.prob(x):
            return Verdict(i, draw(residual(p, q), rng), "recovered")
    return Verdict(len(draft_tokens), draw(target_dists[-1], rng), "bonus")


def recover_from_p(draft_tokens, draft_dists, target_dists, rng):
    """Biased: right acceptance test, but the recovered token comes from p, not the residual."""
    for i, x in enumerate(draft_tokens):
        p, q = target_dists[i], draft_dists[i]
        if rng.random() * q.prob(x) >= p.prob(x):
            return Verdict(i, draw(p, rng), "recovered")
    return Verdict(len(draft_tokens), draw(target_dists[-1], rng), "bonus")


def first_tokens(rule, p, q, seed=0):
    """The first emitted token of N_ROUNDS single-draft rounds, and the accepted count."""
    rng = np.random.default_rng(seed)
    drafts = rng.choice(len(q), size=N_ROUNDS, p=q)
    pd, qd = D(p), D(q)
    out, accepted = np.empty(N_ROUNDS, dtype=np.int64), 0
    for n, x in enumerate(drafts):
        v = rule([x], [qd], [pd, pd], rng)
        out[n] = x if v.n_accepted else v.next_token
        accepted += v.n_accepted
    return out, accepted


def test_rejection_sampling_emits_the_target_distribution():
    tokens, accepted = first_tokens(rejection_accept, P, Q)
    assert fits(np.bincount(tokens, minlength=8), P)
    # Lossless alone is easy (never accept); the acceptance rate must be sum min(p, q).
    rate, expected = accepted / N_ROUNDS, np.minimum(P, Q).sum()   # 0.68
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / N_ROUNDS)


@pytest.mark.parametrize("biased_rule", [accept_iff_p_at_least_q, recover_from_p])
def test_biased_rules_fail_the_same_check(biased_rule):
    tokens, _ = first_tokens(biased_rule, P, Q)
    assert not fits(np.bincount(tokens, minlength=8), P)


def test_exact_match_emits_the_target_distribution_but_accepts_less():
    def exact(draft_tokens, draft_dists, target_dists, rng):
        return exact_match_accept(draft_tokens, target_dists, rng)
    tokens, accepted = first_tokens(exact, P, Q)
    assert fits(np.bincount(tokens, minlength=8), P)
    rate, expected = accepted / N_ROUNDS, float(P @ Q)   # 0.1375 < 0.68
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / N_ROUNDS)


# Two-draft chain where the target's next-token distribution depends on the previous
# token: P1[a] is BASE_P rotated by a, Q1[a] is BASE_Q rotated by a + 3.
BASE_P = np.array([0.35, 0.25, 0.15, 0.10, 0.08, 0.05, 0.02, 0.00])
BASE_Q = np.array([0.10, 0.10, 0.30, 0.05, 0.20, 0.05, 0.10, 0.10])
P0, Q0 = P, Q
P1 = [D(np.roll(BASE_P, a)) for a in range(8)]
Q1 = [D(np.roll(BASE_Q, a + 3)) for a in range(8)]
JOINT = P0[:, None] * np.array([np.roll(BASE_P, a) for a in range(8)])  # [8, 8] p(a) p(b | a)


def first_pairs(rule, seed=0):
    """The first two emitted tokens of N_ROUNDS generations with two drafts per round."""
    rng = np.random.default_rng(seed)
    p0, q0 = D(P0), D(Q0)
    counts = np.zeros((8, 8), dtype=np.int64)
    for _ in range(N_ROUNDS):
        d1 = draw(q0, rng)
        d2 = draw(Q1[d1], rng)
        v = rule([d1, d2], [q0, Q1[d1]], [p0, P1[d1], P1[d2]], rng)
        emitted = v.emitted([d1, d2])
        if len(emitted) == 1:
            # Only a recovered token: the next round drafts after it, as the engine would.
            a = emitted[0]
            d = draw(Q1[a], rng)
            emitted += rule([d], [Q1[a]], [P1[a], P1[d]], rng).emitted([d])
        counts[emitted[0], emitted[1]] += 1
    return counts


def test_two_draft_chain_emits_the_target_joint_distribution():
    assert fits(first_pairs(rejection_accept), JOINT)


@pytest.mark.parametrize("biased_rule", [accept_iff_p_at_least_q, recover_from_p])
def test_two_draft_chain_check_fails_biased_rules(biased_rule):
    assert not fits(first_pairs(biased_rule), JOINT)


# Penalties make every row depend on the tokens before it, drafts included: verify row i
# must see the history and d_1..d_i, the drafter's q for d_{i+1} the same. Then the first
# two emitted tokens follow plain penalised sampling exactly; a row that forgets the
# drafts before it does not.
PENALTY_SAMPLER = make_sampler(temperature=0.9, top_k=5, repeat_penalty=1.3, frequency_penalty=0.4,
                               presence_penalty=0.6, repeat_last_n=3)
PROMPT = (0, 1)
TARGET_ROWS = np.array([[2.0, 1.5, 1.2, 1.0, 0.4, 0.0],     # target logits at generated position t
                        [1.0, 2.2, 0.3, 1.4, 0.9, 0.2],
                        [0.5, 0.5, 1.8, 0.2, 1.1, 0.7]], dtype=np.float32)
DRAFT_ROWS = np.array([[1.0, 2.0, 0.5, 1.5, 0.2, 0.8],      # the drafter's, deliberately off
                       [2.0, 0.1, 1.0, 0.3, 1.7, 0.4],
                       [0.2, 1.2, 0.8, 1.9, 0.6, 0.1]], dtype=np.float32)
_DISTS: dict = {}


def penalised_dist(rows, history) -> Dist:
    """The sampler's distribution at generated position len(history) - len(PROMPT)."""
    key = (id(rows), tuple(history))
    if key not in _DISTS:
        _DISTS[key] = PENALTY_SAMPLER.dist(rows[len(history) - len(PROMPT)], np.array(history))
    return _DISTS[key]


def penalised_pairs(forget_drafts=False, seed=0):
    """First two emitted tokens of N_ROUNDS speculative generations with two drafts per
    round; ``forget_drafts`` gives every verify row only the history before the round."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((6, 6), dtype=np.int64)
    for _ in range(N_ROUNDS):
        history, emitted = list(PROMPT), []
        while len(emitted) < 2:
            k = 2 - len(emitted)
            drafts, qs = [], []
            for i in range(k):
                qs.append(penalised_dist(DRAFT_ROWS, history + drafts))
                drafts.append(draw(qs[-1], rng))
            seen = (lambda i: history) if forget_drafts else (lambda i: history + drafts[:i])
            ps = [penalised_dist(TARGET_ROWS, seen(i)) for i in range(k + 1)]
            out = rejection_accept(drafts, qs, ps, rng).emitted(drafts)
            emitted += out
            history += out
        counts[emitted[0], emitted[1]] += 1
    return counts


def penalised_joint() -> np.ndarray:
    first = penalised_dist(TARGET_ROWS, list(PROMPT)).to_dense(6)
    return np.array([first[a] * penalised_dist(TARGET_ROWS, [*PROMPT, a]).to_dense(6) for a in range(6)])


def test_penalised_chain_emits_plain_penalised_sampling():
    joint = penalised_joint()
    assert np.count_nonzero(joint) > 12          # the chain is not trivial
    assert fits(penalised_pairs(), joint)


def test_penalised_chain_check_fails_rows_that_forget_the_drafts():
    assert not fits(penalised_pairs(forget_drafts=True), penalised_joint())
