"""The engine's counts as the server reports them: ``timings`` (llama-server's field) and
``/slots``' counters of a request that ended, from one run's ``Stats``."""

from __future__ import annotations

import pytest

from pymtp.results import Chunk, Stats
from pymtp.server.responses import timings
from pymtp.server.slot_board import SlotBoard


def _stats(**kw) -> Stats:
    base = dict(drafted=15, accepted=8, acceptance_rate=8 / 15, mean_accept_len=13 / 5, accepted_per_position=[],
                rounds=5, tokens_per_second=13 / 0.25, prompt_tokens=6, generated_tokens=14,
                prompt_seconds=0.03, decode_seconds=0.25, prompt_processed=6)
    return Stats(**{**base, **kw})


def test_per_token_ms_counts_the_steps_after_the_first_token_as_per_second_does():
    """llama-server divides both by predicted_n - 1 (the first token comes from the prompt's
    logits); per_token_ms divided by predicted_n, so the two disagreed (8.70 ms against 111 t/s)."""
    t = timings(_stats())
    assert t["predicted_n"] == 14 and t["predicted_ms"] == pytest.approx(250.0)
    assert t["predicted_per_token_ms"] == 250.0 / 13
    assert t["predicted_per_token_ms"] * t["predicted_per_second"] == pytest.approx(1000.0)  # float rounding only
    assert timings(_stats(generated_tokens=1, tokens_per_second=0.0))["predicted_per_token_ms"] == 0.0
    assert timings(_stats(generated_tokens=0, tokens_per_second=0.0))["predicted_per_token_ms"] == 0.0


def test_a_cancelled_streams_slot_counts_the_tokens_of_the_drafts_it_counts():
    """A stream cancelled mid-round: the client took 12 tokens in chunks, the engine's last
    round made 2 more. /slots took drafted/accepted from the engine but n_decoded from the
    chunks (12 tokens against 15 drafted, 8 accepted: 8 + 5 rounds + 1 = 14)."""
    board = SlotBoard(n_slots=1, n_ctx=64, speculative=True)
    task = board.begin(0, 6, 200, {})
    for _ in range(4):
        task.took(Chunk(text="ab", tokens=[1, 2, 3], drafted=3, accepted=2))
    board.end(0, task, _stats())
    (slot,) = board.view()
    assert slot["next_token"][0]["n_decoded"] == 14 and slot["next_token"][0]["n_remain"] == 186
    assert (slot["draft_n"], slot["draft_n_accepted"], slot["n_prompt_tokens"]) == (15, 8, 6 + 13)


def test_timings_say_the_depths_auto_chose():
    """Python's Stats.depths and generate --json had them; the server's timings did not, so
    a request with draft_max "auto" could not tell which depth ran."""
    t = timings(_stats(depths={4: 3, 0: 9, 2: 1}))
    assert t["draft_depths"] == {"0": 9, "2": 1, "4": 3}
    assert timings(_stats())["draft_depths"] == {}
