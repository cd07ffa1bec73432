"""draft_max="auto" in the engine, the batch, the CLI and the server (depth.py's policy)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from click.testing import CliRunner

import pymtp
from conftest import require_cache_exact, require_exact_kernels, require_rows_within_patch
from pymtp.cli import main
from pymtp.config import DEFAULTS, SEEDED_DEPTH, DecodeParams, ParamError, pin_seeded
from pymtp.depth import Arms
from pymtp.depth_batched import PROBE, Epochs, occupancy
from pymtp.drafter import DraftJob
from pymtp.engine import arm_kind
from pymtp.round_state import CatchUp, Ring
from pymtp.prefix_cache import TAIL_TOKENS
from pymtp.batch import calibrate_engines

# a calibration's budget for tests that check what its search ran: the default 10 s ran
# out before the search was done on two CPU threads shared with other work
SLOW_BUDGET_S = 300.0
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time", "import numpy as np\n"]


@pytest.fixture(scope="module")
def demo():
    m = pymtp.load(str(pymtp.__path__[0]) + "/data/qwen35-tiny-mtp-q8_0.gguf", threads=2)
    yield m
    m.close()


def test_the_default_depth_is_auto():
    assert DEFAULTS.draft_max is None     # left out, resolved per request by pin_seeded
    for p in (DecodeParams(), DecodeParams(temperature=0.7), DecodeParams(seed=1),
              DecodeParams(temperature=0.7, seed=1, spec="none")):
        assert pin_seeded(p, draft_limit=4).draft_max == "auto"


def test_a_seed_pins_a_sampled_request_left_to_the_default():
    # sampled with a seed: one fixed depth, so the seed repeats its text
    seeded = DecodeParams(temperature=0.7, seed=1)
    assert pin_seeded(seeded, draft_limit=4).draft_max == SEEDED_DEPTH == 3
    assert pin_seeded(seeded, draft_limit=2).draft_max == 2          # within the model's limit
    # a request that names its depth gets it, "auto" included (bench measures auto so)
    for k in (1, 4, "auto"):
        p = DecodeParams(temperature=0.7, seed=1, draft_max=k)
        assert pin_seeded(p, draft_limit=4) == p


def test_seeded_sampled_requests_repeat_under_the_default(demo):
    kw = dict(max_tokens=32, temperature=0.9, seed=5, ignore_eos=True)

    def cold(**more):
        # a session of its own: on a GPU build a prompt-cache hit may part from a cold run (CACHE_CHUNKS)
        with demo.session() as s:
            return s.generate("def f(x):", **kw, **more)

    runs = [cold() for _ in range(3)]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert all(set(r.stats.depths) == {SEEDED_DEPTH} for r in runs)   # the last round's too
    pinned = cold(draft_max=SEEDED_DEPTH)
    assert pinned.tokens == runs[0].tokens
    # unseeded, auto picks: a fresh session's search drafts at the model's limit first
    free = demo.session().generate("def f(x):", max_tokens=40, temperature=0.9, ignore_eos=True)
    assert max(free.stats.depths) == demo.draft_limit == 4


def test_a_seeds_shorter_request_gives_the_longer_ones_first_tokens(demo):
    """As plain sampling does: max_tokens does not cut a seeded request's last round
    short, which drew other uniforms (35 of 48 shorter runs here differed before)."""
    kw = dict(temperature=1.0, ignore_eos=True)

    def cold(n: int, seed: int) -> list[int]:
        # a session of its own: on a GPU build a prompt-cache hit may part from a cold run (CACHE_CHUNKS)
        with demo.session() as s:
            return s.generate("def fibonacci(n):", max_tokens=n, seed=seed, **kw).tokens

    for seed in range(3):
        long = cold(24, seed)
        for n in (1, 2, 5, 10, 17):
            assert cold(n, seed) == long[:n], (seed, n)
    with demo.batcher(3) as b:
        runs = [b.submit("def f(x):", max_tokens=n, seed=7, **kw) for n in (4, 11, 20)]
        got = [r.tokens for r in b.results(runs)]
    require_rows_within_patch("a round of several sequences")    # each of its rows against the others
    assert got[0] == got[2][:4] and got[1] == got[2][:11]


def test_a_seeds_round_past_max_tokens_ends_at_the_limit_not_at_its_end_token(demo):
    """A seeded round runs past max_tokens: an end token it drew there comes after the
    limit, where plain decoding stopped (it emitted n+1 of n tokens, finish "stop").

    A raw prompt, so "stop" is an end token (a chat on the fallback template also stops
    at the text "<|im_end|>", which the GPU build drew where the CPU's drew the token),
    and a bias on the end tokens, so that every backend draws them within a few seeds."""
    kw = dict(temperature=0.8, draft_max=3, logit_bias={t: 6.0 for t in demo.eog_ids})

    def cold(n: int, seed: int) -> tuple[list[int], str]:
        # a session of its own: on a GPU build a prompt-cache hit may part from a cold run (CACHE_CHUNKS)
        with demo.session() as s:
            r = s.generate("def fibonacci(n):", max_tokens=n, seed=seed, **kw)
            assert r.stats.generated_tokens == len(r.tokens)
            return r.tokens, r.finish_reason

    ended = 0
    for seed in range(20):
        full, finish = cold(16, seed)
        if finish != "stop":
            continue
        ended += 1          # on the CPU build 7 of 20; 4 of them went past the limit
        for n in range(1, len(full) + 1):
            assert cold(n, seed) == (full[:n], "length"), (seed, n)
    assert ended >= 3


def test_one_streams_search_hears_of_requests_a_stop_string_ends(dense_model):
    """A request its stop string ends closes the engine's generator between rounds: its
    rounds ran at the depth the search gave it, and the search hears of them (it heard
    only of requests that reached their end, and drafted at the untried limit forever)."""
    with dense_model.session() as s:
        p = "The quick brown fox"
        full = s.generate(p, max_tokens=100, ignore_eos=True, spec="none")
        at = len(dense_model.detokenize(full.tokens[:50]))
        stop = full.text[at:at + 6]
        assert full.text.find(stop) == at
        s.engine.arms.clear()
        r = s.generate(p, max_tokens=100, ignore_eos=True, draft_max="auto", stop=stop)
        assert r.finish_reason == "stop" and max(r.stats.depths) == dense_model.draft_limit
        (arms,) = s.engine.arms.values()
        assert set(arms.round_s) == {dense_model.draft_limit} and arms.seen == 1


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


def test_calibrate_runs_the_search_before_the_first_request(demo):
    """Session.calibrate runs a request at every depth on its own prompt (the limit,
    plain, then from the limit down); the first request after it drafts at the limit,
    its acceptance replacing the prompt's, the next runs at the leader, none is left to
    search, and each emits what its fixed setting emits."""
    s = demo.session()
    try:
        c = s.calibrate(budget_s=SLOW_BUDGET_S)
        assert c.depths == [demo.draft_limit, 0, *range(demo.draft_limit - 1, 0, -1)]
        arms = s.engine.arms_for(DecodeParams(draft_max="auto"))
        assert arms.untried() is None and not arms.exhaustive
        assert set(arms.round_s) == set(c.depths) == set(c.estimates)
        assert c.estimates == {k: round(arms.rate(k), 1) for k in sorted(arms.round_s)}
        assert c.seconds > 0.0
        assert arms.probe_texts and arms.provisional_texts
        for want in ("limit", "leader"):
            lead = demo.draft_limit if want == "limit" else arms.leader()
            r = s.generate(PROMPTS[1], max_tokens=40, draft_max="auto", ignore_eos=True, cache_prompt=False)
            assert max(r.stats.depths) == lead, want
            assert not arms.probe_texts and not arms.provisional_texts and arms.untried() is None
            fixed = dict(spec="none") if lead == 0 else dict(draft_max=lead)
            assert r.tokens == s.generate(PROMPTS[1], max_tokens=40, ignore_eos=True, cache_prompt=False,
                                          **fixed).tokens
        again = s.calibrate(budget_s=SLOW_BUDGET_S)       # every depth is measured: nothing runs
        assert again.depths == [] and set(again.estimates) == set(c.depths)
    finally:
        s.close()


def test_calibrate_prices_the_kind_it_is_given(demo):
    s = demo.session()
    try:
        c = s.calibrate(temperature=0.7, top_k=20, seed=1, budget_s=SLOW_BUDGET_S)
        assert c.depths[:2] == [demo.draft_limit, 0]
        assert list(s.engine.arms) == [arm_kind(DecodeParams(temperature=0.7, draft_max="auto"))]
        r = s.generate(PROMPTS[0], max_tokens=40, draft_max="auto", ignore_eos=True)    # greedy: unsearched
        assert max(r.stats.depths) == demo.draft_limit
    finally:
        s.close()


def test_calibrate_refuses_what_it_cannot_run(demo):
    s = demo.session()
    try:
        with pytest.raises(ParamError, match="budget_s must be a number of seconds >= 0"):
            s.calibrate(budget_s=-1)
        with pytest.raises(ParamError, match="max_tokens >= 32"):
            s.calibrate(max_tokens=8)
        with pytest.raises(ParamError) as e:
            s.calibrate(temperature=-1)
        assert e.value.param == "temperature"
        none = s.calibrate(budget_s=0)
        assert (none.depths, none.estimates) == ([], {})
        assert s.engine.arms_for(DecodeParams(draft_max="auto")).round_s == {}
    finally:
        s.close()


def test_batcher_calibrate_runs_the_batched_search_before_the_first_requests(demo, monkeypatch):
    """Batcher.calibrate runs batched auto's search (depth_batched.Epochs) on a copy of its prompt
    in every slot, until the full batch's bucket has nothing left to search. On the
    built-in prompt, whose acceptance is not the texts', the requests' first decode rounds
    then draft the limit for PROBE rounds, and the acceptance they measure replaces the
    prompt's (Epochs.calibrated); on a prompt of the caller's, the requests draft the
    leader's depth from their first decode rounds. Searched on them instead, plain (what a
    new bucket measures first) would run PROBE rounds and the limit PROBE more. Only the
    first rounds are the calibration's: after an epoch the search may go on, on what the
    requests measured (plain priced slower on them let an unmeasured k=3 lead by its
    estimate, two CPU threads under load)."""
    seen, real = [], Arms.observe

    def spy(self, k, tokens, seconds, rounds, drafted_at=(), accepted_at=(), prompt_s=0.0):
        real(self, k, tokens, seconds, rounds, drafted_at, accepted_at, prompt_s)
        seen.append((self, k, list(drafted_at), list(accepted_at), list(self.gains)))

    for prompt in (None, PROMPTS[3]):
        b = demo.batcher(2)
        try:
            c = b.calibrate(prompt, budget_s=SLOW_BUDGET_S)
            epochs, bucket = b.engine.rounds.epochs, (occupancy(2), False)
            arms = epochs.arms[bucket]
            assert arms.untried() is None and c.depths == sorted(arms.round_s) == sorted(c.estimates)
            assert {0, demo.draft_limit} <= set(c.depths)
            assert c.estimates == {k: round(rate, 1) for bk, k, _, rate in epochs.estimates() if bk == bucket}
            assert c.seconds > 0.0
            assert arms.provisional == set(c.depths) and arms.probe_texts == (prompt is None)
            first = demo.draft_limit if prompt is None else arms.leader()
            last = epochs.k           # the calibration's last depth, in force until the next pick
            drafts: dict[int, list[int]] = {0: [], 1: []}      # each request's drafts a round, in order
            seen.clear()
            monkeypatch.setattr(Arms, "observe", spy)
            for i, chunk in b.stream(PROMPTS[:2], max_tokens=40, draft_max="auto", ignore_eos=True,
                                     cache_prompt=False):
                drafts[i].append(chunk.drafted)
            monkeypatch.setattr(Arms, "observe", real)
            for i, d in drafts.items():   # the prompt's round drafts nothing; no search: no plain PROBE first
                # the pick after the prompt's round may come into force a round later: a
                # round is launched before the one before it is tallied (a GPU)
                rest = d[1:] if d[1] == first else d[2:] if d[1] == last else []
                assert rest[:PROBE] == [first] * PROBE, (i, first, last, d)
            # the requests' first measure of that depth replaced the calibration's
            me, k, drafted, accepted, gains = next(o for o in seen if o[0] is arms)
            assert k == first and first not in arms.provisional
            if prompt is None:            # ... and so did their acceptance, position by position
                assert gains == pytest.approx([a / n for a, n in zip(accepted, drafted)], rel=1e-12)
                assert not arms.provisional_texts
        finally:
            b.close()


def test_batcher_calibrate_refuses_what_it_cannot_run(demo, nomtp_path):
    b = demo.batcher(2)
    try:
        with pytest.raises(ParamError, match="budget_s must be a number of seconds >= 0"):
            b.calibrate(budget_s=-1)
        none = b.calibrate(budget_s=0)
        assert (none.depths, none.estimates) == ([], {}) and b.engine.rounds.epochs.arms == {}
    finally:
        b.close()
    plain = pymtp.load(nomtp_path, threads=1, n_ctx=256)
    try:
        with pytest.raises(ParamError, match="has no MTP block, so draft_max='auto' has nothing to calibrate"):
            plain.batcher(2).calibrate()
    finally:
        plain.close()


def test_one_stream_times_the_drafters_prompt_pass_apart_from_the_rounds(demo, monkeypatch):
    """An auto request's rounds are timed from where its drafter held the prompt's rows;
    that pass over the prompt goes to Arms apart (``prompt_s``). A delay put into the
    pass lands there and not in the rounds' seconds; a plain request has no pass."""
    engine = demo._default.engine
    engine.arms.clear()
    seen, real = [], Arms.observe
    monkeypatch.setattr(Arms, "observe", lambda self, *a, **kw: (seen.append((a, kw)), real(self, *a, **kw))[1])
    drafter = engine.drafter()
    decode, calls = drafter.ctx.decode, []

    def slow_first(batch):            # the request's first drafter decode: the prompt's rows
        calls.append(batch.n)
        if len(calls) == 1:
            time.sleep(0.5)
        return decode(batch)

    monkeypatch.setattr(drafter.ctx, "decode", slow_first)
    kw = dict(max_tokens=40, ignore_eos=True, cache_prompt=False)
    t0 = time.perf_counter()
    r = demo.generate(PROMPTS[0], draft_max="auto", **kw)          # the limit, searched first
    wall = time.perf_counter() - t0
    assert max(r.stats.depths) == demo.draft_limit and calls[0] >= len(demo.tokenize(PROMPTS[0])) - 1
    (k, tokens, seconds, rounds, *_), opts = seen[0]
    assert (k, tokens, rounds) == (demo.draft_limit, 40, sum(r.stats.depths.values()))
    assert opts["prompt_s"] >= 0.5 and seconds <= wall - 0.5
    (arms,) = engine.arms.values()
    assert arms.round_s[k] == pytest.approx(seconds / rounds)
    assert arms.prompt_pass == pytest.approx(opts["prompt_s"] / 40)
    assert arms.rate(k) == pytest.approx(arms.tokens(k) / (arms.round_s[k] + arms.tokens(k) * arms.prompt_pass))
    demo.generate(PROMPTS[1], draft_max="auto", **kw)                # then plain decoding
    (k, tokens, seconds, rounds, *_), opts = seen[1]
    assert (k, tokens, rounds, opts["prompt_s"]) == (0, 40, 39, 0.0)


