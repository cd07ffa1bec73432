"""Batched rounds (#10): every sequence in a batch emits what it emits alone.

Several sequences share each target decode and MTP decode here, with different depths,
temperatures, seeds, limits and rollback paths; some finish, are cancelled or arrive
mid-batch. Each one's tokens must equal ``Model.generate`` of the same request alone.
On CPU builds the demo Q8_0 model's logits are compared bit for bit as well; on GPU
builds the token comparisons follow conftest's rules (exact_kernels / GPU_DRIFT).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from collections import defaultdict

import numpy as np
import pytest

import pymtp

from conftest import SMALL_Q8, exact_kernels, gpu_build, require_rows_within_patch, shared_model
from pymtp.config import DecodeParams, ParamError
from pymtp.drafter import catch_up_plan, gap_fillers
from pymtp.engine import Engine
from pymtp.guard import ClosedError
from pymtp.round_plan import SHAPED_ROWS, prefill_chunks, shaped_chunks, verify_rows
from pymtp.rounds import Rounds
from pymtp.scheduler import BatchEngine, lowest_free
from pymtp.seq_resume import Resumes
from pymtp.verify_batch import VerifyBatch

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The quick brown fox",
    "for i in range(10):\n    print(i)\n",
    "import numpy as np\n",
    "class Stack:\n    def __init__(self):\n",
    "Once upon a time",
]

# One request per prompt: depths 0..4, p_min, the checkpoint rollback, a short max_tokens.
MIXED = [
    dict(draft_max=3),
    dict(draft_max=1),
    dict(spec="none"),
    dict(draft_max=4, p_min=0.5),
    dict(draft_max=3, rollback="checkpoint"),
    dict(draft_max=2, max_tokens=9),
]


def require_batch_exact() -> None:
    require_rows_within_patch("a round of several sequences")


def _fresh_batchers(model) -> None:
    """Close the batchers earlier tests left the model for generate_batch."""
    for b in model._batchers.values():
        b.close()
    model._batchers.clear()


def _request(i: int, n: int = 36, **extra) -> dict:
    kw = dict(max_tokens=n, ignore_eos=True)
    kw.update(MIXED[i % len(MIXED)])
    kw.update(extra)
    return kw


def _drain(batcher, runs) -> dict:
    """Step until every run is done; tokens and text per run."""
    tokens, text = defaultdict(list), defaultdict(str)
    while any(not r.done for r in runs):
        for run, chunk in batcher.step():
            tokens[run] += chunk.tokens
            text[run] += chunk.text
    return {r: (tokens[r], text[r]) for r in runs}


def test_a_cancel_between_dropping_and_admitting_ends_the_run(demo, monkeypatch):
    """A slot's relay thread may cancel a waiting request after launch() dropped the
    cancelled ones and before it admits: the run still ends "cancelled" and the batcher
    lets go of it (it kept the run, waiting for a Step that never came)."""
    b = demo.batcher(1)
    try:
        ids = demo.tokenize("Hello there")
        run = b.submit(ids, max_tokens=4)
        drop = b.engine._drop_cancelled

        def then_cancel():
            out = drop()
            b.cancel(run)
            return out

        monkeypatch.setattr(b.engine, "_drop_cancelled", then_cancel)
        for _ in range(3):
            b.step()
        assert (run.done, run.finish_reason) == (True, "cancelled")
        assert run.request not in b._runs
        monkeypatch.undo()
        later = b.submit(ids, max_tokens=4)
        assert b.results([later])[0].tokens == demo.generate(ids, max_tokens=4).tokens
        assert len(b._runs) == 0
    finally:
        b.close()


def test_a_run_cancelled_in_its_prompt_counts_the_prompt_it_decoded(demo):
    """/metrics and /slots count a request's ``Stats.prompt_processed``: a run cancelled
    two chunks into its prompt decoded 16 of its tokens, in a time, not its whole prompt
    in none (it counted ``prompt_tokens - cached_tokens`` with 0 s); a whole run decodes
    them all. A chunk counts once its decode is queued, as llama-server's: the server
    takes a cancelled run's stats before the round in flight lands."""
    from pymtp.server.metrics import _Totals

    b = demo.batcher(1, prefill_chunk=8)
    try:
        ids = demo.tokenize("Hello there, " * 20)
        assert len(ids) > 40
        run = b.submit(ids, max_tokens=4)
        b.step()
        b.step()      # the second chunk in flight
        assert not run.done and run.request.stats.prompt_processed == 16
        b.cancel(run)
        while not run.done:
            b.step()
        st = run.stats
        assert run.finish_reason == "cancelled"
        assert (st.prompt_tokens, st.cached_tokens, st.prompt_processed) == (len(ids), 0, 16)
        assert st.prompt_seconds > 0 and st.generated_tokens == 0
        totals = _Totals()
        totals.add(st)
        assert (totals.prompt, totals.cached, totals.n_tokens_max) == (16, 0, 16)
        whole = b.submit(ids[:20], max_tokens=4, cache_prompt=False)
        b.results([whole])
        assert (whole.stats.prompt_tokens, whole.stats.prompt_processed) == (20, 20 - whole.stats.cached_tokens)
    finally:
        b.close()


@pytest.fixture(scope="module")
def demo():
    import pymtp

    m = pymtp.load(threads=1, n_ctx=1024)
    yield m
    m.close()


# ------------------------------------------------------------------ the policies, pure

def test_verify_rows_pad_to_the_longest_where_snapshots_reach():
    far = [1000] * 3
    assert verify_rows([4, 1, 2], [False, False, False], n_rs_seq=4, space=far) == [4, 4, 4]
    # a checkpointed sequence keeps its own length: its restore re-decodes what it keeps
    assert verify_rows([4, 1, 2], [False, False, True], n_rs_seq=4, space=far) == [4, 4, 2]
    # no snapshots (an architecture without them): nothing could roll pads back
    assert verify_rows([4, 1], [False, False], n_rs_seq=0, space=far[:2]) == [4, 1]
    assert verify_rows([], [], n_rs_seq=4, space=[]) == []
    # a sequence near its context's end is not padded past it (the batch's decode failed)
    assert verify_rows([4, 1, 2], [False] * 3, n_rs_seq=4, space=[5, 3, 4]) == [4, 1, 4]


def test_prefill_chunks_first_come_within_rows_and_outputs():
    assert prefill_chunks([100, 50], [False, False], rows=120, outputs=10) == [100, 20]
    # a chunk scoring its prompt outputs every row, so the outputs bound it; the other
    # prompt's last chunk then waits a round for an output row of its own
    assert prefill_chunks([100, 50], [True, False], rows=120, outputs=10) == [10, 49]
    # a prompt's last chunk needs an output row for its first token
    assert prefill_chunks([5], [False], rows=120, outputs=0) == [4]
    assert prefill_chunks([30], [False], rows=0, outputs=5) == [0]


FAR = [1000] * 5


def test_shaped_chunks_ride_as_the_decoders_rows():
    # plain decoders (one row each, no snapshots): a chunk within SHAPED_ROWS goes a token a round
    assert shaped_chunks([4, 5, 1], [False] * 3, rows=1, n_rs_seq=0, room=100, space=FAR) == [(1, 0), (5, 0), (1, 0)]
    assert SHAPED_ROWS == 4
    # drafting decoders at 4 rows (3 snapshots): shorter chunks are padded up to 4, and a
    # chunk whose rest after 4 would be shorter than the snapshots' tail takes 4 now
    assert shaped_chunks([4, 1, 7, 8, 300], [False] * 5, rows=4, n_rs_seq=3, room=400, space=FAR) == [
        (4, 0), (1, 3), (4, 0), (8, 0), (300, 0)]
    # pads only as far as the snapshots roll back, and as the batch has room
    assert shaped_chunks([1], [False], rows=4, n_rs_seq=2, room=100, space=FAR) == [(1, 0)]
    assert shaped_chunks([300, 2], [False] * 2, rows=4, n_rs_seq=3, room=302, space=FAR) == [(300, 0), (2, 0)]
    assert shaped_chunks([6, 2], [False] * 2, rows=4, n_rs_seq=3, room=8, space=FAR) == [(4, 0), (2, 2)]
    # decoders of differing rows (a checkpointed one), none at all, or a scoring chunk: as planned
    assert shaped_chunks([3], [False], rows=None, n_rs_seq=3, room=100, space=FAR) == [(3, 0)]
    assert shaped_chunks([3, 0], [True, False], rows=4, n_rs_seq=3, room=100, space=FAR) == [(3, 0), (0, 0)]
    # no pads past a prompt's context: the last chunk of a prompt that nearly fills it
    assert shaped_chunks([1, 1], [False] * 2, rows=4, n_rs_seq=3, room=100, space=[2, 4]) == [(1, 0), (1, 3)]


def test_catch_up_plan_puts_output_rows_in_one_decode():
    assert catch_up_plan([3], [True], row_by_row=False) == [3]                 # alone: one fused decode
    assert catch_up_plan([2, 2], [True, True], row_by_row=False) == [2, 2]     # equal: fused
    assert catch_up_plan([3, 1, 2], [True, True, True], row_by_row=False) == [2, 0, 1]   # heads first
    assert catch_up_plan([1, 1, 1], [True, True, True], row_by_row=False) == [1, 1, 1]   # then the tails
    assert catch_up_plan([4, 1], [False, True], row_by_row=False) == [4, 0]    # a feed has no output row
    assert catch_up_plan([3, 9], [True, True], row_by_row=True) == [1, 9]


def test_lowest_free_keeps_running_ids_consecutive():
    assert lowest_free({3, 1, 2}) == 1


def test_gap_fillers_name_the_free_ids_between_running_ones():
    assert gap_fillers([0, 1, 2], busy={0, 1, 2}) == []          # no gap
    assert gap_fillers([0, 2], busy={0, 2}) == [1]
    assert gap_fillers([1, 4, 5], busy={1, 4, 5}) == [2, 3]
    # a live sequence without rows this round sits in the gap: its state is not ours to fill
    assert gap_fillers([0, 3], busy={0, 2, 3}) == []
    assert gap_fillers([5], busy={5}) == [] and gap_fillers([], busy=set()) == []


