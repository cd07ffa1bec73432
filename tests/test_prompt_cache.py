"""The prompt cache across requests (#11), in the library: a session or a batcher slot
reuses what it holds of a new prompt, and every output equals a cold run of the same
request (cache_prompt=False on a fresh session), token for token.

Equality with the cold run is asserted on CPU builds (conftest.require_cache_exact says
why GPU builds skip it): a cached run decodes the rest of its prompt in other chunks than
the cold one does, and its reused rows came from earlier runs' decodes.
"""

from __future__ import annotations

import numpy as np
import pytest

import pymtp
from conftest import require_cache_exact
from pymtp.prefix_cache import TAIL_TOKENS
from pymtp.prompt_cache import CacheBudget, PromptCache, Snapshot
from pymtp.round_state import CatchUp

EVERY = 8          # snapshot every 8 prompt tokens, so partial hits land on known positions
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def cached():
    """The demo model: trained, so its MTP head's drafts depend on the hidden rows and
    pairs it is given (a synthetic fixture's barely do), and a wrong MTP KV shows."""
    m = pymtp.load(threads=1, n_ctx=1024, checkpoint_every=EVERY)
    yield m
    m.close()


@pytest.fixture(scope="module")
def cold(cached):
    """A session that never reuses anything: the reference runs."""
    return cached.session()


def _cold(cold, ids, **kw):
    r = cold.generate(ids, cache_prompt=False, **kw)
    assert r.stats.cached_tokens == 0
    return r


def same_run(r, c) -> None:
    """Same tokens, and the same drafts accepted round by round: the MTP KV a cached run
    starts from (pairs kept from earlier runs, a snapshot's tail) is the cold run's."""
    assert r.tokens == c.tokens
    assert (r.stats.rounds, r.stats.drafted_at, r.stats.accepted_at) == \
        (c.stats.rounds, c.stats.drafted_at, c.stats.accepted_at)


KW = dict(max_tokens=20, ignore_eos=True, draft_max=3)


def test_prefix_hit_reuses_prompt_and_reply(cached, cold):
    require_cache_exact()
    s = cached.session()
    ids = cached.tokenize(PROMPT)
    first = s.generate(ids, **KW)
    assert first.stats.cached_tokens == 0
    follow = ids + first.tokens + cached.tokenize("\nprint(", add_special=False)
    again = s.generate(follow, **KW)
    # the KV holds the prompt and the reply, less its last token unless that was a kept draft
    assert len(ids) + len(first.tokens) - 1 <= again.stats.cached_tokens <= len(ids) + len(first.tokens)
    same_run(again, _cold(cold, follow, **KW))


@pytest.mark.parametrize("rollback", ["auto", "checkpoint"])
def test_generation_ending_at_an_eog_draft(cached, cold, monkeypatch, rollback):
    """A generation whose end-of-generation token comes as an accepted draft keeps its
    reply and that token in the KV (the drafts after it rolled back, through the
    snapshots or a checkpoint restore), so the next turn, which resends both, reuses them.
    Tokens of a reference run stand in for the EOG token, one at a time."""
    require_cache_exact()
    import pymtp.rounds as rounds
    from pymtp.native import NativeModel

    ids = cached.tokenize(PROMPT)
    kw = dict(max_tokens=24, draft_max=4, rollback=rollback)
    # the tokens as they come with nothing ending the run (ignore_eos would ban the real end tokens)
    monkeypatch.setattr(NativeModel, "is_eog", lambda self, t: False)
    reference = cached.session().generate(ids, cache_prompt=False, **kw).tokens
    ends, seen, rolled = [], [], []
    real = rounds.kept_drafts

    def kept(a: int, n: int, finish: str | None) -> int:
        k = real(a, n, finish)
        if finish:
            ends.append(k == n + 1)       # the EOG token is a kept draft
            rolled.append(k < a)          # ... with accepted drafts after it, rolled back
        return k

    monkeypatch.setattr(rounds, "kept_drafts", kept)
    for eog in dict.fromkeys(reference[4:16]):
        monkeypatch.setattr(NativeModel, "is_eog", lambda self, t, eog=eog: t == eog)
        s = cached.session()
        del ends[:]
        first = s.generate(ids, **kw)
        assert first.finish_reason == "stop"
        follow = ids + first.tokens + [eog] + cached.tokenize(" # more", add_special=False)
        ended_in_drafts = ends[-1]
        again = s.generate(follow, **kw)
        # the reply, and the EOG token where it was a draft (as the next token it is not decoded)
        assert again.stats.cached_tokens == len(ids) + len(first.tokens) + ended_in_drafts
        seen.append(ended_in_drafts)
        same_run(again, _cold(cold, follow, **kw))
    assert any(seen) and not all(seen) and any(rolled)     # every way of ending was met


