"""Drafts from a prediction (OpenAI's Predicted Outputs) at temperature > 0: rejection
sampling with q the point mass on each draft, and the exact-match rule, keep plain
sampling's distribution.

Apart from test_stochastic.py (whose helpers it uses) so that the GPU routine's slices
(tests/conftest.py deals whole files) can run the two side by side: with these tests in
it, that file made one slice of ~330 s alone on an H200, and over 600 s beside five
others (session 49), against a 600 s device call."""

from __future__ import annotations

import collections

import numpy as np

import pymtp
from test_stochastic import (  # noqa: F401  (path_model, plain_hist: fixtures)
    ALL_PATHS,
    LLAMA_PATHS,
    N,
    SAMPLING,
    _histogram,
    _plain_hist,
    chi2_homogeneity_pvalue,
    path_model,
    plain_hist,
)


def _predicted_reply(model) -> list[int]:
    """A prediction sampled runs often follow, and often leave: the greedy reply."""
    return model.generate(model.tokenize("The quick brown fox"), spec="none", max_tokens=8, ignore_eos=True).tokens


@ALL_PATHS
def test_drafts_from_a_prediction_keep_the_target_distribution(path_model):
    """Rejection sampling of a prediction's drafts (q the point mass on each) keeps plain
    sampling's distribution, where the runs follow the prediction and where they leave it."""
    prediction = _predicted_reply(path_model)
    stats: list = []
    prompt = path_model.tokenize("The quick brown fox")
    spec = collections.Counter()
    for seed in range(4 * N, 5 * N):
        r = path_model.generate(prompt, seed=seed, prediction=prediction, **SAMPLING)
        spec[tuple(r.tokens[1:3])] += 1
        stats.append(r.stats)
    assert chi2_homogeneity_pvalue(_plain_hist(path_model), spec) > 1e-3
    drafted = sum(s.predicted_drafted for s in stats)
    kept = sum(s.predicted_accepted for s in stats)
    assert 0 < kept < drafted          # drafts from the prediction were both kept and rejected
    assert sum(s.drafted for s in stats) > 0      # ... and the head drafted where the runs left it


@LLAMA_PATHS
def test_exact_match_of_a_predictions_drafts_keeps_the_target_distribution(path_model):
    spec = _histogram(path_model, range(5 * N, 6 * N), accept="exact", prediction=_predicted_reply(path_model),
                      **SAMPLING)
    assert chi2_homogeneity_pvalue(_plain_hist(path_model), spec) > 1e-3


def test_the_check_catches_a_prediction_drafted_with_the_wrong_q(dense_model, plain_hist, monkeypatch):
    """q of a prediction's draft said to be half its mass: kept twice as often as p allows."""
    monkeypatch.setattr(pymtp.sampling.Dist, "point",
                        classmethod(lambda cls, t: cls(np.array([t], dtype=np.int32), np.array([0.5]))))
    spec = _histogram(dense_model, range(4 * N, 5 * N), prediction=_predicted_reply(dense_model), **SAMPLING)
    assert chi2_homogeneity_pvalue(plain_hist, spec) < 1e-6