# ------------------------------------------------------------------ tokens equal solo runs

def _solo(model, prompt, kw) -> list[int]:
    return model.generate(prompt, **kw).tokens


def test_a_free_id_between_running_ones_is_filled_and_keeps_its_cached_prompt(demo, monkeypatch):
    """Once the middle one of three sequences finishes, each round decodes filler rows in
    its free id (no outputs) in the target and in the MTP context, so no decode's ids
    have a gap; the other two still emit their solo runs' tokens, and the next request
    for the middle prompt still reuses what that id cached, with its cold run's tokens."""
    require_batch_exact()
    kws = [dict(max_tokens=40, ignore_eos=True, draft_max=2), dict(max_tokens=4, ignore_eos=True, draft_max=2),
           dict(max_tokens=40, ignore_eos=True, draft_max=2)]
    solo = [_solo(demo, p, kw) for p, kw in zip(PROMPTS, kws)]
    b = demo.batcher(3)
    rounds = b.engine.rounds
    rounds.verify_batch.fill_width = rounds.drafter.fill_width = None     # any rows: a GPU build's default
    batches, mtp_batches = [], []

    def recording(ctx, into):
        decode = ctx.decode

        def record(batch):
            n = batch.n
            into.append((batch.seq[:n].copy(), batch.logits[:n].copy(), batch.token[:n].copy()))
            return decode(batch)
        monkeypatch.setattr(ctx, "decode", record)

    recording(rounds.target, batches)
    recording(rounds.drafter.ctx, mtp_batches)
    try:
        runs = [b.submit(p, **kw) for p, kw in zip(PROMPTS, kws)]
        got = _drain(b, runs)
        assert [got[r][0] for r in runs] == solo
        last_verify = max(i for i, (seq, out, _) in enumerate(batches) if out[seq == 1].any())
        after = [(seq, out, tokens) for seq, out, tokens in batches[last_verify + 1:] if 0 in seq and 2 in seq]
        assert len(after) >= 10
        for seq, out, tokens in after:
            assert sorted(set(seq.tolist())) == [0, 1, 2] and not out[seq == 1].any()
            assert (seq == 1).sum() == (seq == 0).sum() and not tokens[seq == 1].any()   # a verify's rows
        # the MTP decodes where both take the same rows (catch-ups of unequal rows split anyway)
        last_mtp = max(i for i, (seq, out, _) in enumerate(mtp_batches) if out[seq == 1].any())
        mtp_after = [(seq, out) for seq, out, _ in mtp_batches[last_mtp + 1:]
                     if 0 in seq and 2 in seq and (seq == 0).sum() == (seq == 2).sum()]
        assert len(mtp_after) >= 10
        assert all(sorted(set(seq.tolist())) == [0, 1, 2] and not out[seq == 1].any() for seq, out in mtp_after)
        again = b.submit(PROMPTS[1], **kws[1])
        assert _drain(b, [again])[again][0] == solo[1]
        assert again.stats.cached_tokens > 0
        rounds.verify_batch.fill_width = rounds.drafter.fill_width = 0     # never: llama.cpp splits instead
        batches.clear()
        mtp_batches.clear()
        runs = [b.submit(p, **kw) for p, kw in zip(PROMPTS, kws)]
        _drain(b, runs)
        assert any(set(seq.tolist()) == {0, 2} for seq, _, _ in batches)
        assert any(set(seq.tolist()) == {0, 2} for seq, _, _ in mtp_batches)
    finally:
        b.close()


@pytest.mark.parametrize("slots", [3, 6])
def test_greedy_batch_equals_solo_runs(fixture_model, slots):
    """Mixed depths (0..4), p_min, both rollback paths and a short max_tokens, in one batch."""
    require_batch_exact()
    b = fixture_model.batcher(slots)
    try:
        reqs = [(p, _request(i)) for i, p in enumerate(PROMPTS)]
        runs = [b.submit(p, **kw) for p, kw in reqs]
        got = _drain(b, runs)
        for run, (p, kw) in zip(runs, reqs):
            solo = fixture_model.generate(p, **kw)
            assert got[run][0] == solo.tokens, (p, kw)
            assert got[run][1] == solo.text
            assert run.finish_reason == "length"
            s = run.stats
            assert (s.drafted, s.accepted, s.checkpoint_restores) == \
                (solo.stats.drafted, solo.stats.accepted, solo.stats.checkpoint_restores), kw
        m = b.metrics
        assert max(m.batch_sizes) == slots       # the batch was really full
        assert sum(m.batch_sizes.values()) == m.rounds
        drafted = sum(r.stats.drafted for r in runs)
        accepted = sum(r.stats.accepted for r in runs)
        assert 0 < accepted < drafted            # both the accept and the reject paths ran
        assert sum(r.stats.checkpoint_restores for r in runs) > 0
    finally:
        b.close()


@pytest.mark.parametrize("accept", ["rejection", "exact"])
def test_sampled_sequences_equal_their_seeded_solo_runs(dense_model, accept):
    """Sampled sequences keep their own generator: same seed, same tokens as alone,
    next to greedy ones and ones with other filters, penalties and logit biases."""
    require_batch_exact()
    settings = [
        dict(temperature=0.8, top_k=20, seed=1),
        dict(temperature=0.0),
        dict(temperature=1.2, top_p=0.9, seed=2, draft_max=4),
        dict(temperature=0.7, min_p=0.1, seed=3, draft_max=1),
        dict(temperature=1.0, seed=4, repeat_penalty=1.3, presence_penalty=0.5),
        dict(temperature=0.9, top_k=30, seed=5, logit_bias={10: 3.0, 11: float("-inf")}),
        dict(temperature=0.0, logit_bias={10: 6.0}),
    ]
    b = dense_model.batcher(len(settings))
    try:
        reqs = [(PROMPTS[i % len(PROMPTS)], dict(max_tokens=30, ignore_eos=True, accept=accept, **s))
                for i, s in enumerate(settings)]
        runs = [b.submit(p, **kw) for p, kw in reqs]
        got = _drain(b, runs)
        for run, (p, kw) in zip(runs, reqs):
            assert got[run][0] == _solo(dense_model, p, kw), kw
        assert sum(r.stats.accepted for r in runs) > 0
    finally:
        b.close()


_path_models: dict = {}


def _path_model(dense_path, sampling: str):
    """The dense fixture loaded with ``sampling`` as its path (LoadOptions.sampling)."""
    import pymtp

    if sampling not in _path_models:
        _path_models[sampling] = pymtp.load(dense_path, threads=1, n_ctx=1024, sampling=sampling)
    return _path_models[sampling]


@pytest.mark.parametrize("sampling", ["chain", "numpy", "backend"])
def test_three_sampled_sequences_at_0_7_equal_their_solo_runs(dense_path, sampling):
    """Temperature 0.7, a seed each, penalties on two (they reach the drafts too): every
    sequence emits its solo run's tokens on the same sampling path, and RunStats.sampling
    says which path it ran (penalties keep a sequence on the host chain)."""
    require_batch_exact()
    model = _path_model(dense_path, sampling)
    settings = [
        dict(seed=11, top_k=20, repeat_penalty=1.3, repeat_last_n=16, draft_max=3),
        dict(seed=12, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.5, draft_max=2),
        dict(seed=13, min_p=0.05, draft_max=4),
    ]
    reqs = [(PROMPTS[i], dict(temperature=0.7, max_tokens=32, ignore_eos=True, **s)) for i, s in enumerate(settings)]
    b = model.batcher(3)
    try:
        runs = [b.submit(p, **kw) for p, kw in reqs]
        got = _drain(b, runs)
        assert max(b.metrics.batch_sizes) == 3
        for run, (p, kw) in zip(runs, reqs):
            solo = model.generate(p, **kw)
            assert got[run][0] == solo.tokens, kw
            assert (run.stats.drafted, run.stats.accepted) == (solo.stats.drafted, solo.stats.accepted), kw
        # on "backend", rejection sampling in a batch reads no probabilities from the graph
        # (backend_sampling.reads_probabilities): all three sample on the host chain
        host = "chain" if sampling == "backend" else sampling
        assert [r.request.stats.sampling for r in runs] == [host, host, host]
        assert 0 < sum(r.stats.accepted for r in runs) < sum(r.stats.drafted for r in runs)
    finally:
        b.close()


def test_backend_chains_per_seq_id_in_one_batch(dense_path):
    """llama.cpp attaches a backend chain per seq id, so one batch holds sequences with
    different filters sampled in the graph (the exact rule: drawn tokens only), a greedy
    one taking the graph's argmax, and host-sampled ones (logprobs, and rejection
    sampling, which would read the graph's probabilities); a freed seq id takes the next
    request's filters. Each emits its solo run's tokens."""
    require_batch_exact()
    model = _path_model(dense_path, "backend")
    settings = [
        dict(temperature=0.8, top_k=20, top_p=0.95, seed=1, draft_max=3, accept="exact"),
        dict(temperature=1.1, top_p=0.9, seed=2, draft_max=2, accept="exact"),
        dict(temperature=0.0, draft_max=4),
        dict(temperature=0.8, top_k=20, seed=3, logprobs=2),           # logprobs read the logits
        dict(temperature=0.6, min_p=0.1, seed=4, draft_max=1),
    ]
    reqs = [(PROMPTS[i], dict(max_tokens=16 + 4 * i, ignore_eos=True, **s)) for i, s in enumerate(settings)]
    b = model.batcher(3)
    try:
        runs = [b.submit(p, **kw) for p, kw in reqs]
        tokens, filters_at_once, q_in_graph = defaultdict(list), 0, False
        target, mtp = id(b.engine.rounds.target), id(b.engine.rounds.drafter.ctx)
        while any(not r.done for r in runs):
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
            attached = b.engine._chains.attached
            filters_at_once = max(filters_at_once, len({key for (ctx, _), (key, _) in attached.items()
                                                        if ctx == target}))
            q_in_graph |= any(ctx == mtp for ctx, _ in attached)
        assert filters_at_once >= 2            # different filters in the graph in one round
        assert q_in_graph                      # argmax drafts came from the MTP graph
        assert [r.request.stats.sampling for r in runs] == ["backend", "backend", "backend", "chain", "chain"]
        assert sum(s.requests for s in b.metrics.slots) == 5 and max(b.metrics.batch_sizes) == 3
        for run, (p, kw) in zip(runs, reqs):
            assert tokens[run] == _solo(model, p, kw), kw
    finally:
        b.close()