def _mtp_decodes(rounds, monkeypatch) -> list[int]:
    """Counts the drafter context's decodes (one entry per decode: its rows)."""
    ctx = rounds.drafter.ctx
    seen, real = [], ctx.decode
    monkeypatch.setattr(ctx, "decode", lambda batch: (seen.append(batch.n), real(batch))[1])
    return seen


@pytest.fixture
def pinned(demo, monkeypatch):
    """A batcher of one slot whose epochs are 8 rounds long and draft the depths
    ``plan(depths)`` gives them, in order (the last one on and on)."""
    batcher = demo.batcher(1)
    rounds = batcher.engine.rounds
    monkeypatch.setattr("pymtp.depth_batched.EPOCH", 8)
    monkeypatch.setattr("pymtp.depth_batched.PROBE", 8)

    def plan(depths: list[int]):
        left = list(depths[1:] or depths)
        epochs = Epochs(demo.draft_limit, k=depths[0])
        monkeypatch.setattr(epochs, "pick", lambda bucket: left.pop(0) if len(left) > 1 else left[0])
        rounds.epochs = epochs
        return rounds

    yield batcher, plan
    batcher.close()


def test_plain_epochs_leave_the_drafter_idle_until_one_drafts(demo, pinned, monkeypatch):
    """Where positions cannot jump, a round at depth 0 decodes the target only: the
    drafter's rows wait for the first round of a drafting epoch and go in its catch-up
    decode, and its drafts are the ones a drafter caught up every round proposes (same
    rounds, drafts and acceptances)."""
    batcher, plan = pinned
    kw = dict(max_tokens=40, draft_max="auto", ignore_eos=True, cache_prompt=False)
    rounds = plan([0, 3])
    monkeypatch.setattr(rounds.model, "positions_jump", False)
    seen = _mtp_decodes(rounds, monkeypatch)
    (r,) = batcher.generate([PROMPTS[0]], **kw)
    assert r.stats.depths[0] == 8 and r.stats.drafted > 0, r.stats.depths
    # the prompt's rows, then nothing for 8 plain rounds: the first drafting round catches
    # up on their rows in one decode
    assert seen[1] >= 8, seen
    monkeypatch.setattr("pymtp.round_draft.DEFER_ROWS", 0)     # caught up every round
    seen = _mtp_decodes(plan([0, 3]), monkeypatch)
    (every,) = batcher.generate([PROMPTS[0]], **kw)
    assert seen[1:9] == [1] * 8, seen
    require_exact_kernels()
    assert r.tokens == every.tokens == demo.generate(PROMPTS[0], spec="none", max_tokens=40, ignore_eos=True).tokens
    assert (r.stats.depths, r.stats.drafted_at, r.stats.accepted_at) == \
        (every.stats.depths, every.stats.drafted_at, every.stats.accepted_at)


