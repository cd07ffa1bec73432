"""The slot pool on its own: FIFO lending, a bounded queue, and no slot lost to a
cancelled waiter or a stopped generation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pymtp.server.slots import Overloaded, SlotPool


def test_lends_in_order_and_refuses_past_the_queue():
    async def main():
        pool = SlotPool(["s0"], max_queue=2)
        first = await pool.acquire()
        waiters = [asyncio.create_task(pool.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        assert pool.busy == 1 and pool.waiting == 2
        with pytest.raises(Overloaded):
            await pool.acquire()
        pool.release(first)
        got = await waiters[0]
        assert got == "s0" and not waiters[1].done()
        pool.release(got)
        pool.release(await waiters[1])
        assert pool.busy == 0 and pool.waiting == 0
        pool.shutdown()

    asyncio.run(main())


def test_cancelled_waiter_does_not_lose_the_slot():
    async def main():
        pool = SlotPool(["s0"], max_queue=2)
        held = await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)
        pool.release(held)          # handed to the waiter ...
        waiter.cancel()             # ... which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert pool.busy == 0
        assert await asyncio.wait_for(pool.acquire(), 1) == "s0"
        pool.shutdown()

    asyncio.run(main())


def test_cancel_stops_the_worker_and_frees_the_slot():
    closed = threading.Event()

    def endless(session):
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    async def main():
        pool = SlotPool(["s0"], max_queue=0)
        gen = await pool.run(endless)
        assert await gen.__anext__() == 0
        gen.cancel()
        async for _ in gen:     # drains what the worker sent before it saw the cancel
            pass
        assert closed.is_set() and pool.busy == 0
        pool.shutdown()

    asyncio.run(main())


def test_a_cancel_after_the_last_chunk_leaves_the_answer_whole():
    """A drain's abort that lands once the final chunk is sent, before the worker looks at
    the next: the answer ended, so it ends as usual (it ended with the abort's error, a 503
    after a whole answer)."""
    class Chunk:
        def __init__(self, text, finish_reason=None):
            self.text, self.finish_reason = text, finish_reason

    async def main():
        pool = SlotPool(["s0"], max_queue=0)
        holder: list = []
        held = threading.Event()      # the worker may start before run() returns the generation

        def answer(session):
            yield Chunk("a")
            assert held.wait(10)
            holder[0].cancel(RuntimeError("draining"))     # as the last chunk goes out
            yield Chunk("b", "stop")
            yield Chunk("never")

        gen = await pool.run(answer)
        holder.append(gen)
        held.set()
        got = [c.text async for c in gen]
        assert got == ["a", "b"] and pool.busy == 0
        pool.shutdown()

    asyncio.run(main())


def test_an_error_in_start_reaches_the_loop():
    def bad(session):
        raise ValueError("max_tokens must be an integer >= 1, got 0")

    async def main():
        pool = SlotPool(["s0"], max_queue=0)
        gen = await pool.run(bad)
        with pytest.raises(ValueError, match="max_tokens"):
            await gen.__anext__()
        await gen.ended.wait()
        assert pool.busy == 0
        pool.shutdown()

    asyncio.run(main())


class Refused(Exception):
    pass


def test_refuse_fails_waiting_and_new_requests_and_keeps_the_slot():
    async def main():
        pool = SlotPool(["s0"], max_queue=2)
        held = await pool.acquire()
        waiters = [asyncio.create_task(pool.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        pool.refuse(Refused)
        for w in waiters:
            with pytest.raises(Refused):
                await w
        assert pool.refusing and pool.waiting == 0
        with pytest.raises(Refused):
            await pool.acquire()
        pool.release(held)
        assert pool.busy == 0
        pool.shutdown()

    asyncio.run(main())


def test_abort_ends_a_cut_generation_with_the_error_after_its_items():
    go_on, parked = threading.Event(), threading.Event()

    def endless(session):
        i = 0
        while True:
            yield i
            parked.set()      # the worker checked for a cancel after item i, and goes on
            go_on.wait()
            i += 1

    def short(session):
        yield "only"

    async def main():
        pool = SlotPool(["s0", "s1"], max_queue=0)
        cut = await pool.run(endless)
        assert await cut.__anext__() == 0
        done = await pool.run(short)
        await done.ended.wait()           # ran to its end before the abort
        assert pool.running == 1
        # on a loaded machine the worker could still be between item 0 and its cancel check
        # here, and stop before item 1 (CI, 2 cores busy)
        await asyncio.get_running_loop().run_in_executor(None, parked.wait)
        pool.abort_all(lambda: Refused("shutting down"))
        go_on.set()
        seen = []
        with pytest.raises(Refused, match="shutting down"):
            async for item in cut:
                seen.append(item)
        assert seen == [1] and pool.busy == 0 and pool.running == 0   # the slot was free first
        assert [x async for x in done] == ["only"]                     # not cut: a normal end
        assert await pool.wait_idle(1)
        pool.shutdown()

    asyncio.run(main())


def test_wait_idle_waits_for_the_running_generation():
    release = threading.Event()

    def blocked(session):
        release.wait()
        yield "x"

    async def main():
        pool = SlotPool(["s0"], max_queue=0)
        gen = await pool.run(blocked)
        assert not await pool.wait_idle(0.05)
        release.set()
        assert await pool.wait_idle(10) and pool.running == 0
        assert [x async for x in gen] == ["x"]
        pool.shutdown()

    asyncio.run(main())


def test_pick_free_prefers_the_score_then_the_group_with_most_free():
    from pymtp.server.slots import pick_free

    group = {"a0": "a", "a1": "a", "b0": "b", "c0": "c", "c1": "c", "c2": "c"}.get
    assert pick_free(["a0", "b0", "c0", "c1", "c2"], group) == 2        # c has three free
    assert pick_free(["a0", "a1", "b0", "c0", "c1"], group) == 0        # a tie: the first
    assert pick_free(["b0"], group) == 0
    asked = []

    def cached(s):             # b's engine holds 12 of the prompt's tokens
        asked.append(s)
        return 12 if s[0] == "b" else 0

    assert pick_free(["a0", "b0", "c0", "c1", "c2"], group, cached) == 1
    assert sorted(asked) == ["a0", "b0", "c0"]           # once per group
    assert pick_free(["a0", "c0"], None, lambda s: s == "c0") == 1    # no groups: the score alone


def test_grouped_pool_spreads_requests_over_groups():
    """Slots of two engines listed one engine after the other: each request goes to the
    engine with the most free slots, and a slot given back counts for its engine again."""
    async def main():
        pool = SlotPool(["a0", "a1", "a2", "b0", "b1", "b2"], max_queue=0, group=lambda s: s[0])
        got = [await pool.acquire() for _ in range(2)]
        assert [s[0] for s in got] == ["a", "b"]
        third = await pool.acquire()        # a tie: the first free slot, a1
        assert third == "a1"
        assert (await pool.acquire())[0] == "b"       # a has one free, b two
        pool.release(third)
        assert (await pool.acquire())[0] == "a"       # now a has two free, b one
        pool.shutdown()

    asyncio.run(main())
