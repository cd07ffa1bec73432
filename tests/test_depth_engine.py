"""draft_max="auto" in the engine, the batch, the CLI and the server (depth.py's policy)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import pymtp
from conftest import require_cache_exact, require_exact_kernels
from pymtp.cli import main
from pymtp.config import DecodeParams, ParamError
from pymtp.depth import CostModel, Curve, Line, RoundTimes
from pymtp.prefix_cache import TAIL_TOKENS

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time", "import numpy as np\n"]


def _costs(per_row: float, step: float) -> CostModel:
    """A hand-made machine: a target decode of r rows costs 1 + per_row * (r - 1) seconds.
    Frozen (decay 0): the rounds' real milliseconds would otherwise pull each row count
    they observe far below the hand-made seconds of the others."""
    return CostModel(Curve({r: 1.0 + per_row * (r - 1) for r in range(1, 6)}, decay=0.0),
                     Curve({1: step}, decay=0.0), Line.constant(0.0, decay=0.0), Curve({1: step}, decay=0.0),
                     RoundTimes(decay=0.0, trusted=10 ** 9))


@pytest.fixture(scope="module")
def demo():
    m = pymtp.load(str(pymtp.__path__[0]) + "/data/qwen35-tiny-mtp-q8_0.gguf", threads=2)
    yield m
    m.close()


def test_auto_is_greedy_identical_and_reports_its_depths(demo, fixture_model):
    require_exact_kernels()
    for m in (demo, fixture_model):
        for p in PROMPTS:
            plain = m.generate(p, max_tokens=48, spec="none", ignore_eos=True)
            auto = m.generate(p, max_tokens=48, draft_max="auto", ignore_eos=True)
            assert auto.tokens == plain.tokens, p
            d = auto.stats.depths
            assert sum(d.values()) >= 1 and set(d) <= set(range(m.draft_limit + 1))
            assert auto.stats.drafted == sum(k * n for k, n in d.items())


def test_one_stream_runs_each_auto_request_at_one_depth_as_that_setting_would(demo):
    """On one stream draft_max="auto" runs a whole request at the depth depth.Arms picks:
    the limit first, then plain decoding, then on down while that gains; a request
    emits exactly what the fixed setting (0: no-spec) emits with its seed, and one at
    depth 0 drafts nothing."""
    engine = demo._default.engine
    engine.arms.clear()
    # cold prompts, as bench runs them: on a GPU a prompt resumed from the cache decodes in
    # other batch shapes than a cold one, which round differently (docs/exactness.md)
    kw = dict(max_tokens=40, ignore_eos=True, temperature=0.7, top_k=20, cache_prompt=False)
    chosen = []
    for i in range(3):
        r = demo.generate(PROMPTS[i], draft_max="auto", seed=i, **kw)
        k = max(r.stats.depths)
        fixed = dict(spec="none") if k == 0 else dict(draft_max=k)
        assert r.tokens == demo.generate(PROMPTS[i], seed=i, **fixed, **kw).tokens, (i, k)
        chosen.append(k)
    assert chosen[:2] == [demo.draft_limit, 0]
    (arms,) = engine.arms.values()
    assert set(arms.round_s) == set(chosen)
    arms.round_s = {k: (1e-9 if k == 0 else 1.0) for k in range(demo.draft_limit + 1)}   # plain far ahead
    r = demo.generate(PROMPTS[3], draft_max="auto", seed=3, **kw)
    assert r.stats.depths == {0: 39} and r.stats.drafted == 0
    assert r.tokens == demo.generate(PROMPTS[3], spec="none", seed=3, **kw).tokens


@pytest.fixture
def per_round(demo):
    """The demo's engine with draft_max="auto" left to the per-round policy (the one batched
    rounds use), whose choices these tests steer through hand-made costs."""
    engine = demo._default.engine
    engine.whole_requests = False
    yield engine
    engine.whole_requests = True


def test_expensive_rows_mean_plain_decoding_with_probes(demo, per_round):
    """Rows that cost what they emit: k=0 every round, but a one-draft probe after 16 of
    them, then after 32 (the first changed nothing)."""
    engine = per_round
    demo.generate("warm", max_tokens=2, draft_max="auto")          # calibrates
    engine.costs = _costs(per_row=1.0, step=0.5)
    r = demo.generate(PROMPTS[0], max_tokens=64, draft_max="auto", ignore_eos=True)
    d = r.stats.depths
    assert d[1] == 2 and set(d) == {0, 1}, d
    require_exact_kernels()
    assert r.tokens == demo.generate(PROMPTS[0], max_tokens=64, spec="none", ignore_eos=True).tokens


def _mtp_decodes(engine, monkeypatch) -> list[int]:
    """Counts the drafter context's decodes (one entry per decode: its rows)."""
    ctx = engine.drafter().ctx
    seen, real = [], ctx.decode
    monkeypatch.setattr(ctx, "decode", lambda batch: (seen.append(batch.n), real(batch))[1])
    return seen