@pytest.mark.parametrize("accept", ["rejection", "exact"])
def test_a_batch_sampled_in_the_graph_reads_only_its_drawn_tokens(demo_backend, accept):
    """With several chains attached, llama.cpp can overwrite a row's probabilities in the
    graph (backend_sampling.reads_probabilities); these held-out prompts hit that: a k=3
    rejection round read a row of zeros and crashed, at 48 tokens 1 of 8 requests parted
    from its solo run. Rejection sampling in a batch now samples on the host; the exact
    rule, which reads drawn tokens only, stays in the graph. Each request is its solo run
    on the path it took (a lone sequence still reads the graph's probabilities: with one
    chain there is no other to leave out)."""
    require_batch_exact()
    import pymtp
    from pymtp.bench import read_prompts

    prompts = read_prompts(Path(__file__).parents[1] / "benchmarks" / "prompts_heldout.jsonl")[:4]
    kw = dict(temperature=0.7, top_k=20, top_p=0.8, ignore_eos=True, cache_prompt=False, draft_max=3,
              max_tokens=16, accept=accept)
    b = demo_backend.batcher(4)
    try:
        runs = [b.submit(p, seed=i, **kw) for i, p in enumerate(prompts)]
        got = _drain(b, runs)
        assert max(b.metrics.batch_sizes) == 4
        path = "chain" if accept == "rejection" else "backend"
        assert {r.request.stats.sampling for r in runs} == {path}
        solo = demo_backend if path == "backend" else pymtp.load(threads=1, n_ctx=1024, sampling="chain")
        for i, (run, p) in enumerate(zip(runs, prompts)):
            assert got[run][0] == solo.generate(p, seed=i, **kw).tokens
    finally:
        b.close()


@pytest.mark.parametrize("accept,draft_max", [("exact", 0), ("exact", 3), ("rejection", 3)])
def test_a_seeded_top_k_request_in_a_batch_on_the_backend_is_its_solo_run(demo_backend, accept, draft_max):
    """top_k without top_p leaves the graph's candidates in the kernel's order, so a lone
    sequence draws its plain rows on the host from the graph's distribution with the
    request's generator (backend_sampling.plain_token); in a batch it reads no
    probabilities from the graph and samples on the host, and its plain rows were then
    llama.cpp's dist, seeded elsewhere: every request parted from its solo run at its first
    token. They now draw with the request's generator there too."""
    require_batch_exact()
    from pymtp.bench import read_prompts

    prompts = read_prompts(Path(__file__).parents[1] / "benchmarks" / "prompts_heldout.jsonl")[:3]
    kw = dict(temperature=0.8, top_k=20, ignore_eos=True, cache_prompt=False, max_tokens=16, accept=accept,
              **(dict(draft_max=draft_max) if draft_max else dict(spec="none")))
    b = demo_backend.batcher(3)
    try:
        runs = [b.submit(p, seed=i, **kw) for i, p in enumerate(prompts)]
        got = [r.tokens for r in b.results(runs)]
        assert max(b.metrics.batch_sizes) == 3
        assert {r.request.stats.sampling for r in runs} == {"chain"}
    finally:
        b.close()
    for i, p in enumerate(prompts):
        assert got[i] == demo_backend.generate(p, seed=i, **kw).tokens, i


@pytest.fixture(scope="module")
def demo_backend():
    import pymtp

    m = pymtp.load(threads=1, n_ctx=1024, sampling="backend")
    yield m
    m.close()


def test_finished_and_cancelled_slots_take_new_requests(dense_model):
    """Two slots, five requests: requests finish at different rounds, one is cancelled
    mid-generation, and those waiting start in the freed seq ids, whose state must not
    leak into them (KV, recurrent state, MTP KV, pending rollbacks)."""
    require_batch_exact()
    b = dense_model.batcher(2)
    try:
        reqs = [(PROMPTS[i], _request(i, n=12 + 6 * i)) for i in range(5)]
        runs = [b.submit(p, **kw) for p, kw in reqs]
        victim = runs[1]
        tokens, admitted = defaultdict(list), []
        rounds = 0
        while any(not r.done for r in runs):
            if rounds == 4:
                b.cancel(victim)
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
            rounds += 1
            admitted.append(b.engine.active)
        # each step lands a round and launches the next: the last one only lands
        assert max(admitted) == 2 and b.metrics.rounds == rounds - 1
        assert victim.finish_reason == "cancelled"
        solo_victim = _solo(dense_model, *reqs[1])
        assert 0 < len(tokens[victim]) < len(solo_victim)
        assert tokens[victim] == solo_victim[: len(tokens[victim])]
        for run, (p, kw) in zip(runs, reqs):
            if run is not victim:
                assert tokens[run] == _solo(dense_model, p, kw), kw
        assert [s.requests for s in b.metrics.slots] in ([3, 2], [2, 3])
        assert b.metrics.queue.count == 5 and b.metrics.ttft.count == 5
    finally:
        b.close()


def test_long_prompt_prefills_in_chunks_while_others_decode(dense_model):
    """A long prompt admitted next to running sequences is prefilled a chunk per round;
    the others keep emitting in those rounds, and everyone's tokens equal their solo run."""
    require_batch_exact()
    long_prompt = " ".join(PROMPTS) * 2
    n_prompt = len(dense_model.tokenize(long_prompt))
    assert n_prompt > 4 * 8
    reqs = [(PROMPTS[0], _request(0, n=40)), (PROMPTS[3], _request(1, n=40)), (long_prompt, _request(3, n=20))]
    b = dense_model.batcher(3, prefill_chunk=8)
    try:
        runs = [b.submit(p, **kw) for p, kw in reqs[:2]]
        tokens = defaultdict(list)
        overlapping = 0          # rounds where the long prompt prefilled and the others emitted
        while any(not r.done for r in runs):
            if b.metrics.rounds == 3:
                runs.append(b.submit(reqs[2][0], **reqs[2][1]))
            seq = runs[-1].request.seq if len(runs) == 3 else None
            prefilling = seq is not None and seq.prefilling
            emitted = set()
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
                if chunk.tokens:
                    emitted.add(run)
            overlapping += prefilling and bool(emitted & set(runs[:2]))
        assert overlapping >= n_prompt // 8 - 1
        for run, (p, kw) in zip(runs, reqs):
            assert tokens[run] == _solo(dense_model, p, kw), kw
    finally:
        b.close()


@pytest.mark.parametrize("sampling", ["auto", "backend"])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_short_prompt_chunks_ride_as_the_decoders_rows(dense_path, dense_model, monkeypatch, spec, sampling):
    """Beside sequences that decode one row each (plain) a prompt's short chunks go a
    token a round; beside drafting ones (4 verify rows) they are padded to 4 rows and the
    pads rolled back (shaped_chunks). Such a chunk outputs every row, as the decoding
    rows beside it do (VerifyBatch.rides: its round has the graph of the decode rounds after
    it), greedy sequences taking the graph's argmax too (sampling="backend": the greedy
    sampler has no state for the extra rows to move). The prompt's tokens and everyone's
    equal their solo runs."""
    require_batch_exact()
    if sampling == "backend":
        dense_model = _path_model(dense_path, "backend")
    chunks, fills = [], []
    real, real_fill = Rounds._prefilled, VerifyBatch.fill

    def spy(self, c):
        chunks.append((len(c.seq.prompt), c.n, c.pads))
        return real(self, c)

    def fill_spy(self, seqs, rows, shaped):
        n_out = real_fill(self, seqs, rows, shaped)
        assert n_out == int(self.batch.logits[: self.batch.n].sum())
        fills.append((self.batch.n, n_out, [(c.n, c.pads) for c in shaped.values()],
                      bool(rows) and all(n == s.rnd.n_drafts + 1 for s, n in rows.items())))
        return n_out

    monkeypatch.setattr(Rounds, "_prefilled", spy)
    monkeypatch.setattr(VerifyBatch, "fill", fill_spy)
    depth = dict(spec="none") if spec == "none" else dict(draft_max=3)
    # 51 tokens: the tail snapshot's stop (47) is 4 x 11 + 3 past the start
    long_prompt = dense_model.tokenize(" ".join(PROMPTS) * 2)[:51]
    reqs = [(PROMPTS[0], dict(max_tokens=80, ignore_eos=True, **depth)),
            (PROMPTS[3], dict(max_tokens=80, ignore_eos=True, **depth)),
            (long_prompt, dict(max_tokens=20, ignore_eos=True, **depth))]
    b = dense_model.batcher(3, prefill_chunk=8)
    try:
        runs = [b.submit(p, **kw) for p, kw in reqs[:2]]
        tokens = defaultdict(list)
        while any(not r.done for r in runs):
            if b.metrics.rounds == 3:
                runs.append(b.submit(reqs[2][0], **reqs[2][1]))
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
        batched = list(chunks)
        for run, (p, kw) in zip(runs, reqs):
            assert tokens[run] == _solo(dense_model, p, kw), kw
    finally:
        b.close()
    n_long = len(long_prompt)
    late = [(n, pads) for n_prompt, n, pads in batched if n_prompt == n_long]
    assert sum(n for n, _ in late) == n_long
    width = 1 if spec == "none" else 4
    riding = [(n, n_out) for n, n_out, cs, full in fills if full and cs and all(c + p == width for c, p in cs)]
    assert len(riding) >= (SHAPED_ROWS if spec == "none" else 1), fills
    assert all(n_out == n for n, n_out in riding), riding          # every row an output
    if spec == "none":
        assert late[-SHAPED_ROWS:] == [(1, 0)] * SHAPED_ROWS       # the tail, a token a round
    else:
        # chunks of 8 would leave 4 rows to a second ubatch, fewer than the snapshots' tail
        assert dense_model.draft_limit + 1 > 8 - 4
        assert late == [(4, 0)] * 11 + [(3, 1), (4, 0)]


