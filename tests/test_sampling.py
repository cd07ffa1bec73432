"""Sampling filters on hand-made vectors, the filter order, greedy, and the RNG contract."""

import math

import numpy as np
import pytest

from pymtp.backend_sampling import draws_in_a_fixed_order, plain_token, reads_probabilities
from pymtp.sampling import CHAIN_ROW_MAX, SHORT_DRAW, Dist, History, draw, make_sampler
from pymtp.sampling_filters import (
    LogitBias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    bias_logits,
    biased_argmax,
    softmax,
)


def ids_of(n):
    return np.arange(n, dtype=np.int32)


# Both host paths must build the same distribution (pymtp/sampling.py, "Two host paths").
PATHS = pytest.mark.parametrize("path", ["chain", "numpy"])


# --- top_k --------------------------------------------------------------------------

def test_top_k_keeps_largest_in_id_order():
    ids, x = apply_top_k(ids_of(4), np.array([1.0, 3.0, 2.0, 0.0]), 2)
    assert ids.tolist() == [1, 2]
    assert x.tolist() == [3.0, 2.0]


def test_top_k_ties_at_the_cut_go_to_lowest_id():
    ids, _ = apply_top_k(ids_of(5), np.array([1.0, 2.0, 5.0, 2.0, 2.0]), 3)
    assert ids.tolist() == [1, 2, 3]


def test_top_k_zero_or_large_keeps_all():
    x = np.array([1.0, 3.0, 2.0])
    for k in (0, 3, 10):
        ids, y = apply_top_k(ids_of(3), x, k)
        assert ids.tolist() == [0, 1, 2] and y.tolist() == x.tolist()


# --- top_p --------------------------------------------------------------------------

P4 = np.array([0.1, 0.4, 0.2, 0.3])


@pytest.mark.parametrize("top_p, kept", [
    (0.3, [1]),            # 0.4 alone reaches 0.3
    (0.65, [1, 3]),        # 0.4 + 0.3: the token that crosses is kept
    (0.75, [1, 2, 3]),
    (0.95, [0, 1, 2, 3]),
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_support(top_p, kept):
    ids, x = apply_top_p(ids_of(4), np.log(P4), top_p)
    assert ids.tolist() == kept
    np.testing.assert_array_equal(x, np.log(P4)[kept])


def test_top_p_renormalises_over_current_support():
    # top_k=3 drops token 1; the rest renormalise to (0.4, 0.2, 0.3) / 0.9, where 0.4 + 0.3
    # reaches 0.75. Summing the raw probabilities (0.7) would keep token 2 as well.
    ids, x = apply_top_k(ids_of(4), np.log(np.array([0.4, 0.1, 0.2, 0.3])), 3)
    assert ids.tolist() == [0, 2, 3]
    ids, _ = apply_top_p(ids, x, 0.75)
    assert ids.tolist() == [0, 3]


def _top_p_reference(logits, top_p):
    order = np.argsort(-logits, kind="stable")
    probs = softmax(logits)
    n = int(np.searchsorted(np.cumsum(probs[order]), top_p, side="left")) + 1
    return np.sort(order[:n])


@pytest.mark.parametrize("scale", [0.05, 0.5, 3.0])   # flat to peaked
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_full_sort_on_large_rows(scale, top_p):
    # Rows large enough that the nucleus exceeds the first 1024/4096 pools.
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(30_000) * scale).astype(np.float32)
    ids, _ = apply_top_p(ids_of(logits.size), logits, top_p)
    np.testing.assert_array_equal(ids, _top_p_reference(logits.astype(np.float64), top_p))


# --- min_p and temperature ----------------------------------------------------------

def test_min_p_is_relative_to_the_top_token():
    probs = np.array([0.5, 0.3, 0.04, 0.16])
    ids, _ = apply_min_p(ids_of(4), np.log(probs), 0.1)  # keep p >= 0.05
    assert ids.tolist() == [0, 1, 3]
    ids, _ = apply_min_p(ids_of(4), np.log(probs), 0.0)
    assert ids.tolist() == [0, 1, 2, 3]
    ids, _ = apply_min_p(ids_of(4), np.log(probs), 1.0)
    assert ids.tolist() == [0]


def test_temperature_and_softmax():
    x = apply_temperature(np.array([0.0, math.log(2.0)], dtype=np.float32), 0.5)
    assert x.dtype == np.float64
    np.testing.assert_allclose(softmax(x), [0.2, 0.8], rtol=1e-7)
    np.testing.assert_allclose(softmax(np.array([1000.0, 1000.0, -np.inf])), [0.5, 0.5, 0.0])


# --- argument checks ----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=float("nan")), r"top_p must be a number, got nan"),
    (dict(top_k=-1), r"top_k must be an integer >= 0 \(0 disables it\), got -1"),
    (dict(top_k=2.5), r"top_k must be an integer, got 2.5"),
    (dict(top_k=True), r"top_k must be an integer, got True"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    (dict(temperature=-1.0), r"temperature must be finite and >= 0, got -1.0"),
    (dict(temperature=float("inf")), r"temperature must be finite and >= 0"),
    (dict(temperature=1e-38), r"temperature must be 0 \(greedy\) or from 1e-30 to 1e\+30, got 1e-38"),
    (dict(temperature=1e39), r"temperature must be 0 \(greedy\) or from 1e-30 to 1e\+30, got 1e\+39"),
])
def test_make_sampler_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_sampler(**kwargs)


