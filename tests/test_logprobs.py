"""Logprobs: the pure scoring on hand-made rows, then the engine's logprobs against plain
decoding (bit for bit where kernels are exact) and against a fresh decode of the text."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import one_row_logits, require_exact_kernels, row_tolerance
from pymtp.config import DecodeParams, ParamError
from pymtp.logprobs import TokenLogprob, log_normalizer, log_softmax, score, score_rows, top_n

# ------------------------------------------------------------------ pure, by hand


def test_uniform_row_is_minus_log_n():
    r = score(np.zeros(4, dtype=np.float32), 2, 0)
    assert r == TokenLogprob(2, -math.log(4), ())


def test_two_levels():
    # logits [1, 1, 3, 3]: Z = 2e + 2e^3, so log p(3) = -ln 2 - ln(1 + e^-2) and
    # log p(1) = -2 - ln 2 - ln(1 + e^-2)
    row = np.array([1, 1, 3, 3], dtype=np.float32)
    high = -math.log(2) - math.log1p(math.exp(-2))
    assert score(row, 2, 0).logprob == pytest.approx(high, abs=1e-15)
    assert score(row, 0, 0).logprob == pytest.approx(high - 2, abs=1e-15)
    assert np.exp(log_softmax(row)).sum() == pytest.approx(1.0, abs=1e-15)


def test_large_logits_do_not_overflow():
    row = np.array([1000.0, 1000.0, -1000.0], dtype=np.float32)
    assert log_normalizer(row) == pytest.approx(1000.0 + math.log(2), abs=1e-12)
    assert score(row, 1, 0).logprob == pytest.approx(-math.log(2), abs=1e-12)


def test_minus_inf_logit_scores_minus_inf():
    row = np.array([0.0, -np.inf], dtype=np.float32)
    assert score(row, 0, 0).logprob == 0.0
    assert score(row, 1, 0).logprob == -math.inf


def test_top_n_largest_first_ties_to_lowest_id():
    row = np.array([1, 3, 3, 2, 3], dtype=np.float32)
    assert top_n(row, 2).tolist() == [1, 2]
    assert top_n(row, 4).tolist() == [1, 2, 4, 3]
    assert top_n(row, 9).tolist() == [1, 2, 4, 3, 0]
    assert top_n(row, 0).tolist() == []


def test_tie_at_the_cut_goes_to_the_lowest_id():
    # argpartition alone may pick any of the tied 1s; the lowest must win
    row = np.array([1, 1, 5, 1, 1, 1, 1, 1], dtype=np.float32)
    assert top_n(row, 2).tolist() == [2, 0]
    assert top_n(row, 3).tolist() == [2, 0, 1]


def test_score_carries_the_top_alternatives():
    row = np.array([0, math.log(3), 0, 0], dtype=np.float64)    # p = [1, 3, 1, 1] / 6
    r = score(row, 3, 2)
    assert r.token == 3 and r.logprob == pytest.approx(math.log(1 / 6), abs=1e-15)
    assert [t for t, _ in r.top] == [1, 0]
    assert r.top[0][1] == pytest.approx(math.log(3 / 6), abs=1e-15)
    assert r.top[1][1] == pytest.approx(math.log(1 / 6), abs=1e-15)


def test_score_rows_takes_row_i_for_token_i():
    rows = np.array([[5, 0, 0], [0, 5, 0], [0, 0, 5]], dtype=np.float32)
    out = score_rows(rows, [0, 0], 1)
    assert len(out) == 2                      # only as many rows as tokens
    assert out[0].logprob == pytest.approx(-math.log1p(2 * math.exp(-5)), abs=1e-12)
    assert out[1].logprob == pytest.approx(-5 - math.log1p(2 * math.exp(-5)), abs=1e-12)
    assert [r.top[0][0] for r in out] == [0, 1]


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, True, "3", 2.0])
def test_bad_counts_are_refused_by_name(name, value):
    with pytest.raises(ParamError, match=f"{name} must be an integer >= 0") as e:
        DecodeParams(**{name: value}).validate(4)
    assert e.value.param == name


# ------------------------------------------------------------------ through the engine

PROMPTS = ["def fibonacci(n):\n    ", "The quick brown fox", "for i in range(10):\n    print(i)\n"]


def _run(model, prompt, **kw):
    kw.setdefault("max_tokens", 32)
    return model.generate(prompt, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def demo_model():
    """The packaged Q8_0 model: on CPUs its kernels give a row the same bits in a batch of
    k+1 rows as alone (docs/exactness.md), so its logprobs can be compared bit for bit."""
    import pymtp

    m = pymtp.load(threads=1, n_ctx=1024)
    yield m
    m.close()


@pytest.mark.parametrize("draft_max", [1, 3, 4])
def test_greedy_mtp_logprobs_equal_plain(demo_model, draft_max):
    """Every token's logprob and top alternatives, and the prompt's, bit for bit: the
    verify row that scored an accepted draft holds the numbers a one-row decode holds."""
    require_exact_kernels()
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = _run(demo_model, prompt, spec="none", logprobs=5, prompt_logprobs=3)
        spec = _run(demo_model, prompt, spec="mtp", draft_max=draft_max, logprobs=5, prompt_logprobs=3)
        assert spec.tokens == plain.tokens
        assert [r.token for r in spec.logprobs] == spec.tokens
        assert spec.logprobs == plain.logprobs, prompt
        assert spec.prompt_logprobs == plain.prompt_logprobs
        accepted, drafted = accepted + spec.stats.accepted, drafted + spec.stats.drafted
    assert 0 < accepted < drafted     # accepted drafts and recovered tokens were both scored


def test_checkpoint_rollback_scores_before_the_re_decode(demo_model):
    """The checkpoint path re-decodes the accepted rows over the verify's logits; scores
    must come from the verify, so they still equal plain decoding's."""
    require_exact_kernels()
    plain = _run(demo_model, PROMPTS[1], spec="none", logprobs=2)
    r = _run(demo_model, PROMPTS[1], draft_max=3, rollback="checkpoint", logprobs=2)
    assert r.stats.checkpoint_restores > 0
    assert r.tokens == plain.tokens and r.logprobs == plain.logprobs


