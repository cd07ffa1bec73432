"""temperature > 0: seeded runs repeat, and speculative sampling keeps the target distribution."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest

import pymtp
import pymtp.round_judge as judge_mod
import pymtp.sampling_route as route_mod
from conftest import TINY_F16, exact_kernels, shared_model
from pymtp.acceptance import Verdict
from pymtp.config import DecodeParams
from pymtp.engine import Engine
from pymtp.round_state import RunStats
from pymtp.backend_sampling import plain_token
from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel
from pymtp.native_samplers import SamplerChain
from pymtp.sampling import draw, filter_chain, make_sampler, sampled_dist

DEMO = str(pymtp.__path__[0]) + "/data/qwen35-tiny-mtp-q8_0.gguf"     # 8,192 tokens, in the package
SAMPLING = dict(temperature=1.0, top_k=4, draft_max=3, max_tokens=4, ignore_eos=True)
N = 2000


def _emitted(model, prompt, **kw) -> list[int]:
    return model.generate(prompt, **kw).tokens


def _histogram(model, seeds, **kw) -> collections.Counter:
    """Joint histogram of the 2nd and 3rd generated tokens (the first ones a draft can decide)."""
    prompt = model.tokenize("The quick brown fox")
    return collections.Counter(tuple(_emitted(model, prompt, seed=s, **kw)[1:3]) for s in seeds)


def chi2_homogeneity_pvalue(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test; cells with fewer than 10 joint counts are pooled.

    The p-value uses the Wilson-Hilferty normal approximation of the chi-square tail.
    """
    na, nb = sum(a.values()), sum(b.values())
    cells, pool = [], [0, 0]
    for key in set(a) | set(b):
        x, y = a.get(key, 0), b.get(key, 0)
        if x + y < 10:
            pool[0] += x
            pool[1] += y
        else:
            cells.append((x, y))
    if sum(pool):
        cells.append(tuple(pool))
    stat = 0.0
    for x, y in cells:
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    df = len(cells) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# Every place distributions can be built (LoadOptions.sampling): llama.cpp's filters on
# the host (the default), the numpy filters, and llama.cpp's filters inside the decode
# graph (backend sampling, which CPU builds run too). Speculative sampling on each is
# compared with plain sampling on the same path. The numpy path builds the same
# distributions as the default one, token for token (test_sampling.py), so it runs only
# the rejection check.
ALL_PATHS = pytest.mark.parametrize("path_model", ["chain", "backend", "numpy"], indirect=True)
LLAMA_PATHS = pytest.mark.parametrize("path_model", ["chain", "backend"], indirect=True)
_path_models: dict = {}
_plain_hists: dict = {}


@pytest.fixture(scope="module")
def path_model(request, dense_path, dense_model):
    if request.param == "chain":
        return dense_model
    return _path_model_of(dense_path, request.param)


def _path_model_of(dense_path, sampling: str):
    if sampling not in _path_models:
        _path_models[sampling] = pymtp.load(dense_path, threads=1, n_ctx=1024, sampling=sampling)
    return _path_models[sampling]


def _plain_hist(model) -> collections.Counter:
    if model.sampling not in _plain_hists:
        _plain_hists[model.sampling] = _histogram(model, range(N), spec="none", **SAMPLING)
    return _plain_hists[model.sampling]


@pytest.fixture(scope="module")
def plain_hist(dense_model):
    return _plain_hist(dense_model)


@ALL_PATHS
def test_seeded_runs_repeat(path_model):
    prompt = path_model.tokenize("def f(x):")
    kw = dict(temperature=0.8, top_p=0.95, max_tokens=32, ignore_eos=True)
    a = _emitted(path_model, prompt, seed=7, **kw)
    assert a == _emitted(path_model, prompt, seed=7, **kw)
    assert a != _emitted(path_model, prompt, seed=8, **kw)
    b = path_model.generate("def f(x):", seed=7, temperature=0.8, top_p=0.95, max_tokens=32, ignore_eos=True)
    assert b.tokens == a
    spec = _emitted(path_model, prompt, seed=7, spec="mtp", top_k=40, **kw)
    assert spec == _emitted(path_model, prompt, seed=7, spec="mtp", top_k=40, **kw)