def test_plain_rounds_leave_the_drafter_idle_until_a_probe(demo, per_round, monkeypatch):
    """At k=0 a round decodes the target only: the drafter's rows wait for the next round
    that drafts (a probe here) and go in its catch-up decode, and its drafts are the ones a
    drafter caught up every round proposes (same rounds, drafts and acceptances)."""
    engine = per_round
    demo.generate("warm", max_tokens=2, draft_max="auto")
    engine.costs = _costs(per_row=1.0, step=0.5)
    seen = _mtp_decodes(engine, monkeypatch)
    kw = dict(max_tokens=64, draft_max="auto", ignore_eos=True)
    r = demo.generate(PROMPTS[0], **kw)
    d = r.stats.depths
    # the prompt's rows, then per probe one catch-up decode and a chain step per draft after
    # the first: nothing for the plain rounds
    assert len(seen) <= 2 + sum(k * n for k, n in d.items()), (seen, d)
    assert max(seen) > 8, seen          # a probe catches up on the rows of the rounds before it
    monkeypatch.setattr("pymtp.engine.DEFER_ROWS", 0)     # caught up every round, as before
    del seen[:]
    every = demo.generate(PROMPTS[0], **kw)
    assert len(seen) > d[0], seen
    require_exact_kernels()
    assert r.tokens == every.tokens
    assert (r.stats.depths, r.stats.drafted_at, r.stats.accepted_at) == \
        (every.stats.depths, every.stats.drafted_at, every.stats.accepted_at)


def test_a_run_at_k0_keeps_the_prompt_end_reusable(demo, per_round):
    """The prompt cache's snapshots at the prompt's end hold no drafter pairs of their
    own: the first round after the prompt feeds the drafter even at k=0, so a next
    request that parts from this one in its last tokens reuses all before them."""
    engine = per_round
    demo.generate("warm", max_tokens=2, draft_max="auto")
    engine.costs = _costs(per_row=1.0, step=0.5)
    a = demo.prompt_ids("The quick brown fox jumps over the lazy dog. " * 2)
    b = a[:-2] + demo.prompt_ids(" Hello there friend")[-3:]
    first = demo.generate(a, max_tokens=8, draft_max="auto", ignore_eos=True)
    assert set(first.stats.depths) == {0}, first.stats.depths
    again = demo.generate(b, max_tokens=6, draft_max="auto", ignore_eos=True)
    assert again.stats.cached_tokens >= len(a) - TAIL_TOKENS, (again.stats.cached_tokens, len(a))
    require_cache_exact()
    assert again.tokens == demo.generate(b, max_tokens=6, spec="none", ignore_eos=True, cache_prompt=False).tokens


def test_deferred_rows_are_bounded(demo, per_round, monkeypatch):
    """Rows wait for a drafting round at most DEFER_ROWS at a time."""
    engine = per_round
    demo.generate("warm", max_tokens=2, draft_max="auto")
    engine.costs = _costs(per_row=1.0, step=0.5)
    monkeypatch.setattr("pymtp.engine.with_probes", lambda plan, accs, limits, **kw: plan)   # no probes
    monkeypatch.setattr("pymtp.engine.DEFER_ROWS", 8)
    seen = _mtp_decodes(engine, monkeypatch)
    r = demo.generate(PROMPTS[1], max_tokens=40, draft_max="auto", ignore_eos=True)
    assert set(r.stats.depths) == {0}, r.stats.depths
    assert seen[1:] and set(seen[1:]) == {8}, seen       # the prompt's rows, then 8 at a time
    require_exact_kernels()
    assert r.tokens == demo.generate(PROMPTS[1], max_tokens=40, spec="none", ignore_eos=True).tokens