def test_a_top_k_at_or_past_the_vocabulary_is_off():
    assert make_sampler(0.7, top_k=100, n_vocab=100).top_k == 0
    assert make_sampler(0.7, top_k=10**6, n_vocab=100).top_k == 0
    assert make_sampler(0.7, top_k=99, n_vocab=100).top_k == 99
    assert make_sampler(0.7, top_k=10**6).top_k == 10**6       # no vocabulary to weigh it against


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_a_top_k_past_the_vocabulary_samples_as_none_in_the_graph(dense_path, spec):
    # ggml's top_k in a decode graph asserts k <= the row (the process aborted, SIGABRT);
    # a top_k past the vocabulary keeps every token, so it samples as no top_k at all
    import pymtp
    with pymtp.load(dense_path, threads=1, n_ctx=256, sampling="backend") as m:
        kw = dict(max_tokens=8, temperature=0.8, seed=3, spec=spec)
        got = m.generate("a b", top_k=m.n_vocab + 1, **kw)
        assert got.tokens == m.generate("a b", top_k=0, **kw).tokens
        assert m.generate("a b", top_k=10**6, **kw).tokens == got.tokens


@pytest.mark.parametrize("min_p", [1.0, 0.9999999])
def test_a_min_p_the_graph_cannot_hold_samples_on_the_host(dense_path, min_p):
    # llama.cpp's in-graph min_p kept no token at all there: plain rounds drew the last id
    # every time, drafted ones raised IndexError on an empty distribution
    import pymtp
    with pymtp.load(dense_path, threads=1, n_ctx=256) as chain, \
            pymtp.load(dense_path, threads=1, n_ctx=256, sampling="backend") as graph:
        for kw in (dict(spec="none"), dict(spec="mtp"), dict(spec="none", top_k=1)):
            kw = dict(max_tokens=8, temperature=0.7, seed=1, min_p=min_p, **kw)
            want = chain.generate("a b", **kw).tokens
            assert graph.generate("a b", **kw).tokens == want, kw
            assert want != [graph.n_vocab - 1] * 8
        got = graph.generate_batch(["a b", "the quick"], max_tokens=8, temperature=0.7, seed=1, min_p=min_p,
                                   spec="none")
        assert [r.tokens for r in got] == [chain.generate(p, max_tokens=8, temperature=0.7, seed=1, min_p=min_p,
                                                          spec="none").tokens for p in ("a b", "the quick")]