# CPU batch variance of the float-weight fixtures' kernels: a row in a verify batch rounds
# differently from the same row alone by up to ~2e-4 logits (docs/exactness.md), which
# moves a logprob by at most about twice that.
FLOAT_TOL = 5e-4


def _assert_close(a: TokenLogprob, b: TokenLogprob, tol: float) -> None:
    assert a.token == b.token and abs(a.logprob - b.logprob) <= tol
    ta, tb = dict(a.top), dict(b.top)
    cut = min(min(ta.values(), default=0.0), min(tb.values(), default=0.0))
    for t in ta.keys() | tb.keys():
        if t in ta and t in tb:
            assert abs(ta[t] - tb[t]) <= tol
        else:     # in one top list only: a near-tie at the cut
            assert abs((ta.get(t) if t in ta else tb[t]) - cut) <= tol


@pytest.mark.parametrize("draft_max", [1, 4])
def test_greedy_mtp_logprobs_match_plain_on_float_weights(fixture_model, draft_max):
    """Same tokens; logprobs within the kernels' batch rounding, all prompt positions too."""
    require_exact_kernels()
    for prompt in PROMPTS:
        plain = _run(fixture_model, prompt, spec="none", logprobs=5, prompt_logprobs=3)
        spec = _run(fixture_model, prompt, draft_max=draft_max, logprobs=5, prompt_logprobs=3)
        assert spec.tokens == plain.tokens
        for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
            _assert_close(a, b, FLOAT_TOL)
        assert spec.prompt_logprobs == plain.prompt_logprobs   # both prefills chunk alike


def test_asking_for_logprobs_changes_no_token(fixture_model):
    require_exact_kernels()
    for prompt in PROMPTS:
        base = _run(fixture_model, prompt, draft_max=3)
        scored = _run(fixture_model, prompt, draft_max=3, logprobs=20, prompt_logprobs=20)
        assert scored.tokens == base.tokens and scored.text == base.text
        assert base.logprobs is None and base.prompt_logprobs is None



@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets_raw_distribution(dense_model, temperature):
    """Each token is scored on the target's temperature-1, unfiltered row for its position,
    whatever picked it (accepted draft, recovered or bonus token, sampled or greedy);
    the prompt's tokens likewise, the first one unscored. Checked against one-row decodes
    of the whole text: a row off by one moves logprobs by whole units."""
    prompt = dense_model.tokenize(PROMPTS[1])
    r = dense_model.generate(prompt, max_tokens=24, ignore_eos=True, draft_max=3, logprobs=3,
                             prompt_logprobs=2, temperature=temperature, top_k=5, seed=7)
    assert r.stats.accepted > 0
    fresh = one_row_logits(dense_model, prompt + r.tokens)
    want = [log_softmax(row) for row in fresh]
    for i, rec in enumerate(r.logprobs):
        row = want[len(prompt) - 1 + i]
        assert rec.token == r.tokens[i]
        assert rec.logprob == pytest.approx(row[rec.token], abs=row_tolerance())
        assert [t for t, _ in rec.top] == list(top_n(row, 3))
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
    for i, rec in enumerate(r.prompt_logprobs[1:], start=1):
        assert rec.token == prompt[i] and len(rec.top) == 2
        assert rec.logprob == pytest.approx(want[i - 1][prompt[i]], abs=row_tolerance())