def test_deferred_rows_are_bounded(demo, pinned, monkeypatch):
    """Where positions cannot jump, rows wait for a drafting round at most DEFER_ROWS at a time."""
    batcher, plan = pinned
    monkeypatch.setattr("pymtp.round_draft.DEFER_ROWS", 8)
    rounds = plan([0])
    monkeypatch.setattr(rounds.model, "positions_jump", False)
    seen = _mtp_decodes(rounds, monkeypatch)
    (r,) = batcher.generate([PROMPTS[1]], max_tokens=40, draft_max="auto", ignore_eos=True, cache_prompt=False)
    assert set(r.stats.depths) == {0}, r.stats.depths
    assert seen[1:] and set(seen[1:]) == {8}, seen       # the prompt's rows, then 8 at a time
    require_exact_kernels()
    assert r.tokens == demo.generate(PROMPTS[1], max_tokens=40, spec="none", ignore_eos=True).tokens


def test_plain_epochs_keep_the_newest_rows_and_the_drafter_resumes_after_a_gap(demo, pinned, monkeypatch):
    """Where positions may jump (Qwen3.5's M-RoPE), a plain round keeps only the newest
    RESUME_ROWS rows for the drafter, and the prompt's: nothing goes to the drafter
    until the first drafting round, which decodes the prompt's rows, then those and the
    last round's own row at their positions (the last one ``last``'s), leaving a gap in
    the MTP KV; the drafts still get accepted and the output is plain decoding's."""
    batcher, plan = pinned
    assert demo._native.positions_jump
    monkeypatch.setattr("pymtp.round_state.RESUME_ROWS", 2)
    rounds = plan([0, 3])
    seen = _mtp_decodes(rounds, monkeypatch)
    starts, propose = [], rounds.drafter.propose
    monkeypatch.setattr(rounds.drafter, "propose", lambda jobs: (
        starts.extend((j.start, len(j.tokens)) for j in jobs if j.start is not None), propose(jobs))[1])
    (r,) = batcher.generate([PROMPTS[0]], max_tokens=40, draft_max="auto", ignore_eos=True, cache_prompt=False)
    assert r.stats.depths[0] == 8 and r.stats.accepted > 0, (r.stats.depths, r.stats.accepted)
    # the prompt's rows, 2 + 1 rows (row by row on GPUs: drafter.catch_up_plan), then the
    # draft chain's
    assert seen[:2] == [r.stats.prompt_tokens, 1 if rounds.drafter.row_by_row else 3], seen
    # the first token at the prompt's length, then 8 plain rounds: ``last`` is 8 further on
    assert starts == [(r.stats.prompt_tokens + 8 - 2, 3)], starts
    require_exact_kernels()
    assert r.tokens == demo.generate(PROMPTS[0], spec="none", max_tokens=40, ignore_eos=True).tokens