@pytest.mark.parametrize("path", ["chain", "numpy", "backend"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_logit_bias_that_bans_every_token_is_refused_on_every_path(dense_path, path, temperature):
    # llama.cpp's draw took a banned token, numpy's raised NothingToDraw, greedy ended the
    # text at once: the request is refused before it runs, naming logit_bias
    import pymtp
    from pymtp.config import ParamError
    with pymtp.load(dense_path, threads=1, n_ctx=256, sampling=path) as m:
        banned = dict.fromkeys(range(m.n_vocab), float("-inf"))
        with pytest.raises(ParamError, match="bans every token of the vocabulary") as exc:
            m.generate("a b", max_tokens=4, temperature=temperature, seed=1, logit_bias=banned)
        assert exc.value.param == "logit_bias"
        del banned[7]
        got = m.generate("a b", max_tokens=4, temperature=temperature, seed=1, logit_bias=banned, ignore_eos=True)
        assert got.tokens == [7] * 4


def test_make_sampler_rejects_an_unknown_path():
    with pytest.raises(ValueError, match=r"path must be 'chain' or 'numpy', got 'c'"):
        make_sampler(temperature=0.7, path="c")


def test_filters_reject_bad_arguments():
    ids, x = ids_of(3), np.zeros(3)
    with pytest.raises(ValueError, match="top_k"):
        apply_top_k(ids, x, -2)
    with pytest.raises(ValueError, match="top_p"):
        apply_top_p(ids, x, 1.5)
    with pytest.raises(ValueError, match="min_p"):
        apply_min_p(ids, x, 2.0)
    with pytest.raises(ValueError, match=r"apply_temperature needs a finite temperature > 0, got 0"):
        apply_temperature(x, 0)


@PATHS
def test_dist_rejects_nan_and_bad_shapes(path):
    sampler = make_sampler(temperature=1.0, path=path)
    for kwargs in (dict(), dict(top_k=2), dict(top_p=0.9), dict(min_p=0.1)):
        with pytest.raises(ValueError, match="NaN"):
            make_sampler(temperature=1.0, path=path, **kwargs).dist(np.array([0.0, np.nan, 1.0]))
        long_row = np.zeros(300_001, dtype=np.float32)
        long_row[[7, 300_000][len(kwargs) % 2]] = np.nan     # inside the grid, and in its tail
        with pytest.raises(ValueError, match="NaN"):
            make_sampler(temperature=1.0, top_k=40, path=path).dist(long_row)
    with pytest.raises(ValueError, match="all -inf"):
        sampler.dist(np.full(3, -np.inf))
    with pytest.raises(ValueError, match="1-D"):
        sampler.dist(np.zeros((2, 3)))


# --- the whole chain ----------------------------------------------------------------

@PATHS
def test_chain_order_top_k_top_p_min_p_temperature(path):
    # top_k=4 drops token 0; over the rest (0.4, 0.25, 0.2, 0.1)/0.95 top_p=0.8 keeps
    # {1, 2, 3}; min_p=0.6 keeps p >= 0.24 of the raw row, {1, 2}; temperature 0.5 squares.
    logits = np.log(np.array([0.05, 0.4, 0.25, 0.2, 0.1])) + 3.0
    d = make_sampler(temperature=0.5, top_k=4, top_p=0.8, min_p=0.6, path=path).dist(logits)
    assert d.ids.dtype == np.int32 and d.probs.dtype == np.float64
    assert d.ids.tolist() == [1, 2]
    np.testing.assert_allclose(d.probs, [0.16 / 0.2225, 0.0625 / 0.2225], rtol=1e-12)


@PATHS
def test_filters_see_the_temperature_one_distribution(path):
    # At temperature 1, (0.5, 0.3, 0.2) needs two tokens to reach top_p=0.6. Were the
    # temperature applied first, 0.5**2/0.38 = 0.66 alone would reach it.
    d = make_sampler(temperature=0.5, top_p=0.6, path=path).dist(np.log([0.5, 0.3, 0.2]))
    assert d.ids.tolist() == [0, 1]
    np.testing.assert_allclose(d.probs, [0.25 / 0.34, 0.09 / 0.34], rtol=1e-12)


@PATHS
def test_no_filters_gives_the_full_softmax(path):
    logits = np.array([0.0, 1.0, -np.inf, 2.0], dtype=np.float32)
    d = make_sampler(temperature=1.0, path=path).dist(logits)
    assert d.ids.tolist() == [0, 1, 2, 3]
    e = np.exp([0.0, 1.0, 0.0, 2.0]) * [1, 1, 0, 1]
    np.testing.assert_allclose(d.probs, e / e.sum(), rtol=1e-12)


def test_greedy_is_argmax_with_ties_to_lowest_id():
    sampler = make_sampler(temperature=0.0, top_k=1, top_p=0.1)
    assert sampler.is_greedy
    d = sampler.dist(np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32))
    assert d.ids.tolist() == [1] and d.probs.tolist() == [1.0]
    assert sampler(np.array([1.0, 3.0, 3.0, 0.0])) == 1


# --- Dist and draw ------------------------------------------------------------------

def test_dist_lookups():
    d = Dist.from_dense([0.0, 0.5, 0.0, 0.25, 0.25])
    assert d.ids.tolist() == [1, 3, 4]
    assert d.prob(3) == 0.25 and d.prob(0) == 0.0 and d.prob(9) == 0.0
    assert d.probs_at(np.array([4, 2, 1, 7])).tolist() == [0.25, 0.0, 0.5, 0.0]
    assert d.to_dense(5).tolist() == [0.0, 0.5, 0.0, 0.25, 0.25]


def test_draw_follows_the_probabilities_and_skips_zeros():
    d = Dist(np.array([2, 5, 6, 9], dtype=np.int32), np.array([0.5, 0.0, 0.2, 0.3]))
    rng = np.random.default_rng(11)
    tokens = np.array([draw(d, rng) for _ in range(20_000)])
    counts = np.array([(tokens == t).sum() for t in (2, 5, 6, 9)])
    assert counts[1] == 0
    assert counts.sum() == 20_000
    np.testing.assert_allclose(counts / 20_000, [0.5, 0.0, 0.2, 0.3], atol=0.015)


def test_draw_is_inverse_cdf_of_one_uniform():
    d = Dist(np.array([2, 5, 6, 9], dtype=np.int32), np.array([0.5, 0.0, 0.2, 0.3]))
    for seed in range(20):
        u = np.random.default_rng(seed).random()
        expected = 2 if u < 0.5 else 6 if u < 0.7 else 9
        assert draw(d, np.random.default_rng(seed)) == expected


# --- reproducibility ----------------------------------------------------------------

def _run(sampler, rows):
    return [sampler(row) for row in rows]


def test_same_seed_same_samples():
    rows = np.random.default_rng(0).standard_normal((40, 100)).astype(np.float32)
    a = _run(make_sampler(temperature=1.0, top_p=0.9, seed=123), rows)
    b = _run(make_sampler(temperature=1.0, top_p=0.9, seed=123), rows)
    c = _run(make_sampler(temperature=1.0, top_p=0.9, seed=124), rows)
    assert a == b
    assert a != c


def test_the_graphs_seed_is_a_child_of_the_seed_not_a_draw():
    # The dist a request runs in the decode graph is seeded from a child of its seed, so
    # the host's generator gives the same stream whether or not the graph takes the
    # request (a batch may send a request to the host that alone sampled in the graph).
    for path in ("chain", "numpy"):
        s = make_sampler(temperature=0.8, top_k=40, seed=1, path=path)
        assert s.draw_seed == int(np.random.SeedSequence(1).spawn(1)[0].generate_state(1)[0])
        assert s.rng.random(4).tolist() == np.random.default_rng(1).random(4).tolist()
    assert make_sampler(temperature=0.8, seed=None).draw_seed is None      # unseeded: fresh entropy
    assert make_sampler(temperature=0.0, seed=1).draw_seed is None         # greedy draws nothing


def test_each_sample_consumes_one_uniform():
    # A one-point dist advances the generator exactly as a wide one does, so the samples
    # after it do not depend on the support sizes that came before.
    row = np.random.default_rng(0).standard_normal(100)
    wide, narrow = make_sampler(temperature=1.0, seed=5), make_sampler(temperature=1.0, seed=5)
    wide.sample(wide.dist(row))
    narrow.sample(Dist(np.array([7], dtype=np.int32), np.ones(1)))
    assert [wide(row) for _ in range(10)] == [narrow(row) for _ in range(10)]


# --- the fast paths against plain references ----------------------------------------
#
# top_k finds its cut among group maxima, top_p on a long row among counted bins, and a
# draw from a wide support walks a blocked CDF; each must give what the obvious full-row
# computation gives, token for token.

def _top_k_reference(logits, k):
    order = np.argsort(-logits, kind="stable")   # ties -> lower id
    return np.sort(order[:k])


def _long_tail_row(rng, n, head=50, flat_scale=0.3):
    """A row shaped like a padded 248k model's: a few real tokens well above a wide flat tail."""
    row = rng.standard_normal(n).astype(np.float32) * flat_scale
    row[rng.choice(n, head, replace=False)] += rng.uniform(3.0, 12.0, head).astype(np.float32)
    return row


@pytest.mark.parametrize("n, k", [(248_320, 40), (248_320, 20), (8_192, 40), (8_192, 1), (30_000, 500)])
def test_top_k_shortcut_matches_a_full_sort(n, k):
    rng = np.random.default_rng(n + k)
    for trial in range(3):
        row = _long_tail_row(rng, n) if trial else rng.standard_normal(n).astype(np.float32)
        ids, x = apply_top_k(ids_of(n), row, k)
        np.testing.assert_array_equal(ids, _top_k_reference(row, k))
        np.testing.assert_array_equal(x, row[ids])


def test_top_k_shortcut_ties_at_the_cut_go_to_lowest_id():
    # 100 tokens share the 40th-largest value: the lowest 25 ids among them are kept.
    row = np.zeros(50_000, dtype=np.float32)
    tied = np.sort(np.random.default_rng(1).choice(50_000, 100, replace=False))
    row[tied] = 1.0
    row[:15] = 2.0
    ids, _ = apply_top_k(ids_of(row.size), row, 40)
    assert ids.tolist() == list(range(15)) + tied[tied >= 15][:25].tolist()


def test_top_k_shortcut_handles_inf_and_nan():
    row = np.full(100_000, -np.inf, dtype=np.float32)
    row[[5, 77_000, 99_999]] = [1.0, 3.0, 2.0]
    ids, _ = apply_top_k(ids_of(row.size), row, 2)
    assert ids.tolist() == [77_000, 99_999]
    row[12_345] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        apply_top_k(ids_of(row.size), row, 2)


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.95, 0.99])
def test_top_p_matches_full_sort_on_long_tail_rows(top_p):
    # Flat tails make nuclei of tens of thousands of tokens: the counted bins must cut
    # exactly where a full sort does.
    rng = np.random.default_rng(int(top_p * 100))
    for _ in range(3):
        row = _long_tail_row(rng, 248_320)
        ids, x = apply_top_p(ids_of(row.size), row, top_p)
        np.testing.assert_array_equal(ids, _top_p_reference(row.astype(np.float64), top_p))
        np.testing.assert_array_equal(x, row[ids])