@ALL_PATHS
def test_rejection_sampling_keeps_the_target_distribution(path_model):
    spec = _histogram(path_model, range(N, 2 * N), **SAMPLING)
    assert chi2_homogeneity_pvalue(_plain_hist(path_model), spec) > 1e-3


@LLAMA_PATHS
def test_exact_match_keeps_the_target_distribution(path_model):
    spec = _histogram(path_model, range(2 * N, 3 * N), accept="exact", **SAMPLING)
    assert chi2_homogeneity_pvalue(_plain_hist(path_model), spec) > 1e-3


@pytest.mark.parametrize("path_model", ["backend", "numpy"], indirect=True)
def test_the_paths_sample_the_same_distribution(path_model, plain_hist):
    # Not only self-consistent: plain sampling in the graph, and numpy's draw from its own
    # distribution, match the host chain's plain sampling (llama.cpp's dist draws it).
    assert chi2_homogeneity_pvalue(plain_hist, _histogram(path_model, range(3 * N, 4 * N), spec="none",
                                                          **SAMPLING)) > 1e-3


def test_backend_sampling_runs_where_it_can(dense_path):
    # Backend sampling takes the runs it can serve, greedy ones and biased ones too (the
    # graph's argmax, a logit_bias sampler first); runs with penalties (each verify row
    # needs its own history) detach the chain and read logits, and a later run attaches a
    # fresh one.
    engine = Engine(NativeModel(str(dense_path)), n_ctx=256, n_batch=64, threads=1, draft_limit=4,
                    flash_attn="off", sampling="backend")
    prompt = [1, 2, 3, 4, 5]
    used = []
    for kw in (dict(temperature=0.8, top_k=4), dict(temperature=0.0), dict(temperature=0.0, repeat_penalty=1.2),
               dict(temperature=0.8, top_k=4, presence_penalty=1.0), dict(temperature=0.8, top_p=0.9),
               dict(temperature=0.8, top_k=4, accept="exact"), dict(temperature=0.8),
               dict(temperature=0.8, min_p=0.1), dict(temperature=0.0, logit_bias={7: 2.5, 9: -math.inf}),
               dict(temperature=0.8, top_k=4, logit_bias={7: 2.5}), dict(temperature=1.0, top_k=4)):
        for spec in ("none", "mtp"):
            stats = RunStats()
            tokens = [t for step in engine.run(prompt, DecodeParams(max_tokens=12, spec=spec, seed=1,
                                                                    ignore_eos=True, **kw), stats)
                      for t in step.tokens]
            assert len(tokens) == 12
            used.append(stats.sampling)
    engine.close()
    # a logit bias runs in the graph, first in the chain; penalties do not. At temperature
    # 1.0 llama.cpp's temp is its empty sampler ("?temp"), a no-op in the graph too
    assert used == ["backend"] * 4 + ["greedy"] * 2 + ["chain"] * 2 + ["backend"] * 14


