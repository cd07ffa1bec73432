"""The prompt cache's policy on hand-made data (pymtp/prefix_cache.py)."""

from __future__ import annotations

import pytest

from pymtp.round_plan import kept_drafts
from pymtp.prefix_cache import (TAIL_TOKENS, Held, SlotView, clip_chunk, common_prefix, evict, pick_slot,
                                pick_snapshot, prefill_stops, reuse_limit, worth_shelving)


def test_common_prefix_stops_at_the_first_difference():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4, 5]) == 3
    assert common_prefix([], [1]) == 0
    assert common_prefix([7], [8]) == 0


def test_reuse_leaves_the_last_prompt_token_to_decode():
    held = [1, 2, 3, 4, 5, 6]
    assert reuse_limit(held, [1, 2, 3, 4, 5, 6]) == 5      # same prompt again
    assert reuse_limit(held, [1, 2, 3, 4, 5, 6, 7, 8]) == 6  # it extends what is held
    assert reuse_limit(held, [1, 2, 3, 9, 9]) == 3          # diverges inside the held part
    assert reuse_limit(held, [9]) == 0


def test_pick_snapshot_takes_the_latest_at_or_before_the_limit():
    assert pick_snapshot([4, 100, 50], limit=60) == 2
    assert pick_snapshot([4, 100, 50], limit=100) == 1
    assert pick_snapshot([4, 100, 50], limit=3) is None
    assert pick_snapshot([0, 2], limit=1) is None            # a restore at 0 saves nothing
    assert pick_snapshot([], limit=10) is None


def test_pick_slot_prefers_the_longest_reuse():
    free = [SlotView(0, 10, 5), SlotView(1, 30, 1), SlotView(2, 30, 9)]
    assert pick_slot(free) == 1       # equal reuse: the lowest id


def test_pick_slot_without_reuse_takes_the_least_recently_used():
    free = [SlotView(0, 0, 7), SlotView(1, 0, 3), SlotView(2, 0, 0), SlotView(3, 0, 0)]
    assert pick_slot(free) == 2       # never used, lowest id among those
    assert pick_slot([SlotView(4, 0, 8), SlotView(5, 0, 2)]) == 5
    with pytest.raises(ValueError, match="no free slot"):
        pick_slot([])


def test_prefill_stops_every_n_and_near_the_end():
    assert prefill_stops(0, 2500, 1000) == [1000, 2000, 2500 - TAIL_TOKENS, 2500]
    assert prefill_stops(1500, 2500, 1000) == [2000, 2496, 2500]      # a restored prefix
    assert prefill_stops(0, 3, 1000) == [3]                           # too short for a tail stop
    assert prefill_stops(0, 12, 0) == [12 - TAIL_TOKENS, 12]


def test_clip_chunk_ends_at_the_first_stop_inside():
    assert clip_chunk(0, 512, [300, 600]) == 300
    assert clip_chunk(300, 512, [300, 600]) == 300
    assert clip_chunk(0, 100, [100, 200]) == 100      # a stop at its end is no cut
    assert clip_chunk(0, 100, []) == 100


def test_evict_drops_the_oldest_until_it_fits():
    held = [Held("c", 30, 3), Held("a", 30, 1), Held("b", 30, 2)]
    assert evict(held, 90) == []
    assert evict(held, 60) == ["a"]
    assert evict(held, 59) == ["a", "b"]
    assert evict(held, 0) == ["a", "b", "c"]


def test_kept_drafts_follow_the_stop_rules():
    assert kept_drafts(3, 4, None) == 3        # going on: every accepted draft
    assert kept_drafts(3, 1, "stop") == 2      # EOG is d_2: d_1 and the EOG stay
    assert kept_drafts(3, 3, "stop") == 3      # EOG is the next token, not in the KV
    assert kept_drafts(3, 2, "length") == 2    # max_tokens inside the drafts
    assert kept_drafts(0, 0, "length") == 0


@pytest.mark.parametrize("held, reusable, shelve", [
    (100, 0, True),       # another chat
    (100, 20, True),      # one sharing a system prompt
    (100, 50, False),     # as much kept as dropped
    (100, 90, False),     # the same chat, its last reply rewritten by the template
    (0, 0, False),        # nothing held
])
def test_worth_shelving_when_a_request_drops_more_than_it_keeps(held, reusable, shelve):
    assert worth_shelving(held, reusable) is shelve