def test_top_p_on_a_long_row_with_ties_and_minus_inf():
    row = np.full(20_000, -np.inf, dtype=np.float32)
    row[:10_000] = np.repeat(np.arange(10, dtype=np.float32) / 4, 1_000)   # ten plateaus
    ids, _ = apply_top_p(ids_of(row.size), row, 0.5)
    np.testing.assert_array_equal(ids, _top_p_reference(row.astype(np.float64), 0.5))


def _draw_reference(d, u):
    cdf = np.cumsum(d.probs)
    return int(d.ids[np.searchsorted(cdf, u * cdf[-1], side="right")])


def test_blocked_draw_is_the_inverse_cdf():
    rng = np.random.default_rng(3)
    probs = rng.random(248_320) ** 8           # uneven, with many near-zero entries
    probs[rng.choice(probs.size, 50_000, replace=False)] = 0.0
    d = Dist(ids_of(probs.size), probs / probs.sum())
    for seed in range(300):
        u = np.random.default_rng(seed).random()
        token = draw(d, np.random.default_rng(seed))
        assert token == _draw_reference(d, u)
        assert d.probs[token] > 0


def test_short_draw_is_the_inverse_cdf():
    # A filtered row's few candidates are walked in Python (SHORT_DRAW): the same index as
    # numpy's cumsum and searchsorted for every u, at the cuts between entries and where
    # u times the total rounds up to it, never a zero-probability entry.
    rng = np.random.default_rng(5)
    for size in (2, 3, 7, SHORT_DRAW):
        for _ in range(40):
            probs = rng.random(size) ** 4
            probs[rng.random(size) < 0.3] = 0.0
            probs[rng.integers(size)] = 0.5          # one nonzero at least
            d = Dist(ids_of(size), probs / probs.sum())
            cdf = np.cumsum(d.probs)
            for u in [*rng.random(20), *(cdf / cdf[-1]), np.nextafter(1.0, 0.0)]:
                token = draw(d, _Fixed(u))
                expected = _draw_reference(d, u) if u * cdf[-1] < cdf[-1] else int(np.flatnonzero(d.probs)[-1])
                assert token == expected and d.probs[token] > 0