def test_shaped_chunks_pad_only_within_the_batch(dense_path):
    """One sequence drafting 4 (5 verify rows), a prompt at its 4-token tail and another
    prompt whose chunk takes the rest of a 19-row batch: the tail is not padded to 5
    rows beyond the batch (a load on 2 CPU threads failed with "batch of 514 rows exceeds
    capacity 512" when it was), and everyone's tokens are their solo runs'."""
    import pymtp

    m = pymtp.load(dense_path, threads=1, n_ctx=512, n_batch=19)
    try:
        assert m.draft_limit == 4
        ids = m.tokenize(" ".join(PROMPTS) * 2)
        reqs = [(PROMPTS[0], dict(max_tokens=40, ignore_eos=True, draft_max=4)),
                (ids[:12], dict(max_tokens=8, ignore_eos=True, draft_max=4)),      # chunks 8, then 4
                (ids[20:50], dict(max_tokens=8, ignore_eos=True, draft_max=4))]    # its first chunk: 10
        b = m.batcher(3)
        runs = [b.submit(*reqs[0][:1], **reqs[0][1])]
        tokens = defaultdict(list)
        while any(not r.done for r in runs):
            if b.metrics.rounds in (3, 4) and len(runs) == b.metrics.rounds - 2:
                p, kw = reqs[len(runs)]
                runs.append(b.submit(p, **kw))
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
        b.close()
        for run, (p, kw) in zip(runs, reqs):
            assert len(tokens[run]) == kw["max_tokens"]
            # its 19-row batch passes the batch-invariant patch's rows (conftest.PATCH_ROWS): a GPU
            # rounds them unlike a solo run's; the subject, no padding past the batch, holds on both
            if not gpu_build():
                assert tokens[run] == _solo(m, p, kw)
    finally:
        m.close()


def test_stop_strings_and_logprobs_as_alone(demo):
    """Each request's stop strings cut its own text and tokens; logprobs come from its own rows."""
    require_batch_exact()
    alone = [demo.generate(p, max_tokens=32, ignore_eos=True) for p in PROMPTS[:3]]
    stops = [r.text[12:15] for r in alone]
    reqs = [(p, dict(max_tokens=32, ignore_eos=True, stop=s, logprobs=3, prompt_logprobs=2, draft_max=1 + i))
            for i, (p, s) in enumerate(zip(PROMPTS, stops))]
    b = demo.batcher(3)
    try:
        results = {}
        runs = [b.submit(p, **kw) for p, kw in reqs]
        while any(not r.done for r in runs):
            for run, chunk in b.step():
                results.setdefault(run, []).append(chunk)
        for run, (p, kw) in zip(runs, reqs):
            solo = demo.generate(p, **kw)
            chunks = results[run]
            assert "".join(c.text for c in chunks) == solo.text
            assert [t for c in chunks for t in c.tokens] == solo.tokens
            assert [x for c in chunks for x in c.logprobs] == solo.logprobs
            assert chunks[0].prompt_logprobs == solo.prompt_logprobs
            assert run.finish_reason == solo.finish_reason == "stop"
            assert chunks[-1].stop_word == kw["stop"]
            # the tokens a round made past the stop count in neither (a response's usage)
            assert run.stats.generated_tokens == solo.stats.generated_tokens == len(solo.tokens)
    finally:
        b.close()


def test_generate_batch_and_stream_batch(demo):
    require_batch_exact()
    prompts = PROMPTS[:4]
    results = demo.generate_batch(prompts, max_tokens=24, draft_max=3, ignore_eos=True)
    streamed = defaultdict(list)
    for i, chunk in demo.stream_batch(prompts, max_tokens=24, draft_max=3, ignore_eos=True):
        streamed[i] += chunk.tokens
    for i, (p, r) in enumerate(zip(prompts, results)):
        solo = demo.generate(p, max_tokens=24, draft_max=3, ignore_eos=True)
        assert (r.tokens, r.text, r.finish_reason) == (solo.tokens, solo.text, solo.finish_reason)
        assert streamed[i] == solo.tokens
        assert (r.stats.drafted, r.stats.accepted) == (solo.stats.drafted, solo.stats.accepted)
        assert r.stats.prompt_tokens == solo.stats.prompt_tokens
    assert demo.generate_batch([]) == []
    empty = demo.stream_batch([])
    empty.close()               # every stream closes, an empty one too
    assert list(empty) == []


def test_generate_batch_keeps_one_batcher_of_at_most_batch_slots(demo):
    """A batcher a list length, one slot (a context's memory) a prompt, grew without end
    (1.3 GB for 100 prompts of the demo model): now one batcher, grown while idle up to
    BATCH_SLOTS, and the prompts beyond wait for a slot; each still its solo output. A
    stream still running keeps its batcher: a larger batch meanwhile waits in it."""
    from pymtp.generate import BATCH_SLOTS

    require_batch_exact()
    solo = [demo.generate(p, max_tokens=6, ignore_eos=True).tokens for p in PROMPTS]
    _fresh_batchers(demo)
    stream = demo.stream_batch(PROMPTS[:1], max_tokens=6, ignore_eos=True)
    i, first = next(stream)
    held = demo._batchers[0]
    inner = demo.generate_batch(PROMPTS[:3], max_tokens=6, ignore_eos=True)
    assert demo._batchers[0] is held and held.slots == 1 and not held._guard.closed
    rest = [t for _, c in stream for t in c.tokens]
    assert first.tokens + rest == solo[0] and [r.tokens for r in inner] == solo[:3]
    most = 1
    for n in (2, 5, 3, BATCH_SLOTS + 4):
        prompts = [PROMPTS[j % len(PROMPTS)] for j in range(n)]
        got = demo.generate_batch(prompts, max_tokens=6, ignore_eos=True)
        assert [r.tokens for r in got] == [solo[j % len(PROMPTS)] for j in range(n)]
        most = max(most, n)
        assert list(demo._batchers) == [0] and demo._batchers[0].slots == min(most, BATCH_SLOTS)
    assert held._guard.closed       # replaced once idle


def test_a_batch_of_one_string_is_one_prompt(demo):
    """A string is one prompt, as vLLM's generate reads it (it was one prompt per
    character); a generator is read out; None and a bad engine count are ParamErrors."""
    kw = dict(max_tokens=6, draft_max=3, ignore_eos=True)
    (one,) = demo.generate_batch(PROMPTS[0], **kw)
    assert one.tokens == demo.generate_batch([PROMPTS[0]], **kw)[0].tokens
    assert {i for i, _ in demo.stream_batch(PROMPTS[0], **kw)} == {0}
    assert [r.tokens for r in demo.generate_batch((p for p in PROMPTS[:2]), **kw)] == \
        [r.tokens for r in demo.generate_batch(PROMPTS[:2], **kw)]
    for prompts, engines, param in ((None, 1, "prompts"), (PROMPTS[:2], "2", "engines"), (PROMPTS[:2], 3, "engines")):
        with pytest.raises(ParamError) as refused:
            demo.generate_batch(prompts, engines=engines, **kw)
        assert refused.value.param == param


def test_a_batch_runs_to_its_contexts_end_each_as_alone():
    """Sequences decoding to the end of a small context: each ends "length" with its solo
    run's tokens. Pads to the longest verify row went past a sequence's context, and the
    decode failed for every sequence in the batch (a review: a 500 to every client)."""
    import pymtp

    m = pymtp.load(threads=2, n_ctx=256)
    try:
        kw = dict(max_tokens=400, ignore_eos=True, draft_max=3)
        results = m.generate_batch(PROMPTS[:4], **kw)
        assert [r.finish_reason for r in results] == ["length"] * 4
        require_batch_exact()
        for p, r in zip(PROMPTS[:4], results):
            assert r.tokens == m.generate(p, **kw).tokens
    finally:
        m.close()


def test_generate_batch_on_several_engines_equals_solo_runs(demo):
    """``engines=2``: five prompts shared by two batchers (3 + 2 slots) in threads of their
    own; every Result, in the prompts' order, is what ``generate`` gives alone, and both
    batchers decoded."""
    require_batch_exact()
    _fresh_batchers(demo)
    prompts = PROMPTS[:5]
    kw = dict(max_tokens=20, draft_max=3, ignore_eos=True)
    results = demo.generate_batch(prompts, engines=2, **kw)
    for p, r in zip(prompts, results, strict=True):
        solo = demo.generate(p, **kw)
        assert (r.tokens, r.text) == (solo.tokens, solo.text)
    first, second = demo._batchers[0], demo._batchers[1]
    assert [b.metrics.rounds > 0 for b in (first, second)] == [True, True]
    assert second.follows is first      # one depth schedule
    # a smaller split keeps both; a larger one grows the first (it is idle), and the second,
    # which followed the one replaced, is made anew to follow the new one: both old closed,
    # and the new leader counts one follower
    demo.generate_batch(prompts[:4], engines=2, **kw)
    assert (demo._batchers[0], demo._batchers[1]) == (first, second)
    demo.generate_batch(prompts + prompts[:3], engines=2, **kw)
    assert first._guard.closed and second._guard.closed and demo._batchers[0].slots == 4
    assert demo._batchers[1].follows is demo._batchers[0]
    assert demo._batchers[0].engine.rounds.epochs.followers == [demo._batchers[1].engine.rounds.epochs]
    with pytest.raises(ValueError, match="between 1 and the slots"):
        demo.generate_batch(prompts[:2], engines=3, **kw)