def test_partial_hit_restores_the_last_snapshot_before_the_divergence(cached, cold):
    require_cache_exact()
    s = cached.session()
    ids = cached.tokenize(PROMPT)
    s.generate(ids, **KW)
    cut = 2 * EVERY + 3                         # diverges inside the prompt
    other = ids[:cut] + cached.tokenize(" # changed", add_special=False)
    r = s.generate(other, **KW)
    assert r.stats.cached_tokens == 2 * EVERY   # the snapshot at 16, not 19
    same_run(r, _cold(cold, other, **KW))


def test_miss_decodes_everything(cached, cold):
    require_cache_exact()
    s = cached.session()
    s.generate(PROMPT, **KW)
    ids = cached.tokenize("import numpy as np\n")
    r = s.generate(ids, **KW)
    assert r.stats.cached_tokens == 0
    same_run(r, _cold(cold, ids, **KW))


def test_divergence_inside_the_reply_falls_back_to_the_prompt_end(cached, cold):
    require_cache_exact()
    s = cached.session()
    ids = cached.tokenize(PROMPT)
    first = s.generate(ids, **KW)
    edited = ids + first.tokens[:5] + cached.tokenize(" edited", add_special=False)
    assert edited[len(ids) + 5] != first.tokens[5]
    r = s.generate(edited, **KW)
    # no snapshot inside the reply: the one at the end of the prompt
    assert r.stats.cached_tokens == len(ids)
    same_run(r, _cold(cold, edited, **KW))