class _Fixed:
    """A generator whose random() is the given u."""

    def __init__(self, u: float) -> None:
        self.u = float(u)

    def random(self) -> float:
        return self.u


@PATHS
def test_dists_do_not_share_scratch_memory(path):
    # Full-row work arrays are reused across calls; what a Dist holds must not be one.
    rows = np.random.default_rng(4).standard_normal((2, 50_000)).astype(np.float32)
    for kw in (dict(top_k=40), dict(top_p=0.9), dict(min_p=0.01), dict(),
               dict(top_k=40, presence_penalty=1.0)):
        sampler = make_sampler(temperature=0.8, path=path, **kw)
        first = sampler.dist(rows[0], np.array([1, 2, 3]))
        ids, probs = first.ids.copy(), first.probs.copy()
        sampler.dist(rows[1], np.array([4, 5]))
        np.testing.assert_array_equal(first.ids, ids)
        np.testing.assert_array_equal(first.probs, probs)


# --- penalties ----------------------------------------------------------------------

def test_penalties_follow_llama_cpp():
    # Token 0 seen twice, token 1 once: positive logits are divided by repeat_penalty,
    # negative ones multiplied, then count * frequency + presence is subtracted.
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    out = apply_penalties(logits, np.array([0, 1, 0]), 2.0, 0.5, 0.25)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.float32([2.0 / 2 - 2 * 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0]))
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 3.0])   # the input row is untouched
    np.testing.assert_array_equal(apply_penalties(logits, np.array([], dtype=np.int32), 2.0, 1.0, 1.0), logits)


def test_negative_penalties_favour_repeats():
    out = apply_penalties(np.zeros(3, dtype=np.float32), np.array([2]), 1.0, -0.5, -1.0)
    assert out.tolist() == [0.0, 0.0, 1.5]


def test_penalties_look_back_repeat_last_n_tokens():
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    recent = np.array([2, 1, 0])      # token 0 came last
    base = dict(temperature=0.0, presence_penalty=1.0)
    assert make_sampler(**base, repeat_last_n=1).argmax(logits, recent) == 1    # only 0: 2.0 < 2.9
    assert make_sampler(**base, repeat_last_n=2).argmax(logits, recent) == 0    # 0 and 1: 2.0 > 1.9
    assert make_sampler(**base, repeat_last_n=-1).argmax(logits, np.array([0, 2])) == 1
    assert make_sampler(**base, repeat_last_n=0).argmax(logits, recent) == 0    # 0: off
    assert make_sampler(temperature=0.0).argmax(logits, recent) == 0            # no penalties: raw argmax


@PATHS
def test_penalties_come_before_the_filters(path):
    # presence 2 pushes token 0 (logit 3) below token 1 (2.5): top_k=1 keeps token 1.
    d = make_sampler(temperature=1.0, top_k=1, presence_penalty=2.0, path=path).dist(
        np.array([3.0, 2.5, 0.0], dtype=np.float32), np.array([0]))
    assert d.ids.tolist() == [1]


def test_history_windows():
    h = History(np.array([1, 2, 3, 4]), lookback=3)
    assert h.recent().tolist() == [2, 3, 4]
    h.extend([5, 6])
    assert h.recent(np.array([7])).tolist() == [4, 5, 6, 7]     # the sampler keeps the last 3
    assert History(np.array([1, 2]), lookback=-1).recent([3]).tolist() == [1, 2, 3]
    off = History(np.array([1, 2]), lookback=0)
    off.extend([3])
    assert off.recent([4]) is None


# --- logit bias -------------------------------------------------------------------------

def test_logit_bias_adds_in_float32_as_llama_cpp_does():
    # The numbers of llama.cpp's own logit_bias sampler on the same row, bit for bit.
    from pymtp.native_samplers import SamplerChain, TokenDataArray

    rng = np.random.default_rng(5)
    row = rng.standard_normal(8_192).astype(np.float32) * 4
    bias = LogitBias.of({7: 0.1, 100: -3.3, 8_191: 42.0, 12: -math.inf, 55: 0.0})
    assert bias.ids.tolist() == [7, 12, 100, 8_191]            # zeros dropped, ids ascending
    ours = bias_logits(row, bias)
    chain = SamplerChain().add_logit_bias(row.size, bias.ids, bias.values)
    cur = TokenDataArray(row.size)
    cur.set(row)
    chain.apply(cur)
    theirs = cur.result()
    np.testing.assert_array_equal(ours[theirs["id"]], theirs["logit"])
    assert ours[12] == -math.inf and ours[8_191] == row[8_191] + np.float32(42.0)
    np.testing.assert_array_equal(np.delete(ours, [7, 12, 100, 8_191]), np.delete(row, [7, 12, 100, 8_191]))
    assert LogitBias.of({3: 0.0}) is None and LogitBias.of(None) is None


