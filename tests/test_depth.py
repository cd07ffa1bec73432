"""Adaptive depth policy (pymtp/depth.py) on hand-made request rates and acceptance."""

from __future__ import annotations

import sys
import threading

import pytest

from pymtp.depth import (ARM_DECAY, ARM_MIN_TOKENS, CONTEND, GAIN_DECAY, RECHECK_FIRST, RECHECK_GROWTH, RECHECK_SHARE,
                         SLOW_CLIP, Arms)
from pymtp.depth_batched import (AFTER_PROMPT, CUT_RATE, CUT_ROUNDS, EPOCH, PROBE, PROMPT_ROUNDS, RESHAPED, SETTLE, Epochs,
                                 Following, occupancy, occupancy_label)


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


def test_arms_offer_every_unmeasured_depth_while_exhaustive():
    """A calibration (Session.calibrate) prices every depth's rounds: where plain leads by
    far, the search rules k=1..3 out, an exhaustive one offers them from the limit down."""
    rates = {0: 100, 1: 60, 2: 65, 3: 70, 4: 70}
    arms = Arms(limit=4)
    assert _ran(arms, rates, 2) == [4, 0] and arms.untried() is None
    arms.exhaustive = True
    assert _ran(arms, rates, 3) == [3, 2, 1] and arms.untried() is None
    arms.exhaustive = False
    assert _ran(arms, rates, 1) == [0]


def test_arms_replace_a_calibrations_prices_with_a_requests_first_measure():
    """A calibration (Session.calibrate) that priced k=4 low on its own prompt: a
    request's first measure of k=4 replaces that price, and of the acceptance and prompt
    pass too; the second moves it ARM_DECAY of the way, as any does. Without the mark,
    the re-check's measure moves k=4 only part of the way, and plain keeps the lead."""
    def calibrated(texts: bool) -> Arms:
        arms = Arms(limit=4)
        _ran(arms, {0: 100, 1: 60, 2: 65, 3: 70, 4: 70}, 2, gains=[0.5, 0.3, 0.2, 0.1])   # k=4, plain
        arms.calibrated([4, 0], texts)
        return arms

    for mark in (True, False):
        arms = calibrated(mark)
        if not mark:
            arms.provisional, arms.provisional_texts = set(), False
        assert arms.leader() == 0 and arms.provisional == ({4, 0} if mark else set())
        real = {0: 100, 4: 150}                            # k=4 on real texts: 3.6 tokens a round
        tokens = 100 * (1 + sum(GAINS))
        arms.observe(4, round(tokens), tokens / real[4], 100, [100] * 4, [round(100 * g) for g in GAINS],
                     prompt_s=0.5)
        if mark:
            assert arms.round_s[4] == tokens / real[4] / 100 and arms.gains == pytest.approx(GAINS)
            assert arms.prompt_pass == 0.5 / round(tokens)
            assert arms.provisional == {0} and not arms.provisional_texts
            assert arms.leader() == 4
        else:
            assert arms.leader() == 0
    # a later measure decays as any does
    arms = calibrated(True)
    arms.observe(0, 100, 1.0, 100)
    arms.observe(0, 100, 0.5, 100)
    assert arms.round_s[0] == pytest.approx(0.01 - ARM_DECAY * 0.005)
    # texts stay the requests' where a request had drafted before the calibration
    arms = Arms(limit=4)
    _ran(arms, {0: 100, 1: 60, 2: 65, 3: 70, 4: 70}, 2)
    arms.calibrated([4, 0], texts=False)
    before = list(arms.gains)
    arms.observe(4, 100, 1.0, 50, [50] * 4, [50] * 4)
    assert arms.gains == pytest.approx([g + GAIN_DECAY * (1 - g) for g in before])


def test_arms_count_a_slow_request_at_most_slow_clip_times_its_depths_price():
    """A request that ran at half speed (the host busy elsewhere) moves its depth's price
    at most SLOW_CLIP of the way, a calibration's too; a fast one moves it all the way
    it would. Batched rounds are not clipped."""
    arms = Arms(limit=4)
    arms.observe(0, 100, 1.0, 100)                  # 0.01 s a round
    arms.observe(0, 100, 2.0, 100)                  # a request at half speed
    assert arms.round_s[0] == pytest.approx(0.01 + ARM_DECAY * (SLOW_CLIP - 1) * 0.01)
    arms.observe(0, 100, 0.5, 100)
    assert arms.round_s[0] == pytest.approx(0.01 * (1 + ARM_DECAY * (SLOW_CLIP - 1)) * (1 - ARM_DECAY)
                                            + ARM_DECAY * 0.005)
    # a calibration's price: the first request replaces it, clipped where slow
    for seconds, price in ((2.0, SLOW_CLIP * 0.01), (0.6, 0.006)):
        arms = Arms(limit=4)
        arms.observe(0, 100, 1.0, 100)
        arms.calibrated([0], texts=False)
        arms.observe(0, 100, seconds, 100)
        assert arms.round_s[0] == pytest.approx(price) and arms.provisional == set()
    batched = Arms(limit=4, by_rounds=True)
    batched.observe(0, 100, 1.0, 100)
    batched.observe(0, 100, 2.0, 100)
    assert batched.round_s[0] == pytest.approx(0.01 + ARM_DECAY * 0.01)