def test_a_request_that_never_drafts_never_decodes_in_the_drafter(demo, pinned, monkeypatch):
    """Under load auto may run plain epochs for whole requests; then their rounds cost
    what plain decoding's do: no MTP decode at all, not even of the prompt."""
    batcher, plan = pinned
    seen = _mtp_decodes(plan([0]), monkeypatch)
    (r,) = batcher.generate([PROMPTS[3]], max_tokens=40, draft_max="auto", ignore_eos=True, cache_prompt=False)
    assert set(r.stats.depths) == {0} and seen == [], (r.stats.depths, seen)
    require_exact_kernels()
    assert r.tokens == demo.generate(PROMPTS[3], spec="none", max_tokens=40, ignore_eos=True).tokens


def test_a_prompt_prefilled_in_a_plain_epoch_keeps_its_newest_rows_for_a_round_that_drafts(demo, pinned, monkeypatch):
    """A prompt prefilled in chunks during a plain epoch does not catch the drafter up
    between them (MTP decodes in the load's prompt rounds that a request that never
    drafts never reads): it keeps the newest PREFILL_DEFER rows, and the first round that
    drafts decodes them after a gap, at their positions; the output is plain decoding's."""
    batcher, plan = pinned
    monkeypatch.setattr("pymtp.round_draft.PREFILL_DEFER", 4)
    monkeypatch.setattr(batcher.engine, "prefill_chunk", 8)
    prompt = demo.prompt_ids(" ".join(PROMPTS * 2))
    assert len(prompt) > 3 * 8
    kw = dict(max_tokens=24, draft_max="auto", ignore_eos=True, cache_prompt=False)
    seen = _mtp_decodes(plan([0]), monkeypatch)
    (plain,) = batcher.generate([prompt], **kw)
    assert set(plain.stats.depths) == {0} and seen == [], (plain.stats.depths, seen)
    rounds = plan([0, 3])
    jobs, propose = [], rounds.drafter.propose
    monkeypatch.setattr(rounds.drafter, "propose", lambda js: (
        jobs.extend((j.start, len(j.tokens)) for j in js), propose(js))[1])
    (r,) = batcher.generate([prompt], **kw)
    assert r.stats.depths[0] == 8 and r.stats.accepted > 0, (r.stats.depths, r.stats.accepted)
    start, n = jobs[0]       # the prompt's rows: its last ones, after a gap, up to its end
    assert 0 < start and start + n == len(prompt) and n <= 4 + 8, jobs
    require_exact_kernels()
    assert r.tokens == plain.tokens == demo.generate(prompt, spec="none", **kw).tokens