def test_a_context_that_refuses_a_chain_refuses_it_for_itself_only(dense_path):
    # The target and the drafter's context share BackendChains; where one cannot run a
    # chain in its graph (a head on another device), the other still takes it, and the
    # one that refused is not asked again for those filters, whatever the seed.
    from pymtp.backend_sampling import BackendChains

    model = NativeModel(str(dense_path))
    cfg = ContextConfig(n_ctx=256, n_batch=64, n_ubatch=64, threads=1, n_seq_max=2, flash_attn="off")
    able, refusing = NativeContext(model, cfg), NativeContext(model, cfg)
    asked = []
    refusing.set_sampler = lambda seq, chain: asked.append(chain) is not None and False
    chains = BackendChains()
    greedy, hot = make_sampler(temperature=0.0), make_sampler(temperature=0.8, top_k=4)
    try:
        assert not chains.set(refusing, 0, greedy) and len(asked) == 2       # the attach, then the detach
        assert chains.set(able, 0, greedy) and chains.set(able, 1, greedy)
        assert not chains.set(refusing, 1, greedy) and len(asked) == 2
        assert not chains.set(refusing, 0, hot, seed=1) and len(asked) == 4
        assert not chains.set(refusing, 1, hot, seed=2) and len(asked) == 4
        assert chains.set(able, 0, hot, seed=3)
        assert {slot: key for slot, (key, _) in chains.attached.items()} == {
            (id(able), 0): ((4, 1.0, 0.0, 0.8), None, 3), (id(able), 1): (("greedy",), None, 0)}
    finally:
        for ctx in (able, refusing):
            ctx.close()
        chains.close()


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_unseeded_runs_keep_their_chain_and_still_draw_afresh(dense_path, monkeypatch, spec):
    # Attaching a chain makes llama.cpp reserve the context's graphs again at the next
    # decode. An unseeded run needs no seed of its own, so it keeps the chain its seq id
    # holds (drawing from fresh entropy at each restart); a seeded run still attaches its
    # own, so that its seed replays.
    engine = Engine(NativeModel(str(dense_path)), n_ctx=256, n_batch=64, threads=1, draft_limit=4,
                    flash_attn="off", sampling="backend")
    attached = []
    real = NativeContext.set_sampler
    monkeypatch.setattr(NativeContext, "set_sampler",
                        lambda self, seq, chain: (attached.append(chain is not None), real(self, seq, chain))[1])

    def run(seed):
        params = DecodeParams(max_tokens=8, spec=spec, seed=seed, temperature=1.0, ignore_eos=True, draft_max=2)
        return tuple(t for step in engine.run([1, 2, 3, 4, 5], params) for t in step.tokens)

    try:
        first = run(None)
        n_first = len(attached)
        texts = {first} | {run(None) for _ in range(7)}
        assert len(attached) == n_first       # no attach or detach after the first run
        assert len(texts) > 1                 # fresh draws, not one seed replayed
        seeded = run(11)
        assert seeded == run(11) and len(attached) > n_first
    finally:
        engine.close()


def test_auto_samples_in_the_graph_only_plain_runs_on_a_gpu_at_a_large_vocabulary():
    big, small = route_mod.GRAPH_PLAIN_VOCAB, route_mod.GRAPH_PLAIN_VOCAB - 1
    assert route_mod.samples_in_graph("auto", True, big, drafts=False)
    assert not route_mod.samples_in_graph("auto", True, big, drafts=True)
    # greedy takes the graph's argmax drafting or not, on a GPU at a large vocabulary only
    assert route_mod.samples_in_graph("auto", True, big, drafts=True, greedy=True)
    assert not route_mod.samples_in_graph("auto", True, small, drafts=False, greedy=True)
    assert not route_mod.samples_in_graph("auto", False, big, drafts=True, greedy=True)
    assert not route_mod.samples_in_graph("auto", True, small, drafts=False)
    assert not route_mod.samples_in_graph("auto", False, big, drafts=False)
    assert route_mod.samples_in_graph("backend", False, small, drafts=True)
    assert not route_mod.samples_in_graph("chain", True, big, drafts=False)


@pytest.mark.parametrize("filters, reads_per_token", [
    # the chain drew it (one int back), not its candidates
    (dict(top_k=8, top_p=0.95), {"sampled_token": 1}),
    # top_k alone leaves the candidates in the kernel's order: drawn on the host instead
    (dict(top_k=8), {"sampled_candidates": 1, "sampled_probs": 1}),
])
def test_a_plain_backend_round_takes_the_graphs_draw(dense_path, monkeypatch, filters, reads_per_token):
    # Rounds without drafts read the token the chain drew where the draw does not depend
    # on the order the graph's top_k left its candidates in; seeded runs repeat either way.
    engine = Engine(NativeModel(str(dense_path)), n_ctx=256, n_batch=64, threads=1, draft_limit=4,
                    flash_attn="off", sampling="backend")
    reads = collections.Counter()
    for name in ("sampled_token", "sampled_candidates", "sampled_probs"):
        real = getattr(NativeContext, name)
        monkeypatch.setattr(NativeContext, name, lambda self, i, _r=real, _n=name: (reads.update([_n]), _r(self, i))[1])
    params = DecodeParams(max_tokens=16, spec="none", seed=3, temperature=0.8, ignore_eos=True, **filters)
    try:
        runs = [[t for step in engine.run([1, 2, 3, 4, 5], params) for t in step.tokens] for _ in range(2)]
    finally:
        engine.close()
    assert runs[0] == runs[1] and len(runs[0]) == 16
    assert reads == {name: 32 * n for name, n in reads_per_token.items()}