def test_a_batch_on_engines_leaves_another_threads_running_engine_be(demo):
    """Another thread's batch still running on the second engine (queued there, as a
    thread does between its submit and its next round) while a larger batch on two
    engines comes: the first engine is not grown, so the second is not made anew to
    follow it; it was closed under the running requests (a ClosedError, or them cut
    "cancelled"). Both batches are their solo runs."""
    require_batch_exact()
    _fresh_batchers(demo)
    kw = dict(max_tokens=12, draft_max=3, ignore_eos=True)
    demo.generate_batch(PROMPTS[:2], engines=2, **kw)            # two engines of one slot
    first, second = demo._batchers[0], demo._batchers[1]
    theirs = second.submit_all([PROMPTS[4]], **kw)               # the other thread's, not yet stepped
    mine = demo.generate_batch(PROMPTS[:3], engines=2, **kw)     # 2 + 1: would grow the first
    assert (demo._batchers[0], demo._batchers[1]) == (first, second) and not second._guard.closed
    (result,) = second.results(theirs)
    assert (result.tokens, result.finish_reason) == (demo.generate(PROMPTS[4], **kw).tokens, "length")
    assert [r.tokens for r in mine] == [demo.generate(p, **kw).tokens for p in PROMPTS[:3]]


def test_an_engine_that_fails_ends_the_other_engines_prompts(demo, monkeypatch):
    """generate_batch with engines: when one engine's thread fails, the error is raised
    and the other engines' prompts are cancelled at their next round, not decoded to
    their max_tokens for no one."""
    kw = dict(max_tokens=200, draft_max=3, ignore_eos=True)
    demo.generate_batch(PROMPTS[:4], engines=2, max_tokens=2)        # the two batchers exist
    first, second = demo._batcher_for(2, 0), demo._batcher_for(2, 1)

    def broken(*a, **k):
        time.sleep(0.05)             # the first engine is well into its rounds
        raise RuntimeError("engine lost")

    monkeypatch.setattr(second.engine, "launch", broken)     # its rounds fail, as a lost device would
    before = first.metrics.rounds
    with pytest.raises(RuntimeError, match="engine lost"):
        demo.generate_batch(PROMPTS[:4], engines=2, **kw)
    assert not first.busy and first.metrics.rounds - before < 40      # 200 tokens: 60 rounds or more
    # the failed engine's prompts never admitted wait cancelled; its next batch lets them go
    assert len(second.engine._waiting) == 2 and all(r.cancelled for r in second.engine._waiting)
    monkeypatch.undo()
    results = demo.generate_batch(PROMPTS[:4], engines=2, max_tokens=4, ignore_eos=True)
    assert [len(r.tokens) for r in results] == [4] * 4 and not second.engine._waiting


def test_an_interrupt_of_a_batch_on_engines_ends_every_engines_prompts(demo, monkeypatch):
    """Ctrl-C while generate_batch waits on its engines: the interrupt is raised and every
    engine's prompts are cancelled at their next round (the pool's exit waited for each
    engine to decode its whole batch first: 5.6 s for a 0.3 s interrupt)."""
    import pymtp.generate

    kw = dict(max_tokens=200, draft_max=3, ignore_eos=True)
    demo.generate_batch(PROMPTS[:4], engines=2, max_tokens=2)        # the two batchers exist
    batchers = demo._batcher_for(2, 0), demo._batcher_for(2, 1)

    def interrupted(futures, **_):
        time.sleep(0.05)             # the engines are well into their rounds
        raise KeyboardInterrupt

    monkeypatch.setattr(pymtp.generate, "wait", interrupted)
    before = [b.metrics.rounds for b in batchers]
    with pytest.raises(KeyboardInterrupt):
        demo.generate_batch(PROMPTS[:4], engines=2, **kw)
    # 200 tokens: 60 rounds or more each
    assert [not b.busy and b.metrics.rounds - n < 40 for b, n in zip(batchers, before)] == [True, True]
    monkeypatch.undo()
    results = demo.generate_batch(PROMPTS[:4], engines=2, max_tokens=4, ignore_eos=True)
    assert [len(r.tokens) for r in results] == [4] * 4


def test_a_refused_prompt_leaves_nothing_queued(demo):
    """A list whose last prompt is refused queues none of them: neither on one batcher
    (``submit_all``) nor on several; the next batch runs as if the refused call had not
    been made."""
    too_long = "word " * (demo.options.n_ctx + 8)
    b = demo._batcher_for(3)
    before = sum(s.requests for s in b.metrics.slots)
    for engines in (1, 2):
        with pytest.raises(ValueError):
            demo.generate_batch([PROMPTS[0], PROMPTS[1], too_long], engines=engines, max_tokens=8)
    # the first engine's batcher took both calls' first two prompts, cancelled; the second
    # engine's (its one prompt the refused one) none
    for i, queued in [(0, 4), (1, 0)]:
        waiting = demo._batchers[i].engine._waiting
        assert len(waiting) == queued and all(r.cancelled for r in waiting), i
    results = demo.generate_batch([PROMPTS[2]] * 3, max_tokens=8, ignore_eos=True)
    assert [len(r.tokens) for r in results] == [8, 8, 8]
    assert sum(s.requests for s in b.metrics.slots) - before == 3      # only these ran


def test_step_hands_landed_chunks_on_before_launching_where_launching_decodes(demo, monkeypatch):
    """On a CPU (Rounds.overlapped False) a round's chunks go to ``hand_on`` before the
    next round is launched, so a client sees them one round sooner; where the device
    decodes while the host goes on they are returned after the launch. The chunks are
    the same either way."""
    got = {}
    for overlapped in (True, False):
        b = demo.batcher(2)
        try:
            monkeypatch.setattr(b.engine.rounds, "overlapped", overlapped)
            runs = [b.submit(p, max_tokens=12, draft_max=2, ignore_eos=True) for p in PROMPTS[:2]]
            handed, returned = [], []

            def hand_on(out):
                handed.append((b.engine.rounds.flight is None, [(runs.index(r), c.tokens) for r, c in out]))

            while any(not r.done for r in runs):
                returned += [(runs.index(r), c.tokens) for r, c in b.step(hand_on)]
            if overlapped:
                assert handed == [] and returned
                chunks = returned
            else:
                assert returned == [] and handed
                assert all(nothing_in_flight for nothing_in_flight, _ in handed)
                chunks = [c for _, out in handed for c in out]
            got[overlapped] = [[t for i, tokens in chunks if i == j for t in tokens] for j in range(2)]
            assert [len(t) for t in got[overlapped]] == [12, 12]
        finally:
            b.close()
    assert got[True] == got[False]


def test_shared_small_q8_0_batch_equals_solo():
    require_batch_exact()
    model = shared_model(SMALL_Q8)
    reqs = [(p, _request(i, n=24)) for i, p in enumerate(PROMPTS[:4])]
    b = model.batcher(4)
    try:
        runs = [b.submit(p, **kw) for p, kw in reqs]
        got = _drain(b, runs)
        for run, (p, kw) in zip(runs, reqs):
            assert got[run][0] == _solo(model, p, kw), kw
    finally:
        b.close()


# ------------------------------------------------------------------ logits, bit for bit