@pytest.mark.parametrize("defer, first", [(4, 0), (12, 0), (4, 3)])
def test_a_plain_epochs_prompt_pairs_are_the_newest_of_all_its_pairs(demo, pinned, monkeypatch, defer, first):
    """What a plain epoch's prompt chunk leaves the drafter (``Drafting.prompt_pairs``,
    which copies only the rows it keeps) is exactly the newest PREFILL_DEFER of the
    pending rows joined with the chunk's pairs, with the position of the first kept one;
    a chunk whose prompt is nearly done keeps them all, and the last one's are followed
    by the first token's pair (chunks of 8: with 4 only the
    chunk's own newest rows stay, with 12 the pending's newest too). ``first=3``: the
    first chunk lands in a drafting epoch and keeps all its rows, the epoch turns plain
    before the next launch, and the next chunk cuts them with its own; the output is
    plain decoding's."""
    from pymtp import round_draft as D

    batcher, plan = pinned
    monkeypatch.setattr("pymtp.round_draft.PREFILL_DEFER", defer)
    monkeypatch.setattr(batcher.engine, "prefill_chunk", 8)
    prompt = demo.prompt_ids(" ".join(PROMPTS * 2))
    rounds = plan([first])
    real, seen = D.Drafting.prompt_pairs, []

    def checked(self, s, c, hidden, auto, then=None):
        old = s.pending
        full = CatchUp(np.asarray(s.prompt[c.start:c.start + c.n], dtype=np.int32),
                       np.concatenate([s.hidden_before, hidden[:-1]]))
        full = full if old is None else old.then(full)
        assert (then is None) == s.prefilling
        if then is not None:      # the last chunk's pairs, then the first token's
            full = full.then(CatchUp(np.array([then], dtype=np.int32), hidden[-1:]))
        plain = self._plain_prefill(s, auto)
        out = real(self, s, c, hidden, auto, then)
        cut = len(full.tokens) - len(out.tokens)
        keeps_all = not plain or len(s.prompt) - s.prefilled <= defer
        assert cut == (0 if keeps_all else max(0, len(full.tokens) - defer)), (cut, c.start)
        first_pos = full.start if full.start is not None else rounds.drafter.end(s.seq)
        assert out.start == (full.start if cut == 0 else first_pos + cut)
        assert np.array_equal(out.tokens, full.tokens[cut:]) and np.array_equal(out.hidden, full.hidden[cut:])
        seen.append((c.n, cut, len(out.tokens), plain))
        rounds.epochs.k = 0          # every chunk after the first lands in a plain epoch
        return out

    monkeypatch.setattr(D.Drafting, "prompt_pairs", checked)
    kw = dict(max_tokens=4, draft_max="auto", ignore_eos=True, cache_prompt=False)
    (r,) = batcher.generate([prompt], **kw)
    assert set(r.stats.depths) == {0}
    cuts = [cut for _, cut, _, _ in seen]
    assert sum(n for n, _, _, _ in seen) == len(prompt) and any(cuts) and cuts[-1] == 0, seen
    if defer == 12:       # the pending's newest rows stay beside the chunk's
        assert any(0 < cut < 8 for cut in cuts), seen
    if first:             # the drafting epoch's chunk kept its 8 rows; the next one cut them too
        assert seen[0] == (8, 0, 8, False) and seen[1][1] == 8 + 8 - defer and seen[1][3], seen
        require_exact_kernels()
        assert r.tokens == demo.generate(prompt, spec="none", **kw).tokens