@pytest.mark.parametrize("commit", [False, True])
def test_a_verify_context_draws_afresh_only_after_a_commit(commit):
    # llama.cpp's dist is transactional where a sequence may output several rows a decode
    # (every verify context): each decode draws from the state its last committed draw left.
    # Without plain_token's commit, 200 decodes of one row all drew the same token.
    model = NativeModel(DEMO)
    prompt = np.asarray(model.tokenize("The"), dtype=np.int32)
    ctx = NativeContext(model, ContextConfig(n_ctx=256, n_batch=64, n_ubatch=64, threads=2, n_outputs_max=4,
                                             flash_attn="off"))
    chain = filter_chain(40, 1.0, 0.0, 1.5).add_dist(7)
    sampler = make_sampler(temperature=1.5, top_k=40, top_p=0.99, seed=0)     # a top_p: the chain's draw
    try:
        assert ctx.set_sampler(0, chain)
        batch, drawn = Batch(64), collections.Counter()
        for _ in range(200):
            ctx.seq_rm(0, -1, -1)
            batch.set(prompt, 0, outputs="last")
            ctx.decode(batch)
            drawn[plain_token(ctx, prompt.size - 1, sampler, chain if commit else None)] += 1
        row = sampled_dist(ctx, prompt.size - 1)
    finally:
        ctx.set_sampler(0, None)
        ctx.close()
        chain.close()
    assert row.ids.size == 40 and row.probs.max() < 0.2     # a wide row: 200 fair draws spread
    if commit:
        assert len(drawn) >= 20 and max(drawn.values()) < 40, drawn
    else:
        assert len(drawn) == 1, drawn


REPLAY_FILTERS = dict(temperature=1.5, top_k=40, top_p=0.99)


# How far apart the slices must end. With one uniform reused, every slice holds it, so
# they overlap (low <= high) where the replay's probabilities are the run's: CPU builds.
# On a GPU build the replay's rows round differently from the run's (conftest.row_tolerance:
# up to 0.1 logits, 0.067 at T=1.5, ~7% of a probability), which moves a slice's edges by up
# to ~0.07: slices around one reused uniform could then miss each other by twice that.
# On a CPU build the three runs below end 0.79-0.94 apart; with one uniform reused (no
# commits) their slices overlapped by 0.002-0.005.
REPLAY_MARGIN = 1e-3 if exact_kernels() else 0.2


def _shared_uniform(model: NativeModel, prompt: list[int], tokens: list[int]) -> tuple[float, float, int]:
    """Replay ``tokens`` after ``prompt`` on the host: the part of [0, 1) every token's
    slice covers, as (low, high), and how many tokens had a slice. A chain's dist takes the
    candidate whose slice holds the step's uniform, the candidates in falling probability
    (top_p's order), so a run whose steps all reused one uniform has low <= high.

    The rows are decoded one at a time, as plain rounds decode them. A token the replay's
    filters drop (a GPU build's rounding can move one across top_p's cut) has no slice
    and is left out: fewer slices can only overlap more, so this never hides a reused
    uniform."""
    ctx = NativeContext(model, ContextConfig(n_ctx=256, n_batch=64, n_ubatch=64, threads=2, n_outputs_max=1,
                                             flash_attn="off"))
    try:
        batch, rows = Batch(64), []
        batch.set(np.array(prompt, dtype=np.int32), 0, outputs="last")
        for i, token in enumerate(tokens):
            ctx.decode(batch)
            rows.append(ctx.logits(1)[0].copy())
            batch.set(np.array([token], dtype=np.int32), len(prompt) + i, outputs="last")
    finally:
        ctx.close()
    sampler = make_sampler(path="numpy", **REPLAY_FILTERS)
    low, high, placed = 0.0, 1.0, 0
    for row, token in zip(rows, tokens):
        d = sampler.dist(row)
        order = np.argsort(-d.probs, kind="stable")
        upper = np.cumsum(d.probs[order])
        at = np.flatnonzero(d.ids[order] == token)
        if at.size == 0:
            continue
        j = int(at[0])
        low, high, placed = max(low, upper[j] - d.probs[order][j]), min(high, upper[j]), placed + 1
    return low, high, placed