def test_biased_argmax_is_the_argmax_of_the_biased_rows():
    # Rows of few distinct values (ties everywhere), biases that lift, lower, ban and tie:
    # each row's token is np.argmax of its biased copy, ties to the lowest id, including
    # rows whose top is biased (banned or lowered) and rows every bias leaves below.
    rng = np.random.default_rng(11)
    for trial in range(300):
        vocab = int(rng.integers(2, 40))
        rows = rng.integers(-3, 4, size=(int(rng.integers(1, 6)), vocab)).astype(np.float32)
        ids = rng.choice(vocab, size=int(rng.integers(1, vocab + 1)), replace=False)
        # odd trials only lower (the path of a ban, ignore_eos's): every other may lift too
        values = rng.choice([-math.inf, -2.0, -1.0] + ([] if trial % 2 else [1.0, 0.5, 3.0]), size=ids.size)
        bias = LogitBias.of(dict(zip(ids.tolist(), values.tolist())))
        assert bias.lowers == (trial % 2 == 1 or bool((values <= 0).all()))
        want = [int(np.argmax(bias_logits(r, bias))) for r in rows]
        assert biased_argmax(rows, bias).tolist() == want, trial
        s = make_sampler(temperature=0.0, logit_bias=dict(zip(ids.tolist(), values.tolist())))
        assert s.argmaxes(rows).tolist() == want and s.argmax(rows[0]) == want[0]
    # the cases by name: a biased id ties the raw top (lower id wins either way), the top banned
    row = np.float32([0.0, 2.0, 1.0, 2.0])
    assert biased_argmax(row, LogitBias.of({0: 2.0})).tolist() == [0]      # 2.0 ties id 1, lower
    assert biased_argmax(row, LogitBias.of({3: 0.5})).tolist() == [3]
    assert biased_argmax(row, LogitBias.of({2: 1.0})).tolist() == [1]      # 2.0 ties id 1, higher
    assert biased_argmax(row, LogitBias.of({1: -math.inf})).tolist() == [3]
    assert biased_argmax(row, LogitBias.of({1: -math.inf, 3: -math.inf})).tolist() == [2]


def test_logit_bias_comes_before_the_penalties():
    # llama-server's chain: logit_bias first. Token 0's logit 1 + 1 = 2 is halved by the
    # repeat penalty to 1.0, below token 1's 1.5; penalised first it would be 0.5 + 1 = 1.5
    # and win the tie at the lowest id.
    logits = np.array([1.0, 1.5, 0.0], dtype=np.float32)
    s = make_sampler(temperature=0.0, repeat_penalty=2.0, logit_bias={0: 1.0})
    np.testing.assert_array_equal(s.adjusted(logits, np.array([0])), np.float32([1.0, 1.5, 0.0]))
    assert s.argmax(logits, np.array([0])) == 1
    np.testing.assert_array_equal(logits, [1.0, 1.5, 0.0])       # the decoded row is untouched


@PATHS
def test_logit_bias_moves_the_argmax_and_the_distribution(path):
    row = np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    assert make_sampler(temperature=0.0, logit_bias={0: -100}).argmax(row) == 1
    assert make_sampler(temperature=0.0, logit_bias={3: 100}).argmax(row) == 3
    assert make_sampler(temperature=0.0).argmax(row) == 0
    d = make_sampler(temperature=0.5, top_k=2, logit_bias={0: -math.inf, 3: 2.5}, path=path).dist(row)
    assert d.ids.tolist() == [1, 3]          # 0 banned; 3 lifted to 2.5, above 1's 2.0
    np.testing.assert_allclose(d.probs, [1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-1.0))])   # 2.0 and 2.5 at T=0.5
    plain = make_sampler(temperature=0.5, top_k=2, path=path).dist(row)
    assert plain.ids.tolist() == [0, 1]


def test_llama_cpps_draw_takes_the_bias_first():
    # The draw chain from the raw row: llama.cpp's logit_bias, then the filters and dist,
    # as llama-server's chain. Without the vocabulary's size there is no such chain.
    s = make_sampler(temperature=0.7, top_k=40, seed=1, logit_bias={5: 1.0}, n_vocab=8_192)
    assert s.adjusts and s.draws_natively(8_192, constrained=False)
    assert s.draw_chain.names() == ["logit-bias", "top-k", "temp", "dist"]
    assert s.chain.names() == ["top-k", "temp"]             # the host's row is biased already
    assert make_sampler(temperature=0.7, top_k=40, seed=1, logit_bias={5: 1.0}).draw_chain is None
    assert not make_sampler(temperature=0.7, top_k=40, seed=1).adjusts


def test_llama_cpps_biased_draw_follows_the_biased_distribution():
    # A row whose top token is banned and whose 4th is lifted to the top: 4,000 native
    # draws land where the host's biased distribution puts its mass.
    from pymtp.native_samplers import TokenDataArray

    row = np.array([4.0, 3.0, 2.5, 1.0, 0.0, -1.0], dtype=np.float32)
    kw = dict(temperature=1.0, top_k=3, logit_bias={0: -math.inf, 3: 2.5})
    s = make_sampler(seed=2, n_vocab=row.size, **kw)
    want = make_sampler(path="numpy", **kw).dist(row)
    assert want.ids.tolist() == [1, 2, 3]
    cur = TokenDataArray(row.size)
    counts = np.zeros(row.size)
    for _ in range(4_000):
        cur.set(row)
        s.draw_chain.apply(cur)
        counts[cur.result()[cur.selected]["id"]] += 1
    assert counts[[0, 4, 5]].sum() == 0
    np.testing.assert_allclose(counts[[1, 2, 3]] / 4_000, want.probs, atol=0.03)