def test_arms_after_a_calibration_the_first_request_drafts_at_the_limit():
    """A calibration's prompt that accepts few drafts prices every depth under plain; the
    requests' texts accept more. The request after the calibration drafts at the limit
    and its acceptance replaces the calibration's, so the search goes on from the texts'
    prices: k=3, the fastest on them. Without the texts marked, plain keeps the lead for
    every request here, since a re-check of k=4 (0.56x of plain by the calibration's
    prices) waits dozens of requests."""
    cal_gains = [0.3, 0.2, 0.1, 0.05]

    def rates(gains) -> dict[int, float]:      # one machine: a round costs the same on any text
        return {k: (1 + sum(gains[:k])) / (0.01 + 0.00375 * k if k else 0.01) for k in range(5)}

    for texts in (True, False):
        arms = Arms(limit=4)
        assert _ran(arms, rates(cal_gains), 2, cal_gains) == [4, 0] and arms.untried() is None
        arms.calibrated([4, 0], texts)
        assert arms.probe_texts == texts
        ran = _ran(arms, rates(GAINS), 8)
        if texts:
            assert ran[:2] == [4, 3] and ran.count(3) >= 6 and arms.leader() == 3
            assert arms.gains[3] == pytest.approx(GAINS[3], abs=0.06)   # the texts', decayed since
            assert not arms.probe_texts and not arms.provisional_texts
        else:
            assert ran == [0] * 8 and arms.leader() == 0
    # the probe is part of the search: the leader's run of requests goes on after it
    arms = Arms(limit=4)
    _ran(arms, rates(cal_gains), 2, cal_gains)
    _ran(arms, rates(cal_gains), 3, cal_gains)
    since = arms.since
    arms.calibrated([], texts=True)
    assert _ran(arms, rates(cal_gains), 1, cal_gains) == [4]
    assert arms.since == since and arms.wait == RECHECK_FIRST


def _round10(ep: Epochs, accept: tuple[int, int]) -> int:
    """One round of 10 sequences at the depth in force (plain 10 ms, k=1 13.7, k=2 15):
    ``accept`` = (sequences whose first draft is accepted, ... whose first two are)."""
    k = ep.k
    first, both = accept
    steps = [(1 + (i < first) + (k > 1 and i < both), k, (i < first) + (k > 1 and i < both)) if k else (1, 0, 0)
             for i in range(10)]
    ep.tally({0: 0.010, 1: 0.0137, 2: 0.015}[k], steps)
    return k


def test_epochs_after_a_calibration_the_next_pick_drafts_at_the_limit_for_the_texts():
    """A batched calibration (Batcher.calibrate) whose prompt accepts few drafts prices
    plain ahead (k=2 933 tok/s, k=1 949, plain 1000); the requests' texts accept more
    (k=2 1800). After ``calibrated`` with texts, the bucket's next pick drafts the limit,
    its acceptance replaces the prompt's and k=2 leads; without, plain keeps the lead
    until a re-check, RECHECK_FIRST epochs on."""
    bucket = (occupancy(10), False)
    for texts in (True, False):
        ep = Epochs(limit=2)
        for _ in range(200):
            _round10(ep, (3, 1))
            if bucket in ep.arms and ep.arms[bucket].untried() is None:
                break
        arms = ep.arms[bucket]
        assert set(arms.round_s) == {0, 1, 2} and arms.leader() == 0 and arms.gains == [0.3, 0.1]
        for _ in range(SETTLE + 3):           # the calibration's last rounds, not a whole observation
            _round10(ep, (3, 1))
        assert ep.tallies                      # ... are dropped: the requests' first measure is theirs
        ep.calibrated(bucket, texts)
        assert ep.tallies == {} and ep.left == 0 and arms.provisional == {0, 1, 2}
        ran = [_round10(ep, (9, 8)) for _ in range(100)]
        if texts:
            # the first round ends the calibration's epoch; SETTLE rounds then pay for the change
            assert ran[1:1 + SETTLE + PROBE] == [2] * (SETTLE + PROBE)
            assert arms.gains[:2] == pytest.approx([0.9, 0.8]) and arms.leader() == 2
            assert not arms.probe_texts and ran[-EPOCH:] == [2] * EPOCH
        else:
            assert ran == [0] * 100 and arms.leader() == 0
    # a bucket the calibration did not price is left alone
    ep = Epochs(limit=2)
    ep.calibrated(bucket, True)
    assert ep.arms == {} and not ep.drafted()


def test_arms_guess_a_depth_above_a_drafting_one_at_that_ones_cost():
    """Between two measured drafting depths the guess is the lower one's seconds, not the
    line: past the first draft a GPU's verify rows get cheaper, and the line ruled out a
    k=3 that was the fastest drafting depth."""
    arms = Arms(limit=4, round_s={0: 1.0, 1: 4.0, 4: 5.0}, gains=GAINS)
    assert arms.seconds(2) == arms.seconds(3) == 4.0
    assert arms.seconds(2) < 4.0 + (5.0 - 4.0) / 3          # below the line from k=1 to k=4
    assert Arms(limit=4, round_s={0: 1.0, 4: 5.0}).seconds(3) == 4.0    # above plain: the line
    # plain leads (1 token in 1.0 s); k=1 and k=4 trail, and k=3 is guessed at k=1's cost:
    # 3.3 tokens in 4.0 s cannot beat plain's rate, while at 3.0 s it could
    assert arms.untried() is None
    arms.round_s[1] = 3.0
    assert arms.untried() == 3


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
    rates = {0: 100, 1: 80, 2: 95}       # k=2 close enough that RECHECK_SHARE does not lengthen its waits
    seq = _ran(arms, rates, 2 + RECHECK_FIRST + 1 + 2 * RECHECK_FIRST + 1)
    assert seq[:2] == [2, 0]
    # the leader (plain), then the runner-up (k=2) once, then twice the wait
    assert seq[2:] == [0] * RECHECK_FIRST + [2] + [0] * (2 * RECHECK_FIRST) + [2]
    assert arms.wait == 4 * RECHECK_FIRST
    for _ in range(20):
        _ran(arms, rates, arms.wait + 1)
    assert arms.wait == RECHECK_GROWTH * RECHECK_FIRST
    # depths close behind the leader take turns, the one measured longest ago first: on a
    # machine whose speed drifts, only running them keeps their estimates current
    arms = Arms(limit=2)
    rates = {0: 100, 1: CONTEND * 100 + 1, 2: 99}
    seq = _ran(arms, rates, 3 + RECHECK_FIRST + 1 + 2 * RECHECK_FIRST + 1)
    assert seq == [2, 0, 1] + [0] * RECHECK_FIRST + [2] + [0] * (2 * RECHECK_FIRST) + [1]