def test_the_steps_of_a_run_sampled_in_the_graph_do_not_share_one_uniform():
    # Replayed on the host, the slices of one plain run's tokens must not all overlap:
    # they did while every decode of a verify context reused the uncommitted uniforms
    # (all 32 met at 0.789-0.791).
    model = NativeModel(DEMO)
    prompt = [int(t) for t in model.tokenize("The")]
    engine = Engine(model, n_ctx=256, n_batch=64, threads=2, draft_limit=4, flash_attn="off", sampling="backend")
    try:
        stats = RunStats()
        tokens = [t for step in engine.run(prompt, DecodeParams(max_tokens=32, spec="none", seed=5, ignore_eos=True,
                                                                **REPLAY_FILTERS), stats) for t in step.tokens]
    finally:
        engine.close()
    assert stats.sampling == "backend" and len(tokens) == 32
    low, high, placed = _shared_uniform(model, prompt, tokens)
    assert placed >= 24 and high < low - REPLAY_MARGIN, (low, high, placed)


def test_the_steps_of_batched_runs_sampled_in_the_graph_do_not_share_one_uniform():
    # The server's path: two plain requests decoded together, each replayed alone.
    model = pymtp.load(DEMO, threads=2, n_ctx=512, sampling="backend")
    b = model.batcher(2)
    try:
        prompts = [model.tokenize(t) for t in ("The", "def f(x):")]
        runs = [b.submit(p, spec="none", seed=6 + i, max_tokens=32, ignore_eos=True, **REPLAY_FILTERS)
                for i, p in enumerate(prompts)]
        tokens = collections.defaultdict(list)
        while any(not r.done for r in runs):
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
        assert max(b.metrics.batch_sizes) == 2
        assert [r.request.stats.sampling for r in runs] == ["backend", "backend"]
        native = NativeModel(DEMO)
        for run, prompt in zip(runs, prompts):
            assert len(tokens[run]) == 32
            low, high, placed = _shared_uniform(native, [int(t) for t in prompt], tokens[run])
            assert placed >= 24 and high < low - REPLAY_MARGIN, (low, high, placed)
    finally:
        b.close()
        model.close()


@pytest.mark.parametrize("spec, accept", [("none", "rejection"), ("mtp", "exact")])
def test_every_draw_the_engine_reads_from_a_chain_is_committed(dense_path, monkeypatch, spec, accept):
    # Each token taken from a chain's own draw commits it (plain_token), so the next decode
    # draws afresh: as many commits as such reads, in plain and exact-match rounds.
    engine = Engine(NativeModel(str(dense_path)), n_ctx=256, n_batch=64, threads=1, draft_limit=4,
                    flash_attn="off", sampling="backend")
    count = collections.Counter()
    real_read, real_accept = NativeContext.sampled_token, SamplerChain.accept
    monkeypatch.setattr(NativeContext, "sampled_token", lambda self, i: (count.update(["read"]), real_read(self, i))[1])
    monkeypatch.setattr(SamplerChain, "accept", lambda self, t: (count.update(["commit"]), real_accept(self, t))[1])
    params = DecodeParams(max_tokens=24, spec=spec, draft_max=3, accept=accept, seed=3, temperature=0.8, top_k=8,
                          top_p=0.95, ignore_eos=True)
    try:
        stats = RunStats()
        tokens = [t for step in engine.run([1, 2, 3, 4, 5], params, stats) for t in step.tokens]
    finally:
        engine.close()
    assert len(tokens) == 24 and stats.sampling == "backend"
    drafts_read = stats.drafted          # the drafter's argmax (greedy chain): read, nothing to commit
    assert count["read"] - drafts_read == count["commit"] > 0, (count, drafts_read)


