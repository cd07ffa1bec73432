"""The slot pool: N sessions, one generation each at a time, and a bounded FIFO wait.

A generation runs in a worker thread (llama.cpp releases the GIL while it decodes), and
its chunks cross to the event loop through an asyncio queue, so the loop keeps serving
other requests. A slot goes back to the pool only after its worker has closed the
session's generator; a cancelled request therefore frees its slot within one round.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generic, Iterator, TypeVar

S = TypeVar("S")          # a session: anything ``start`` knows how to run
T = TypeVar("T")          # what its generator yields


class Overloaded(Exception):
    """Every slot is busy and the wait queue is full."""


class SlotPool(Generic[S]):
    """Lends sessions one request at a time; at most ``max_queue`` requests wait for one.

    Its state is touched only from the event loop thread, so it needs no lock.
    """

    def __init__(self, sessions: list[S], max_queue: int) -> None:
        if not sessions:
            raise ValueError("parallel must be >= 1")
        if max_queue < 0:
            raise ValueError(f"queue must be >= 0, got {max_queue}")
        self.size = len(sessions)
        self.max_queue = max_queue
        self.sessions = list(sessions)
        self._free: deque[S] = deque(sessions)
        self._waiters: deque[asyncio.Future] = deque()
        self._running: set[Generation] = set()
        self._executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="pymtp-slot")

    @property
    def busy(self) -> int:
        return self.size - len(self._free)

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> S:
        if self._free and not self.waiting:
            return self._free.popleft()
        if self.waiting >= self.max_queue:
            raise Overloaded()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # Handed a session in the same moment we were cancelled: pass it on.
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def release(self, session: S) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(session)
                return
        self._free.append(session)

    async def run(self, start: Callable[[S], Iterator[T]],
                  on_end: Callable[[], None] | None = None) -> "Generation[T]":
        """Wait for a slot, then iterate ``start(session)`` in a worker thread.

        ``on_end`` runs in the worker after the generator is closed, however it ended.
        """
        session = await self.acquire()
        gen: Generation[T] = Generation(asyncio.get_running_loop(), self)
        self._running.add(gen)
        self._executor.submit(gen._work, session, start, on_end)
        return gen

    def cancel_all(self) -> None:
        for gen in list(self._running):
            gen.cancel()

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

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: SlotPool) -> None:
        self._loop = loop
        self._pool = pool
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.ended = asyncio.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:    # the loop is closed: the server is shutting down
            pass

    def _work(self, session, start: Callable, on_end: Callable[[], None] | None) -> None:
        try:
            it = start(session)
            try:
                for item in it:
                    self._put(item)
                    if self._cancel.is_set():
                        break
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:   # handed to the event loop, which decides what it means
            self._put(_Failed(exc))
        finally:
            try:
                if on_end is not None:
                    on_end()
            finally:
                try:
                    self._loop.call_soon_threadsafe(self._finish, session)
                except RuntimeError:
                    pass

    def _finish(self, session) -> None:
        self._pool._running.discard(self)
        self._pool.release(session)
        self.ended.set()
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