def test_arms_recheck_a_far_depth_too_when_none_is_close():
    """With no depth within CONTEND of the leader, the one measured longest ago runs: a
    depth put last by one bad measurement is not kept out for good."""
    arms = Arms(limit=2, round_s={0: 0.5, 1: 2.0, 2: 1.0}, gains=[0.1, 0.05])     # plain leads by far
    arms.last, arms.seen = {0: 3, 1: 1, 2: 2}, 3
    assert [round(arms.rate(k), 3) for k in range(3)] == [2.0, 0.55, 1.15]
    arms.since = arms.recheck_wait(1)
    assert arms.choose() == 1                      # not the best of the others (k=2): the stalest
    arms.since -= 1
    assert arms.choose() == 0


def test_arms_wait_the_longer_before_a_recheck_the_more_it_is_estimated_to_lose():
    """A re-check may lose at most RECHECK_SHARE of the time on the leader before it.
    One request at 1.15 tokens a second where the leader gives 2.0 takes 1.74 requests'
    time and loses 0.425 of it: 37 requests on the leader first; a far one waits
    RECHECK_GROWTH times the first wait at most, a close one the doubled wait only."""
    arms = Arms(limit=2, round_s={0: 0.5, 1: 2.0, 2: 1.0}, gains=[0.1, 0.05])
    assert RECHECK_SHARE == 0.02 and arms.wait == RECHECK_FIRST
    assert arms.recheck_wait(2) == round(2.0 / 1.15 * (1 - 1.15 / 2.0) / RECHECK_SHARE) == 37
    assert round(2.0 / 0.55 * (1 - 0.55 / 2.0) / RECHECK_SHARE) == 132 > RECHECK_GROWTH * RECHECK_FIRST
    assert arms.recheck_wait(1) == RECHECK_GROWTH * RECHECK_FIRST
    arms.round_s[2] = 1.15 / 1.9                         # 1.9 tokens a second: the leader's rate less 5%
    assert arms.recheck_wait(2) == RECHECK_FIRST
    # batched (Epochs): an observation is PROBE rounds, and a round at k=2 costs 1.9 at plain
    rounds = Arms(limit=2, round_s={0: 0.5, 1: 2.0, 2: 0.95}, gains=[0.2, 0.1], by_rounds=True)
    assert rounds.recheck_wait(2) == round(1.9 * (1 - 1.3 / 0.95 / 2.0) / RECHECK_SHARE) == 30


def test_arms_follow_a_depth_that_takes_the_lead():
    arms = Arms(limit=1)
    _ran(arms, {0: 100, 1: 95}, 2 + RECHECK_FIRST)          # plain leads, k=1 waits its turn
    assert arms.choose() == 1
    _ran(arms, {0: 100, 1: 400})                             # the machine changed: k=1's rounds got cheap
    assert arms.rate(1) == pytest.approx(1.9 / (1.9 / 95 + ARM_DECAY * (1.9 / 400 - 1.9 / 95)))
    assert arms.leader() == 1 and arms.wait == RECHECK_FIRST and arms.choose() == 1