def _stop_inside_a_round(model, prompt: str, draft_max: int) -> str:
    """A stop string that first ends on a token a round emits with more after it."""
    chunks = list(model.stream(prompt, max_tokens=32, ignore_eos=True, draft_max=draft_max))
    before: list[int] = []
    for c in chunks:
        if len(c.tokens) >= 2:
            text = model.detokenize(before + c.tokens[:1])
            stop = text[-3:]
            if len(stop) == 3 and text.find(stop) == len(text) - 3:
                return stop
        before += c.tokens
    raise AssertionError("no round emitted a token with others after it")


@pytest.mark.parametrize("draft_max", [2, 4])
def test_stop_string_cuts_tokens_and_logprobs_as_plain_decoding(demo_model, draft_max):
    """A round can emit tokens past a stop string; they are not output, so tokens,
    logprobs and the count of generated tokens (a response's usage) end where plain
    decoding's end."""
    require_exact_kernels()
    stop = _stop_inside_a_round(demo_model, PROMPTS[0], draft_max)
    plain = _run(demo_model, PROMPTS[0], spec="none", stop=stop, logprobs=1)
    r = _run(demo_model, PROMPTS[0], draft_max=draft_max, stop=stop, logprobs=1)
    assert r.finish_reason == plain.finish_reason == "stop"
    assert (r.text, r.tokens, r.logprobs) == (plain.text, plain.tokens, plain.logprobs)
    assert r.stats.generated_tokens == plain.stats.generated_tokens == len(plain.tokens)


def test_no_scoring_unless_asked(dense_model, monkeypatch):
    """The default path computes no softmax at all."""
    import pymtp.rounds as rounds

    def refuse(*a, **k):
        raise AssertionError("scored without being asked")

    monkeypatch.setattr(rounds, "score", refuse)
    monkeypatch.setattr(rounds, "score_rows", refuse)
    r = _run(dense_model, PROMPTS[0], draft_max=3)
    assert r.logprobs is None and len(r.tokens) == 32
    with pytest.raises(AssertionError, match="scored without being asked"):
        _run(dense_model, PROMPTS[0], draft_max=3, logprobs=0)


def test_stream_chunks_carry_their_tokens_logprobs(dense_model):
    whole = _run(dense_model, PROMPTS[2], draft_max=3, logprobs=2, prompt_logprobs=0)
    chunks = list(dense_model.stream(PROMPTS[2], max_tokens=32, ignore_eos=True, draft_max=3, logprobs=2,
                                     prompt_logprobs=0))
    assert all(len(c.logprobs) == len(c.tokens) for c in chunks)
    assert [r for c in chunks for r in c.logprobs] == whole.logprobs
    assert chunks[0].prompt_logprobs == whole.prompt_logprobs
    assert all(c.prompt_logprobs is None for c in chunks[1:])



def test_penalties_change_tokens_not_what_a_logprob_is(dense_model):
    """Penalties move which token is picked, not the reported numbers: each position is
    scored on the target's raw row, as llama-server's and vLLM's defaults do, so the
    numbers are those of one-row decodes of the penalised text."""
    pen = dict(repeat_penalty=1.5, presence_penalty=2.0, frequency_penalty=1.0, repeat_last_n=-1)
    prompt = dense_model.tokenize(PROMPTS[2])
    base = dense_model.generate(prompt, max_tokens=24, ignore_eos=True, draft_max=3)
    r = dense_model.generate(prompt, max_tokens=24, ignore_eos=True, draft_max=3, logprobs=3, **pen)
    assert r.tokens != base.tokens and r.stats.accepted > 0
    fresh = one_row_logits(dense_model, prompt + r.tokens)
    for i, rec in enumerate(r.logprobs):
        row = fresh[len(prompt) - 1 + i]
        assert rec.logprob == pytest.approx(log_softmax(row)[rec.token], abs=row_tolerance())
        assert [t for t, _ in rec.top] == list(top_n(row, 3))