def test_same_request_again_reuses_up_to_the_tail_snapshot(cached, cold):
    require_cache_exact()
    s = cached.session()
    ids = cached.tokenize(PROMPT)
    first = s.generate(ids, **KW)
    again = s.generate(ids, **KW)
    # the latest snapshot before the last token: 4 before the end, or a multiple of EVERY
    assert again.stats.cached_tokens == max(len(ids) - TAIL_TOKENS, (len(ids) - 1) // EVERY * EVERY)
    assert again.tokens == first.tokens == _cold(cold, ids, **KW).tokens


@pytest.mark.parametrize("short", [1, 2])
@pytest.mark.parametrize("follow", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_generation_that_ended_before_it_drafted_leaves_the_drafter_its_prompt(cached, cold, short, follow,
                                                                                 temperature):
    # One or two tokens draft nothing: the plain round held the prompt's rows back for
    # the first round that drafts (Drafting._hold), and the run ended first. They were lost,
    # and the next request resumed with a drafter that held none of the prompt: fewer
    # drafts accepted, and a seed's text other than a cold run's.
    require_cache_exact()
    s = cached.session()
    ids = cached.tokenize(PROMPT)
    first = s.generate(ids, max_tokens=short, draft_max=3)
    again = ids + first.tokens + cached.tokenize("\n# next", add_special=False) if follow else ids
    kw = dict(KW, temperature=temperature, seed=5)
    r = s.generate(again, **kw)
    assert r.stats.cached_tokens > 0
    same_run(r, _cold(cold, again, **kw))


def test_cancelled_stream_then_next_request(cached, cold):
    require_cache_exact()
    s = cached.session()
    ids = cached.tokenize(PROMPT)
    got = []
    stream = s.stream(ids, max_tokens=60, ignore_eos=True, draft_max=3)
    for chunk in stream:
        got += chunk.tokens
        if len(got) >= 8:
            break
    stream.close()
    follow = ids + got + cached.tokenize("\n# next", add_special=False)
    r = s.generate(follow, **KW)
    # The stopped sequence was snapshotted after the tokens its engine committed: the round
    # launched before the consumer stopped (rounds.Rounds.launch) is landed first, and
    # where it kept drafts the slot holds tokens past ``got``, so the follow-up resumes
    # from the prompt's end; never from less.
    assert r.stats.cached_tokens >= len(ids)
    same_run(r, _cold(cold, follow, **KW))


def test_cache_prompt_false_neither_reuses_nor_keeps(cached):
    s = cached.session()
    ids = cached.tokenize(PROMPT)
    s.generate(ids, **KW)
    r = s.generate(ids, cache_prompt=False, **KW)
    assert r.stats.cached_tokens == 0
    assert s.generate(ids, **KW).stats.cached_tokens == 0     # the cold run kept nothing


def test_spec_none_and_mtp_runs_share_a_session(cached, cold):
    require_cache_exact()
    s = cached.session()
    ids = cached.tokenize(PROMPT)
    plain = s.generate(ids, spec="none", max_tokens=12, ignore_eos=True)
    follow = ids + plain.tokens + cached.tokenize("\n", add_special=False)
    a = s.generate(follow, spec="none", max_tokens=12, ignore_eos=True)
    assert a.stats.cached_tokens >= len(ids) + len(plain.tokens) - 1
    b = s.generate(follow, **KW)       # another target context: a cold start there
    same_run(b, _cold(cold, follow, **KW))
    assert a.tokens == _cold(cold, follow, spec="none", max_tokens=12, ignore_eos=True).tokens


def test_plain_run_between_mtp_runs_on_one_context(cached, cold):
    """rollback="checkpoint" drafts on the plain run's target context: a plain run there
    in between must leave the MTP KV in step with the target's tokens."""
    require_cache_exact()
    s = cached.session()
    kw = dict(KW, rollback="checkpoint")
    ids = cached.tokenize(PROMPT)
    first = s.generate(ids, **kw)
    other = ids[:10] + cached.tokenize(" while True:\n", add_special=False)
    s.generate(other, spec="none", max_tokens=10, ignore_eos=True)
    follow = ids + first.tokens + cached.tokenize("\nx = 1", add_special=False)
    r = s.generate(follow, **kw)
    same_run(r, _cold(cold, follow, **kw))


def _pairs_fed(monkeypatch) -> dict[int, dict[int, tuple[int, np.ndarray]]]:
    """Every pair the drafter is given, by seq id and MTP KV position: (token, hidden row)."""
    from pymtp.drafter import MTPDrafter
    real, fed = MTPDrafter.propose, {}

    def spy(self, jobs):
        for job in jobs:
            at = job.start if job.start is not None else self.end(job.seq)
            for i, (tok, row) in enumerate(zip(job.tokens, job.hidden)):
                fed.setdefault(job.seq, {})[at + i] = (int(tok), row.copy())
        return real(self, jobs)

    monkeypatch.setattr(MTPDrafter, "propose", spy)
    return fed


def test_mtp_turn_resumes_from_a_plain_turn(cached, cold, monkeypatch):
    """A ``spec: "none"`` turn's snapshots keep no hidden rows, so the drafter holds none
    of that chat. Where positions may jump (the demo model), the next MTP turn on its slot
    resumes from one anyway, when at least RESUME_ROWS of its prompt come after it (it read
    its whole prompt again before): the drafter gets every pair after the snapshot but the
    first, whose row before it is gone, each the cold run's pair at that position. Greedy:
    the text is the cold run's."""
    require_cache_exact()
    from pymtp.round_state import RESUME_ROWS
    assert cached._native.positions_jump
    b = cached.batcher(1)
    try:
        # a short question: the newest snapshot RESUME_ROWS before its end (every EVERY
        # prompt tokens), none nearer
        ids = cached.tokenize(PROMPT)
        plain, = b.generate([ids], spec="none", max_tokens=12, ignore_eos=True)
        follow = ids + plain.tokens + cached.tokenize("\nx", add_special=False)
        r = b.generate([follow], **KW)[0]
        assert len(follow) - RESUME_ROWS - EVERY < r.stats.cached_tokens <= len(follow) - RESUME_ROWS
        assert r.tokens == _cold(cold, follow, **KW).tokens

        # a long one: the plain turn's end, where its KV stops
        ids = cached.tokenize("class Stack:\n    def __init__(self):\n        self.items = []\n")
        plain, = b.generate([ids], spec="none", max_tokens=12, ignore_eos=True)
        held = len(ids) + len(plain.tokens) - 1       # the KV holds all but the last token
        question = "\n\n    # the same class again, with a pop that raises on an empty stack:\n"
        follow = ids + plain.tokens + cached.tokenize(question, add_special=False)
        assert len(follow) - held >= RESUME_ROWS
        fed = _pairs_fed(monkeypatch)
        r = b.generate([follow], **KW)[0]
        got = fed.pop(next(iter(fed)))
        assert r.stats.cached_tokens == held
        assert min(got) == held + 1
        c = _cold(cold, follow, **KW)
        assert r.tokens == c.tokens
        want = fed.pop(next(iter(fed)))
        both = got.keys() & want.keys()        # (each leaves its last pairs for later)
        assert set(range(held + 1, len(follow) + 1)) <= both
        for q in both:
            assert want[q][0] == got[q][0] and np.array_equal(want[q][1], got[q][1]), q
    finally:
        b.close()


def test_two_slots_each_keep_their_conversation(cached, cold):
    require_cache_exact()
    b = cached.batcher(2)
    try:
        pa, pb = cached.tokenize(PROMPT), cached.tokenize("class Stack:\n    def push(self, x):\n")
        ra, rb = b.generate([pa, pb], **KW)
        na = pa + ra.tokens + cached.tokenize("\n# a", add_special=False)
        nb = pb + rb.tokens + cached.tokenize("\n# b", add_special=False)
        rb2, ra2 = b.generate([nb, na], **KW)     # the other order: routing finds each prefix
        assert ra2.stats.cached_tokens >= len(pa) + len(ra.tokens) - 1
        assert rb2.stats.cached_tokens >= len(pb) + len(rb.tokens) - 1
        same_run(ra2, _cold(cold, na, **KW))
        same_run(rb2, _cold(cold, nb, **KW))
    finally:
        b.close()


def test_more_chats_than_slots_keep_their_prompts(cached, cold):
    """Two chats on one slot (as llama-server's --cache-ram): each new chat shelves the
    other one, whose next turn gets it back, KV and drafter as they were: it reuses its
    whole last turn, and its drafts are a cold run's, round by round."""
    require_cache_exact()
    b = cached.batcher(1)
    try:
        shelf = b.engine.cache.shelf
        chats = [cached.tokenize(PROMPT), cached.tokenize("class Stack:\n    def push(self, x):\n")]
        asked = [0, 0]
        for turn in range(3):
            for i, ids in enumerate(chats):
                # where a server of several engines sends it: its shelved chat counts
                assert b.reusable(ids) >= (len(ids) - asked[i] - 1 if turn else 0)
                r, = b.generate([ids], **KW)
                if turn:
                    assert r.stats.cached_tokens >= len(ids) - asked[i] - 1, (turn, i)
                    same_run(r, _cold(cold, ids, **KW))
                else:
                    assert r.stats.cached_tokens == 0
                # the other chat is shelved once both ran; this one's next turn reuses it all
                assert [e.slot.tokens[:4] for e in shelf] == ([chats[1 - i][:4]] if turn or i else [])
                ask = cached.tokenize(f"\n# turn {turn}", add_special=False)
                chats[i], asked[i] = ids + r.tokens + ask, len(ask)
        budget = cached.cache_budget
        assert budget.used >= sum(e.nbytes for e in shelf) > 0
    finally:
        b.close()


def test_a_shelved_chat_comes_back_byte_for_byte(cached):
    """What a shelved chat gets back on a slot is what was copied out: the target's and
    the drafter's seq state, byte for byte, and the drafter's pairs (any backend: these are
    copies, not decodes)."""
    b = cached.batcher(2)
    try:
        resumes, cache = b.engine.rounds.resumes, b.engine.cache
        r, = b.generate([cached.tokenize(PROMPT)], **KW)
        seq = next(s for s, slot in cache.slots.items() if slot.snapshots)
        end = resumes.drafter.end(seq)
        assert resumes.shelve(seq, 0)
        e = cache.shelf[-1]
        assert e.drafter.end == end > 0 and cache.slots[seq].snapshots == []
        rounds = b.engine.rounds
        rounds.release_id(seq)    # as a cold request would
        other = 1 - seq           # through the other seq id and back (a state names its stream)
        resumes.unshelve(e, other)
        assert cache.shelf == [] and cache.slots[other].tokens == e.slot.tokens
        assert resumes.shelve(other, 0)
        rounds.release_id(other)
        resumes.unshelve(cache.shelf[-1], seq)
        buf = np.empty(resumes.target.state_size(seq, flags=0), dtype=np.uint8)
        assert np.array_equal(buf[:resumes.target.state_get(seq, buf, flags=0)], e.target)
        back = resumes.drafter.save(seq)
        assert np.array_equal(back.data, e.drafter.data) and (back.end, back.whole) == (end, end)
        follow = e.slot.tokens + cached.tokenize("\n", add_special=False)
        again, = b.generate([follow], **KW)
        assert again.stats.cached_tokens >= len(e.slot.tokens) - 1
    finally:
        b.close()


def test_a_restore_that_fails_decodes_the_prompt_anew(cached, cold, monkeypatch, caplog):
    """A shelved chat whose restore fails part way leaves the slot empty (its KV and
    snapshots would disagree) and its request decodes its whole prompt there, as a cold
    run, as llama-server goes on after a cache load that fails: it ended with the error
    (a 500 on the server). The chat stays shelved, and comes back once a restore works."""
    from pymtp.drafter import MTPDrafter
    b = cached.batcher(1)
    try:
        first = cached.tokenize(PROMPT)
        r, = b.generate([first], **KW)
        b.generate([cached.tokenize("class Stack:\n    def push(self, x):\n")], **KW)   # shelves the first
        shelf = b.engine.cache.shelf
        assert len(shelf) == 1
        shelved = shelf[0]

        def broken(self, seq, state):
            raise RuntimeError("restore failed")

        monkeypatch.setattr(MTPDrafter, "load", broken)
        follow = first + r.tokens
        with caplog.at_level("WARNING", logger="pymtp.scheduler"):
            got, = b.generate([follow], **KW)
        assert "restore failed" in caplog.text
        assert got.stats.cached_tokens == 0 and got.stats.prompt_processed == len(follow)
        same_run(got, _cold(cold, follow, **KW))
        assert shelved in shelf
        monkeypatch.undo()
        b.generate([cached.tokenize("class Stack:\n    def push(self, x):\n")], **KW)   # the slot's chat goes
        again, = b.generate([follow + cached.tokenize("\n", add_special=False)], **KW)
        assert again.stats.cached_tokens >= len(follow) - 1
    finally:
        b.close()


def test_a_chat_coming_back_leaves_the_shelf_before_the_slots_goes_on():
    """Swapping a shelved chat with a slot's (``take``, then ``shelve``, then ``unshelve``,
    as the scheduler does) never counts both: an older shelved chat that fits beside the
    result survives the swap."""
    cache = PromptCache(CacheBudget(400), EVERY)

    def chat(seq: int, first: int) -> None:
        cache.slot(seq).tokens = list(range(first, first + 10))
        cache.slot(seq).snapshots = [Snapshot(10, np.zeros(50, np.uint8), None, None, cache.budget.stamp())]

    for seq, first in ((0, 0), (1, 100), (2, 200)):     # A and B shelved, C on the slot
        chat(seq, first)
        if seq < 2:
            assert cache.shelve(seq, 0, np.zeros(100, np.uint8), None)
            cache.slots.pop(seq)
    assert cache.budget.used == 350
    b = cache.shelved_for(list(range(100, 120)), spec=False, exact=False)[0]
    cache.take(b)
    assert cache.shelve(2, 0, np.zeros(100, np.uint8), None)     # 350 without b; 500 with it
    cache.unshelve(b, 2)
    assert [e.slot.tokens[0] for e in cache.shelf] == [0, 200] and cache.budget.used == 350


def test_shelved_chats_share_the_budget_oldest_first():
    """A shelved conversation takes the snapshots its slot drops (none is held twice) and
    shares the budget with the others, oldest first."""
    cache = PromptCache(CacheBudget(300), EVERY)

    def snap(pos: int, n: int) -> Snapshot:
        return Snapshot(pos, np.zeros(n, np.uint8), None, None, cache.budget.stamp())

    cache.slot(0).tokens, cache.slot(0).snapshots = list(range(10)), [snap(5, 20), snap(10, 50)]
    cache.slot(1).tokens, cache.slot(1).snapshots = list(range(20, 30)), [snap(10, 50)]
    assert not cache.shelve(0, 10, np.zeros(100, np.uint8), None)     # nothing past 10
    assert cache.shelve(0, 5, np.zeros(100, np.uint8), None)           # moves the one at 10
    assert [s.pos for s in cache.slot(0).snapshots] == [5] and [s.pos for s in cache.shelf[0].slot.snapshots] == [10]
    assert cache.budget.used == 20 + 50 + 150 and cache.budget.count == 3
    assert cache.shelve(1, 0, np.zeros(100, np.uint8), None)           # 320: the oldest goes, seq 0's at 5
    assert cache.slot(0).snapshots == [] and cache.slot(1).snapshots == []
    assert [e.slot.tokens[0] for e in cache.shelf] == [0, 20] and cache.budget.used == 300
    cache.slot(2).tokens, cache.slot(2).snapshots = list(range(40, 49)), [snap(9, 10)]
    assert cache.shelve(2, 0, np.zeros(50, np.uint8), None)            # 360: the first shelved goes
    assert [e.slot.tokens[0] for e in cache.shelf] == [20, 40] and cache.budget.used == 210
    cache.slot(3).tokens, cache.slot(3).snapshots = list(range(9)), [snap(9, 10)]
    assert not cache.could_shelve(3, 0, 291) and cache.could_shelve(3, 0, 290)   # asked before a copy
    assert not cache.could_shelve(3, 9, 10)                            # nothing past 9
    assert not cache.shelve(3, 0, np.zeros(291, np.uint8), None)       # more than the whole budget
    assert [s.pos for s in cache.slot(3).snapshots] == [9]             # left where it was
    assert cache.shelved_for(list(range(20, 25)), spec=False, exact=False) is None   # nothing in 4 tokens
    e, pos = cache.shelved_for(list(range(20, 40)), spec=False, exact=False)
    assert (e, pos) == (cache.shelf[0], 10)
    newest = cache.shelf[1].slot.snapshots[0].stamp
    cache.unshelve(e, 4)
    assert [x.slot.tokens[0] for x in cache.shelf] == [40] and cache.slot(4).tokens == list(range(20, 30))
    assert cache.slot(4).snapshots[0].stamp > newest                   # the newest again


def test_cancelled_batch_request_keeps_its_prefix(cached, cold):
    require_cache_exact()
    b = cached.batcher(2)
    try:
        ids = cached.tokenize(PROMPT)
        run = b.submit(ids, max_tokens=60, ignore_eos=True)
        got = []
        while len(got) < 6:
            for r, chunk in b.step():
                got += chunk.tokens
        b.cancel(run)
        while b.busy:
            b.step()
        follow = ids + got + cached.tokenize("\n# next", add_special=False)
        (r,) = b.generate([follow], **KW)
        # the round in flight at the cancel landed first: as in the solo case above, the
        # slot may hold tokens past ``got``, and then the follow-up resumes at the prompt's end
        assert r.stats.cached_tokens >= len(ids)
        same_run(r, _cold(cold, follow, **KW))
    finally:
        b.close()


def test_multi_turn_chat_equals_cold_runs(cached, cold):
    require_cache_exact()
    s = cached.session()
    messages = [{"role": "system", "content": "You write short Python functions."}]
    prompt_before = 0
    for turn, ask in enumerate(["Add two numbers.", "Now three.", "And a list?", "Reverse it."]):
        messages.append({"role": "user", "content": ask})
        r = s.chat(messages, max_tokens=16, ignore_eos=True)
        c = cold.chat(messages, max_tokens=16, ignore_eos=True, cache_prompt=False)
        assert r.tokens == c.tokens, turn
        if turn:
            assert r.stats.cached_tokens >= prompt_before, turn
        prompt_before = r.stats.prompt_tokens
        messages.append({"role": "assistant", "content": r.text})


def test_keep_mode_mtp_kv_gives_the_same_tokens():
    """draft_kv="keep" (the GPU default) keeps accepted drafts' chain rows in the MTP KV:
    a cached run drafts from those rows where a cold one has the target's, so only the
    tokens must agree."""
    require_cache_exact()
    m = pymtp.load(threads=1, n_ctx=1024, checkpoint_every=EVERY, draft_kv="keep")
    try:
        s, cold = m.session(), m.session()
        ids = m.tokenize(PROMPT)
        first = s.generate(ids, **KW)
        follow = ids + first.tokens + m.tokenize("\nprint(", add_special=False)
        again = s.generate(follow, **KW)
        assert again.stats.cached_tokens >= len(ids) + len(first.tokens) - 1
        assert again.tokens == _cold(cold, follow, **KW).tokens
    finally:
        m.close()


def test_memory_budget_is_respected(dense_path):
    probe = pymtp.load(dense_path, threads=1, n_ctx=1024, checkpoint_every=EVERY)
    try:
        probe.generate(PROMPT, **KW)
        per = probe.cache_budget.used / probe.cache_budget.count     # one snapshot's bytes
    finally:
        probe.close()
    m = pymtp.load(dense_path, threads=1, n_ctx=1024, checkpoint_every=EVERY,
                   prompt_cache_mib=3.5 * per / 2**20)
    try:
        s = m.session()
        for text in [PROMPT, "import os\n" * 6, "class A:\n    pass\n" * 4]:
            s.generate(text, **KW)
            assert m.cache_budget.used <= m.cache_budget.budget
            assert m.cache_budget.count <= 3
        assert f"in {m.cache_budget.count} snapshots" in m.memory_report()
        assert f"of {3.5 * per / 2**20:.2f} MiB" in m.memory_report()
    finally:
        m.close()


def test_a_budget_smaller_than_one_snapshot_says_so_once(dense_path, caplog):
    """Nothing is reused then; the warning names the knob and the size that would do."""
    m = pymtp.load(dense_path, threads=1, n_ctx=1024, checkpoint_every=EVERY, prompt_cache_mib=0.001)
    try:
        with caplog.at_level("WARNING", logger="pymtp.prompt_cache"):
            m.generate(PROMPT, **KW)
            assert m.generate(PROMPT, **KW).stats.cached_tokens == 0 and m.cache_budget.count == 0
        told = [r.getMessage() for r in caplog.records if r.name == "pymtp.prompt_cache"]
        assert len(told) == 1, told
        assert "more than the whole budget of 0.00 MiB, so no prompt is reused" in told[0]
        assert "--cache-ram) at least 1 MiB" in told[0]
    finally:
        m.close()


def test_cache_off_and_bad_budgets(dense_path):
    m = pymtp.load(dense_path, threads=1, n_ctx=1024, prompt_cache_mib=0)
    try:
        m.generate(PROMPT, **KW)
        assert m.generate(PROMPT, **KW).stats.cached_tokens == 0
        assert "prompt cache off" in m.memory_report()
    finally:
        m.close()
    with pytest.raises(ValueError, match="prompt_cache_mib must be a number >= 0"):
        pymtp.load(dense_path, prompt_cache_mib=-1)
    with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 0"):
        pymtp.load(dense_path, checkpoint_every=2.5)


def test_cache_prompt_must_be_a_bool(cached):
    with pytest.raises(pymtp.ParamError, match="cache_prompt must be true or false") as e:
        cached.generate(PROMPT, cache_prompt="yes")
    assert e.value.param == "cache_prompt"


def test_idle_catch_up_readies_the_drafter_for_the_next_turn(cached, cold):
    """A turn that ends at its first token leaves the drafter behind its prompt (its last
    chunk's pairs wait for a round after the first token); between requests the batcher
    decodes them, so the next turn starts with nothing to catch up, and runs as cold."""
    b = cached.batcher(1)
    try:
        ids = cached.tokenize(PROMPT)
        (first,) = b.generate([ids], max_tokens=1, draft_max=3)
        rounds = b.engine.rounds
        behind = rounds.resumes.mtp_end(0)
        assert behind < len(ids), behind
        assert b.catch_up_idle(most=2) == 2                  # a piece at a time
        assert rounds.resumes.mtp_end(0) == behind + 2
        assert b.catch_up_idle() == len(ids) - behind - 2
        assert rounds.resumes.mtp_end(0) == len(ids)
        assert b.catch_up_idle() == 0                       # nothing left
        follow = ids + first.tokens + cached.tokenize("\nprint(", add_special=False)
        (again,) = b.generate([follow], **KW)
        assert again.stats.cached_tokens >= len(ids)
        require_cache_exact()
        same_run(again, _cold(cold, follow, **KW))
    finally:
        b.close()


def test_next_turn_leaves_the_drafters_catch_up_until_after_its_first_token(cached, cold):
    """A cached turn's new tokens (here fewer than PREFILL_DEFER) reach the drafter only
    in the round after the first token, so its time to first token holds target decodes
    alone; the pairs wait in the prompt-end snapshot's tail, and the turn after runs as
    cold."""
    b = cached.batcher(1)
    try:
        rounds = b.engine.rounds
        ids = cached.tokenize(PROMPT)
        (first,) = b.generate([ids], max_tokens=1, draft_max=3)
        b.catch_up_idle()
        assert rounds.resumes.mtp_end(0) == len(ids)
        follow = ids + first.tokens + cached.tokenize("\nprint(fibonacci(10))\n# and now", add_special=False)
        (second,) = b.generate([follow], max_tokens=1, draft_max=3)
        assert second.stats.cached_tokens >= len(ids)
        assert [rounds.resumes.mtp_end(0)] == [len(ids)]              # nothing decoded into the drafter
        assert b.catch_up_idle() == len(follow) - len(ids)
        last = follow + second.tokens + cached.tokenize(" print(", add_special=False)
        (third,) = b.generate([last], **KW)
        assert third.stats.cached_tokens >= len(follow)
        require_cache_exact()
        same_run(third, _cold(cold, last, **KW))
    finally:
        b.close()


def test_a_seeded_request_takes_no_snapshot_its_drafter_reaches_only_after_a_gap():
    """Where the drafter may resume after a gap, a snapshot it holds no pairs for serves
    a greedy or unseeded request (their text or distribution does not depend on the
    drafts) but not a seeded sampled one: its drafts, and with them its seed's draws,
    would differ from a cold run's, on every later request that took that snapshot."""
    cache = PromptCache(CacheBudget(1 << 20), EVERY, jumps=True)
    tokens = list(range(100, 121))
    hidden = np.ones((1, 4), dtype=np.float32)
    snap = Snapshot(15, np.zeros(8, np.uint8), hidden, None, 1)      # no tail: a plain epoch's
    slot = cache.slot(0)
    slot.tokens, slot.snapshots = tokens, [snap]
    assert cache.usable(0, tokens[:19], mtp_end=0) is snap
    assert cache.usable(0, tokens[:19], mtp_end=0, exact=True) is None
    assert cache.view(0, tokens[:19], 0, exact=True).reusable == 0 and cache.view(0, tokens[:19], 0).reusable == 15
    assert cache.usable(0, tokens[:19], mtp_end=15, exact=True) is snap      # the drafter holds it all


def _fresh_tokens(prompts: list[str], kw: dict) -> list[int]:
    """The first prompt's tokens from a model that ran nothing before."""
    fresh = pymtp.load(threads=1, n_ctx=1024)
    try:
        return fresh.generate_batch(prompts, **kw)[0].tokens
    finally:
        fresh.close()


def _plain_auto_run(b, prompts: list[str], monkeypatch):
    """A greedy auto-depth request held at depth 0 (the plain epoch a review's auto run
    happened to pick): its head sits out, its drafter is left behind."""
    epochs = b.engine.rounds.epochs
    epochs.k = 0
    with monkeypatch.context() as patch:
        patch.setattr(epochs, "pick", lambda bucket: 0)
        return b.generate(prompts, max_tokens=30, temperature=0, draft_max="auto")[0]


def test_seeded_batches_after_a_plain_epoch_repeat_a_fresh_models_text(monkeypatch):
    """A review's run: a greedy batch whose auto depth ran plain left prompt snapshots the
    drafter reached only after a gap; every seeded batch after it restored one and
    sampled other text than a fresh model's, for good."""
    require_cache_exact()
    prompts, kw = ["The capital of France"], dict(temperature=0.9, seed=4, max_tokens=30)
    want = _fresh_tokens(prompts, kw)
    m = pymtp.load(threads=1, n_ctx=1024)
    try:
        b = m.batcher(1)
        greedy = _plain_auto_run(b, prompts, monkeypatch)
        assert list(greedy.stats.depths) == [0] and greedy.stats.depths[0] > 16      # the head sat out
        assert b.generate(prompts, **kw)[0].tokens == want
        again = b.generate(prompts, **kw)[0]
        assert again.tokens == want and again.stats.cached_tokens > 0     # its own snapshots serve
    finally:
        m.close()


def test_a_seeded_request_after_an_idle_catch_up_over_a_gap_repeats_a_fresh_models_text(monkeypatch):
    """A review's run: after a greedy request whose auto depth ran plain, the idle catch-up
    decoded the last snapshot's tail into the drafter after a gap (its end then read past
    every snapshot), so a seeded request took an earlier snapshot as if the drafter held
    its pairs, and drafted, and sampled, otherwise than a fresh model."""
    require_cache_exact()
    prompts, kw = ["def bubble_sort(items):\n    n = len(items)\n"], dict(temperature=0.8, seed=42, max_tokens=30)
    want = _fresh_tokens(prompts, kw)
    m = pymtp.load(threads=1, n_ctx=1024)
    try:
        b = m.batcher(1)
        rounds = b.engine.rounds
        _plain_auto_run(b, prompts, monkeypatch)
        assert rounds.resumes.mtp_end(0) == 0
        assert b.catch_up_idle() > 0
        assert rounds.resumes.mtp_end(0, exact=True) == 0 < rounds.resumes.mtp_end(0)      # pairs after a gap only
        assert b.generate(prompts, **kw)[0].tokens == want
    finally:
        m.close()


def test_a_later_snapshots_tail_brings_the_drafter_to_an_earlier_one():
    # Hand-made slot: a snapshot at 15 with no tail, one at 20 whose tail holds the pairs
    # of positions 0..19 (a generation that ended before it drafted again keeps its
    # prompt's rows there). A drafter holding nothing reaches 15 through the later tail,
    # so the earlier snapshot serves it even where the drafter cannot resume after a gap.
    cache = PromptCache(CacheBudget(1 << 20), EVERY, jumps=False)
    tokens = list(range(100, 121))
    hidden = np.arange(20 * 4, dtype=np.float32).reshape(20, 4)
    early = Snapshot(15, np.zeros(8, np.uint8), hidden[14:15], None, 1)
    late = Snapshot(20, np.zeros(8, np.uint8), hidden[19:20], CatchUp(np.array(tokens[:20], np.int32), hidden), 2)
    slot = cache.slot(0)
    slot.tokens, slot.snapshots = tokens, [early, late]
    got = cache.usable(0, tokens[:19], mtp_end=0)
    assert (got.pos, got.data, got.hidden_before, got.tail_start) == (15, early.data, early.hidden_before, 0)
    assert got.tail.tokens.tolist() == tokens[:15] and np.array_equal(got.tail.hidden, hidden[:15])
    cache.slot(0).snapshots = [early]          # evicted since: what usable gave still holds the pairs
    assert got.tail.tokens.tolist() == tokens[:15]
    cache.slot(0).snapshots = [early, late]
    got_tokens, got_hidden = cache.pairs(0, 3, 15)
    assert got_tokens.tolist() == tokens[3:15] and np.array_equal(got_hidden, hidden[3:15])
    assert cache.pairs(0, 3, 21) is None            # past every tail
    late.tail = CatchUp(late.tail.tokens[5:], hidden[5:])      # a tail from position 5: no pairs before it
    assert cache.pairs(0, 3, 15) is None and cache.usable(0, tokens[:19], mtp_end=0) is None
    assert cache.usable(0, tokens[:19], mtp_end=5).tail_start == 5
    assert cache.usable(0, tokens[:19], mtp_end=15) is early          # the drafter holds all it needs


def test_a_tail_cut_from_a_larger_array_is_kept_as_its_own():
    """A snapshot's tail was a view of the round's rows: the whole array stayed alive while
    nbytes, which the budget holds the cache to, counted the view."""
    class Ctx:
        def state_size(self, seq):
            return 8

        def state_get(self, seq, buf):
            buf[:] = 7
            return 8

    cache = PromptCache(CacheBudget(1 << 20), EVERY)
    rows = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    ids = np.arange(40, dtype=np.int32)
    snap = cache.save(Ctx(), 0, list(range(10)), rows[9:10], CatchUp(ids[5:10], rows[5:10]))
    assert snap.tail.tokens.base is None and snap.tail.hidden.base is None
    assert snap.tail.tokens.tolist() == list(range(5, 10)) and np.array_equal(snap.tail.hidden, rows[5:10])
    assert snap.nbytes == 8 + 4 * 4 + 5 * 4 + 5 * 4 * 4