def test_arms_price_the_drafters_prompt_pass_apart_from_a_depths_rounds():
    """A drafting request's prompt pass (its drafter's decode of the prompt's rows) costs
    what its prompt's length makes it: kept out of the depth's seconds a round, pooled
    over the drafting depths a decoded token, and charged to each of them alike; plain
    decoding pays none. Folded into the rounds, a long prompt priced its depth higher."""
    arms = Arms(limit=3)
    arms.observe(3, 330, 1.0, 100, [100] * 3, [90, 80, 60], prompt_s=0.033)
    assert arms.round_s == {3: 0.01} and arms.prompt_pass == pytest.approx(1e-4)
    arms.observe(0, 101, 1.0, 100)                      # a plain one: its own rounds, no pass
    assert arms.round_s[0] == 0.01 and arms.prompt_pass == pytest.approx(1e-4)
    arms.observe(3, 330, 1.0, 100, [100] * 3, [90, 80, 60], prompt_s=0.33)    # a prompt 10x longer
    assert arms.round_s[3] == pytest.approx(0.01)
    assert arms.prompt_pass == pytest.approx(1e-4 + ARM_DECAY * (1e-3 - 1e-4))
    assert arms.rate(1) == pytest.approx(1.9 / (arms.seconds(1) + 1.9 * arms.prompt_pass))
    tokens = 1 + 0.9 + 0.8 + 0.6
    assert arms.rate(3) == pytest.approx(tokens / (0.01 + tokens * arms.prompt_pass))
    assert arms.rate(0) == pytest.approx(100.0)
    # k=3's rounds give 3.3x plain's tokens a second, and a pass over long prompts takes
    # most of that back: plain decoding leads
    arms.observe(3, 330, 1.0, 100, [100] * 3, [90, 80, 60], prompt_s=10.0)
    assert 330 / 1.0 > 3 * 100 and arms.leader() == 0


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
    ep = Epochs(limit=2, k=2)                         # a search that starts at the limit, as one stream's
    assert ep.k == 2 and ep.left == PROBE
    ep.tally(1.0, [])                                 # no auto sequence decoded: not a round of the epoch
    assert ep.tallies == {} and ep.left == PROBE
    for _ in range(PROBE - 1):                        # 4 sequences, 2 drafts each, the first accepted
        ep.tally(0.01, [(2, 2, 1)] * 4)
    arms = ep.arms_for((occupancy(4), False))
    assert ep.k == 2 and arms.round_s == {}
    ep.tally(0.01, [(2, 2, 1)] * 4)
    # a round of the batch is 4 sequence-rounds: 0.0025 s each, 1 + 1.0 + 0 tokens a round
    assert arms.round_s == {2: pytest.approx(0.0025)} and arms.gains == [1.0, 0.0]
    assert arms.rate(2) == pytest.approx(2 / 0.0025)                 # 800 tokens a second
    assert ep.k == 0 and ep.tallies == {} and ep.left == PROBE
    # the first SETTLE rounds at a new depth pay for the change (the drafter catching up,
    # a new graph): not timed
    for _ in range(SETTLE):
        ep.tally(1.0, [(1, 0, 0)] * 4)
    assert ep.tallies == {} and ep.left == PROBE
    for _ in range(PROBE):                             # plain: 4 tokens a round in 0.004 s
        ep.tally(0.004, [(1, 0, 0)] * 4)
    assert arms.rate(0) == pytest.approx(1000) and arms.leader() == 0
    # k=1, on the line from plain to k=2, could beat plain (2 tokens in 0.00175 s): measured
    assert ep.k == 1 and ep.left == PROBE
    for _ in range(SETTLE + PROBE):                     # it cannot: 2 tokens in 0.0025 s
        ep.tally(0.01, [(2, 1, 1)] * 4)
    # the search is over: the leader runs a whole epoch
    assert arms.untried() is None and ep.k == 0 and ep.left == EPOCH and ep.settling


def test_epochs_probe_another_depth_for_a_few_rounds_and_ever_less_often():
    """Under load on a GPU a drafting depth loses to plain by far; measuring it for whole
    epochs, as the search and the re-checks once did, made auto 0.57x of plain."""
    ep = Epochs(limit=1, k=1)
    ran = []
    for _ in range(4000):
        ran.append(ep.k)
        ep.tally(0.004 if ep.k == 0 else 0.02, [(1 + ep.k, ep.k, ep.k)] * 8)   # plain 2.5x the rate
    assert ran[:2 * PROBE + SETTLE] == [1] * PROBE + [0] * (SETTLE + PROBE)   # the first SETTLE not timed
    runs, k, n = [], None, 0
    for d in ran:
        if d != k and k is not None:
            runs.append((k, n))
            n = 0
        k, n = d, n + 1
    # a re-check that loses by far ends after CUT_ROUNDS timed rounds
    probes = [n for d, n in runs[1:] if d == 1]
    assert len(probes) >= 2 and set(probes) == {SETTLE + CUT_ROUNDS}, runs
    # the first waits until it can lose at most RECHECK_SHARE of the time on plain before
    # it: 0.6 of a round 5x plain's, 150 observations of PROBE rounds (a few more by what the
    # probe measured it lost, its SETTLE rounds included); then twice as long, up to
    # RECHECK_GROWTH times the first wait
    leads = [n for d, n in runs[1:] if d == 0]
    assert 150 * PROBE <= leads[0] <= 155 * PROBE
    longest = RECHECK_GROWTH * ep.arms[(occupancy(8), False)].first_wait * PROBE
    assert all(min(1.9 * a, longest) <= b <= longest + 2 * PROBE for a, b in zip(leads, leads[1:len(probes)])), leads
    assert sum(d == 1 for d in ran) < 0.01 * len(ran)


def _probe_rounds(seconds: float) -> int:
    """Rounds of 8 sequences that a probe of k=1 (2 tokens a sequence in ``seconds``)
    runs, timed, after plain (1 token a sequence in 4 ms) led."""
    ep = Epochs(limit=1)
    for _ in range(PROBE):
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    assert ep.k == 1 and ep.settling == SETTLE
    for _ in range(SETTLE):
        ep.tally(1.0, [(2, 1, 1)] * 8, 8)
    n = 0
    while ep.k == 1:
        ep.tally(seconds, [(2, 1, 1)] * 8, 8)
        n += 1
    assert set(ep.arms[(occupancy(8), False)].round_s) == {0, 1}
    return n


def test_epochs_cut_a_probe_that_loses_by_far_and_not_one_close_behind():
    """Under load on the H100 a probe of k=4 ran 9 ms rounds for 0.6x plain's rate, and
    prompt rounds stretched its PROBE rounds to 69: one that far behind ends after
    CUT_ROUNDS rounds."""
    assert CUT_RATE == 0.75
    assert _probe_rounds(16 / 2000 / 0.8) == PROBE          # 0.8x plain's rate: measured in full
    assert _probe_rounds(16 / 2000 / 0.5) == CUT_ROUNDS     # 0.5x: cut


