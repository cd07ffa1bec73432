"""Constrained decoding (grammar, JSON schema): the grammar stage of the sampler on
hand-made arrays, then the invariants on real models: constrained MTP greedy output is
constrained plain greedy output token for token, and constrained MTP sampling keeps the
constrained target distribution (and a wrong variant fails the same test)."""

from __future__ import annotations

import collections
import json
import re

import numpy as np
import pytest

import pymtp
from conftest import SMALL_Q8, TINY_F16, require_exact_kernels, shared_model
from pymtp.acceptance import rejection_accept
from pymtp.config import DecodeParams, ParamError
from pymtp.drafter import MTPDrafter
from pymtp.engine import Engine
from pymtp.round_state import RunStats
from pymtp.native import NativeModel
from pymtp.sampling import Dist, draw, make_sampler
from pymtp.token_masks import TokenSet, constrained_argmax, constrained_support
from test_acceptance import fits
from test_stochastic import chi2_homogeneity_pvalue


# --- the grammar stage on hand-made rows -------------------------------------------------

def test_constrained_argmax_is_the_best_allowed():
    logits = np.array([0.1, 3.0, 2.0, 2.5, -1.0], dtype=np.float32)
    assert constrained_argmax(logits, TokenSet([0, 2, 4], 5)) == 2
    assert constrained_argmax(logits, TokenSet([1], 5)) == 1
    assert constrained_argmax(logits, TokenSet([4], 5)) == 4


def test_constrained_argmax_searches_past_the_top_candidates():
    # the only allowed token ranks 3,000th of 5,000: found after the top 1, 16, 256, 4096
    rng = np.random.default_rng(0)
    logits = rng.permutation(5000).astype(np.float32)
    token = int(np.argsort(-logits)[2999])
    assert constrained_argmax(logits, TokenSet([token], 5000)) == token


def test_constrained_argmax_ties_go_to_the_lowest_id():
    logits = np.zeros(600, dtype=np.float32)
    logits[:3] = 5.0                                   # ties among the disallowed top
    assert constrained_argmax(logits, TokenSet([599, 300, 40], 600)) == 40


def test_nothing_allowed_raises():
    with pytest.raises(ValueError, match="allows no token"):
        constrained_argmax(np.arange(8, dtype=np.float32), TokenSet([], 8))
    # allowed, but banned by a bias: the greedy path emitted the banned token
    banned = np.arange(8, dtype=np.float32)
    banned[[2, 5]] = -np.inf
    with pytest.raises(ValueError, match="nothing is left to draw"):
        constrained_argmax(banned, TokenSet([2, 5], 8))
    assert constrained_argmax(banned, TokenSet([2, 3], 8)) == 3
    with pytest.raises(ValueError, match="allows no token"):
        constrained_support(np.arange(8, dtype=np.float32), TokenSet([], 8))


def test_constrained_support_with_top_k_holds_the_top_k_allowed():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=3000).astype(np.float32)
    allowed = rng.choice(3000, size=40, replace=False)
    mask = TokenSet(allowed, 3000)
    got = constrained_support(logits, mask, top_k=5)
    best5 = np.sort(allowed[np.argsort(-logits[allowed])[:5]])
    assert set(best5) <= set(got.tolist()) and mask.allows(got).all()
    assert np.array_equal(constrained_support(logits, mask), np.sort(allowed))


@pytest.mark.parametrize("path", ["chain", "numpy"])
@pytest.mark.parametrize("filters", [dict(), dict(top_k=3), dict(top_p=0.8), dict(min_p=0.2, top_k=10)])
def test_masked_dist_is_the_dist_of_the_masked_row(path, filters):
    # the grammar stage equals setting the refused logits to -inf before the filters
    rng = np.random.default_rng(2)
    logits = rng.normal(scale=2.0, size=64).astype(np.float32)
    allowed = rng.choice(64, size=20, replace=False)
    masked = np.full(64, -np.inf, dtype=np.float32)
    masked[allowed] = logits[allowed]
    s = make_sampler(0.8, path=path, **filters)
    got = s.dist(logits, mask=TokenSet(allowed, 64))
    ref = make_sampler(0.8, path="numpy", **filters).dist(masked)
    # two float32 softmaxes over the same numbers in different orders (a mask, a -inf row): last-bit rounding
    assert np.allclose(got.to_dense(64), ref.to_dense(64), atol=1e-6)
    assert set(got.ids.tolist()) <= set(allowed.tolist())


# --- statistical, on hand-made distributions ---------------------------------------------
# One draft per round: the first emitted token must follow the constrained target p'.

N_ROUNDS = 20_000
P = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.00])
Q = np.array([0.05, 0.25, 0.30, 0.10, 0.05, 0.10, 0.05, 0.10])
ALLOWED = [0, 1, 3, 5, 6]


def _masked(probs):
    out = np.zeros_like(probs)
    out[ALLOWED] = probs[ALLOWED]
    return out / out.sum()