def test_cheap_rows_mean_deep_drafts(demo, per_round):
    engine = per_round
    demo.generate("warm", max_tokens=2, draft_max="auto")
    engine.costs = _costs(per_row=0.001, step=0.001)
    r = demo.generate(PROMPTS[1], max_tokens=64, draft_max="auto", ignore_eos=True)
    d = r.stats.depths
    deep = sum(n for k, n in d.items() if k >= 3)
    assert deep >= 0.8 * sum(d.values()), d


def test_calibration_measures_every_row_count(demo, per_round):
    engine = per_round
    engine.costs = None
    demo.generate("warm", max_tokens=2, draft_max="auto")
    assert engine.calibration_s > 0
    pts = engine.costs.target.points
    assert set(range(1, demo.draft_limit + 2)) <= set(pts) and all(v > 0 for v in pts.values())
    assert engine.costs.mtp_step.points[1] > 0


@pytest.mark.parametrize("value, ok", [("auto", True), (3, True), ("fast", False), (2.5, False), (True, False)])
def test_draft_max_values(value, ok):
    p = DecodeParams(draft_max=value)
    if ok:
        p.validate(draft_limit=4)
    else:
        with pytest.raises(ParamError, match='draft_max must be an integer or "auto"'):
            p.validate(draft_limit=4)


def test_batched_auto_sequences_share_the_epochs_depth(demo):
    """In batched rounds every auto sequence drafts the depth of the epoch (depth.Epochs):
    the limit first; at depth 0 none drafts, and each emits what no-spec does."""
    first = demo.generate_batch(PROMPTS, max_tokens=20, draft_max="auto", ignore_eos=True)
    assert all(max(r.stats.depths) == demo.draft_limit and r.stats.drafted > 0 for r in first), \
        [r.stats.depths for r in first]
    rounds = demo._batcher_for(len(PROMPTS)).engine.rounds
    rounds.epochs.k = 0
    plain = demo.generate_batch(PROMPTS, max_tokens=20, draft_max="auto", ignore_eos=True)
    assert [r.stats.depths for r in plain] == [{0: 19}] * len(PROMPTS)
    assert all(r.stats.drafted == 0 for r in plain)
    require_exact_kernels()
    assert [r.tokens for r in plain] == [demo.generate(p, max_tokens=20, spec="none", ignore_eos=True).tokens
                                         for p in PROMPTS]


def test_batch_of_auto_sequences_equals_their_solo_runs(demo):
    require_exact_kernels()
    solo = [demo.generate(p, max_tokens=40, draft_max="auto", ignore_eos=True).tokens for p in PROMPTS]
    together = demo.generate_batch(PROMPTS, max_tokens=40, draft_max="auto", ignore_eos=True)
    assert [r.tokens for r in together] == solo
    assert all(sum(r.stats.depths.values()) > 0 for r in together)


def test_cli_generate_and_bench_take_auto(tmp_path):
    demo = str(pymtp.__path__[0]) + "/data/qwen35-tiny-mtp-q8_0.gguf"
    r = CliRunner().invoke(main, ["generate", demo, "-p", "Once upon a time", "-n", "16", "-k", "auto",
                                  "--json", "-t", "2"])
    assert r.exit_code == 0, r.output
    assert sum(json.loads(r.output)["stats"]["depths"].values()) > 0
    bad = CliRunner().invoke(main, ["generate", demo, "-p", "x", "-k", "fast"])
    assert bad.exit_code == 2 and 'draft_max must be an integer or "auto"' in bad.output
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    b = CliRunner().invoke(main, ["bench", demo, "--prompts", str(prompts), "-n", "8", "-k", "2", "-k", "auto",
                                  "--json", "-t", "2"])
    assert b.exit_code == 0, b.output
    rows = {row["setting"]: row for row in json.loads(b.output[b.output.index("{"):])["results"]}
    assert set(rows) == {"no-spec", "mtp k=2", "mtp k=auto"}
    auto = rows["mtp k=auto"]
    assert sum(auto["depths"].values()) > 0
    assert auto["requests_at_depth"] == {max(auto["depths"]): 1}      # one prompt: one run at one depth
