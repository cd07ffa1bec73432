"""round_plan.stop_rules: where a round's emitted tokens stop (pure, hand-made lists).

A round's drafts are capped at the tokens left, except a seeded sampled request's
(Drafting._room: a cut round would draw other uniforms), whose round may run past the limit."""

from pymtp.round_plan import stop_rules

EOG = 99


def is_eog(token: int) -> bool:
    return token == EOG


def test_a_round_inside_its_budget_emits_everything():
    assert stop_rules([5, 6, 7], produced=0, max_tokens=10, is_eog=is_eog) == ([5, 6, 7], None)


def test_an_end_of_generation_token_ends_the_run_and_is_not_emitted():
    assert stop_rules([5, EOG, 7], produced=0, max_tokens=10, is_eog=is_eog) == ([5], "stop")


def test_max_tokens_cuts_inside_the_round():
    assert stop_rules([5, 6, 7], produced=8, max_tokens=10, is_eog=is_eog) == ([5, 6], "length")


def test_reaching_max_tokens_exactly_ends_with_length():
    assert stop_rules([5, 6], produced=8, max_tokens=10, is_eog=is_eog) == ([5, 6], "length")


def test_an_end_of_generation_token_past_max_tokens_is_not_reached():
    # a seeded round ran past the limit: plain decoding stopped at the limit, before the EOG
    assert stop_rules([5, 6, EOG], produced=8, max_tokens=10, is_eog=is_eog) == ([5, 6], "length")
    assert stop_rules([5, 6, 7, EOG], produced=8, max_tokens=10, is_eog=is_eog) == ([5, 6], "length")


def test_an_end_of_generation_token_wins_over_max_tokens_at_the_same_place():
    # the EOG token would have been the last allowed: the run still stops for EOG
    assert stop_rules([5, EOG], produced=8, max_tokens=10, is_eog=is_eog) == ([5], "stop")