def test_a_reply_that_ends_in_a_plain_epoch_is_reused_past_the_drafters_gap(demo, pinned, monkeypatch):
    """The snapshot at the end of a reply whose plain rounds dropped the drafter's rows
    keeps only the newest pairs; the next turn still restores it (the drafter jumps to
    its tail), so it reuses the whole reply."""
    batcher, plan = pinned
    monkeypatch.setattr("pymtp.round_state.RESUME_ROWS", 2)
    plan([0])
    a = demo.prompt_ids(PROMPTS[1])
    (first,) = batcher.generate([a], max_tokens=16, draft_max="auto", ignore_eos=True)
    assert set(first.stats.depths) == {0}, first.stats.depths
    b = a + first.tokens + demo.tokenize(" and then", add_special=False)
    plan([3])
    (again,) = batcher.generate([b], max_tokens=12, draft_max="auto", ignore_eos=True)
    assert again.stats.cached_tokens >= len(a) + len(first.tokens) - 1, (again.stats.cached_tokens, len(a))
    assert again.stats.accepted > 0
    require_cache_exact()
    assert again.tokens == demo.generate(b, max_tokens=12, spec="none", ignore_eos=True, cache_prompt=False).tokens


def test_a_batched_round_is_timed_from_the_landing_before_it(demo, pinned, monkeypatch):
    """What the loop does between two landings counts for the round: on a GPU it hands
    the last round's Steps on while the device decodes, and a round timed by its launch
    and its landing alone left that out, more for a depth that emits more tokens. Once
    no round follows, the next one's time starts at its own launch."""
    batcher, plan = pinned
    rounds = plan([3])
    timed = []
    monkeypatch.setattr(rounds.epochs, "tally", lambda seconds, *rest: timed.append(seconds))
    start = time.perf_counter()
    run = batcher.submit(PROMPTS[0], max_tokens=12, draft_max="auto", ignore_eos=True, cache_prompt=False)
    while not run.done:
        batcher.step()
        time.sleep(0.05)        # between one landing and the next, on any backend
    # each round's time holds a sleep, and no two overlap (no bound of the machine's speed:
    # under load one round took over a second)
    assert len(timed) >= 2 and all(t >= 0.05 for t in timed) and sum(timed) <= time.perf_counter() - start, timed
    assert rounds._landed is None


@pytest.mark.parametrize("fill", [False, True])
def test_rounds_tell_the_epochs_when_their_seq_ids_have_a_gap(demo, monkeypatch, fill):
    """Once the middle one of three sequences ends, the other two are decoded in two
    ubatches (scheduler.py); depth_batched.Epochs times such rounds apart. Where filler rows
    close the gap (verify_batch.VerifyBatch.fill_width), the round is one
    ubatch and is timed as one."""
    batcher = demo.batcher(3)
    try:
        rounds = batcher.engine.rounds
        rounds.verify_batch.fill_width = rounds.drafter.fill_width = None if fill else 0
        seen = []
        real = rounds.epochs.tally
        monkeypatch.setattr(rounds.epochs, "tally", lambda seconds, steps, n_seqs=None, gap=False, *rest: (
            seen.append((n_seqs, gap)), real(seconds, steps, n_seqs, gap, *rest))[1])
        runs = [batcher.submit(p, max_tokens=n, draft_max="auto", ignore_eos=True, cache_prompt=False)
                for p, n in zip(PROMPTS, (24, 6, 24))]
        while not all(r.done for r in runs):
            batcher.step()
        assert (3, False) in seen and ((2, False) in seen) == fill and ((2, True) in seen) != fill, seen
        gaps = any(bucket[1] for bucket in rounds.epochs.arms) or any(key[0][1] for key in rounds.epochs.tallies)
        assert gaps != fill
    finally:
        batcher.close()