@pytest.mark.parametrize("bias, message", [
    ({"5": 1.0}, r"logit_bias keys must be token ids \(integers >= 0\), got '5'"),
    ({-1: 1.0}, r"logit_bias keys must be token ids \(integers >= 0\), got -1"),
    ({5: 101}, r"logit_bias for token 5 must be in \[-100, 100\] \(or -inf to ban it\), got 101"),
    ({5: math.inf}, r"logit_bias for token 5 must be in \[-100, 100\]"),
    ({5: "1"}, r"logit_bias must be a number, got '1'"),
    ([(5, 1.0)], r"logit_bias must map token ids to biases \(a dict\)"),
])
def test_logit_bias_arguments_are_checked(bias, message):
    with pytest.raises(ValueError, match=message):
        make_sampler(temperature=0.7, logit_bias=bias)


@pytest.mark.parametrize("kwargs, message", [
    (dict(repeat_penalty=0.0), r"repeat_penalty must be finite and > 0 \(1 disables it\), got 0.0"),
    (dict(repeat_penalty=float("inf")), r"repeat_penalty must be finite and > 0"),
    (dict(frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\] \(0 disables it\), got 2.5"),
    (dict(presence_penalty=-3), r"presence_penalty must be in \[-2, 2\] \(0 disables it\), got -3"),
    (dict(presence_penalty="1"), r"presence_penalty must be a number, got '1'"),
    (dict(repeat_last_n=-2), r"repeat_last_n must be an integer >= -1 \(0 disables penalties, -1 looks at "
                             r"every token\), got -2"),
    (dict(repeat_last_n=1.5), r"repeat_last_n must be an integer, got 1.5"),
])
def test_penalty_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_sampler(temperature=0.7, **kwargs)


# --- llama.cpp's chain against the numpy filters --------------------------------------

SETTINGS = [dict(top_k=40, top_p=0.95, min_p=0.05),     # llama-server's defaults
            dict(top_k=20, top_p=0.8),                  # Qwen's
            dict(top_p=0.95), dict(min_p=0.1), dict(top_k=3), dict()]


@pytest.mark.parametrize("n", [8_192, 248_320])
@pytest.mark.parametrize("kw", SETTINGS)
def test_chain_path_matches_the_numpy_path(n, kw):
    # Rows without ties: the two paths keep the same support and give the same numbers
    # (one float64 softmax of the row's own logits), token for token.
    rng = np.random.default_rng(n + len(kw))
    for scale in (1.0, 3.0):
        rows = [_long_tail_row(rng, n) * scale, rng.standard_normal(n).astype(np.float32) * scale]
        for row in rows:
            a = make_sampler(temperature=0.7, path="chain", **kw).dist(row)
            b = make_sampler(temperature=0.7, path="numpy", **kw).dist(row)
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_array_equal(a.probs, b.probs)


def test_chain_path_uses_llama_cpps_filters():
    # The chain is llama.cpp's: its samplers in llama-server's order, neutral ones left out.
    assert make_sampler(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05).chain.names() == [
        "top-k", "top-p", "min-p", "temp"]
    assert make_sampler(temperature=0.7, top_p=0.8).chain.names() == ["top-p", "temp"]
    assert make_sampler(temperature=0.7).chain is None              # nothing to filter
    assert make_sampler(temperature=0.0, top_k=40).chain is None    # greedy never filters
    assert make_sampler(temperature=0.7, top_k=40, path="numpy").chain is None


def test_only_the_chain_path_draws_inside_llama_cpp():
    # draw_chain is the filters then llama.cpp's dist; rows it cannot take go to numpy.
    s = make_sampler(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=1)
    assert s.draw_chain.names() == ["top-k", "top-p", "min-p", "temp", "dist"]
    assert make_sampler(temperature=0.7, seed=1).draw_chain.names() == ["temp", "dist"]
    assert s.draws_natively(8_192, constrained=False)
    assert not s.draws_natively(8_192, constrained=True)                # the grammar's mask
    assert not s.draws_natively(CHAIN_ROW_MAX + 1, constrained=False)    # numpy cuts it to top-k first
    assert not make_sampler(temperature=0.7, top_k=40, repeat_penalty=1.1).draws_natively(8_192, False)
    assert not make_sampler(temperature=0.7, top_k=40, path="numpy").draws_natively(8_192, False)
    assert make_sampler(temperature=0.0, top_k=40).draw_chain is None   # greedy takes the argmax


def test_chain_path_draws_like_the_numpy_path():
    # Same distribution and the same one-uniform draw: the same tokens, seed for seed.
    rows = np.random.default_rng(9).standard_normal((30, 8_192)).astype(np.float32) * 2
    for kw in SETTINGS[:3]:
        a = make_sampler(temperature=0.8, seed=3, path="chain", **kw)
        b = make_sampler(temperature=0.8, seed=3, path="numpy", **kw)
        assert [a(r) for r in rows] == [b(r) for r in rows]


def test_dist_from_sparse_sorts_and_drops_zeros():
    # What llama.cpp's backend sampling hands back: candidates by rank, float32 probabilities,
    # zeros where a later filter dropped a candidate.
    d = Dist.from_sparse(np.array([7, 2, 9, 4], dtype=np.int32), np.array([0.5, 0.3, 0.0, 0.2], dtype=np.float32))
    assert d.ids.tolist() == [2, 4, 7] and d.ids.dtype == np.int32
    assert d.probs.dtype == np.float64 and d.probs.sum() == pytest.approx(1.0, abs=1e-15)
    np.testing.assert_allclose(d.probs, [0.3, 0.2, 0.5], rtol=1e-7)


class _SampledRow:
    """The reads of one backend-sampled row, its candidates in a given order; the chain's
    own draw walks them in that order, as llama.cpp's dist does in the graph."""

    def __init__(self, ids, probs, u: float) -> None:
        self.ids, self.probs = np.array(ids, dtype=np.int32), np.array(probs, dtype=np.float32)
        self.u = u

    def sampled_candidates(self, i):
        return self.ids

    def sampled_probs(self, i):
        return self.probs

    def sampled_token(self, i):
        return int(self.ids[np.searchsorted(np.cumsum(self.probs), self.u, side="right")])


@pytest.mark.parametrize("filters, in_order", [
    (dict(top_k=40), False), (dict(top_k=40, min_p=0.05), False),
    (dict(top_k=40, top_p=0.95), True), (dict(top_p=0.9), True), (dict(), True), (dict(min_p=0.1), True)])
def test_a_plain_token_does_not_depend_on_the_order_of_the_candidates(filters, in_order):
    # ggml's top_k hands its candidates back in no set order (CUB's DeviceTopK: another
    # order each run); where no top_p sorts them again, the graph's draw would follow it.
    ids, probs = [3, 9, 5, 1], [0.4, 0.3, 0.2, 0.1]
    shuffled = [_SampledRow([ids[j] for j in o], [probs[j] for j in o], u=0.5)
                for o in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1])]
    graph_draws = [row.sampled_token(0) for row in shuffled]
    assert graph_draws == [9, 9, 3]           # the same u, another token in another order
    sampler = lambda: make_sampler(temperature=0.8, seed=11, **filters)     # noqa: E731
    assert draws_in_a_fixed_order(sampler()) == in_order
    tokens = [plain_token(row, 0, sampler(), None) for row in shuffled]
    if in_order:      # the chain's draw, one int back (a top_p or no top_k fixes the order)
        assert tokens == graph_draws
    else:             # one draw from the id-sorted distribution, whatever the order
        rng = sampler().rng
        assert tokens == [draw(Dist.from_sparse(np.array(ids), np.array(probs)), rng)] * 3


