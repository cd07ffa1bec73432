"""The reasoning budget (pymtp/reasoning_budget.py): its states on hand-made tokens, then
on the dense fixture, where a budgeted reply must be the plain reply's first N tokens, the
forced text, and what plain decoding writes after that text, with drafts or without."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from pymtp.config import DecodeParams, ParamError
from pymtp.reasoning_budget import COUNTING, DONE, FORCING, IDLE, WAITING, Budget, opened_in
from test_stochastic import chi2_homogeneity_pvalue

# a hand-made vocabulary: each id's bytes
PIECES = {0: b"a", 1: b"b", 2: b"</think>", 3: b"</th", 4: b"ink>", 5: b"<think>", 6: b"\xe4\xbd", 7: b"\xa0",
          8: b"<thi", 9: b"nk>", 10: b" stop"}
FORCED = (10, 2)


def _budget(tokens: int) -> Budget:
    return Budget(tokens, FORCED, PIECES.__getitem__, len(PIECES))


def _walk(state, tokens):
    for t in tokens:
        state = state.then(t)
    return state


def test_an_opened_block_counts_its_tokens_then_forces_the_message_and_end_tag():
    s = _budget(3).start(opened_in(b"<|im_start|>assistant\n<think>\n"))
    assert (s.phase, s.left) == (COUNTING, 3) and s.allows_all
    s = _walk(s, [0, 1])
    assert (s.phase, s.left) == (COUNTING, 1)
    s = s.then(0)
    assert s.phase == FORCING and not s.allows_all
    ids = np.arange(len(PIECES), dtype=np.int32)
    assert list(ids[s.allows(ids)]) == [10] and list(s.allowed()) == [10]
    with pytest.raises(ValueError, match="forced token 10"):
        s.then(0)
    s = s.then(10)
    assert list(s.allowed()) == [2]
    s = s.then(2)
    assert s.phase == DONE and s.allows_all and s.allows(ids).all()
    assert _walk(s, [0, 5, 0, 0, 0]).phase == DONE       # a later block is not counted


def test_a_block_the_model_closes_itself_ends_the_count():
    assert _budget(3).start(opened_in(b"<think>\n")).then(2).phase == DONE
    # the end tag split over two tokens
    s = _walk(_budget(3).start(opened_in(b"<think>\n")), [0, 3])
    assert (s.phase, s.left) == (COUNTING, 1)
    assert s.then(4).phase == DONE


def test_the_count_starts_at_an_open_tag_the_model_writes():
    s = _budget(2).start(opened_in(b"<|im_start|>assistant\n"))
    assert s.phase == IDLE
    s = _walk(s, [0, 1, 8])
    assert s.phase == IDLE
    s = s.then(9)           # "<thi" + "nk>"
    assert (s.phase, s.left) == (COUNTING, 2)
    assert _walk(s, [0, 0]).phase == FORCING


def test_a_prompt_whose_last_tag_closes_the_block_leaves_it_closed():
    assert _budget(3).start(opened_in(b"<think>\n\n</think>\n\n")).phase == IDLE
    assert _budget(3).start(opened_in(b"<think>a</think> then <think>\nI")).phase == COUNTING


def test_budget_zero_forces_at_once():
    s = _budget(0).start(opened_in(b"<think>\n"))
    assert s.phase == FORCING and list(s.allowed()) == [10]
    assert _walk(_budget(0).start(opened_in(b"")), [5]).phase == FORCING


def test_a_character_cut_by_the_budget_is_finished_before_forcing():
    s = _walk(_budget(2).start(opened_in(b"<think>\n")), [0, 6])       # 0xE4 0xBD: two bytes of three
    assert s.phase == WAITING and s.allows_all
    s = s.then(7)
    assert s.phase == FORCING


class _Letters:
    """An inner grammar state that allows only ids 0, 2 and 10 (a letter, the end tag, the message)."""

    keep_going = False

    def __init__(self):
        self.closed = False

    def allows(self, ids):
        return np.isin(ids, [0, 2, 10])

    def allowed(self):
        return np.array([0, 2, 10], dtype=np.int32)

    def then(self, token):
        assert token in (0, 2, 10)
        return _Letters()

    def close(self):
        self.closed = True


def test_a_grammar_inside_is_asked_too():
    s = _budget(1).start(opened_in(b"<think>"), _Letters())
    assert not s.allows_all and list(s.allowed()) == [0, 2, 10]
    assert list(s.allows(np.array([0, 1, 2], dtype=np.int32))) == [True, False, True]
    s = s.then(0)
    assert s.phase == FORCING and list(s.allowed()) == [10]
    inner = s.inner
    s.close()
    assert inner.closed


@pytest.mark.parametrize("value", [-2, 1.5, "3", True])
def test_a_bad_budget_is_refused_by_name(value):
    with pytest.raises(ParamError, match="reasoning_budget must be an integer") as e:
        DecodeParams(reasoning_budget=value).validate(4)
    assert e.value.param == "reasoning_budget"
    with pytest.raises(ParamError) as e:
        DecodeParams(reasoning_budget=3, reasoning_budget_message=b"x").validate(4)
    assert e.value.param == "reasoning_budget_message"
    with pytest.raises(ParamError, match="reasoning_opened must be True, False or None") as e:
        DecodeParams(reasoning_budget=3, reasoning_opened=1).validate(4)
    assert e.value.param == "reasoning_opened"


def test_a_chat_budget_counts_in_the_replys_block_not_in_a_message(dense_model, monkeypatch):
    """``Session.chat``: a ``<think>`` in the user's message is no block of the reply's
    (the prompt's tail alone said it was one, and budget 0 forced ``</think>`` at once);
    where the generation prompt opens the block the budget counts from the reply's start."""
    from pymtp.chat import ChatTemplate

    base = dense_model.chat_template_for_prompts()
    msgs = [{"role": "user", "content": "What does <think> mean?"}]
    for opens, budgeted in ((False, False), (True, True)):
        gen = "'<|im_start|>assistant\\n<think>\\n'" if opens else "'<|im_start|>assistant\\n'"
        text = "{# a reasoning model's: <think> #}" + base.text.replace("'<|im_start|>assistant\\n'", gen)
        monkeypatch.setattr(dense_model, "_template", ChatTemplate(text, bos_token=base.bos_token,
                                                                     eos_token=base.eos_token))
        assert dense_model.chat_template_for_prompts().thinks
        free = dense_model.chat(msgs, max_tokens=10, temperature=0)
        got = dense_model.chat(msgs, max_tokens=10, temperature=0, reasoning_budget=0)
        end = dense_model._native.tokenize("</think>", add_special=False, parse_special=True)
        if budgeted:
            assert got.tokens[:len(end)] == end != free.tokens[:len(end)]
        else:
            assert got.tokens == free.tokens and got.text == free.text


# --- on the dense fixture -------------------------------------------------------------

PROMPT = "the quick <think>\n"
MESSAGE = " ok"


def _forced(model) -> list[int]:
    n = model._native
    return n.tokenize(MESSAGE, add_special=False) + n.tokenize("</think>", add_special=False, parse_special=True)


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_budgeted_reply_is_the_plain_start_the_forced_text_and_plain_decoding_after_it(dense_model, budget):
    plain = dense_model.generate(PROMPT, max_tokens=24, temperature=0, spec="none").tokens
    forced = _forced(dense_model)
    cut = budget + len(forced)
    ids = dense_model.prompt_ids(PROMPT)
    after = dense_model.generate(ids + plain[:budget] + forced, max_tokens=24 - cut, temperature=0,
                                 spec="none").tokens
    want = plain[:budget] + forced + after
    assert len(want) == 24 and want != plain
    for spec, depth in (("none", None), ("mtp", 1), ("mtp", 3)):
        got = dense_model.generate(PROMPT, max_tokens=24, temperature=0, spec=spec, draft_max=depth,
                                   reasoning_budget=budget, reasoning_budget_message=MESSAGE).tokens
        assert got == want, (spec, depth)


def test_a_sampled_budgeted_reply_forces_at_the_budget(dense_model):
    forced = _forced(dense_model)
    for spec in ("none", "mtp"):
        got = dense_model.generate(PROMPT, max_tokens=20, temperature=0.8, seed=5, spec=spec,
                                   reasoning_budget=4, reasoning_budget_message=MESSAGE).tokens
        assert got[4:4 + len(forced)] == forced, spec


def test_a_prompt_without_an_open_block_is_not_budgeted(dense_model):
    plain = dense_model.generate("the quick", max_tokens=16, temperature=0).tokens
    assert dense_model.generate("the quick", max_tokens=16, temperature=0, reasoning_budget=0).tokens == plain


def test_a_grammar_and_a_budget_hold_together(dense_model):
    grammar = 'root ::= [a-z ]{1,12} "</think>" [a-z ]{1,12}'
    free = dense_model.generate(PROMPT, max_tokens=30, temperature=0, grammar=grammar)
    budgeted = {spec: dense_model.generate(PROMPT, max_tokens=30, temperature=0, grammar=grammar, spec=spec,
                                           reasoning_budget=1) for spec in ("none", "mtp")}
    assert budgeted["none"].tokens == budgeted["mtp"].tokens
    end = dense_model._native.tokenize("</think>", add_special=False, parse_special=True)
    got = budgeted["mtp"].tokens
    assert got[1:1 + len(end)] == end and len(got) > 1 + len(end)      # one token, the end, then the rest
    assert free.tokens[1:1 + len(end)] != end        # unbudgeted, the grammar's block runs longer


N = 1500


def _after_forcing(model, seeds, spec: str) -> collections.Counter:
    """Joint histogram of the two tokens after the forced text, budget 1: the rounds that
    force draft across the budget, then draw past the forced text."""
    m = len(_forced(model))
    kw = dict(temperature=1.0, top_k=6, max_tokens=m + 3, reasoning_budget=1, reasoning_budget_message=MESSAGE)
    ids = model.prompt_ids(PROMPT)
    return collections.Counter(tuple(model.generate(ids, seed=s, spec=spec, draft_max=3, **kw).tokens[m + 1:m + 3])
                               for s in seeds)


def test_budgeted_sampling_keeps_the_target_distribution(dense_model):
    plain = _after_forcing(dense_model, range(N), "none")
    spec = _after_forcing(dense_model, range(N, 2 * N), "mtp")
    assert chi2_homogeneity_pvalue(plain, spec) > 1e-3
