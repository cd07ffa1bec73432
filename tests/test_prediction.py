"""OpenAI's Predicted Outputs (pymtp/prediction.py): drafts read from a predicted text.

The policy on hand-made token lists; then the engine: whatever the prediction (the reply
itself, an edited copy, unrelated text), a greedy run gives plain decoding's tokens, in
one stream and in a batch, and its rounds draft from the prediction where the reply
follows it. The sampling distribution with predictions is checked in test_stochastic.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import pymtp
from conftest import require_exact_kernels, require_rows_within_patch, row_tolerance
from pymtp.config import ParamError
from pymtp.prediction import Prediction
from test_constraint import SCHEMA

PROMPT = "def fibonacci(n):\n    "


# ----------------------------------------------------------------------------- policy


def test_a_reply_that_follows_the_prediction_is_drafted_from_it():
    p = Prediction([10, 11, 12, 13, 14])
    assert p.propose(3) == [10, 11, 12]          # the reply is expected to start where it does
    p.advance([10])
    assert p.propose(3) == [11, 12, 13]
    p.advance([11, 12, 13])
    assert p.propose(3) == [14]                  # what is left
    assert p.propose(0) == []
    p.advance([14])
    assert p.propose(3) == []                    # past its end: the head drafts


def test_a_reply_that_leaves_is_found_again_by_its_last_two_tokens():
    p = Prediction([1, 2, 3, 4, 5, 6, 7])
    p.advance([1, 2, 9])                         # 9 replaces 3
    assert (p.cursor, p.left_at) == (None, 2)
    p.advance([4])                               # [9, 4]: not in the prediction
    assert p.propose(3) == []
    p.advance([5])                               # [4, 5]: found, the text goes on after it
    assert p.propose(3) == [6, 7]


def test_one_token_alone_does_not_resync():
    p = Prediction([7, 8, 9, 7, 5])
    p.advance([3, 7])                            # 7 occurs twice, but one token says nothing
    assert p.propose(2) == []
    p.advance([8])                               # [7, 8]
    assert p.propose(2) == [9, 7]


def test_a_resync_takes_the_longest_match_and_prefers_the_text_after_the_exit():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    p = Prediction([5, 6, 1, 2, 3, 8, 1, 2, 3, 4, 9, 9])
    p.advance([5, 6, 1, 2, 3, 8, 0])             # leaves at index 6 (expected 1)
    assert p.left_at == 6
    p.advance([2, 3, 4])                         # [0, 2, 3, 4]: 3-gram [2, 3, 4] ends at 10
    assert p.propose(2) == [9, 9]
    q = Prediction([5, 6, 1, 2, 3, 8, 1, 2, 3, 0])
    q.advance([5, 6, 7])                         # leaves at 2
    q.advance([2, 3])                            # [6, 7, 2, 3]: [2, 3] ends at 5 and at 9
    assert q.propose(1) == [8]                   # the first at or after where it left
    r = Prediction([1, 2, 8, 8, 8, 8, 8])
    r.advance([1, 2, 8, 8, 8, 0])                # leaves at 5
    r.advance([1, 2])                            # [8, 0, 1, 2]: only before the exit
    assert r.propose(1) == [8]


def test_a_chunk_that_leaves_and_comes_back_is_read_whole():
    p = Prediction([1, 2, 3, 4, 5, 6])
    p.advance([1, 2, 0, 4, 5])                   # a round's emitted tokens: the tail [0, 4, 5]
    assert p.propose(1) == [6]


def test_a_match_at_the_very_end_is_no_place_to_go_on_from():
    p = Prediction([1, 2, 3, 4, 5, 6])
    p.advance([9, 5, 6])               # [5, 6] ends the prediction: nothing after it to draft
    assert p.cursor is None
    p.advance([7])
    assert p.misses == 0               # no draft was tried, so none was missed
    q = Prediction([5, 6, 1, 2, 5, 6])
    q.advance([9, 5, 6])               # [5, 6] ends it, and occurs at its start too: go on there
    assert q.propose(2) == [1, 2]


def test_an_empty_prediction_drafts_nothing():
    p = Prediction([])
    assert p.propose(4) == []
    p.advance([1, 2, 3])
    assert p.propose(4) == []


# ----------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def demo():
    m = pymtp.load(threads=1, n_ctx=1024)
    yield m
    m.close()


def _plain(model, prompt, **kw):
    return model.generate(prompt, spec="none", **kw)


@pytest.mark.parametrize("draft_max", [2, 4])
def test_greedy_with_any_prediction_is_plain_decoding(demo, draft_max):
    require_exact_kernels()
    kw = dict(max_tokens=80, ignore_eos=True)
    plain = _plain(demo, PROMPT, **kw)
    text = plain.text
    predictions = {
        "the reply": text,
        "its ids": plain.tokens,
        "edited": text[:30] + "total = 0\n" + text[45:],
        "unrelated": "The quick brown fox jumps over the lazy dog. " * 3,
        "longer": text + "\n\nprint(fibonacci(10))\n" * 4,
    }
    for name, prediction in predictions.items():
        r = demo.generate(PROMPT, draft_max=draft_max, prediction=prediction, **kw)
        assert r.tokens == plain.tokens, name
        s = r.stats
        assert s.predicted_accepted <= s.predicted_drafted
        if name == "unrelated":
            assert s.predicted_drafted == 0 and s.drafted > 0, name
        else:
            assert s.predicted_accepted > 0, name
    exact = demo.generate(PROMPT, draft_max=draft_max, prediction=plain.tokens, **kw).stats
    # the ids themselves: every round with room for drafts drafts from them and keeps all
    # it drafts; the first token came from the prompt, a last round may have had no room
    assert exact.drafted == 0 and exact.predicted_accepted == exact.predicted_drafted
    assert exact.predicted_accepted + exact.predicted_rounds + exact.depths.get(0, 0) + 1 == len(plain.tokens)
    full, rest = divmod(len(plain.tokens) - 1, draft_max + 1)
    assert exact.predicted_rounds == full + (rest >= 2)
    assert exact.depths.get(0, 0) == (rest == 1)


def test_an_edited_prediction_is_left_and_found_again(demo, monkeypatch):
    require_exact_kernels()
    kw = dict(max_tokens=80, ignore_eos=True, draft_max=3)
    plain = _plain(demo, PROMPT, **kw)
    ids = list(plain.tokens)
    edited = ids[:20] + [ids[20] + 1, ids[20] + 2] + ids[21:]     # one token replaced by two others
    found = []
    resync = Prediction.resync
    monkeypatch.setattr(Prediction, "resync", lambda self: found.append(resync(self)) or found[-1])
    r = demo.generate(PROMPT, prediction=edited, **kw)
    assert r.tokens == plain.tokens
    assert any(f is not None for f in found)    # the reply left the prediction and was found in it again
    assert r.stats.predicted_accepted > len(ids) // 2


def test_a_prediction_is_kept_inside_a_grammar(demo):
    require_exact_kernels()
    kw = dict(max_tokens=60, json_schema=SCHEMA, draft_max=3)
    plain = _plain(demo, "A person as JSON: ", **kw)
    # the reply, then a text the grammar refuses where the reply would close
    prediction = plain.text + " trailing words"
    r = demo.generate("A person as JSON: ", prediction=prediction, **kw)
    assert r.tokens == plain.tokens
    assert r.stats.predicted_accepted > 0
    assert demo.generate("A person as JSON: ", prediction="not json at all", **kw).tokens == plain.tokens


def test_plain_decoding_ignores_a_prediction(demo):
    kw = dict(max_tokens=24, ignore_eos=True)
    plain = _plain(demo, PROMPT, **kw)
    r = _plain(demo, PROMPT, prediction=plain.text, **kw)
    assert r.tokens == plain.tokens
    assert r.stats.predicted_drafted == 0


def test_batched_sequences_with_and_without_predictions_equal_their_solo_runs(demo):
    require_rows_within_patch("a round of several sequences")
    prompts = [PROMPT, "The quick brown fox", "import numpy as np\n", "class Stack:\n    def __init__(self):\n"]
    kw = dict(max_tokens=48, ignore_eos=True)
    plain = [_plain(demo, p, **kw) for p in prompts]
    asks = [dict(prediction=plain[0].text, draft_max=3), dict(draft_max=3),
            dict(prediction=plain[2].tokens[:10] + [5, 6] + plain[2].tokens[11:], draft_max="auto"),
            dict(prediction=plain[3].text, temperature=0.8, seed=3, draft_max=2)]
    b = demo.batcher(len(prompts))
    try:
        runs = [b.submit(p, **kw, **ask) for p, ask in zip(prompts, asks)]
        got = b.results(runs)
    finally:
        b.close()
    for i, (r, ask) in enumerate(zip(got, asks)):
        solo = demo.generate(prompts[i], **kw, **ask)
        assert r.tokens == solo.tokens, i
        if ask.get("temperature", 0) == 0:
            assert r.tokens == plain[i].tokens, i
    assert got[0].stats.predicted_accepted > 0 and got[0].stats.drafted == 0
    assert got[1].stats.predicted_drafted == 0 and got[1].stats.drafted > 0
    assert got[2].stats.predicted_accepted > 0


@pytest.mark.parametrize("prediction, message", [
    (5, r"prediction must be the token ids the reply is expected to repeat, as a tuple \(generate, stream, "
        r"submit and the server take the text, or a list, too\), got 5"),
    ([1, "a"], r"too\), got \(1, 'a'\)"),
    ([1, 10 ** 6], "prediction holds token id 1000000, outside this model's vocabulary of 8192"),
    ([1, -2], "prediction holds token id -2, outside"),
    (np.array([1, 9000]), "prediction holds token id 9000, outside"),       # numpy ids are checked too
    ([np.int64(1), np.int64(2 ** 40)], "prediction holds token id 1099511627776, outside"),
    (np.array(5), r"as a tuple .*got array\(5\)"),
])
def test_a_bad_prediction_is_refused_naming_it(demo, prediction, message):
    with pytest.raises(ParamError, match=message) as e:
        demo.generate(PROMPT, max_tokens=4, prediction=prediction)
    assert e.value.param == "prediction"


def test_the_head_resumes_on_the_reply_the_predicted_rounds_made(demo, monkeypatch):
    """After rounds drafted from the prediction the head drafts again: the rows it catches
    up on are the reply's tokens at their positions (each with the target's row before it),
    however many tokens each predicted round emitted."""
    from pymtp.drafter import MTPDrafter

    kw = dict(max_tokens=64, ignore_eos=True, draft_max=3)
    prompt = "class Model(nn.Module):\n    def __init__(self, config):\n"     # a reply that does not repeat early
    plain = _plain(demo, prompt, **kw)
    ids = list(plain.tokens)
    # the reply for 24 tokens, then text it never writes: the head takes over there
    prediction = ids[:24] + demo.tokenize("The quick brown fox jumps over the lazy dog.", add_special=False)
    jobs = []
    propose = MTPDrafter.propose

    def spy(self, batch):
        jobs.extend((j.start, list(j.tokens), j.k) for j in batch)
        return propose(self, batch)

    monkeypatch.setattr(MTPDrafter, "propose", spy)
    r = demo.generate(prompt, prediction=prediction, **kw)
    if r.tokens != plain.tokens:
        require_exact_kernels()             # skips where kernels round per batch shape; else a failure:
        assert r.tokens == plain.tokens     # a prediction never changes greedy output
    full = list(demo.tokenize(prompt)) + list(r.tokens)
    resumed = [(start, tokens) for start, tokens, k in jobs if start is not None and k > 0]
    assert resumed, "the head never resumed after a gap"
    for start, tokens in resumed:
        assert tokens == full[start: start + len(tokens)], start
    assert r.stats.predicted_accepted >= 15 and r.stats.drafted > 0


def test_logprobs_and_penalties_beside_a_prediction(demo):
    """Each verify row of a predicted round sees the drafts before it in the penalties'
    history, and scores its token as plain decoding's row does."""
    require_exact_kernels()
    kw = dict(max_tokens=48, ignore_eos=True, draft_max=3, logprobs=2, repeat_penalty=1.3, frequency_penalty=0.2)
    plain = _plain(demo, PROMPT, **kw)
    r = demo.generate(PROMPT, prediction=plain.text, **kw)
    assert r.tokens == plain.tokens
    assert r.stats.predicted_accepted > len(plain.tokens) // 2
    assert [t.token for t in r.logprobs] == plain.tokens
    # llamafile's multi-row kernels on CPU builds (docs/exactness.md, "Exact CPU build") move
    # a verify row's logits a few hundredths from its one-row decode's past ~30 positions;
    # a row scored at the wrong position is off by whole units
    bound = max(row_tolerance(4), 0.1)
    for got, want in zip(r.logprobs, plain.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=bound)
        assert got.top[0][0] == want.top[0][0]          # (the alternatives below may swap at a near-tie)
        theirs = dict(want.top)
        for t, lp in got.top:
            if t in theirs:
                assert lp == pytest.approx(theirs[t], abs=bound)