def test_an_exact_match_backend_round_reads_only_tokens(dense_path, monkeypatch):
    # The exact-match rule reads no distribution: on the backend each verify row's token
    # is the one its chain drew, and each draft the drafter graph's argmax, so a drafting
    # round reads one int per examined row, no candidates, probabilities or logits.
    engine = Engine(NativeModel(str(dense_path)), n_ctx=256, n_batch=64, threads=1, draft_limit=4,
                    flash_attn="off", sampling="backend")
    reads = collections.Counter()
    for name in ("sampled_token", "sampled_candidates", "sampled_probs", "logits"):
        real = getattr(NativeContext, name)
        monkeypatch.setattr(NativeContext, name, lambda self, *a, _r=real, _n=name: (reads.update([_n]), _r(self, *a))[1])
    params = DecodeParams(max_tokens=24, spec="mtp", draft_max=3, accept="exact", seed=3, temperature=0.8,
                          top_k=8, top_p=0.95, ignore_eos=True)
    try:
        runs, drafted = [], []
        for _ in range(2):
            stats = RunStats()
            runs.append([t for step in engine.run([1, 2, 3, 4, 5], params, stats) for t in step.tokens])
            drafted.append(stats.drafted)
            assert stats.sampling == "backend"
    finally:
        engine.close()
    assert runs[0] == runs[1] and len(runs[0]) == 24
    assert drafted[0] > 0
    assert set(reads) == {"sampled_token"}, reads


@pytest.mark.parametrize("filters", [dict(), dict(min_p=0.1), dict(top_k=8)])
def test_backend_distribution_is_the_hosts(dense_path, filters):
    # The chain in the graph gives the host's distribution of the same row, also where it
    # cuts nothing by rank and so hands back probabilities over the whole vocabulary.
    model = NativeModel(str(dense_path))
    cfg = ContextConfig(n_ctx=256, n_batch=64, n_ubatch=64, threads=1, n_outputs_max=1, flash_attn="off")
    plain, graph = NativeContext(model, cfg), NativeContext(model, cfg)
    chain = filter_chain(filters.get("top_k", 0), 1.0, filters.get("min_p", 0.0), 0.8).add_dist(0)
    try:
        assert graph.set_sampler(0, chain)
        batch = Batch(64)
        for ctx in (plain, graph):
            batch.set(np.array([1, 2, 3, 4, 5], dtype=np.int32), 0, outputs="last")
            ctx.decode(batch)
        host = make_sampler(temperature=0.8, path="numpy", **filters).dist(plain.logits(1)[0])
        got = sampled_dist(graph, 4)
        assert got.ids.tolist() == host.ids.tolist()
        # llama.cpp's graph softmax against numpy's, both float32: the same ids, last-bit rounding apart
        np.testing.assert_allclose(got.probs, host.probs, atol=1e-6)
        # its logits, parallel to the candidates: the row's at temperature, -inf where dropped
        ids = graph.sampled_candidates(4)
        ids = np.arange(model.n_vocab) if ids is None else ids
        logits = graph.sampled_logits(4)
        kept = np.isfinite(logits)
        assert sorted(ids[kept].tolist()) == host.ids.tolist()
        # the graph divides by the temperature in float32, numpy here in float64
        np.testing.assert_allclose(logits[kept], plain.logits(1)[0][ids[kept]] / 0.8, rtol=1e-6)
    finally:
        graph.set_sampler(0, None)
        plain.close()
        graph.close()
        chain.close()


def test_native_draw_reads_the_row_it_is_given(dense_path):
    # NativeContext.sample: llama.cpp's chain and dist over batch row i's logits. top_k=1
    # leaves only that row's argmax, whatever the seed; top_k=3 draws among its top three
    # and, over seeds, reaches more than one of them.
    model = NativeModel(str(dense_path))
    cfg = ContextConfig(n_ctx=256, n_batch=64, n_ubatch=64, threads=1, n_outputs_max=5, flash_attn="off")
    ctx = NativeContext(model, cfg)
    chains = []
    try:
        batch = Batch(64)
        batch.set(np.array([1, 2, 3, 4, 5], dtype=np.int32), 0, outputs="all")
        ctx.decode(batch)
        rows = ctx.logits(5).copy()
        assert len({int(r.argmax()) for r in rows}) > 1          # the rows differ: a wrong row shows
        for i, row in enumerate(rows):
            one = filter_chain(1, 1.0, 0.0, 0.8).add_dist(i)
            chains.append(one)
            assert ctx.sample(one, i) == int(row.argmax())
        top3 = set(np.argsort(-rows[2])[:3].tolist())
        drawn = set()
        for seed in range(40):
            chains.append(filter_chain(3, 1.0, 0.0, 0.8).add_dist(seed))
            drawn.add(ctx.sample(chains[-1], 2))
        assert drawn <= top3 and len(drawn) > 1
    finally:
        ctx.close()
        for c in chains:
            c.close()