class _Recorder(Rounds):
    """Rounds that keep, per sequence, the target logits behind every token it emits, and
    whether that row was decoded alone (a target decode of one row)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows: dict = defaultdict(list)
        self.alone: dict = defaultdict(list)

    def _prefilled(self, chunk):
        step = super()._prefilled(chunk)
        if chunk.logits is not None:
            self.rows[chunk.seq].append(chunk.logits[None, :].copy())
            self.alone[chunk.seq].append(self.verify_rows == 1)
        return step

    def _judge(self, s) -> None:
        super()._judge(s)        # before a restore's re-decode writes over the rows
        n = s.rnd.verdict.n_accepted + 1
        self.rows[s].append(s.rnd.logits[:n].copy())
        self.alone[s] += [self.verify_rows == 1] * n

    def _land_lone(self, s):
        self.rows[s].append(self.target.logits(1).copy())    # a lone plain round's one row
        self.alone[s].append(True)
        return super()._land_lone(s)


class _RecordingEngine(Engine):
    def _rounds(self, target, drafter, cache=None):
        self.recorder = _Recorder(self.model, target, drafter, cache=cache)
        return self.recorder


def _solo_rows(model, ids, params) -> tuple[np.ndarray, np.ndarray]:
    """[n_tokens, n_vocab] logits behind each token of a solo run, and which were alone."""
    o = model.options
    engine = _RecordingEngine(model._native, n_ctx=o.n_ctx, n_batch=o.n_batch, threads=o.threads,
                              draft_limit=model.draft_limit, flash_attn=model.flash_attn)
    try:
        n = sum(len(step.tokens) for step in engine.run(ids, params))
        (rows,), (alone,) = engine.recorder.rows.values(), engine.recorder.alone.values()
        return np.concatenate(rows)[:n], np.array(alone[:n])
    finally:
        engine.close()


def _batch_rows(model, reqs, *, kv_unified: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    o = model.options
    engine = BatchEngine(model._native, slots=len(reqs), n_ctx=o.n_ctx, n_batch=o.n_batch, threads=o.threads,
                         draft_limit=model.draft_limit, flash_attn=model.flash_attn, kv_unified=kv_unified)
    engine.rounds = rec = _Recorder(model._native, engine.rounds.target, engine.rounds.drafter)
    try:
        handles = [engine.submit(ids, params) for ids, params in reqs]
        seqs, counts = {}, defaultdict(int)
        while not engine.idle():
            seqs.update((h, h.seq) for h in handles if h.seq is not None)
            for h, step in engine.step():
                counts[h] += len(step.tokens)
        return [(np.concatenate(rec.rows[seqs[h]])[: counts[h]], np.array(rec.alone[seqs[h]][: counts[h]]))
                for h in handles]
    finally:
        engine.close()


# How far a row may move once a row decoded alone moved (below), on the demo model: 0.023
# once in 158 such rows on an Intel Xeon with AMX; 0.143 on an AVX2-only AMD EPYC, where a
# row alone moved at the sixth token and the 58 rows after it inherited the drift (0.107 for
# those with company). A wrong row moves by whole units.
ALONE_TOLERANCE = 0.25


def test_demo_rows_bit_identical_to_solo_runs(demo):
    """Every row a sequence's solo run decodes among others (a verify of k+1 rows, a prompt)
    holds the same bits in a batch of four, on the demo Q8_0 model.

    A row the solo run decodes alone (plain decoding, a round without drafts) goes through
    ggml's one-row kernel there and through llamafile's many-row one in a batch
    (ggml/src/ggml-cpu/llamafile/sgemm.cpp: ``if (n < 2) return false``); the two sum in
    different orders, so such a row may move by rounding. With one unified KV buffer instead
    of a stream per sequence, rows with company move too: the sequences' cells interleave
    and the attention sums group differently. That is why the batch keeps separate streams.

    A row alone that moved leaves a state (KV, recurrent) that moved with it, so the rows
    after it are held to ALONE_TOLERANCE too. On an AVX2-only AMD EPYC that happened in one
    of the four sequences (its rows with company matched bit for bit up to there); on the
    Xeon the tolerance was first measured on, in none.
    """
    require_batch_exact()
    reqs = [(demo.tokenize(p), DecodeParams(**_request(i, n=64))) for i, p in enumerate(PROMPTS[2:6])]
    solo = [_solo_rows(demo, ids, params) for ids, params in reqs]
    batched = _batch_rows(demo, reqs, kv_unified=False)
    together = 0
    for (a, a_alone), (b, b_alone), (_, params) in zip(solo, batched, reqs):
        assert a.shape == b.shape and a.shape[0] == params.max_tokens
        alone = a_alone | b_alone
        moved = np.nonzero(alone & (a != b).any(axis=1))[0]
        exact = ~alone & (np.arange(len(a)) < (moved[0] if len(moved) else len(a)))
        together += int(exact.sum())
        assert np.array_equal(a[exact], b[exact]), params
        assert np.abs(a[~exact] - b[~exact]).max(initial=0) <= ALONE_TOLERANCE, params
    assert together > 100
    unified = _batch_rows(demo, reqs, kv_unified=True)
    assert any(not np.array_equal(a[~(aa | ua)], u[~(aa | ua)]) for (a, aa), (u, ua) in zip(solo, unified))


# Plain decoding's top-2 margin under which a GPU's batched kernels could flip a token
# (test_engine.NEAR_TIE; a wrong seq id or rollback moves logits by whole units).
NEAR_TIE = 0.1


def test_batch_parts_from_solo_only_at_a_near_tie(fixture_model):
    """On every backend: where a sequence's batched output first differs from its solo
    run, the solo run's top-2 logit margin there is under NEAR_TIE; on CPU builds they
    never part (the tests above)."""
    reqs = [(fixture_model.tokenize(p), _request(i, n=40)) for i, p in enumerate(PROMPTS)]
    b = fixture_model.batcher(len(reqs))
    try:
        runs = [b.submit(ids, **kw) for ids, kw in reqs]
        got = _drain(b, runs)
    finally:
        b.close()
    for run, (ids, kw) in zip(runs, reqs):
        solo, solo_rows = fixture_model.generate(ids, **kw).tokens, _solo_rows(fixture_model, ids, DecodeParams(**kw))[0]
        tokens = got[run][0]
        assert len(tokens) == len(solo) == kw["max_tokens"]
        part = next((i for i, (x, y) in enumerate(zip(tokens, solo)) if x != y), None)
        if part is not None:
            top2 = np.sort(solo_rows[part])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, (kw, part, float(top2[1] - top2[0]))
            assert gpu_build(), f"CPU outputs parted at {part}: {kw}"


# ------------------------------------------------------------------ refusals

def test_batcher_refuses_bad_requests_at_submit(dense_model):
    b = dense_model.batcher(2)
    try:
        with pytest.raises(ParamError, match="draft_max=9 exceeds"):
            b.submit("x", draft_max=9)
        with pytest.raises(ParamError, match="prompt is empty"):
            b.submit([])
        with pytest.raises(ParamError, match="context holds"):
            b.submit([1] * 5000)
        with pytest.raises(TypeError, match="unknown keyword"):
            b.submit("x", temprature=0.5)
        assert not b.busy
    finally:
        b.close()


def test_n_batch_must_hold_a_round_of_every_slot(dense_path):
    import pymtp

    m = pymtp.load(dense_path, threads=1, n_ctx=256, n_batch=16)
    try:
        with pytest.raises(ParamError, match=r"slots=4 do not fit in a round of n_batch=16 with draft_limit=4: "
                                             r"use slots <= 3, or load the model with n_batch >= 21") as e:
            m.batcher(4)
        assert e.value.param == "slots"
    finally:
        m.close()


def test_generate_batch_takes_the_slots_n_batch_holds(dense_path):
    """Five prompts on a model loaded with n_batch=16: three slots fit a round of draft
    depth 4 (16 rows), so the other two wait for one. It raised "cannot hold a round of
    5 slots" where a caller never chose slots."""
    import pymtp

    m = pymtp.load(dense_path, threads=1, n_ctx=256, n_batch=16)
    try:
        prompts, kw = PROMPTS[:5], dict(max_tokens=6, ignore_eos=True)
        results = m.generate_batch(prompts, **kw)
        assert m._batchers[0].slots == 3
        assert [len(r.tokens) for r in results] == [6] * 5
        if exact_kernels():     # else batched rows round unlike solo ones (conftest.GPU_DRIFT); the
            #                     subject, slots the caller never chose fitting n_batch, holds on both
            assert [r.tokens for r in results] == [m.generate(p, **kw).tokens for p in prompts]
    finally:
        m.close()


def test_closed_batcher_and_model_refuse(dense_path):
    import pymtp
    from pymtp.guard import ClosedError

    m = pymtp.load(dense_path, threads=1, n_ctx=256)
    b = m.batcher(2)
    b.submit("abc", max_tokens=4)
    m.close()
    with pytest.raises(ClosedError):
        b.step()
    with pytest.raises(ClosedError):
        b.submit("abc")


@pytest.mark.parametrize("close", ["batcher", "model"])
def test_closing_ends_the_runs_still_going_as_cancelled(dense_path, close):
    """A run of a closed batcher, running or waiting for a slot, stayed done=False: a loop
    waiting on it never ended. Each ends "cancelled", as a cancelled run does, and keeps
    what it had been given."""
    import pymtp

    m = pymtp.load(dense_path, threads=1, n_ctx=256)
    try:
        b = m.batcher(1)
        runs = [b.submit("abc", max_tokens=40, ignore_eos=True) for _ in range(2)]
        made = [chunk for _ in range(3) for chunk in b.step()]      # the prompt, then rounds
        assert made and {run for run, _ in made} == {runs[0]} and not any(r.done for r in runs)
        (b if close == "batcher" else m).close()
        assert [(r.done, r.finish_reason, r.error) for r in runs] == [(True, "cancelled", None)] * 2
        assert [r.request.finish for r in runs] == ["cancelled", "cancelled"]
    finally:
        m.close()


def test_a_request_whose_start_fails_ends_alone_and_gives_its_seq_id_back(demo, monkeypatch):
    """A request whose start fails in the stepping thread (a made-up error here: the
    library refuses what it can before queuing, as decode_params does) ends alone: one
    empty chunk with finish_reason "error" and the error on its run, its seq id free
    again. The request running beside it, admitted before, keeps going and emits its
    solo run's tokens. Such failures used to end every request of the step, and their
    ids stayed taken: after two, a 2-slot batcher admitted nothing more."""
    require_batch_exact()
    kw = dict(max_tokens=24, ignore_eos=True, draft_max=2)
    solo = _solo(demo, PROMPTS[0], kw)
    b = demo.batcher(2)
    real = b.engine.rounds.start

    def start(seq, prompt, p, stats):
        if p.max_tokens == 3:
            raise RuntimeError("refused at start")
        return real(seq, prompt, p, stats)

    monkeypatch.setattr(b.engine.rounds, "start", start)
    try:
        good = b.submit(PROMPTS[0], **kw)
        tokens = defaultdict(list)
        for run, chunk in b.step():
            tokens[run] += chunk.tokens
        for _ in range(2):      # both while `good` holds the other id
            bad = b.submit(PROMPTS[1], max_tokens=3)
            chunks = []
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
                chunks += [chunk] if run is bad else []
            assert [(c.finish_reason, c.tokens, c.text) for c in chunks] == [("error", [], "")]
            assert isinstance(bad.error, RuntimeError) and bad.done and bad.request.finish == "error"
            assert bad.request.seq is None and not good.done
        runs = [good] + [b.submit(p, max_tokens=6, ignore_eos=True) for p in PROMPTS[1:3]]
        for _ in range(200):
            if all(r.done for r in runs):
                break
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
        assert tokens[good] == solo
        assert [len(tokens[r]) for r in runs[1:]] == [6, 6]
        assert all(r.error is None for r in runs)
    finally:
        b.close()