def test_epochs_wait_before_a_recheck_by_what_the_last_probe_of_it_lost():
    """The estimate from the rates misses what a probe pays besides its timed rounds
    (the drafter catching up on the plain epoch's prompts, the SETTLE rounds into and
    out of it). A probe's rounds, from its first through the SETTLE rounds after it,
    are priced against the leader's seconds a token, and its re-checks wait by that."""
    ep = Epochs(limit=1)
    full = (occupancy(8), False)
    for _ in range(PROBE):                             # plain: 8 tokens in 4 ms, 0.5 ms a token
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    assert ep.k == 1 and ep.span is not None and ep.span.lead == 0
    for _ in range(SETTLE):                            # the change costs 50 ms a round
        ep.tally(0.05, [(2, 1, 1)] * 8, 8)
    for _ in range(PROBE):                             # then 16 tokens in 10 ms: 0.8x plain's rate
        ep.tally(0.01, [(2, 1, 1)] * 8, 8)
    arms = ep.arms[full]
    assert ep.k == 0 and arms.probe_loss == {}          # still open: changing back is the probe's too
    # estimated from the rates alone: 2.5x a plain round for 0.8x its rate, 25 observations
    assert arms.recheck_wait(1) == max(RECHECK_FIRST * EPOCH // PROBE, 25) == 25
    for _ in range(SETTLE):
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    # 0.188 s for 176 tokens that plain makes in 0.088 s: 0.1 s lost, 156 observations of
    # PROBE plain rounds (0.032 s) at RECHECK_SHARE
    assert ep.span is None and arms.probe_loss == {1: pytest.approx(0.1)}
    assert arms.observed_s[0] == pytest.approx(PROBE * 0.004)
    assert arms.recheck_wait(1) == round(0.1 / 0.032 / RECHECK_SHARE) == 156
    ran = []
    while ep.k == 0:
        ran.append(ep.k)
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    assert 156 * PROBE <= len(ran) + SETTLE <= (156 + EPOCH // PROBE) * PROBE + SETTLE
    # a probe that takes the lead lost nothing; the loss decays like a round's seconds
    arms.lost(1, -0.5)
    assert arms.probe_loss[1] == pytest.approx(0.1 * (1 - ARM_DECAY))


def test_epochs_price_a_leaders_epoch_with_its_observations_a_probe_every_round(monkeypatch):
    """Pricing reads every depth's prompt rows: done every round, it was most of what a
    plain epoch's tally cost (two CPU threads, 8 sequences). A depth picked as the
    leader is priced with each observation (every PROBE rounds); a probe every round from
    CUT_ROUNDS on, so that one losing by far is cut early."""
    ep = Epochs(limit=1)
    for _ in range(PROBE):
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    calls = []
    real = Epochs._priced
    monkeypatch.setattr(Epochs, "_priced", lambda self, bucket: calls.append(self.k) or real(self, bucket))
    while ep.k == 1:     # the probe of k=1 at 0.8x plain's rate, not cut: priced every round from CUT_ROUNDS
        ep.tally(16 / 2000 / 0.8, [(2, 1, 1)] * 8, 8)
    assert calls == [1] * (PROBE - CUT_ROUNDS + 1 + 1)      # ... and once more for the pick
    assert ep.k == 0 and ep.leading
    calls.clear()
    for _ in range(SETTLE + EPOCH):
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    # the SETTLE rounds are not timed; then one pricing a PROBE of rounds, and the pick
    assert calls == [0] * (EPOCH // PROBE + 1)


def test_epochs_price_the_rounds_after_a_prompt_or_a_new_count_of_sequences_with_the_prompts():
    """On the H100 the decode round after one with prompt rows runs the decode's shape
    outside the CUDA graph: 3.4 ms where the rounds around it took 1.3 (demo model, 8
    sequences, --spec none), and rounds of 5-7 sequences, mostly right after one joined
    or left, 3.2 ms against 1.0. Counted as decode rounds, they priced whichever probe
    they fell in; they are what the load's churn costs."""
    assert AFTER_PROMPT == 1
    ep = Epochs(limit=1)
    ep.pick = lambda bucket: 0                        # plain throughout
    full = (occupancy(8), False)
    for _ in range(PROBE):
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    ep.tally(0.012, [(1, 0, 0)] * 8, 8, prompt_rows=100)
    ep.tally(0.0064, [(1, 0, 0)] * 8, 8)              # the round after it
    for _ in range(PROBE):
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    assert ep.arms[full].round_s == {0: pytest.approx(0.0005)}
    p = ep.prompts[0]
    assert (p.extra, p.rows, p.rounds) == (pytest.approx(0.008 + 0.0024), 100, 2)
    # a sequence leaves: the first RESHAPED rounds of 7 build and capture the new shape
    assert RESHAPED == 2
    for seconds in [0.0095] * RESHAPED + [0.0035] * PROBE:
        ep.tally(seconds, [(1, 0, 0)] * 7, 7)
    assert ep.arms[full].round_s == {0: pytest.approx(0.0005)}
    assert (p.extra, p.rows, p.rounds) == (pytest.approx(0.0104 + 2 * 0.006), 100, 4)


def test_epochs_charge_a_drafting_depth_at_least_plains_price_of_a_prompt_row():
    """Drafting adds to a prompt's rounds and takes nothing away: a drafting depth whose
    prompt rounds were measured cheaper than plain's is charged plain's price."""
    from pymtp.depth_batched import _Prompts
    ep = Epochs(limit=2)
    full = (occupancy(8), False)
    ep.prompts = {0: _Prompts(0.1, 1000, 5), 1: _Prompts(0.01, 1000, 5), 2: _Prompts(0.3, 1000, 5)}
    ep.load_rows, ep.load_tokens = 1000.0, 500.0
    assert ep.row_seconds(1) < ep.row_seconds(0) < ep.row_seconds(2)
    ep.pick(full)
    per_token = ep.arms[full].per_token
    assert per_token == {0: pytest.approx(2 * ep.row_seconds(0)), 1: pytest.approx(2 * ep.row_seconds(0)),
                         2: pytest.approx(2 * ep.row_seconds(2))}


def test_epochs_time_a_new_depth_from_its_third_round():
    """On a GPU the first round at a new depth decodes the new shape outside the CUDA
    graph and the second captures it (H100, demo model, 8 sequences, plain after
    drafting: 3.7-4.0 ms, 4.4-4.9, then 1.4-1.6). Counted, the second priced an 8-round
    probe of plain 25% over its cost."""
    ep = Epochs(limit=1, k=1)
    for _ in range(PROBE):
        ep.tally(0.008, [(2, 1, 1)] * 8, 8)
    assert ep.k == 0
    for seconds in [0.004, 0.0045] + [0.0015] * PROBE:
        ep.tally(seconds, [(1, 0, 0)] * 8, 8)
    assert ep.arms[(occupancy(8), False)].round_s[0] == pytest.approx(0.0015 / 8)


def test_occupancy_buckets_double():
    assert [occupancy(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    with pytest.raises(ValueError, match="at least one sequence"):
        occupancy(0)


def test_epochs_time_each_occupancy_apart_and_pick_anew_when_it_changes():
    """The end of a load (sequences finishing one by one) is timed apart from the full
    batch: a round of one sequence costs on a GPU about what a round of eight does, and
    counted with them it priced the depth of its epoch at several times its cost."""
    ep = Epochs(limit=2)
    full, alone = (occupancy(8), False), (occupancy(1), False)
    assert ep.k == 0                                  # a load's first rounds: plain
    for _ in range(PROBE):                            # full batch, plain
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    assert ep.k == 2 and ep.settling and set(ep.arms) == {full}     # then the limit
    for _ in range(SETTLE):                           # the change of depth: not timed
        ep.tally(1.0, [(1, 2, 0)] * 8, 8)
    for _ in range(PROBE // 2):                       # full batch at k=2: 0.96x plain's rate
        ep.tally(0.0125, [(3, 2, 2)] * 8, 8)
    ep.tally(0.0125, [(3, 2, 2)], 1)                  # the load ends: one sequence left
    # its own search, at plain: the full batch's has no leader yet
    assert ep.bucket == alone and ep.k == 0 and ep.left == PROBE and ep.settling
    # (the first rounds at a new count of sequences go with the load's churn: not timed here)
    assert (alone, 2) not in ep.tallies and ep.tallies[(full, 2)].rounds == PROBE // 2
    for _ in range(SETTLE):
        ep.tally(1.0, [(1, 0, 0)], 1)
    for _ in range(ARM_MIN_TOKENS):                   # one sequence, plain, until enough tokens to time
        ep.tally(0.002, [(1, 0, 0)], 1)
    assert ep.arms[alone].round_s == {0: pytest.approx(0.002)}
    # the acceptance is the texts': pooled over every occupancy
    assert ep.arms[alone].gains is ep.arms[full].gains
    # one sequence's search goes on with the limit, whose first SETTLE rounds pay for the change
    assert ep.k == 2 and ep.settling
    for _ in range(SETTLE):
        ep.tally(1.0, [(1, 2, 0)] * 8, 8)
    # the full batch back: k=2 goes on where it was, measured after PROBE rounds of it;
    # then plain leads (a change of bucket starts a probe: PROBE rounds after the first)
    for _ in range(PROBE + 1):
        ep.tally(0.0125, [(3, 2, 2)] * 8, 8)
    assert ep.k == 0 and ep.bucket == full
    assert ep.arms[full].round_s == {0: pytest.approx(0.0005), 2: pytest.approx(0.0125 / 8)}
    # a fixed-depth sequence in the round counts for the occupancy, not for the tokens
    for _ in range(SETTLE):
        ep.tally(1.0, [(1, 0, 0)] * 8, 8)
    ep.tally(0.004, [(1, 0, 0)] * 2, 8)
    assert ep.tallies[(full, 0)].seq_rounds == 2


def test_epochs_time_rounds_with_a_gap_in_the_seq_ids_apart():
    """llama.cpp decodes a batch whose seq ids have a gap in several ubatches: such a
    round of 7 sequences cost 4x one of 8 without on the H100, and a probe of plain that
    caught them made k=4 look faster."""
    ep = Epochs(limit=1, k=1)
    full, gapped = (occupancy(8), False), (occupancy(7), True)
    for _ in range(PROBE):
        ep.tally(0.008, [(2, 1, 1)] * 8, 8)              # k=1: 2 tokens in 1 ms a sequence
    for _ in range(SETTLE):                           # the change to plain
        ep.tally(1.0, [(1, 0, 0)] * 8, 8)
    for _ in range(PROBE // 2):
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)             # plain: 1 token in 0.5 ms
    for _ in range(RESHAPED + PROBE):                     # a sequence finished between two others
        ep.tally(0.028, [(1, 0, 0)] * 7, 7, gap=True)     # (the first RESHAPED rounds: the churn's)
    # timed in a bucket of their own: 4 ms a sequence-round, not in the full batch's plain
    assert ep.arms[gapped].round_s == {0: pytest.approx(0.004)} and ep.tallies[(full, 0)].rounds == PROBE // 2
    for _ in range(RESHAPED + PROBE // 2):                # the gap filled: plain goes on where it was
        ep.tally(0.004, [(1, 0, 0)] * 8, 8)
    assert ep.arms[full].round_s == {1: pytest.approx(0.001), 0: pytest.approx(0.0005)}
    assert ep.arms[full].leader() == 0 and ep.k == 0


def test_epochs_price_rounds_with_prompt_rows_apart_from_the_probe_that_caught_them():
    """A round that prefills a new prompt costs about ten times a decode round; counted in
    an 8-round probe of plain decoding, two of them made plain look slower than k=1, whose
    decode rounds cost 1.5x plain's a token. Priced apart, what they cost beyond their
    decoding, a prompt row, times the load's prompt rows a token, is charged to every
    token."""
    ep = Epochs(limit=1, k=1)
    full = (occupancy(8), False)
    for _ in range(PROBE):
        ep.tally(0.012, [(2, 1, 1)] * 8, 8)              # k=1: 2 tokens in 1.5 ms a sequence
    for _ in range(SETTLE):                              # the change to plain
        ep.tally(1.0, [(1, 0, 0)] * 8, 8)
    for i in range(PROBE + 4):                           # plain: 1 token in 0.5 ms, and two prompt rounds
        rows = 100 if i in (2, 5) else 0                 # (the AFTER_PROMPT round after each goes with it)
        ep.tally(0.04 if rows else 0.004, [(1, 0, 0)] * 8, 8, prompt_rows=rows)
    arms = ep.arms[full]
    assert arms.round_s == {1: pytest.approx(0.0015), 0: pytest.approx(0.0005)}
    assert arms.leader() == 0 and ep.k == 0
    # those two came before plain's own price: what they cost beyond it is unknown; the
    # next two are priced: 0.08 s for 16 sequence-rounds of plain (0.008 s) and 400 rows,
    # 0.18 ms a row, the pooled price too, which k=1 (no prompt round of its own) takes
    assert ep.prompts == {}
    for _ in range(2):
        ep.tally(0.04, [(1, 0, 0)] * 8, 8, prompt_rows=200)
    assert ep.row_seconds(0) == pytest.approx(0.00018) and ep.row_seconds(1) == pytest.approx(0.00018)
    # 600 prompt rows for 128 + 112 tokens
    per_token = 600 / 240 * 0.00018
    assert ep.estimates() == [(full, 0, pytest.approx(0.0005), pytest.approx(1 / (0.0005 + per_token))),
                              (full, 1, pytest.approx(0.0015), pytest.approx(2 / (0.0015 + 2 * per_token)))]
    # counted as decode rounds, the same two rounds price plain below k=1
    ep = Epochs(limit=1, k=1)
    for _ in range(PROBE):
        ep.tally(0.012, [(2, 1, 1)] * 8, 8)
    for _ in range(SETTLE):
        ep.tally(1.0, [(1, 0, 0)] * 8, 8)
    for i in range(PROBE):
        ep.tally(0.04 if i in (2, 5) else 0.004, [(1, 0, 0)] * 8, 8)
    assert ep.arms[full].leader() == 1


def test_epochs_book_prompt_rounds_by_depth_and_keep_their_price_bounded():
    """The drafter's catch-up of a prompt comes in the round after its last chunk, with
    one sequence more decoding: booked by bucket, it fell where no prompt rows were, and
    that bucket's price of a prompt row grew with every such round."""
    ep = Epochs(limit=1, k=1)
    ep.pick = lambda bucket: 1                          # depth 1 throughout
    four, five = (occupancy(4), False), (occupancy(5), False)
    for bucket in (four, five):
        ep.arms_for(bucket).round_s[1] = 0.001
    ep.tally(0.104, [(2, 1, 1)] * 4, 4, prompt_rows=300)       # a last chunk: 0.1 s beyond its 4 decodes
    ep.tally(0.025, [(2, 1, 1)] * 5, 5, drafter_prompt=True)   # its catch-up: 0.02 s beyond 5
    assert set(ep.prompts) == {1} and ep.prompts[1].rows == 300
    assert ep.row_seconds(1) == pytest.approx(0.12 / 300)
    for _ in range(5000):                                       # catch-ups alone: cost, no rows
        ep.tally(0.025, [(2, 1, 1)] * 5, 5, drafter_prompt=True)
    assert ep.prompts[1].rounds <= 2 * PROMPT_ROUNDS and ep.row_seconds(1) < 0.1


def _load(ep: Epochs, rounds: int, steady: dict[int, float], prompt: dict[int, float], every: int = 5) -> list[int]:
    """Rounds of 8 sequences at the depth in force: at depth k a round emits k + 1 tokens
    a sequence (every draft accepted) in ``steady[k]`` seconds, and every ``every``-th
    round also prefills 100 prompt rows, in ``prompt[k]``. Returns the depths run."""
    ran = []
    for i in range(rounds):
        k = ep.k
        rows = 100 if i % every == every - 1 else 0
        ep.tally(prompt[k] if rows else steady[k], [(k + 1, k, k)] * 8, 8, prompt_rows=rows)
        ran.append(k)
    return ran


def test_epochs_charge_a_depth_what_its_own_prompt_rounds_cost():
    """On the H100 a prompt chunk beside drafting sequences splits the batch in ubatches
    that run outside the CUDA graph: 12 ms where beside plain ones it cost 0.6-4.7. A
    depth whose decode rounds are faster a token can lose by its prompt rounds."""
    ep = Epochs(limit=1)
    full = (occupancy(8), False)
    ran = _load(ep, 400, steady={0: 0.004, 1: 0.006}, prompt={0: 0.012, 1: 0.05})
    arms = ep.arms[full]
    assert arms.round_s == {0: pytest.approx(0.0005), 1: pytest.approx(0.00075)}
    assert ep.row_seconds(1) > 2 * ep.row_seconds(0)
    assert arms.leader() == 0 and sum(k == 0 for k in ran[-200:]) > 150
    arms.per_token = {}                                  # by its decode rounds alone k=1 would lead
    assert arms.leader() == 1
    # where every depth's prompt rounds cost alike, the decode rounds decide
    ep = Epochs(limit=1)
    ran = _load(ep, 400, steady={0: 0.004, 1: 0.006}, prompt={0: 0.05, 1: 0.05})
    assert ep.arms[full].leader() == 1 and sum(k == 1 for k in ran[-200:]) > 150


def test_occupancy_labels_name_the_sequences_of_a_bucket():
    assert [occupancy_label(b) for b in range(5)] == ["1", "2", "3-4", "5-8", "9-16"]
    assert all(occupancy(int(occupancy_label(b).split("-")[-1])) == b for b in range(8))


def test_a_new_bucket_measures_the_nearest_searched_buckets_leader_first():
    """The end of a load passes through buckets for a few rounds each: they run what led
    where the batch was full, not the limit."""
    ep = Epochs(limit=2)
    full = (occupancy(8), False)
    for k, seconds in ((2, 0.02), (0, 0.004)):            # k=2 2x plain's cost a token: plain leads
        ep.arms_for(full).observe(k, 100, seconds * PROBE, 8 * PROBE, [8 * PROBE] * k, [4 * PROBE] * k)
    assert ep.arms[full].untried() is None and ep.arms[full].leader() == 0
    assert ep.pick((occupancy(7), True)) == 0 and ep.pick((occupancy(3), False)) == 0
    assert Epochs(limit=2).pick(full) == 0                  # nothing searched yet: plain
    ep.arms_for(full).round_s = {0: 1.0, 2: 0.001}          # a leader that drafts
    assert ep.pick((occupancy(1), False)) == 2


def test_following_drafts_the_leaders_depth_from_its_next_round_and_measures_nothing():
    """An engine beside another (``--engines``) drafts the depth the first engine's epochs
    pick: taken when one of its own rounds is tallied, so a round in flight keeps its
    depth; its rounds change none of the leader's measurements, and what it reports
    measured is the leader's."""
    leader = Epochs(3, k=1)
    follower = Following(leader)
    assert follower.k == 1
    leader.k = 3
    assert follower.k == 1
    follower.tally(0.01, [(2, 3, 1)], 1, False, 0, False)
    assert follower.k == 3
    assert leader.tallies == {} and leader.arms == {} and leader.decoded == 0
    leader.tally(0.01, [(2, 3, 1)])
    assert follower.arms is leader.arms and follower.estimates() == leader.estimates()


def test_a_leader_buckets_its_rounds_by_the_sequences_decoding_in_every_engine():
    """Engines share the device, so the leader's round is bucketed by its sequences and
    its followers' latest rounds' (``Epochs.sharing``): one sequence of its own beside
    a follower decoding two is a round of three; an idle follower adds none, and a
    closed one no more."""
    leader = Epochs(1)
    follower = Following(leader)
    follower.launched(2)
    for _ in range(PROBE):
        leader.tally(0.01, [(1, 0, 0)], 1)
    assert [b for b, _ in leader.tallies] == [(occupancy(3), False)]
    follower.launched(0)
    leader.tally(0.01, [(1, 0, 0)], 1)
    assert leader.bucket == (occupancy(1), False)
    follower.launched(2)
    follower.leave()                 # its engine closed
    assert leader.sharing(1) == 1 and leader.followers == []


def test_arms_can_be_read_from_another_thread_while_the_search_measures(monkeypatch):
    """An engine that follows another's depths reads that one's Arms from its own thread
    (Batcher.calibrate), and the server's /metrics from another, while the leader's
    thread adds the depths its search measures. Reading over the dict itself raised
    "dictionary changed size during iteration" in the reader (here within a few of the
    300 tries, each a fresh search with a slowed estimate to widen the window)."""
    real = Arms.rate

    def slow(self, k):
        sum(range(2000))
        return real(self, k)

    monkeypatch.setattr(Arms, "rate", slow)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    current, failed, stop = [Arms(4)], [], threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                arms = current[0]
                arms.leader()
                arms.seconds(2)
        except RuntimeError as exc:
            failed.append(exc)

    t = threading.Thread(target=reader)
    try:
        for i in range(300):
            arms = Arms(4)
            arms.round_s[0] = 0.001
            current[0] = arms
            if i == 0:
                t.start()
            for k in (4, 1, 3):        # the search's order after plain
                arms.round_s[k] = 0.001 * (k + 1)
            if failed:
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(switch)
    assert failed == []


def test_followers_of_one_size_leave_their_leader_each_for_itself():
    """Two idle followers of one size are two engines: the one that closes leaves, the
    other's sequences still count (compared by value, the first of them left instead)."""
    leader = Epochs(1)
    a, b = Following(leader), Following(leader)
    b.leave()
    assert leader.followers == [a] and leader.followers[0] is a
    a.launched(2)
    assert leader.sharing(1) == 3


def test_a_follower_takes_the_leaders_depth_at_each_launch():
    """An engine that idled (no round tallied) drafts the leader's depth of now from its
    next round's launch, prompt rounds included."""
    leader = Epochs(3, k=0)
    f = Following(leader)
    leader.k = 3
    f.launched(0)             # a round of prompt rows only
    assert f.k == 3