def _first_tokens(draft_from, ratio_q, seed=0):
    """Counts of the first emitted token, and the acceptance rate, when drafts are drawn
    from ``draft_from`` and acceptance reads ``ratio_q``, against the masked target."""
    rng = np.random.default_rng(seed)
    p = Dist.from_dense(_masked(P))
    q_draw, q_ratio = Dist.from_dense(draft_from), Dist.from_dense(ratio_q)
    counts, accepted = np.zeros(8), 0
    for _ in range(N_ROUNDS):
        x = draw(q_draw, rng)
        v = rejection_accept([x], [q_ratio], [p, p], rng)
        counts[v.emitted([x])[0]] += 1
        accepted += v.n_accepted
    return counts, accepted / N_ROUNDS


def test_masked_q_keeps_the_constrained_target():
    counts, _ = _first_tokens(_masked(Q), _masked(Q))
    assert fits(counts, _masked(P))


def test_q_unmasked_in_the_ratio_is_caught():
    # drafts drawn under the mask, but acceptance reads the unmasked q: too many accepted
    counts, _ = _first_tokens(_masked(Q), Q)
    assert not fits(counts, _masked(P))


def test_mask_on_p_only_is_lossless_but_accepts_less():
    # An unmasked q, read consistently, is still rejection sampling: lossless, but its
    # refused drafts are always rejected (p' = 0 there). Masking q is for speed.
    counts, rate = _first_tokens(Q, Q)
    _, masked_rate = _first_tokens(_masked(Q), _masked(Q))
    assert fits(counts, _masked(P))
    assert rate < masked_rate - 0.05


# --- on models -----------------------------------------------------------------------------

LETTERS = 'root ::= [a-z ]+'
CALL = 'root ::= "def " [a-z_]+ "(" ([a-z]+ (", " [a-z]+)*)? "):"'
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "import numpy as np\n"]


def _run(model, prompt, **kw):
    return model.generate(prompt, max_tokens=kw.pop("max_tokens", 48), **kw)


def _check_output(text: str, finish: str, constraint: dict) -> None:
    if "grammar" in constraint:
        pattern = {LETTERS: r"[a-z ]+", CALL: r"def [a-z_]+\(([a-z]+(, [a-z]+)*)?\):"}[constraint["grammar"]]
        if finish == "stop":
            assert re.fullmatch(pattern, text), text
        else:
            assert re.fullmatch(r"[a-z ]*" if constraint["grammar"] == LETTERS else r"[a-z_():, ]*|def .*", text)
    elif finish == "stop":
        value = json.loads(text)
        assert isinstance(value, dict)
        if "json_schema" in constraint:
            assert set(value) == {"name", "age", "tags"} and isinstance(value["age"], int)


CONSTRAINTS = [dict(grammar=LETTERS), dict(grammar=CALL), dict(json_schema=SCHEMA)]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["letters", "call", "schema"])
@pytest.mark.parametrize("draft_max", [1, 3])
def test_greedy_constrained_mtp_equals_plain(fixture_model, constraint, draft_max):
    require_exact_kernels()
    for prompt in PROMPTS:
        plain = _run(fixture_model, prompt, spec="none", **constraint)
        spec = _run(fixture_model, prompt, spec="mtp", draft_max=draft_max, **constraint)
        assert spec.tokens == plain.tokens, prompt
        _check_output(spec.text, spec.finish_reason, constraint)


@pytest.mark.parametrize("path", [TINY_F16, SMALL_Q8], ids=["tiny-f16", "small-q8"])
def test_greedy_constrained_trained_models(path):
    require_exact_kernels()
    model = shared_model(path)
    schema = dict(json_schema=SCHEMA)
    json_mode = dict(json_schema=None, grammar=pymtp.constraint.json_object_grammar())
    for constraint in (schema, json_mode, dict(grammar=CALL)):
        for prompt in PROMPTS:
            plain = _run(model, prompt, spec="none", max_tokens=64, **constraint)
            for k in (1, 3):
                spec = _run(model, prompt, spec="mtp", draft_max=k, max_tokens=64, **constraint)
                assert spec.tokens == plain.tokens, (prompt, k)
            if constraint is not json_mode:
                _check_output(spec.text, spec.finish_reason, constraint)
            elif spec.finish_reason == "stop":
                assert isinstance(json.loads(spec.text), dict)
        # drafts under the mask keep acceptance (a refused draft would always be rejected)
        assert spec.stats.acceptance_rate > 0.3, spec.stats


def test_constrained_batch_equals_alone(dense_model):
    prompts = PROMPTS
    kw = dict(max_tokens=24, draft_max=2, grammar=LETTERS)
    alone = [_run(dense_model, p, **kw).tokens for p in prompts]
    assert [r.tokens for r in dense_model.generate_batch(prompts, **kw)] == alone
    kw = dict(max_tokens=24, draft_max=2, json_schema=SCHEMA, temperature=0.9, seed=5)
    alone = [_run(dense_model, p, **kw).tokens for p in prompts]
    assert [r.tokens for r in dense_model.generate_batch(prompts, **kw)] == alone


# --- sampling: constrained MTP vs constrained plain ----------------------------------------