@pytest.mark.parametrize("ending", ["max_tokens", "stop string", "end of generation"])
def test_kept_prediction_drafts_are_the_output_tokens_named_predicted(demo, ending):
    """``predicted_accepted`` counts the output's tokens that were the prediction's drafts,
    as the chunks name them (pymtp.origins), however the text ends: a stop string, or an
    end-of-generation token, inside a round's drafts leaves the drafts past it out of both."""
    from pymtp.origins import PREDICTED, token_origins

    prompt, kw, extra = PROMPT, dict(max_tokens=60, draft_max=4, ignore_eos=True), []
    if ending == "end of generation":      # a reply of three tokens, then the end: all drafted
        prompt, kw = "if __name__ == '__main__':\n    main()\n", dict(max_tokens=60, draft_max=4)
        extra = [next(t for t in range(demo.n_vocab) if demo._native.is_eog(t))]
    plain = _plain(demo, prompt, **kw)
    if ending == "stop string":
        kw["stop"] = [plain.text[40:44]]
    stats: list = []
    chunks = list(demo.stream(prompt, prediction=list(plain.tokens) + extra, stats_out=stats, **kw))
    named = [o for c in chunks for o in token_origins(c.drafted, c.accepted, len(c.tokens), c.predicted)]
    s = stats[0]
    assert len(named) == s.generated_tokens == sum(len(c.tokens) for c in chunks)
    assert named.count(PREDICTED) == s.predicted_accepted > 0
    assert s.predicted_accepted < s.generated_tokens
    if ending == "stop string":
        assert chunks[-1].finish_reason == "stop" and len(named) < len(plain.tokens)
    if ending == "end of generation":
        assert chunks[-1].finish_reason == "stop" and s.predicted_drafted > s.predicted_accepted == len(named) - 1


def test_re_syncs_that_lead_nowhere_ask_for_longer_matches():
    # "1 2" recurs, followed by 3 in the prediction but by something else in the reply
    p = Prediction([1, 2, 3, 4, 1, 2, 3, 5, 9, 9])
    p.advance([7, 1, 2])               # off from the start; [1, 2] found: 3 is proposed
    assert p.propose(1) == [3]
    p.advance([8])                     # left at once: the next re-sync needs 3 tokens
    assert p.misses == 1
    p.advance([1, 2])                  # [8, 1, 2] is not in the prediction
    assert p.propose(1) == []
    p.advance([3])                     # [1, 2, 3] is: the text goes on after it
    assert p.propose(2) in ([4, 1], [5, 9])
    p.advance([p.propose(1)[0]])       # kept: back to two-token re-syncs
    assert p.misses == 0
