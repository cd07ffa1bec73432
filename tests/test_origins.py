"""Token origins (pymtp/origins.py): the names per round, the split of text by token, and
the invariant that the rounds the chunks report are the engine's own accounting."""

from __future__ import annotations

import pytest

from conftest import require_exact_kernels
from pymtp.origins import TextOrigins, token_origins

PROMPT = "def fibonacci(n):"


# ------------------------------------------------------------------ names, pure

def test_early_mismatch_ends_with_recovered():
    assert token_origins(3, 1, 2) == ["d1", "recovered"]


def test_all_accepted_gets_bonus():
    assert token_origins(3, 3, 4) == ["d1", "d2", "d3", "bonus"]


def test_round_without_drafts_is_decoded():
    assert token_origins(0, 0, 1) == ["decoded"]


def test_stop_rules_cut_a_prefix():
    assert token_origins(4, 4, 2) == ["d1", "d2"]
    assert token_origins(2, 0, 0) == []


@pytest.mark.parametrize("drafted, accepted, n", [(2, 3, 1), (2, -1, 0), (2, 1, 3)])
def test_impossible_rounds_are_refused(drafted, accepted, n):
    with pytest.raises(ValueError, match="accept|emits at most"):
        token_origins(drafted, accepted, n)


# ------------------------------------------------------------------ text by token, pure

PIECES = {1: b"a", 2: b"\xc3", 3: b"\xa9b", 4: b"<", 5: b"\xe2\x82"}


def test_a_character_split_over_two_tokens_belongs_to_the_token_that_completes_it():
    t = TextOrigins(PIECES.__getitem__)
    t.feed([1, 2, 3], ["d1", "d2", "recovered"])
    assert t.split("a\u00e9") == [["a", "d1"], ["\u00e9", "recovered"]]
    assert t.split("b") == [["b", "recovered"]]


def test_text_held_back_comes_out_later_with_its_own_origin():
    t = TextOrigins(PIECES.__getitem__)
    t.feed([4], ["d1"])
    assert t.split("") == []                      # a possible stop string: held back
    t.feed([1], ["bonus"])
    assert t.split("<a") == [["<", "d1"], ["a", "bonus"]]


def test_an_unfinished_character_at_the_end_is_flushed_to_the_last_token():
    t = TextOrigins(PIECES.__getitem__)
    t.feed([1, 5], ["decoded", "d1"], final=True)
    assert t.split("a\ufffd") == [["a", "decoded"], ["\ufffd", "d1"]]


def test_text_the_tokens_never_made_is_an_error():
    t = TextOrigins(PIECES.__getitem__)
    t.feed([1], ["d1"])
    with pytest.raises(ValueError, match="did not decode to"):
        t.split("ab")
    t = TextOrigins(PIECES.__getitem__)
    t.feed([1], ["d1"])
    with pytest.raises(ValueError, match="decode to 'a'"):
        t.split("x")


# ------------------------------------------------------------------ the engine's rounds

@pytest.fixture(scope="module")
def demo():
    import pymtp

    m = pymtp.load(threads=1, n_ctx=1024)
    yield m
    m.close()


def _check_rounds_are_the_stats(chunks, stats):
    """The chunks' rounds add up to the run's Stats, position by position."""
    rounds = [c for c in chunks if c.drafted]
    assert sum(c.drafted for c in rounds) == stats.drafted
    assert sum(c.accepted for c in rounds) == stats.accepted
    assert len(rounds) == stats.rounds
    for i, (drafted, accepted) in enumerate(zip(stats.drafted_at, stats.accepted_at)):
        assert sum(c.drafted > i for c in rounds) == drafted
        assert sum(c.accepted > i for c in rounds) == accepted
    assert chunks[0].drafted == 0 and len(chunks[0].tokens) == 1      # the prompt's first token
    for c in chunks[:-1]:     # only the last round can be cut by the stop rules
        assert len(c.tokens) == c.accepted + 1


@pytest.mark.parametrize("draft_max", [3, "auto"])
def test_session_chunks_carry_the_engines_rounds(demo, draft_max):
    stats = []
    chunks = list(demo.session().stream(PROMPT, max_tokens=48, draft_max=draft_max, ignore_eos=True,
                                        stats_out=stats))
    _check_rounds_are_the_stats(chunks, stats[0])
    assert stats[0].accepted > 0       # the demo model's head is trained: something to colour
    origins = [o for c in chunks for o in token_origins(c.drafted, c.accepted, len(c.tokens))]
    assert len(origins) == 48
    assert origins.count("d1") == sum(min(c.accepted, len(c.tokens)) > 0 for c in chunks)


def test_batched_chunks_carry_the_same_rounds_as_a_session(demo):
    require_exact_kernels()      # the same rounds need the same drafts and verdicts
    # one fixed depth: auto (the default) picks one in each apart
    alone = list(demo.session().stream(PROMPT, max_tokens=32, ignore_eos=True, draft_max=3))
    b = demo.batcher(2)
    runs = [b.submit(PROMPT, max_tokens=32, ignore_eos=True, draft_max=3),
            b.submit("import os\n", max_tokens=20, draft_max=3)]
    together = []
    while b.busy:
        together += [chunk for run, chunk in b.step() if run is runs[0]]
    b.close()
    assert [(c.tokens, c.drafted, c.accepted) for c in together] == \
        [(c.tokens, c.drafted, c.accepted) for c in alone]
    _check_rounds_are_the_stats(together, runs[0].stats)


def test_plain_decoding_is_all_decoded(demo):
    chunks = list(demo.session().stream(PROMPT, max_tokens=8, spec="none"))
    assert all(c.drafted == 0 and c.accepted == 0 for c in chunks)
