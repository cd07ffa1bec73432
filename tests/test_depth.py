"""Adaptive depth policy (pymtp/depth.py) on hand-made costs and acceptance rates."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pymtp.depth import (ARM_DECAY, ARM_MIN_TOKENS, CONTEND, EPOCH, EXPLORE_EVERY, Epochs, GAIN_DECAY, RECHECK_FIRST, RECHECK_MAX, Acceptance, Arms,
                         CostModel, Curve, Line, RoundTimes, expected_tokens, plan_depths, with_probes)


def curve(points: dict[int, float]) -> Curve:
    c = Curve()
    for r, s in points.items():
        c.observe(r, s)
    return c


def test_curve_interpolates_extrapolates_and_decays():
    c = curve({1: 1.0, 3: 2.0})
    assert c(0) == 0.0 and c(1) == 1.0 and c(2) == 1.5 and c(5) == 3.0
    c.observe(3, 3.0)                       # decayed, not replaced: 2 + 0.2 * (3 - 2)
    assert c(3) == pytest.approx(2.2)
    assert curve({4: 2.0})(2) == 1.0        # one point: proportional to rows
    with pytest.raises(ValueError, match="no measurement yet"):
        Curve()(1)
    with pytest.raises(ValueError, match="rows >= 1 and seconds > 0"):
        Curve().observe(0, 1.0)


def test_acceptance_updates_only_the_positions_a_round_tried():
    a = Acceptance([0.5, 0.5, 0.5, 0.5], decay=0.5)
    a.observe(drafted=3, accepted=1)        # 1 accepted, 2 rejected, 3 and 4 never judged
    assert a.rates == [0.75, 0.25, 0.5, 0.5]
    a.observe(drafted=2, accepted=2)        # both accepted; 3 was not drafted
    assert a.rates == [0.875, 0.625, 0.5, 0.5]
    assert a.gains() == [0.875, 0.875 * 0.625, 0.875 * 0.625 * 0.5, 0.875 * 0.625 * 0.25]
    with pytest.raises(ValueError):
        a.observe(drafted=1, accepted=2)


def test_expected_tokens_counts_the_bonus_token():
    assert expected_tokens([0.8, 0.64, 0.512], 0) == 1.0
    assert expected_tokens([0.8, 0.64, 0.512], 2) == pytest.approx(2.44)


def test_a_deep_draft_can_win_where_one_draft_loses():
    # a 4-row decode costs little more than a 2-row one (CPU matmuls), so k=1 < no-spec < k=3
    cost = CostModel(curve({1: 1.0, 2: 1.9, 3: 2.0, 4: 2.05}), curve({1: 0.05}))
    gains = Acceptance([0.8, 0.8, 0.8]).gains()
    assert plan_depths([gains], [3], cost) == [3]
    assert plan_depths([gains], [1], cost) == [0]            # capped at 1: not worth it


def test_no_drafts_when_rows_cost_what_they_emit():
    cost = CostModel(curve({1: 1.0, 2: 2.0}), curve({1: 0.1}))
    assert plan_depths([[0.9, 0.81, 0.73]], [3], cost) == [0]


def test_the_confident_sequence_drafts_and_the_unsure_one_does_not():
    cost = CostModel(curve({1: 1.0, 2: 1.1}), curve({1: 0.05, 2: 0.06}))
    sure, unsure = Acceptance([0.9] * 3).gains(), Acceptance([0.05] * 3).gains()
    ks = plan_depths([sure, unsure], [3, 3], cost)
    assert ks[0] == 3 and ks[1] == 0


def _brute(gains, limits, cost):
    best, arg = -1.0, None
    for ks in itertools.product(*(range(lim + 1) for lim in limits)):
        tokens = sum(expected_tokens(g, k) for g, k in zip(gains, ks))
        r = tokens / cost.round_seconds(list(ks))
        if r > best:
            best, arg = r, list(ks)
    return best, arg


def test_plan_matches_a_brute_force_search():
    """Exact for one sequence; for 2-4 sequences within 1% of the best plan."""
    rng = np.random.default_rng(0)
    worst = 1.0
    for case in range(300):
        n = 1 if case < 100 else int(rng.integers(2, 5))
        # increasing costs, from nearly flat (a GPU's few rows) to linear or worse
        per_row, bend, step = rng.uniform(0.01, 1.0), rng.uniform(0.6, 1.4), rng.uniform(0.02, 0.3)
        target = curve({r: 1.0 + per_row * (r - 1) ** bend for r in range(1, 4 * n + 2)})
        cost = CostModel(target, curve({m: step * (1 + 0.1 * (m - 1)) for m in range(1, n + 1)}),
                         Line.constant(float(rng.uniform(0, 0.5))))
        gains = [Acceptance(list(rng.uniform(0.05, 0.98, 3))).gains() for _ in range(n)]
        limits = [int(x) for x in rng.integers(0, 4, n)]
        ks = plan_depths(gains, limits, cost)
        assert all(0 <= k <= lim for k, lim in zip(ks, limits))
        best, arg = _brute(gains, limits, cost)
        got = sum(expected_tokens(g, k) for g, k in zip(gains, ks)) / cost.round_seconds(ks)
        if n == 1:
            assert ks == arg, (case, ks, arg)
        worst = min(worst, got / best)
    assert worst >= 0.99, worst


def test_probes_draft_after_a_run_of_idle_rounds():
    accs = [Acceptance([0.5] * 3), Acceptance([0.5] * 3)]
    seen = [with_probes([0, 2], accs, [3, 3], every=3) for _ in range(4)]
    assert seen == [[0, 2], [0, 2], [1, 2], [0, 2]]
    assert with_probes([0], [Acceptance([0.5])], [0], every=1) == [0]     # nothing to probe with


def test_probes_back_off_while_they_change_nothing():
    """Each probe that leaves the sequence at k=0 doubles the wait for the next (up to
    ``most``); a round the plan drafts in starts it over."""
    acc = Acceptance([0.5] * 3)
    probes = [i for i in range(1, 100) if with_probes([0], [acc], [3], every=3, most=12) == [1]]
    assert probes == [3, 9, 21, 33, 45, 57, 69, 81, 93]     # waits of 3, 6, 12, then 12
    with_probes([2], [acc], [3], every=3, most=12)          # the plan drafts: back to 3
    assert [with_probes([0], [acc], [3], every=3, most=12) for _ in range(3)] == [[0], [0], [1]]


def test_host_cost_is_a_constant_until_two_row_counts_are_seen():
    cost = CostModel(curve({1: 1.0}), curve({1: 0.1}), Line(decay=0.5))
    cost.observe_host(2, 0.4)
    cost.observe_host(2, -1.0)              # clock noise never makes it negative
    assert cost.host.per_row == 0.0 and cost.host.fixed == pytest.approx(0.2)
    assert cost.round_seconds([0]) == pytest.approx(1.2) and cost.host(9) == pytest.approx(0.2)


def test_host_cost_fits_a_per_row_slope_and_follows_it():
    line = Line(decay=0.3)
    for rows in [1, 4, 2, 5, 3] * 4:
        line.observe(rows, 0.5 + 0.25 * rows)       # judging each verify row costs 0.25
    assert line.per_row == pytest.approx(0.25) and line.fixed == pytest.approx(0.5)
    assert line(8) == pytest.approx(2.5)
    for rows in [1, 4, 2, 5, 3] * 30:
        line.observe(rows, 0.5 + 0.05 * rows)       # the text got cheaper to judge: it follows
    assert line.per_row == pytest.approx(0.05, rel=1e-3)
    for rows in [1, 4, 2, 5, 3] * 30:
        line.observe(rows, 2.0 - 0.1 * rows)        # a falling fit is noise: flat, never below 0
    assert line.per_row == 0.0 and line(50) > 0.0


def test_per_row_host_cost_makes_a_gpu_stop_short_of_its_limit():
    """A flat target (a GPU's few rows) drafts to its limit when the host costs nothing per
    row, and stops earlier once each verify row costs host time (sampling above T=0)."""
    flat = curve({r: 1.0 for r in range(1, 6)})
    gains = [Acceptance([0.9, 0.8, 0.7, 0.5]).gains()]
    free = CostModel(flat, curve({1: 0.02}), Line.constant(0.2))
    assert plan_depths(gains, [4], free) == [4]
    dear = Line(decay=0.5)
    for rows in (2, 5, 3, 4):
        dear.observe(rows, 0.2 + 0.3 * rows)
    assert plan_depths(gains, [4], CostModel(flat, curve({1: 0.02}), dear)) == [3]


def test_only_a_drafting_sequence_pays_its_catch_up():
    """The drafter's catch-up is part of a round that drafts, by the rows it decodes; a
    plain round (k=0) leaves them waiting and costs the target decode alone."""
    cost = CostModel(curve({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}), curve({1: 0.5}), Line.constant(0.0),
                     catch_up=curve({1: 0.5, 8: 1.0}))
    assert cost.round_seconds([0]) == 1.0
    assert cost.round_seconds([1]) == 1.5                              # one row, by default
    assert cost.round_seconds([3], pending=[8]) == 1.0 + 1.0 + 2 * 0.5
    assert cost.round_seconds([0, 2], pending=[8, 1]) == 1.0 + 0.5 + 0.5
    assert CostModel(curve({1: 1.0}), curve({1: 0.25})).round_seconds([1], pending=[2]) == \
        pytest.approx(2.0 + 0.5)                                       # no catch-up curve: chain steps'
    # on a GPU's flat target an MTP decode at half a target decode: k=1 at 0.4 acceptance
    # emits 1.4 tokens in 1.5 (0.93 a second) against no-spec's 1.0
    gains = Acceptance([0.4, 0.4, 0.4]).gains()
    gpu = CostModel(curve({r: 1.0 for r in range(1, 5)}), curve({1: 0.5}), Line.constant(0.0))
    assert plan_depths([gains], [3], gpu) == [0]
    cheap = CostModel(curve({r: 1.0 for r in range(1, 5)}), curve({1: 0.05}), Line.constant(0.0))
    assert plan_depths([gains], [3], cheap) == [2]
    assert plan_depths([gains], [3], cheap, pending=[40]) == [0]       # 40 rows to catch up: 2.0 s


def test_a_sequence_alone_is_priced_by_its_measured_rounds():
    """The parts say drafting is nearly free; one sequence's rounds took longer than the
    parts say (a CPU's caches cold after the MTP head's decode, say). A depth seen
    ``trusted`` times is priced by its rounds, others by the parts scaled by how far off
    they were; batches keep the parts."""
    flat = curve({r: 1.0 for r in range(1, 5)})
    cost = CostModel(flat, curve({1: 0.1}), Line.constant(0.0), solo=RoundTimes(decay=0.5, trusted=2))
    gains = Acceptance([0.8, 0.8, 0.8]).gains()
    assert plan_depths([gains], [3], cost) == [3]
    assert cost.modelled([3]) == pytest.approx(1.3)
    cost.solo.observe(3, 2.6, 1.3)
    assert cost.round_seconds([3]) == pytest.approx(1.5 * 1.3)      # seen once: the scaled parts
    cost.solo.observe(3, 2.6, 1.3)
    assert cost.round_seconds([3]) == pytest.approx(2.6)
    assert cost.round_seconds([0]) == pytest.approx(1.75)           # scale 1 -> 1.5 -> 1.75
    assert plan_depths([gains], [3], cost) == [2]        # priced 2.1 for 2.44 tokens: beats k=3's 2.6
    for k in (0, 1, 2, 3):                               # drafting rounds at 3x, plain ones as modelled
        for _ in range(2):
            cost.solo.observe(k, 3 * cost.modelled([k]) if k else 1.0, cost.modelled([k]))
    assert plan_depths([gains], [3], cost) == [0]
    assert cost.round_seconds([0, 1]) == cost.modelled([0, 1])


def test_a_sequence_alone_keeps_its_depth_unless_another_is_clearly_better():
    """Changing depth costs a GPU new CUDA graphs, which no round's price shows: a lone
    sequence moves only for SWITCH_GAIN more tokens a second."""
    cost = CostModel(curve({1: 1.0, 2: 1.0, 3: 1.0}), curve({1: 0.1}), Line.constant(0.0))
    gains = [0.5, 0.25]
    # k=1: 1.5 tokens in 1.1 s (1.364/s); k=2: 1.75 in 1.2 (1.458/s), 6.9% better
    assert plan_depths([gains], [2], cost) == [2]
    assert plan_depths([gains], [2], cost, start=[1]) == [2]
    close = CostModel(curve({1: 1.0, 2: 1.0, 3: 1.0}), curve({1: 0.1}), Line.constant(0.0),
                      catch_up=curve({1: 0.1}), solo=RoundTimes(trusted=1))
    close.solo.observe(2, 1.27, 1.2)      # now k=2 is 1.378/s: 1% better than k=1
    close.solo.observe(1, 1.1, 1.1)
    assert plan_depths([gains], [2], close) == [2]
    assert plan_depths([gains], [2], close, start=[1]) == [1]


def test_unmeasured_plain_rounds_are_run_in_a_block():
    acc = Acceptance([0.9] * 3)
    seen = [with_probes([3], [acc], [3], unmeasured_plain=[True], block=3)[0] for _ in range(EXPLORE_EVERY + 4)]
    assert seen[:EXPLORE_EVERY - 1] == [3] * (EXPLORE_EVERY - 1)
    assert seen[EXPLORE_EVERY - 1:] == [0, 0, 0, 3, 3]
    measured = Acceptance([0.9] * 3)
    assert {with_probes([3], [measured], [3], unmeasured_plain=[False])[0] for _ in range(200)} == {3}


GAINS = [0.9, 0.8, 0.6, 0.3]        # P(drafts 1..i+1 all accepted): 1.9, 2.7, 3.3, 3.6 tokens a round


def _ran(arms: Arms, rates: dict[int, float], n: int = 1, gains=GAINS) -> list[int]:
    """Run ``n`` requests of 100 rounds; at depth k they decode ``rates[k]`` tokens a
    second, drafts accepted as ``gains`` says. Returns the depths chosen, in order."""
    out = []
    for _ in range(n):
        k = arms.choose()
        tokens = 100 * (1 + sum(gains[:k]))
        arms.observe(k, round(tokens), tokens / rates[k], 100 if k else round(tokens),
                     [100] * k, [round(100 * g) for g in gains[:k]])
        out.append(k)
    return out


def test_arms_search_the_limit_then_plain_then_depths_that_could_beat_the_leader():
    # k=3 and k=2 each could beat the leader on the line from plain to the depth above
    # them, and did; k=1 could not beat k=2 and is never run
    arms = Arms(limit=4)
    rates = {0: 100, 1: 90, 2: 130, 3: 120, 4: 110}
    assert _ran(arms, rates, 5) == [4, 0, 3, 2, 2]
    assert arms.untried() is None and arms.leader() == 2
    assert {k: round(arms.rate(k), 6) for k in arms.round_s} == {k: rates[k] for k in (0, 2, 3, 4)}
    assert arms.seconds(1) == pytest.approx(arms.round_s[0] + (arms.round_s[2] - arms.round_s[0]) / 2)
    # plain decoding far ahead: no depth in between could catch it, two requests explore
    arms = Arms(limit=4)
    assert _ran(arms, {0: 100, 1: 60, 2: 65, 3: 70, 4: 70}, 5) == [4, 0, 0, 0, 0]
    assert set(arms.round_s) == {4, 0} and arms.untried() is None
    with pytest.raises(ValueError, match="depth 2 has no measured depth on both sides"):
        Arms(limit=4, round_s={4: 1.0}, gains=GAINS).rate(2)


def test_arms_price_a_depth_by_its_round_time_and_the_pooled_acceptance():
    """One easy text at k=3 (every draft accepted) moves the acceptance every depth is
    priced by a little, and k=3 stays behind plain decoding; its own tokens a second
    (4 tokens a round: 115 against plain's 100) would have put it ahead. A deeper draft
    never counts as likelier than the one before it."""
    arms = Arms(limit=3)
    assert _ran(arms, {0: 100, 1: 80, 2: 85, 3: 95}, 3) == [3, 0, 2]
    seconds = 100 * arms.round_s[3]                           # k=3's rounds cost what they did
    arms.observe(3, 400, seconds, 100, [100] * 3, [100] * 3)
    assert arms.gains == pytest.approx([0.9 + GAIN_DECAY * 0.1, 0.8 + GAIN_DECAY * 0.2, 0.6 + GAIN_DECAY * 0.4])
    assert arms.rate(3) == pytest.approx((1 + sum(arms.gains)) / 3.3 * 95)      # 99.0
    assert 400 / seconds > 110 and arms.leader() == 0
    assert Arms(limit=2, round_s={2: 1.0}, gains=[0.5, 0.7]).rate(2) == 2.0


def test_arms_recheck_the_runner_up_ever_less_while_the_leader_holds():
    arms = Arms(limit=2)
    rates = {0: 100, 1: 80, 2: 90}
    seq = _ran(arms, rates, 2 + RECHECK_FIRST + 1 + 2 * RECHECK_FIRST + 1)
    assert seq[:2] == [2, 0]
    # the leader (plain), then the runner-up (k=2) once, then twice the wait
    assert seq[2:] == [0] * RECHECK_FIRST + [2] + [0] * (2 * RECHECK_FIRST) + [2]
    assert arms.wait == 4 * RECHECK_FIRST
    for _ in range(20):
        _ran(arms, rates, arms.wait + 1)
    assert arms.wait == RECHECK_MAX
    # depths close behind the leader take turns, the one measured longest ago first: on a
    # machine whose speed drifts, only running them keeps their estimates current
    arms = Arms(limit=2)
    rates = {0: 100, 1: CONTEND * 100 + 1, 2: 99}
    seq = _ran(arms, rates, 3 + RECHECK_FIRST + 1 + 2 * RECHECK_FIRST + 1)
    assert seq == [2, 0, 1] + [0] * RECHECK_FIRST + [2] + [0] * (2 * RECHECK_FIRST) + [1]


def test_arms_follow_a_depth_that_takes_the_lead():
    arms = Arms(limit=1)
    _ran(arms, {0: 100, 1: 90}, 2 + RECHECK_FIRST)          # plain leads, k=1 waits its turn
    assert arms.choose() == 1
    _ran(arms, {0: 100, 1: 400})                             # the machine changed: k=1's rounds got cheap
    assert arms.rate(1) == pytest.approx(1.9 / (1.9 / 90 + ARM_DECAY * (1.9 / 400 - 1.9 / 90)))
    assert arms.leader() == 1 and arms.wait == RECHECK_FIRST and arms.choose() == 1


def test_arms_ignore_requests_too_short_to_time_and_refuse_unknown_depths():
    arms = Arms(limit=3)
    arms.observe(3, ARM_MIN_TOKENS - 1, 0.01, 10)
    arms.observe(3, 100, 0.0, 10)
    assert arms.round_s == {} and arms.choose() == 3
    with pytest.raises(ValueError, match=r"depth in 0..3, got 4"):
        arms.observe(4, 100, 1.0, 10)
    with pytest.raises(ValueError, match="draft limit >= 1"):
        Arms(limit=0)


def test_epochs_give_the_batch_one_depth_and_time_it_by_sequence_rounds():
    ep = Epochs(Arms(limit=2))
    assert ep.k == 2                                  # the limit first, as for one stream
    ep.tally(1.0, [])                                 # no auto sequence decoded: not a round of the epoch
    assert ep.rounds == 0
    for _ in range(EPOCH - 1):                        # 4 sequences, 2 drafts each, the first accepted
        ep.tally(0.01, [(2, 2, 1)] * 4)
    assert ep.k == 2 and ep.arms.round_s == {}
    ep.tally(0.01, [(2, 2, 1)] * 4)
    # a round of the batch is 4 sequence-rounds: 0.0025 s each, 1 + 1.0 + 0 tokens a round
    assert ep.arms.round_s == {2: pytest.approx(0.0025)} and ep.arms.gains == [1.0, 0.0]
    assert ep.arms.rate(2) == pytest.approx(2 / 0.0025)                 # 800 tokens a second
    assert ep.k == 0 and (ep.rounds, ep.tokens, ep.seq_rounds, ep.drafted_at) == (0, 0, 0, [])
    for _ in range(EPOCH):                             # plain: 4 tokens a round in 0.004 s
        ep.tally(0.004, [(1, 0, 0)] * 4)
    assert ep.arms.rate(0) == pytest.approx(1000) and ep.arms.leader() == 0