def test_a_failed_start_raises_from_the_batch_it_ran_in(demo, monkeypatch):
    """``Batcher.generate`` raises the error of a prompt whose start failed (its results
    would be missing one) and cancels the others rather than leave them running."""
    b = demo.batcher(2)
    real = b.engine.rounds.start

    def start(seq, prompt, p, stats):
        if list(prompt) == b.model.prompt_ids(PROMPTS[1]):
            raise RuntimeError("refused at start")
        return real(seq, prompt, p, stats)

    monkeypatch.setattr(b.engine.rounds, "start", start)
    try:
        with pytest.raises(RuntimeError, match="refused at start"):
            b.generate(PROMPTS[:2], max_tokens=30, ignore_eos=True)
        assert b.engine.idle()
        assert [len(r.tokens) for r in b.generate([PROMPTS[0]], max_tokens=5, ignore_eos=True)] == [5]
    finally:
        b.close()


def test_two_threads_batching_on_one_model_each_get_their_own_text(dense_model):
    """generate_batch and stream_batch from two threads share the model's batcher: each
    thread's steps make the other's chunks too, which go to that thread (they were
    dropped, and its texts came back cut short with no error). The streaming thread
    reads slowly, so the other steps its rounds meanwhile."""
    require_batch_exact()
    prompts = ["The quick brown fox", [5, 6, 7, 8]]
    kw = dict(max_tokens=64, ignore_eos=True)
    alone = [dense_model.generate(p, **kw).tokens for p in prompts]
    streamed: list[list[int]] = [[], []]
    whole: list = []
    together = threading.Barrier(2)

    def stream() -> None:
        together.wait()
        for i, chunk in dense_model.stream_batch(prompts, **kw):
            streamed[i] += chunk.tokens
            time.sleep(0.005)

    def generate() -> None:
        together.wait()
        time.sleep(0.05)        # after the stream's runs took the slots
        whole.extend(r.tokens for r in dense_model.generate_batch(prompts, **kw))

    threads = [threading.Thread(target=stream), threading.Thread(target=generate)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert streamed == alone and whole == alone


@pytest.mark.parametrize("where", ["_read", "_roll_back", "_emit"])
def test_an_interrupt_inside_a_round_leaves_nothing_for_the_next_requests(demo, monkeypatch, where):
    """Ctrl-C landing inside a batched round (here in its second call of ``where``: after
    the verify decode, before the round's tokens are read, judged or emitted) ends the
    batch with the KeyboardInterrupt, and the sequences of that round are dropped, not
    parked: the prompt cache kept a half-read round of them, and the same prompts
    generated again on that batcher gave other greedy tokens (interrupted in ``_read``)."""
    require_batch_exact()
    kw = dict(max_tokens=40, draft_max=3)
    prompts = PROMPTS[:2]
    solo = [_solo(demo, p, kw) for p in prompts]
    real, calls = getattr(Rounds, where), []

    def interrupted(self, *a, **k):
        calls.append(where)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    with demo.batcher(2) as b:
        monkeypatch.setattr(Rounds, where, interrupted)
        with pytest.raises(KeyboardInterrupt):
            b.generate(prompts, **kw)
        monkeypatch.setattr(Rounds, where, real)
        assert b.engine.idle() and not b._runs
        assert [r.tokens for r in b.generate(prompts, **kw)] == solo


def test_a_round_that_fails_in_one_thread_ends_the_other_threads_requests(demo, monkeypatch):
    """Two threads drive their own requests on one batcher; a round in which both run
    fails in one thread's step. That thread raises the error, the other a RoundFailed
    caused by it (its request was in the same half-run round: it went on to emit from
    it, or waited for chunks that never came), and neither hangs; the batcher serves
    the next request."""
    from pymtp.batch import RoundFailed

    kw = dict(max_tokens=200, ignore_eos=True, draft_max=2)
    real, calls = Rounds._read, []

    def fails(self, *a, **k):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("the device is lost")
        return real(self, *a, **k)

    with demo.batcher(2) as b:
        monkeypatch.setattr(Rounds, "_read", fails)
        mine = [b.submit_all([p], **kw) for p in PROMPTS[:2]]      # both in every round
        errors: list = [None, None]

        def drive(i: int) -> None:
            try:
                b.results(mine[i])
            except BaseException as exc:
                errors[i] = exc

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        lost = [e for e in errors if not isinstance(e, RoundFailed)]
        failed = [e for e in errors if isinstance(e, RoundFailed)]
        assert len(lost) == 1 and len(failed) == 1, errors
        assert str(lost[0]) == "the device is lost" and failed[0].__cause__ is lost[0]
        assert all(run.request.finish == "error" and run.done for runs in mine for run in runs)
        monkeypatch.setattr(Rounds, "_read", real)
        assert b.engine.idle()
        assert [len(r.tokens) for r in b.generate([PROMPTS[2]], max_tokens=5, ignore_eos=True)] == [5]


def test_chunks_carry_what_the_prompt_cache_spared(demo):
    """Every chunk says how many prompt tokens the cache spared (Stats.cached_tokens), on a
    session and in a batch, so a stream can report its input from its first chunk."""
    prompt = PROMPTS[3] + " # a prompt of its own for this test"
    kw = dict(max_tokens=4, ignore_eos=True)
    with demo.session() as s:
        for expect_cached in (False, True):
            stats: list = []
            chunks = list(s.stream(prompt, stats_out=stats, **kw))
            assert {c.cached_tokens for c in chunks} == {stats[0].cached_tokens}
            assert (stats[0].cached_tokens > 0) == expect_cached
    with demo.batcher(1) as b:
        for expect_cached in (False, True):
            run = b.submit(prompt, **kw)
            chunks = [c for _, c in b._drive([run])]
            assert {c.cached_tokens for c in chunks} == {run.stats.cached_tokens}
            assert (run.stats.cached_tokens > 0) == expect_cached


def _collect_in_thread(target, timeout: float = 60):
    """Run ``target`` in a thread; (finished, its result or exception)."""
    out: list = []

    def run():
        try:
            out.append(target())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (out[0] if out else None)


def test_a_request_that_ends_in_a_step_whose_launch_fails_keeps_its_last_chunk(demo, monkeypatch):
    """Another owner's request finishes in the land of a step whose launch then fails:
    its last chunk reaches its owner (it was dropped with the step's return value, and
    the owner got a text cut short with no error); the failing owner gets the error."""
    kw_b = dict(max_tokens=6, ignore_eos=True)
    solo = demo.generate(PROMPTS[1], **kw_b)
    real = Rounds.launch
    with demo.batcher(2) as b:
        run_b = b.submit(PROMPTS[1], **kw_b)
        runs_a = b.submit_all([PROMPTS[0]], max_tokens=40, ignore_eos=True)

        def launch(self, *a, **k):
            if run_b.request.done:          # B's last tokens landed in this step
                raise RuntimeError("the device is lost")
            return real(self, *a, **k)

        monkeypatch.setattr(Rounds, "launch", launch)
        with pytest.raises(RuntimeError, match="the device is lost"):
            b.results(runs_a)
        monkeypatch.setattr(Rounds, "launch", real)
        (got,) = b.results([run_b])
        assert (len(got.tokens), got.finish_reason) == (6, "length")
        require_batch_exact()       # B's rounds shared decodes with A's
        assert got.text == solo.text


@pytest.mark.parametrize("where", ["mtp_end", "queue"])
def test_an_interrupt_while_a_request_is_admitted_ends_it_and_frees_its_id(demo, monkeypatch, where):
    """Ctrl-C while the engine admits another owner's request (picking its id: the prompt
    cache's ``mtp_end``; or just after taking it: the queue time's record) ends that
    request with the error: it was lost (its owner's drive stepped for ever) or its id
    leaked (a one-slot batcher then admitted nothing)."""
    from pymtp.batch import RoundFailed
    from pymtp.scheduler import Timings

    kw = dict(max_tokens=6, ignore_eos=True)
    with demo.batcher(1) as b:
        runs_a = b.submit_all([PROMPTS[0]], **kw)
        run_b = b.submit(PROMPTS[1], **kw)        # waits for the one slot
        cls, name = (Resumes, "mtp_end") if where == "mtp_end" else (Timings, "add")
        real = getattr(cls, name)

        def interrupted(self, *a):
            if runs_a[0].done and run_b.request.t_submit and not run_b.request.done:
                monkeypatch.setattr(cls, name, real)
                raise KeyboardInterrupt
            return real(self, *a)

        monkeypatch.setattr(cls, name, interrupted)
        try:
            b.results(runs_a)
        except KeyboardInterrupt:
            pass
        monkeypatch.setattr(cls, name, real)
        assert run_b.request.done and run_b.request.finish == "error"
        finished, got = _collect_in_thread(lambda: b.results([run_b]))
        assert finished and isinstance(got, KeyboardInterrupt | RoundFailed), got
        assert b.engine.idle() and b.engine._free == {0}
        assert [len(r.tokens) for r in b.generate([PROMPTS[2]], **kw)] == [6]


def test_an_abandoned_stream_collected_inside_a_step_does_not_deadlock(demo, monkeypatch):
    """A started stream_batch dropped inside a reference cycle is closed by the garbage
    collector wherever a collection runs; inside a step of its own batcher in the same
    thread its drive's last step waited for that step's lock for ever."""
    import gc

    kw = dict(max_tokens=16, ignore_eos=True)
    prompts = PROMPTS[:2]
    alone = [r.tokens for r in demo.generate_batch(prompts, **kw)]
    real, collected = Rounds.land, []

    def land(self):
        if not collected:
            collected.append(gc.collect())       # a collection that lands here
        return real(self)

    gc.disable()
    try:
        stream = demo.stream_batch(prompts, **kw)
        next(stream)

        class Holder:
            pass

        h = Holder()
        h.me, h.stream = h, stream
        del h, stream
        monkeypatch.setattr(Rounds, "land", land)
        finished, got = _collect_in_thread(lambda: [r.tokens for r in demo.generate_batch(prompts, **kw)])
    finally:
        gc.enable()
    assert finished and collected, "generate_batch deadlocked"
    assert got == alone


def test_a_stream_closed_before_its_first_chunk_cancels_its_requests(demo):
    """stream_batch queues its requests at the call; closed (or dropped) before its first
    chunk, it cancels them (they decoded for no one, slowing the next batch)."""
    kw = dict(max_tokens=30, ignore_eos=True)
    _fresh_batchers(demo)       # one whose depths earlier tests set may take more rounds for 3 tokens
    b = demo._batcher_for(2)
    stream = demo.stream_batch(PROMPTS[:2], **kw)
    assert b.engine.waiting == 2
    stream.close()
    rounds = b.metrics.rounds
    assert [len(r.tokens) for r in demo.generate_batch(PROMPTS[2:4], max_tokens=3, ignore_eos=True)] == [3, 3]
    assert b.metrics.rounds - rounds <= 4 and b.engine.idle()
    demo.stream_batch(PROMPTS[:2], **kw)           # dropped at once
    demo.generate_batch(PROMPTS[2:4], max_tokens=3, ignore_eos=True)
    assert b.engine.idle() and not b._runs


def test_closing_the_models_stream_closes_the_batchers_stream_inside(demo, monkeypatch):
    """Model.stream_batch wraps the batcher's stream to hold the model; close() on the
    wrapper reaches the stream inside even while something else holds that one (a
    generator wrapper that never started ran nothing at close on Python 3.12)."""
    b = demo._batcher_for(2)
    made, real = [], b.stream
    monkeypatch.setattr(b, "stream", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    stream = demo.stream_batch(PROMPTS[:2], max_tokens=30, ignore_eos=True)
    assert b.engine.waiting == 2
    stream.close()
    assert [run.request.cancelled for run in made[0]._runs] == [True, True]


def test_failing_all_ends_the_queued_requests_too_and_keeps_none(demo, monkeypatch):
    """``Batcher.fail_all`` (the server's worker after a failed step) ends the running and
    the queued requests alike, each with its error, and the batcher keeps neither (the
    queued one's run stayed in it: one more for every failed round)."""
    from pymtp.batch import RoundFailed

    real = Rounds.launch

    def lost(self, *a, **k):
        raise RuntimeError("the device is lost")

    with demo.batcher(1) as b:
        running = b.submit(PROMPTS[0], max_tokens=30, ignore_eos=True)
        b.step()
        queued = b.submit(PROMPTS[1], max_tokens=30, ignore_eos=True)
        monkeypatch.setattr(Rounds, "launch", lost)
        with pytest.raises(RuntimeError) as e:
            b.step()
        b.fail_all(e.value)
        monkeypatch.setattr(Rounds, "launch", real)
        assert b._runs == {} and b.engine.idle()
        for run in (running, queued):
            assert run.done and run.request.finish == "error" and isinstance(run.error, RoundFailed)
            assert run.error.__cause__ is e.value
        assert [len(r.tokens) for r in b.generate([PROMPTS[2]], max_tokens=4, ignore_eos=True)] == [4]


@pytest.mark.parametrize("temperature", [0.7, 0.0])     # greedy emitted the banned token
@pytest.mark.parametrize("grammar", ['root ::= "a"', 'root ::= "x" "a"'])
def test_a_request_whose_own_draw_fails_ends_alone(demo, grammar, temperature):
    """A request whose draw fails inside a round (a grammar whose tokens its logit bias
    bans, sampled: at its first token, or later, where its draft fails first, in the
    round's launch) ends alone with that error; the request beside it goes on and emits
    its solo run's tokens (the round raised, and every request in it ended). On one
    session the same request raises, and the next generation is its solo run."""
    require_batch_exact()
    good_kw = dict(max_tokens=24, ignore_eos=True, draft_max=2)
    banned = {t: float("-inf") for w in ("a", "xa") for t in demo.tokenize(w, add_special=False)[-1:]}
    bad_kw = dict(max_tokens=6, grammar=grammar, logit_bias=banned, temperature=temperature, seed=3, draft_max=2)
    solo = _solo(demo, PROMPTS[1], good_kw)
    with demo.session() as s:
        with pytest.raises(ValueError, match="all -inf"):
            s.generate(PROMPTS[0], **bad_kw)
        assert s.generate(PROMPTS[1], **good_kw).tokens == solo
    with demo.batcher(2) as b:
        good, bad = b.submit(PROMPTS[1], **good_kw), b.submit(PROMPTS[0], **bad_kw)
        tokens, chunks = defaultdict(list), defaultdict(list)
        while not (good.done and bad.done):
            for run, chunk in b.step():
                tokens[run] += chunk.tokens
                chunks[run].append(chunk)
        assert tokens[good] == solo and good.error is None
        assert isinstance(bad.error, ValueError) and [c.finish_reason for c in chunks[bad]][-1] == "error"
        assert b.engine.idle() and b.engine._free == {0, 1}
        with pytest.raises(ValueError, match="all -inf"):
            b.generate([PROMPTS[0]], **bad_kw)


def test_a_refused_prompt_of_a_batch_is_named_by_its_index(dense_model):
    """generate_batch with one bad prompt among many said what was wrong, not which one."""
    prompts = ["the quick brown fox"] * 3 + [[1, dense_model.n_vocab + 5]]
    for engines in (1, 2):
        with pytest.raises(ParamError, match=r"^prompts\[3\]: prompt") as e:
            dense_model.generate_batch(prompts, max_tokens=2, engines=engines)
        assert e.value.param == "prompts[3]"


def test_results_of_another_batchers_run_are_refused_not_waited_for(dense_model):
    """Nothing steps another batcher's run here: results() waited forever at full CPU. A
    run whose batcher closed says it was cancelled (its results said "length"), and a
    drive of it raises ClosedError (it returned a Result cut short: a thread that was not
    stepping when another thread closed the model went on as if its text were whole)."""
    b1, b2 = dense_model.batcher(1), dense_model.batcher(1)
    try:
        run = b1.submit("the quick brown fox", max_tokens=4)
        with pytest.raises(ParamError, match=r"runs\[0\] was submitted to another batcher"):
            b2.results([run])
        assert b1.results([run])[0].finish_reason == "length"
        late = b2.submit("the quick brown fox", max_tokens=4)
        b2.close()
        assert late.finish_reason == "cancelled"
        with pytest.raises(ClosedError, match="this batcher is closed"):
            b2.results([late])
    finally:
        b1.close()
        b2.close()


def test_only_free_ids_count_toward_where_a_prompt_is_reused(dense_model):
    """``Batcher.reusable`` (where a server of several engines sends a prompt) scores the
    seq ids a new request could take: a busy id's rows are its request's until it ends."""
    b = dense_model.batcher(2)
    try:
        ids = dense_model.tokenize("the quick brown fox jumps over the lazy dog " * 3)
        first = b.submit(ids, max_tokens=4, ignore_eos=True)
        b.results([first])
        held = b.reusable(ids)
        assert held > len(ids) // 2
        run = b.submit(ids + dense_model.tokenize(" again", add_special=False), max_tokens=8, ignore_eos=True)
        b.step()            # admitted on the id holding its prefix, and running
        assert not run.done and b.engine.free_ids() != [0, 1]
        assert b.reusable(ids) == 0        # the other id holds nothing
        b.results([run])
        assert b.reusable(ids) >= held
    finally:
        b.close()


def test_a_batcher_closed_mid_stream_ends_each_stream_cancelled(dense_path):
    """A stream read on after its model closed raises ClosedError (its runs ended
    "cancelled"; the stream ended as if whole), and ``busy`` is False: a ``while b.busy``
    loop waited forever on the queued request."""
    m = pymtp.load(dense_path, threads=1, n_ctx=1024)
    try:
        stream = m.stream_batch(["the quick brown fox", "import os\n"], max_tokens=100, ignore_eos=True)
        next(stream)
        m.close()
        seen = []
        with pytest.raises(ClosedError, match="model"):
            for _, chunk in stream:      # what the last step made, then the close
                seen.append(chunk.finish_reason)
        assert seen == [None] * len(seen)
    finally:
        m.close()
    m = pymtp.load(dense_path, threads=1, n_ctx=1024)
    try:
        b = m.batcher(2)
        run = b.submit("the quick brown fox", max_tokens=30)
        b.close()
        assert (run.finish_reason, b.busy) == ("cancelled", False)
    finally:
        m.close()


def test_results_refuses_a_run_whose_chunks_step_handed_out(dense_model):
    """After a step() loop had taken a run's chunks, results() gave it an empty text beside
    stats counting its tokens."""
    with dense_model.batcher(2) as b:
        run = b.submit(PROMPTS[0], max_tokens=6, ignore_eos=True)
        stepped = []
        while not stepped:      # the prompt's step makes none
            stepped += [chunk for r, chunk in b.step() if r is run]
        assert not run.done
        with pytest.raises(ParamError, match=r"^runs\[0\]'s chunks were handed out by step\(\) already"):
            b.results([run])
        while b.busy:
            stepped += [chunk for r, chunk in b.step() if r is run]
    assert [t for c in stepped for t in c.tokens] == dense_model.generate(PROMPTS[0], max_tokens=6,
                                                                         ignore_eos=True).tokens
    other = dense_model.batcher(1)
    fresh = other.submit(PROMPTS[1], max_tokens=3, ignore_eos=True)
    assert other.results([fresh])[0].tokens == dense_model.generate(PROMPTS[1], max_tokens=3, ignore_eos=True).tokens


def test_a_run_is_collected_once(demo):
    """A second ``results`` of a run already collected gave an empty Result with its
    finish reason and its whole run's stats: a ParamError now names the run."""
    b = demo.batcher(2)
    run = b.submit("def f(x):", max_tokens=8)
    first = b.results([run])[0]
    assert len(first.tokens) == 8 and first.text
    with pytest.raises(ParamError, match=r"runs\[0\] was collected already") as e:
        b.results([run])
    assert e.value.param == "runs"
    fresh = b.submit("x", max_tokens=2)
    with pytest.raises(ParamError, match=r"runs\[1\] was collected already"):
        b.results([fresh, run])
    assert len(b.results([fresh])[0].tokens) == 2