N = 2000
SAMPLED = dict(temperature=1.0, top_k=6, draft_max=3, max_tokens=4, grammar=LETTERS)


def _histogram(model, seeds, **kw) -> collections.Counter:
    """Joint histogram of the 2nd and 3rd generated tokens (the first ones a draft decides)."""
    prompt = model.tokenize("The quick brown fox")
    return collections.Counter(tuple(model.generate(prompt, seed=s, **kw).tokens[1:3]) for s in seeds)


@pytest.fixture(scope="module")
def constrained_plain_hist(dense_model):
    return _histogram(dense_model, range(N), spec="none", **SAMPLED)


def test_constrained_sampling_keeps_the_target_distribution(dense_model, constrained_plain_hist):
    spec = _histogram(dense_model, range(N, 2 * N), **SAMPLED)
    assert chi2_homogeneity_pvalue(constrained_plain_hist, spec) > 1e-3
    allowed = {t for t in range(dense_model.n_vocab) if re.fullmatch(r"[a-z ]+", dense_model.detokenize([t]))}
    assert {t for key in spec for t in key} <= allowed


def test_q_without_the_mask_in_acceptance_fails_the_test(dense_model, constrained_plain_hist, monkeypatch):
    # The deliberately wrong variant: the drafter draws from its masked q but hands
    # acceptance the unmasked q (the mask applied to p and to the draw, not to the q that
    # the ratio p/q reads); the same test must reject it.
    draft = MTPDrafter._draft

    def unmasked_q(self, job, logits, row):
        n = len(job.drafts)
        before = None if job.recent is None else np.concatenate([job.recent, job.drafts]).astype(np.int32)
        tok = draft(self, job, logits, row)
        if tok is not None and job.sample and len(job.dists) > n:
            job.dists[-1] = job.sampler.dist(logits, before)
        return tok

    monkeypatch.setattr(MTPDrafter, "_draft", unmasked_q)
    spec = _histogram(dense_model, range(N, 2 * N), **SAMPLED)
    assert chi2_homogeneity_pvalue(constrained_plain_hist, spec) < 1e-3


def test_backend_sampling_falls_back_to_the_host(dense_path):
    # llama.cpp's grammar has no in-graph implementation: a constrained run samples on
    # the host (its stats say "chain"), an unconstrained one in the graph
    engine = Engine(NativeModel(str(dense_path)), n_ctx=256, n_batch=64, threads=1, draft_limit=4,
                    flash_attn="off", sampling="backend")
    try:
        prompt = [1, 2, 3, 4, 5]
        for grammar, where in ((LETTERS, "chain"), (None, "backend"), (LETTERS, "chain")):
            stats = RunStats()
            p = DecodeParams(max_tokens=12, seed=1, temperature=0.8, top_k=8, grammar=grammar)
            tokens = [t for step in engine.run(prompt, p, stats) for t in step.tokens]
            assert stats.sampling == where and len(tokens) > 0
            if grammar is not None:
                text = b"".join(engine.model.token_to_bytes(t) for t in tokens).decode()
                assert re.fullmatch(r"[a-z ]+", text), text
    finally:
        engine.close()


# --- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, param, words", [
    (dict(grammar='root ::= foo'), "grammar", "Undefined rule identifier 'foo'"),
    (dict(grammar='root ::= [a-'), "grammar", "unexpected end of input"),
    (dict(grammar='start ::= "a"'), "grammar", "'root'"),
    (dict(grammar='   '), "grammar", "non-empty"),
    (dict(json_schema='{"type": '), "json_schema", "not valid JSON"),
    (dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "json_schema",
     "at /properties/a: $ref '#/$defs/missing' points at nothing"),
    (dict(json_schema=[1, 2]), "json_schema", "dict"),
    (dict(grammar=LETTERS, json_schema=SCHEMA), "json_schema", "not both"),
])
def test_bad_constraints_are_refused_naming_the_keyword(dense_model, kw, param, words):
    with pytest.raises(ParamError, match=re.escape(words)) as info:
        dense_model.generate("x", max_tokens=2, **kw)
    assert info.value.param == param


def test_a_reversed_repetition_count_is_found_where_llama_cpp_reads_counts():
    """{m,n} with m > n made llama.cpp's parser build rules until the process ran out of
    memory; only counts outside strings, character classes and comments are counts."""
    from pymtp.constraint import renamed_rules, reversed_count

    assert reversed_count('root ::= "a"{5,2}') == "{5,2}"
    assert reversed_count('root ::= x\nx ::= ("a" | "b"){ 3 , 1 }') == "{ 3 , 1 }"
    for fine in ('root ::= "a"{2,5} "b"{3} "c"{0,} "d"{,4}', 'root ::= "{5,2}" [{9,1}] # {7,3}\n'):
        assert reversed_count(fine) is None, fine
    # the lexer renamed_rules shares with it keeps its text as it was
    gbnf = 'root ::= a "b\\"c" [d\\]x] x{1,2} # x\nx ::= "y"'
    assert renamed_rules(gbnf, {"x": "z"}) == 'root ::= a "b\\"c" [d\\]x] z{1,2} # x\nz ::= "y"'
