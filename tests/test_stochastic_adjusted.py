"""temperature > 0 with penalties and a logit bias: speculative sampling keeps the
adjusted distribution, and greedy MTP equals plain decoding with them.

Apart from test_stochastic.py (whose helpers it uses) so that the GPU routine's slices
(tests/conftest.py deals whole files) can run the two side by side: together they made
one slice of ~500 s on an H200, against a 600 s device call."""

from __future__ import annotations

import collections
import math

import pytest

from conftest import TINY_F16, require_exact_kernels, shared_model
from test_stochastic import (  # noqa: F401  (path_model, plain_hist: fixtures)
    ALL_PATHS,
    N,
    SAMPLING,
    _emitted,
    _histogram,
    _path_model_of,
    chi2_homogeneity_pvalue,
    path_model,
    plain_hist,
)


# Penalties make each row depend on the tokens before it, drafts included (engine.History).
PENALTIES = dict(repeat_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.5, repeat_last_n=16)


@pytest.fixture(scope="module")
def plain_penalised_hist(dense_model):
    return _histogram(dense_model, range(N), spec="none", **SAMPLING, **PENALTIES)


def test_penalties_change_what_plain_sampling_emits(plain_hist, plain_penalised_hist):
    # else the test below would prove nothing about penalties
    assert chi2_homogeneity_pvalue(plain_hist, plain_penalised_hist) < 1e-6


def test_rejection_sampling_keeps_the_penalised_distribution(dense_model, plain_penalised_hist):
    spec = _histogram(dense_model, range(N, 2 * N), **SAMPLING, **PENALTIES)
    assert chi2_homogeneity_pvalue(plain_penalised_hist, spec) > 1e-3


def test_penalised_seeded_runs_repeat(dense_model):
    prompt = dense_model.tokenize("def f(x):")
    kw = dict(temperature=0.8, top_k=40, max_tokens=32, ignore_eos=True)
    a = _emitted(dense_model, prompt, seed=7, **kw, **PENALTIES)
    assert a == _emitted(dense_model, prompt, seed=7, **kw, **PENALTIES)
    assert a != _emitted(dense_model, prompt, seed=7, **kw)


def test_greedy_with_penalties_equals_plain(dense_model):
    # Greedy takes the argmax of the penalised row; MTP must reach the same tokens.
    require_exact_kernels()
    for prompt in ("The quick brown fox", "def f(x):"):
        kw = dict(max_tokens=40, ignore_eos=True, **PENALTIES)
        plain = dense_model.generate(prompt, spec="none", **kw)
        spec = dense_model.generate(prompt, spec="mtp", draft_max=3, **kw)
        assert spec.tokens == plain.tokens
        assert spec.stats.accepted > 0
        assert plain.tokens != dense_model.generate(prompt, spec="none", max_tokens=40, ignore_eos=True).tokens


def test_greedy_with_penalties_sees_the_drafts_before_each_row():
    # Code repeats tokens within a round, so a verify row that forgot the drafts before it
    # would penalise the wrong tokens: on this prompt that changed the output at token ~40.
    require_exact_kernels()
    model = shared_model(TINY_F16)
    for prompt in ("import os\nimport sys\n\n\ndef main(argv):\n    ", "for i in range(10):\n    print(i)\n"):
        kw = dict(max_tokens=64, ignore_eos=True, **PENALTIES)
        plain = model.generate(prompt, spec="none", **kw)
        assert model.generate(prompt, spec="mtp", draft_max=3, **kw).tokens == plain.tokens, prompt


# A logit bias moves each row by a fixed amount (sampling_filters.bias_logits): banned, lifted and
# lowered tokens among the likeliest few of this prompt's rows.
def _bias_for(model, prompt: str, **kw) -> dict[int, float]:
    """A bias that bites on ``prompt``: ban plain decoding's 2nd token, lift its 4th."""
    plain = model.generate(prompt, spec="none", max_tokens=4, ignore_eos=True, **kw).tokens
    return {plain[1]: -math.inf, plain[3]: 3.0}


@pytest.fixture(scope="module")
def bias(dense_model):
    return _bias_for(dense_model, "The quick brown fox")


_biased_hists: dict = {}


def _plain_biased_hist(model, bias) -> collections.Counter:
    if model.sampling not in _biased_hists:
        _biased_hists[model.sampling] = _histogram(model, range(N), spec="none", logit_bias=bias, **SAMPLING)
    return _biased_hists[model.sampling]


def test_a_bias_changes_what_plain_sampling_emits(dense_model, plain_hist, bias):
    # else the tests below would prove nothing about the bias
    assert chi2_homogeneity_pvalue(plain_hist, _plain_biased_hist(dense_model, bias)) < 1e-6


@ALL_PATHS
def test_rejection_sampling_keeps_the_biased_distribution(path_model, bias):
    spec = _histogram(path_model, range(N, 2 * N), logit_bias=bias, **SAMPLING)
    assert chi2_homogeneity_pvalue(_plain_biased_hist(path_model, bias), spec) > 1e-3


def test_the_graph_samples_the_hosts_biased_distribution(dense_model, dense_path, bias):
    # the graph's logit_bias sampler, first in its chain, against the host's bias
    graph = _path_model_of(dense_path, "backend")
    assert chi2_homogeneity_pvalue(_plain_biased_hist(dense_model, bias),
                                   _plain_biased_hist(graph, bias)) > 1e-3


def _batched(model, prompt, **kw) -> tuple[list[int], str]:
    """A request's tokens through a batcher, and where its rows were sampled."""
    b = model.batcher(1)
    try:
        run = b.submit(prompt, **kw)
        return b.results([run])[0].tokens, run.request.stats.sampling
    finally:
        b.close()


@pytest.mark.parametrize("sampling", ["chain", "backend"])
@pytest.mark.parametrize("extra", [{}, PENALTIES], ids=["bias", "bias-penalties"])
def test_greedy_with_a_bias_equals_plain(dense_model, dense_path, extra, sampling):
    # Greedy takes the argmax of the biased (then penalised) row in every verify row: on
    # the host (biased_argmax over the rows at once; row by row with penalties), or in
    # the graph where the bias is all (its logit_bias sampler, then its argmax).
    require_exact_kernels()
    model = dense_model if sampling == "chain" else _path_model_of(dense_path, sampling)
    where = "backend" if sampling == "backend" and not extra else "greedy"
    for prompt in ("The quick brown fox", "def f(x):"):
        kw = dict(max_tokens=40, ignore_eos=True, logit_bias=_bias_for(dense_model, prompt, **extra), **extra)
        plain = model.generate(prompt, spec="none", **kw)
        spec = model.generate(prompt, spec="mtp", draft_max=3, **kw)
        assert spec.tokens == plain.tokens
        assert spec.tokens == dense_model.generate(prompt, spec="none", **kw).tokens      # the host's
        assert spec.stats.accepted > 0
        assert _batched(model, prompt, spec="mtp", draft_max=3, **kw) == (plain.tokens, where)
        unbiased = dense_model.generate(prompt, spec="none", max_tokens=40, ignore_eos=True, **extra).tokens
        assert plain.tokens != unbiased
        banned = [t for t, b in kw["logit_bias"].items() if b == -math.inf]
        assert not set(banned) & set(plain.tokens)
