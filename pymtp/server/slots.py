"""The slot pool: N sessions, one generation each at a time, and a bounded FIFO wait.

A generation runs in a worker thread (llama.cpp releases the GIL while it decodes), and
its chunks cross to the event loop through an asyncio queue, so the loop keeps serving
other requests. A slot goes back to the pool only after its worker has closed the
session's generator; a cancelled request therefore frees its slot within one round (a
session with ``interrupt``, the batched engine's, also while its prompt is decoded).

For a graceful shutdown the pool can ``refuse`` new work (failing the queued requests at
once), report when the running ones are done (``wait_idle``), and ``abort_all`` that are
left, each then ending with an error instead of a normal end.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generic, Hashable, Iterator, Sequence, TypeVar

S = TypeVar("S")          # a session: anything ``start`` knows how to run
T = TypeVar("T")          # what its generator yields


class Overloaded(Exception):
    """Every slot is busy and the wait queue is full."""


def pick_free(free: Sequence[S], group: Callable[[S], Hashable] | None,
              score: Callable[[S], int] | None = None) -> int:
    """The index in ``free`` of the session to lend: the highest ``score`` (the prompt
    tokens its engine's cache could skip), then the group with the most free sessions,
    so that requests spread over the groups (the batched engines of ``pymtp serve
    --engines``) instead of filling one while another idles; then the first."""
    counts = Counter(group(s) for s in free) if group is not None else Counter()
    cached: dict[Hashable, int] = {}

    def scored(s: S) -> int:      # once per group: every slot of an engine scores the same
        if score is None:
            return 0
        key = group(s) if group is not None else id(s)
        if key not in cached:
            cached[key] = score(s)
        return cached[key]

    return max(range(len(free)), key=lambda i: (scored(free[i]),
                                                 counts[group(free[i])] if group is not None else 0, -i))


class SlotPool(Generic[S]):
    """Lends sessions one request at a time; at most ``max_queue`` requests wait for one.

    Its state is touched only from the event loop thread, so it needs no lock. With
    ``group``, a free session is lent from the group with the most free ones
    (``pick_free``), or where ``acquire``'s ``prefer`` scores highest; without either,
    the one free the longest.
    """

    def __init__(self, sessions: list[S], max_queue: int, group: Callable[[S], Hashable] | None = None) -> None:
        if not sessions:
            raise ValueError("parallel must be >= 1")
        if max_queue < 0:
            raise ValueError(f"queue must be >= 0, got {max_queue}")
        self.size = len(sessions)
        self.max_queue = max_queue
        self.sessions = list(sessions)
        self._free: deque[S] = deque(sessions)
        self._group = group
        self._waiters: deque[asyncio.Future] = deque()
        self._running: set[Generation] = set()
        self._refusal: Callable[[], BaseException] | None = None
        self._executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="pymtp-slot")

    @property
    def busy(self) -> int:
        return self.size - len(self._free)

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    @property
    def running(self) -> int:
        """Generations whose worker has not finished (a busy slot is one of these)."""
        return len(self._running)

    @property
    def refusing(self) -> bool:
        return self._refusal is not None

    async def acquire(self, prefer: Callable[[S], int] | None = None) -> S:
        """A free session (``prefer``: a score, the highest goes first), or wait for one."""
        if self._refusal is not None:
            raise self._refusal()
        if self._free and not self.waiting:
            return self._take(prefer)
        if self.waiting >= self.max_queue:
            raise Overloaded()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # Handed a session in the same moment we were cancelled: pass it on.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _take(self, prefer: Callable[[S], int] | None) -> S:
        if self._group is None and prefer is None:
            return self._free.popleft()
        i = pick_free(self._free, self._group, prefer)
        session = self._free[i]
        del self._free[i]
        return session

    def release(self, session: S) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(session)
                return
        self._free.append(session)

    async def run(self, start: Callable[[S], Iterator[T]], on_end: Callable[[], None] | None = None,
                  prefer: Callable[[S], int] | None = None) -> "Generation[T]":
        """Wait for a slot (``acquire``), then iterate ``start(session)`` in a worker thread.

        ``on_end`` runs in the worker after the generator is closed, however it ended.
        """
        session = await self.acquire(prefer)
        gen: Generation[T] = Generation(asyncio.get_running_loop(), self, session)
        self._running.add(gen)
        self._executor.submit(gen._work, session, start, on_end)
        return gen

    def cancel_all(self) -> None:
        for gen in list(self._running):
            gen.cancel()

    def refuse(self, error: Callable[[], BaseException]) -> None:
        """From now on ``acquire`` raises ``error()``, and so do the requests already waiting.

        A queued request has not started: failing it now lets its client retry elsewhere
        at once instead of waiting for a slot that a draining server may never give it.
        """
        self._refusal = error
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error())

    def abort_all(self, error: Callable[[], BaseException]) -> None:
        """Stop every running generation; each iterator then raises ``error()`` (see ``cancel``)."""
        for gen in list(self._running):
            gen.cancel(error())

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no generation runs (or ``timeout`` s); whether none does.

        Meant for after ``refuse``, when no new generation can start.
        """
        waits = [asyncio.ensure_future(g.ended.wait()) for g in self._running]
        if not waits:
            return True
        _, pending = await asyncio.wait(waits, timeout=timeout)
        for w in pending:
            w.cancel()
        return not self._running

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Generation(Generic[T]):
    """The event loop's end of one worker: an async iterator over what it yields.

    An exception in the worker (including one raised by ``start`` before the first item)
    is re-raised by ``__anext__``. ``cancel()`` makes the worker stop after its current
    item; the slot is free again before the iterator reports its end.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: SlotPool, session: Any = None) -> None:
        self._loop = loop
        self._pool = pool
        self._session = session
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self._error: BaseException | None = None    # raised instead of the end, if cut short
        self._cut = False                           # the worker stopped before its generator ended
        self.ended = asyncio.Event()

    def cancel(self, error: BaseException | None = None) -> None:
        """Stop the worker after its current item.

        With ``error``, an iterator that was cut short raises it (after the items already
        sent, once the slot is free) instead of ending: the consumer can tell a client why
        its answer stops there. A generation that had already run to its end ends as usual.
        """
        if error is not None and self._error is None:
            self._error = error
        self._cancel.set()
        # a session that can (batching.BatchSlot) ends its stream now, not at its next item;
        # once released (``ended``, set on this loop as cancel is called) it may run another's
        interrupt = getattr(self._session, "interrupt", None)
        if interrupt is not None and not self.ended.is_set():
            interrupt()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:    # the loop is closed: the server is shutting down
            pass

    def _work(self, session, start: Callable, on_end: Callable[[], None] | None) -> None:
        failed: BaseException | None = None
        try:
            it = start(session)
            try:
                item = None
                for item in it:
                    self._put(item)
                    if self._cancel.is_set():      # after the last chunk: the answer is whole
                        self._cut = not getattr(item, "finish_reason", None)
                        break
                else:       # an interrupted session's stream ends before its last chunk
                    self._cut = self._cancel.is_set() and not getattr(item, "finish_reason", None)
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:   # handed to the event loop, which decides what it means
            failed = exc
        finally:
            try:
                if on_end is not None:
                    on_end()
            finally:
                # the failure after on_end: a refused request's 400 reached the client while
                # /slots still showed it running (on_end ends its slot task)
                if failed is not None:
                    self._put(_Failed(failed))
                try:
                    self._loop.call_soon_threadsafe(self._finish, session)
                except RuntimeError:
                    pass

    def _finish(self, session) -> None:
        self._pool._running.discard(self)
        self._pool.release(session)
        self.ended.set()
        if self._cut and self._error is not None:
            self._queue.put_nowait(_Failed(self._error))
        self._queue.put_nowait(_END)

    def __aiter__(self) -> "Generation[T]":
        return self

    async def __anext__(self) -> T:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)     # stay ended for later calls
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            raise item.exc
        return item