def test_rounds_tell_the_epochs_each_rounds_prompt_rows(demo, monkeypatch):
    """A round that prefills a new prompt beside a decoding sequence, and the round whose
    drafter decodes that prompt's rows, are priced apart from the decode rounds
    (depth_batched.Epochs): the epochs learn the target's prompt rows of every round and whether
    its drafter decoded a new prompt's."""
    batcher = demo.batcher(2)
    try:
        rounds = batcher.engine.rounds
        rounds.epochs.k = 3
        monkeypatch.setattr(rounds.epochs, "pick", lambda bucket: 3)
        seen = []
        real_draft, real_tally = rounds._draft, rounds.epochs.tally

        def draft(seqs, decoding):
            drafted = real_draft(seqs, decoding)
            seen.append([drafted, [len(s.prompt) - s.prefilled for s in seqs if s.prefilling], None, None])
            return drafted

        def tally(seconds, steps, n_seqs=None, gap=False, prompt_rows=0, drafter_prompt=False):
            seen[-1][2:] = prompt_rows, drafter_prompt
            real_tally(seconds, steps, n_seqs, gap, prompt_rows, drafter_prompt)

        monkeypatch.setattr(rounds, "_draft", draft)
        monkeypatch.setattr(rounds.epochs, "tally", tally)
        kw = dict(max_tokens=24, draft_max="auto", ignore_eos=True, cache_prompt=False)
        first = batcher.submit(PROMPTS[0], **kw)
        while batcher.metrics.rounds < 4:
            batcher.step()
        second = batcher.submit(PROMPTS[1] * 8, **kw)
        n_second = len(second.request.prompt)
        while not (first.done and second.done):
            batcher.step()
    finally:
        batcher.close()
    start = next(i for i, (_, left, _, _) in enumerate(seen) if left == [n_second])
    late = [i for i, (_, left, _, _) in enumerate(seen) if left and i >= start]
    # the target's rows of the prompt, round by round, add up to the prompt, and the
    # drafter decodes none of them while the prompt is being prefilled
    assert sum(seen[i][2] for i in late) == n_second and not any(seen[i][0] or seen[i][3] for i in late), seen
    after = seen[late[-1] + 1]
    assert after == [True, [], 0, True], seen           # the drafter's catch-up of the prompt
    assert all(d is False and rows == 0 and not dp for d, left, rows, dp in seen[late[-1] + 2:]), seen
    # every prompt row counts for the rows a token; the rounds that carried them, and the
    # catch-up, are booked at their depth once its decode rounds are priced
    ep = rounds.epochs
    assert ep.load_rows == n_second and set(ep.prompts) <= {3}


def test_catch_up_rows_follow_on_at_the_first_ones_position():
    tokens, hidden = np.arange(2, dtype=np.int32), np.arange(4, dtype=np.float32).reshape(2, 2)
    more = CatchUp(tokens, hidden, 18).then(CatchUp(np.array([7], dtype=np.int32), np.zeros((1, 2), dtype=np.float32)))
    assert (more.tokens.tolist(), more.hidden[:, 0].tolist(), more.start) == ([0, 1, 7], [0, 2, 0], 18)


def test_a_plain_epochs_ring_keeps_the_newest_rows_and_the_rounds_own(monkeypatch):
    """What _hold keeps (RESUME_ROWS) and each plain round adds: the newest RESUME_ROWS
    pairs before a round and the round's own, at their positions."""
    monkeypatch.setattr("pymtp.round_state.RESUME_ROWS", 2)
    tokens, hidden = np.arange(5, dtype=np.int32), np.arange(10, dtype=np.float32).reshape(5, 2)
    ring = Ring.of(CatchUp(tokens, hidden), 20)           # pairs at 15..19: 18 and 19 kept
    rows = ring.rows()
    assert (rows.tokens.tolist(), rows.hidden.tolist(), rows.start) == ([3, 4], [[6, 7], [8, 9]], 18)
    ring.add(7, np.array([70, 71], dtype=np.float32))      # at 20
    rows = ring.rows()
    assert (rows.tokens.tolist(), rows.hidden[:, 0].tolist(), rows.start) == ([3, 4, 7], [6, 8, 70], 18)
    ring.add(8, np.array([80, 81], dtype=np.float32))      # at 21: over the oldest
    ring.add(9, np.array([90, 91], dtype=np.float32))
    rows = ring.rows()
    assert (rows.tokens.tolist(), rows.hidden[:, 1].tolist(), rows.start) == ([7, 8, 9], [71, 81, 91], 20)
    short = Ring.of(CatchUp(tokens[:1], hidden[:1], 4), 5)
    assert (short.rows().tokens.tolist(), short.rows().start) == ([0], 4)


def test_the_drafter_refuses_a_job_that_starts_inside_its_kv(demo):
    s = demo.session()
    s.generate(PROMPTS[2], max_tokens=4, draft_max=2, ignore_eos=True, cache_prompt=False)
    drafter = demo._default.engine.drafter()
    end = drafter.end(0)
    assert end > 0
    job = DraftJob(0, np.array([1], dtype=np.int32), np.zeros((1, demo._native.n_embd_out), dtype=np.float32),
                   start=end - 1)
    with pytest.raises(ValueError, match=f"starts at {end - 1}, inside the {end} positions"):
        drafter.propose([job])


def test_a_plain_epoch_keeps_the_prompt_end_reusable(demo, pinned):
    """The prompt cache's snapshots at the prompt's end hold no drafter pairs of their
    own: the first round after the prompt feeds the drafter even at depth 0, so a next
    request that parts from this one in its last tokens reuses all before them."""
    batcher, plan = pinned
    plan([0])
    a = demo.prompt_ids("The quick brown fox jumps over the lazy dog. " * 2)
    b = a[:-2] + demo.prompt_ids(" Hello there friend")[-3:]
    (first,) = batcher.generate([a], max_tokens=8, draft_max="auto", ignore_eos=True)
    assert set(first.stats.depths) == {0}, first.stats.depths
    (again,) = batcher.generate([b], max_tokens=6, draft_max="auto", ignore_eos=True)
    assert again.stats.cached_tokens >= len(a) - TAIL_TOKENS, (again.stats.cached_tokens, len(a))
    require_cache_exact()
    assert again.tokens == demo.generate(b, max_tokens=6, spec="none", ignore_eos=True, cache_prompt=False).tokens