@pytest.mark.parametrize("kw, spec, accept, reads", [
    (dict(temperature=0.0), True, "rejection", False),               # the graph's argmax: tokens
    (dict(temperature=0.0, top_k=40), False, "rejection", False),
    (dict(temperature=0.7, top_k=20, top_p=0.8), True, "rejection", True),   # p at every verify row
    (dict(temperature=0.7, top_k=20, top_p=0.8), True, "exact", False),      # drawn tokens only
    (dict(temperature=0.7, top_k=20, top_p=0.8), False, "rejection", False),  # a plain draw in order
    (dict(temperature=0.7, top_k=40), False, "rejection", True),     # drawn on the host from them
    (dict(temperature=0.7, top_k=40), True, "exact", True),
    (dict(temperature=1.0), False, "exact", False),
])
def test_which_sequences_would_read_the_graphs_probabilities(kw, spec, accept, reads):
    # In a batch these sample on the host: llama.cpp can overwrite a chain's probabilities
    # when several sequences have chains (tests/test_batch.py has the batch that crashed).
    assert reads_probabilities(make_sampler(seed=1, **kw), spec, accept) == reads


def _native_draws(seed, n: int = 64) -> list[int]:
    from pymtp.native_samplers import TokenDataArray
    from pymtp.sampling import filter_chain

    row = np.linspace(0.0, 1.0, 40, dtype=np.float32)       # 40 tokens of nearly equal odds
    chain = filter_chain(0, 1.0, 0.0, 1.0).add_dist(seed)
    cur, drawn = TokenDataArray(row.size), []
    for _ in range(n):
        cur.set(row)
        chain.apply(cur)
        drawn.append(int(cur.result()[cur.selected]["id"]))
    chain.close()
    return drawn


def test_every_integer_seed_replays_in_llama_cpps_dist():
    # llama.cpp reads 0xFFFFFFFF as "take a fresh seed from the system" (LLAMA_DEFAULT_SEED):
    # a seed whose child (Sampler.draw_seed) or low 32 bits came out as that value would
    # have drawn differently on every run. Integers replay; only None is fresh entropy.
    from pymtp.native_samplers import FRESH_SEED, dist_seed

    assert _native_draws(FRESH_SEED) == _native_draws(FRESH_SEED) == _native_draws(0)
    assert _native_draws(2**32 + 5) == _native_draws(5) != _native_draws(6)
    assert _native_draws(None) != _native_draws(None)          # 40^64 to one they agree
    assert [dist_seed(s) for s in (None, FRESH_SEED, 2**32 - 2, 2**33 + 7)] == [FRESH_SEED, 0, 2**32 - 2, 7]