def _recovered_from_p(draft_tokens, draft_dists, target_dists, rng):
    """A biased rule: right acceptance test, but the recovered token drawn from p, not p - q."""
    for i, x in enumerate(int(t) for t in draft_tokens):
        if rng.random() * draft_dists[i].prob(x) < target_dists[i].prob(x):
            continue
        return Verdict(i, draw(target_dists[i], rng), "recovered")
    k = len(draft_tokens)
    return Verdict(k, draw(target_dists[k], rng), "bonus")


def test_the_check_catches_a_biased_rule(dense_model, plain_hist, monkeypatch):
    monkeypatch.setattr(judge_mod, "rejection_accept", _recovered_from_p)
    spec = _histogram(dense_model, range(N, 2 * N), **SAMPLING)
    assert chi2_homogeneity_pvalue(plain_hist, spec) < 1e-6


def test_temperature_zero_ignores_filters(dense_model):
    greedy = dense_model.generate("abc", max_tokens=16, ignore_eos=True)
    filtered = dense_model.generate("abc", max_tokens=16, top_k=3, top_p=0.5, seed=3, ignore_eos=True)
    assert filtered.tokens == greedy.tokens


@pytest.mark.parametrize("sampling", ["chain", "numpy", "backend"])
def test_the_least_temperature_samples_the_greedy_tokens(dense_path, sampling):
    """At config.TEMPERATURE_MIN every path still scales the logits within float32: the
    argmax, drafting or not (1e-38 drew other tokens on the chain; 1e39 raised)."""
    from pymtp.config import TEMPERATURE_MAX, TEMPERATURE_MIN
    with pymtp.load(dense_path, threads=1, n_ctx=256, sampling=sampling) as m:
        for spec, k in (("mtp", 3), ("none", None)):     # greedy at the seeded run's depth: the same shapes
            greedy = m.generate("abc", max_tokens=12, spec=spec, draft_max=k, ignore_eos=True).tokens
            cold = m.generate("abc", max_tokens=12, temperature=TEMPERATURE_MIN, seed=1, spec=spec, ignore_eos=True)
            assert cold.tokens == greedy, spec
            hot = m.generate("abc", max_tokens=12, temperature=TEMPERATURE_MAX, top_p=0.5, seed=1, spec=spec,
                             ignore_eos=True)
            assert len(hot.tokens) == 12


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, r"temperature must be finite and >= 0, got -1.0"),
    ({"temperature": 0.7, "top_p": 1.5}, "top_p"),
    ({"temperature": 0.7, "top_k": -2}, "top_k"),
    ({"temperature": 0.7, "min_p": 2.0}, "min_p"),
    ({"temperature": 0.7, "accept": "maybe"}, "accept must be 'rejection' or 'exact'"),
])
def test_bad_sampling_options(dense_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dense_model.generate("abc", max_tokens=4, **kwargs)


def test_rejection_accepts_more_than_exact_on_trained_model():
    model = shared_model(TINY_F16)
    prompt = model.tokenize("import os\nimport sys\n\n\ndef main(argv):\n    ")
    rates = {}
    for rule in ("rejection", "exact"):
        drafted = accepted = 0
        for seed in range(6):
            r = model.generate(prompt, max_tokens=64, temperature=0.7, top_p=0.95, seed=seed,
                               accept=rule, draft_max=3, ignore_eos=True)
            drafted += r.stats.drafted
            accepted += r.stats.accepted
        rates[rule] = accepted / drafted
    assert rates["rejection"] > rates["exact"] + 0.03, rates


def test_auto_depth_keeps_the_target_distribution(dense_model, plain_hist):
    """draft_max="auto" changes how many drafts a round proposes, never what is emitted."""
    spec = _histogram(dense_model, range(2 * N, 3 * N), **{**SAMPLING, "draft_max": "auto"})
    assert chi2_homogeneity_pvalue(plain_hist, spec) > 1e-3