@pytest.mark.parametrize("value, ok", [("auto", True), (3, True), ("fast", False), (2.5, False), (True, False)])
def test_draft_max_values(value, ok):
    p = DecodeParams(draft_max=value)
    if ok:
        p.validate(draft_limit=4)
    else:
        with pytest.raises(ParamError, match='draft_max must be an integer or "auto"'):
            p.validate(draft_limit=4)


def test_batched_auto_sequences_share_the_epochs_depth(demo, monkeypatch):
    """In batched rounds every auto sequence drafts the depth of the epoch (depth_batched.Epochs):
    plain first, then the limit (both within 20 tokens); at depth 0 none drafts, and each
    emits what no-spec does."""
    first = demo.generate_batch(PROMPTS, max_tokens=20, draft_max="auto", ignore_eos=True)
    assert all(max(r.stats.depths) == demo.draft_limit and r.stats.drafted > 0 for r in first), \
        [r.stats.depths for r in first]
    epochs = demo._batcher_for(len(PROMPTS)).engine.rounds.epochs
    monkeypatch.setattr(epochs, "k", 0)
    monkeypatch.setattr(epochs, "pick", lambda bucket: 0)
    plain = demo.generate_batch(PROMPTS, max_tokens=20, draft_max="auto", ignore_eos=True)
    assert [r.stats.depths for r in plain] == [{0: 19}] * len(PROMPTS)
    assert all(r.stats.drafted == 0 for r in plain)
    require_rows_within_patch("a round of several sequences")
    assert [r.tokens for r in plain] == [demo.generate(p, max_tokens=20, spec="none", ignore_eos=True).tokens
                                         for p in PROMPTS]


def test_batch_of_auto_sequences_equals_their_solo_runs(demo):
    require_rows_within_patch("a round of several sequences")
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
    assert [str(k) for k, _ in auto["requests_in_order"]] == [max(auto["depths"])] and auto["requests_in_order"][0][1] > 0
    assert "requests_in_order" not in rows["mtp k=2"]
    cal = auto["calibration"]           # auto's search ran at load, before the measured runs
    # the limit first, then plain decoding: as many as its 10 s budget runs (one, once, on a
    # box whose two cores the rest of the suite and a benchmark shared)
    assert cal["depths"][0] == max(cal["depths"]) > 0 and cal["depths"][1:2] in ([0], []) and cal["seconds"] > 0
    assert sorted(int(k) for k in cal["estimates"]) == sorted(cal["depths"])
    text = CliRunner().invoke(main, ["bench", demo, "--prompts", str(prompts), "-n", "8", "-k", "auto", "-t", "2"]).output
    assert "mtp k=auto: calibrated at load in" in text and "mtp k=auto: depth@tok/s request by request" in text


def test_a_following_batcher_drafts_the_depth_its_leaders_search_picks(demo):
    """``follow``: a batcher made beside another (serve --engines, generate_batch with
    engines) drafts the depth the other's epochs pick, from its next round, and runs no
    search of its own: its metrics hold no epochs, and calibrating it reports the
    leader's search. Greedy output is the same at any depth."""
    require_rows_within_patch("a round of several sequences")
    leader = demo.batcher(2)
    follower = demo.batcher(2, follow=leader)
    try:
        epochs = leader.engine.rounds.epochs
        assert follower.engine.rounds.epochs.leader is epochs and follower.metrics.epochs is None
        kw = dict(max_tokens=24, draft_max="auto", ignore_eos=True, cache_prompt=False)
        plain = [demo.generate(p, spec="none", max_tokens=24, ignore_eos=True).tokens for p in PROMPTS[:2]]
        for k in (2, 0, 1):
            epochs.k = k         # what the leader's last pick left in force
            rs = follower.generate(PROMPTS[:2], **kw)
            assert [r.tokens for r in rs] == plain, k
            for r in rs:         # the first round took the depth left by the last run; the
                d = r.stats.depths      # rounds cut short by max_tokens draft less
                assert max(d, key=d.get) == k and max(d) <= max(k, 2), (k, d)
        assert epochs.arms == {} and epochs.tallies == {}
        with pytest.raises(ValueError, match="drafts the depths of the batcher it follows"):
            follower.calibrate()            # the leader records the search: it would never end
        with pytest.raises(ValueError, match="needs the batcher whose search runs first"):
            calibrate_engines([follower, leader])
        searched = calibrate_engines([leader, follower])
        assert searched.estimates and sorted(searched.estimates) == searched.depths
        arms = epochs.arms[(occupancy(4), False)]       # both engines' slots: the requests' first
        assert arms.probe_texts and arms.provisional == set(searched.depths)    # measures replace it
        assert calibrate_engines([leader, follower], budget_s=0).estimates == searched.estimates
    finally:
        follower.close()
        assert leader.engine.rounds.epochs.followers == []
        leader.close()


def test_a_leader_calibrated_alone_searches_its_own_slots(demo):
    """A batcher with a follower, calibrated on its own (the follower idle), searches the
    bucket of its own slots: the follower adds no sequence to its rounds. Calibrated for
    the bucket of both engines' slots, it searched until its budget ran out."""
    leader = demo.batcher(2)
    follower = demo.batcher(2, follow=leader)
    try:
        c = leader.calibrate(budget_s=60.0)
        assert c.estimates
        assert leader.engine.rounds.epochs.arms[(occupancy(2), False)].untried() is None
    finally:
        follower.close()
        leader.close()
