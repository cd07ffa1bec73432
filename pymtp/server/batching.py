"""``--parallel N`` as one batched engine: N slots of a ``Batcher``, stepped by one thread.

The slot pool (slots.py) lends ``BatchSlot``s exactly as it lends sessions: it bounds
how many requests run (N) and how many wait (the queue, then 503), and cancels a
generation whose client went away. A slot's ``stream`` submits the request to the shared
``Batcher`` and relays the chunks that ``BatchWorker``'s thread produces, one round at a
time for every running request (pymtp/scheduler.py). Closing the stream early cancels
the request, whose seq id the next round frees before it admits anyone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterator, Sequence

from ..batch import Batcher, BatchRun
from ..generate import Calibration, Chunk, Model
from ..guard import ClosedError
from ..rpc import RpcError, RpcWorkerLost
from .errors import worker_lost

log = logging.getLogger("pymtp.server")
# rows of one idle catch-up decode: what a request arriving meanwhile may wait for (a
# 64-row piece kept the next chat turn waiting up to 16 ms on two CPU threads; 16 rows,
# at most about 3.5 ms)
IDLE_ROWS = 16


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class BatchWorker:
    """Steps one Batcher in its own thread while it has requests, and hands every request
    its chunks through a queue of its own.

    ``replace``: called after a lost RPC worker has ended every request, for a batcher to
    go on with (the model failed over to this host); when it raises, requests are refused
    with what it said."""

    def __init__(self, batcher: Batcher, replace: Callable[[], Batcher] | None = None) -> None:
        self.batcher = batcher
        self.replace = replace
        self.broken: RpcError | None = None
        self._failing_over = False        # new requests wait for the replacement meanwhile
        self._cond = threading.Condition()
        self._queues: dict[BatchRun, queue.SimpleQueue] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pymtp-batch", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int] | str, *, stop=None, **params) -> tuple[BatchRun, queue.SimpleQueue]:
        """Queue a request (a bad one raises here, as ``Session.stream`` does)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or not self._failing_over)
            if self._closed:
                raise ClosedError("the server's batched engine is closed")
            if self.broken is not None:
                raise worker_lost(self.broken)
            run = self.batcher.submit(prompt, stop=stop, **params)
            chunks: queue.SimpleQueue = queue.SimpleQueue()
            self._queues[run] = chunks
            self._cond.notify()
        return run, chunks

    def cancel(self, run: BatchRun) -> None:
        self.batcher.cancel(run)
        with self._cond:
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self.batcher.busy)
                if self._closed:
                    return
            try:
                self._hand_on(self.batcher.step(self._hand_on))
            except BaseException as exc:      # every request ends with it; the engine goes on
                lost = isinstance(exc, RpcWorkerLost)
                if lost:
                    with self._cond:
                        self._failing_over = True
                self._fail_all(exc)
                if lost:
                    self._fail_over(exc)
                continue
            # the last request ended: prepare the next turn, a piece at a time while none comes
            try:
                while not self.batcher.busy and not self._closed and self.batcher.catch_up_idle(IDLE_ROWS):
                    pass
            except Exception:          # an optimisation: the next request does it anyway
                log.exception("catching the drafter up between requests failed")

    def _hand_on(self, out: list[tuple[BatchRun, Chunk]]) -> None:
        """Each chunk to its request's queue; a finished request's queue is dropped."""
        with self._cond:
            for run, chunk in out:
                q = self._queues.get(run)
                if q is not None:
                    q.put(chunk)
            for run in [r for r in self._queues if r.done]:
                self._queues.pop(run)

    def _fail_over(self, exc: RpcWorkerLost) -> None:
        """The split model cannot decode any more: go on with what ``replace`` makes."""
        log.error("%s", exc)
        batcher, broken = None, None
        try:
            if self.replace is None:
                raise exc
            batcher = self.replace()
        except Exception as e:      # the split model is gone either way: say why from now on
            log.error("no fail-over: %s", e)
            broken = e if isinstance(e, RpcError) else RpcError(f"{exc}; the fail-over to this host failed: {e}")
        with self._cond:
            self.batcher = batcher or self.batcher
            self.broken = broken
            self._failing_over = False
            self._cond.notify_all()
        if batcher is not None:
            log.warning("failed over: the model now runs on this host alone")

    def _fail_all(self, exc: BaseException) -> None:
        self.batcher.engine.fail_all()
        with self._cond:
            for q in self._queues.values():
                q.put(_Failed(exc))
            self._queues.clear()

    def close(self) -> None:
        """Stop stepping (after the round under way) and free the engine."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            waiting = list(self._queues.values())
            self._queues.clear()
        for q in waiting:
            q.put(_Failed(ClosedError("the server is shutting down")))
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.batcher.close()


class BatchSlot:
    """What the slot pool lends: one of the batched engine's slots, used like a Session."""

    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker

    def stream(self, prompt: Sequence[int] | str, *, stop=None, stats_out: list | None = None,
               **params) -> Iterator[Chunk]:
        """As ``Session.stream``: the request is checked now, its chunks come as rounds end."""
        run, chunks = self.worker.submit(prompt, stop=stop, **params)
        return self._relay(run, chunks, stats_out)

    def _relay(self, run: BatchRun, chunks: queue.SimpleQueue, stats_out: list | None) -> Iterator[Chunk]:
        try:
            while True:
                item = chunks.get()
                if isinstance(item, _Failed):
                    if isinstance(item.exc, RpcError):
                        raise worker_lost(item.exc)
                    raise item.exc
                yield item
                if item.finish_reason:
                    return
        finally:
            if not run.done:
                self.worker.cancel(run)
            if stats_out is not None:
                stats = run.request.stats
                if stats.t_end == 0.0:      # cancelled: the engine frees it at the next round
                    stats.t_end = time.perf_counter()
                stats_out.append(run.stats)

    def close(self) -> None:
        """The worker is closed once, by the service, for all its slots."""


def batch_slots(model: Model, parallel: int, calibrate: bool = False,
                ) -> tuple[list[BatchSlot], BatchWorker, Calibration | None]:
    """``parallel`` slots of one batched engine on ``model``, the worker stepping it, and
    with ``calibrate`` what auto's search for a full batch found before the worker started
    (Batcher.calibrate; a batcher made on a fail-over searches on its requests)."""
    def fail_over() -> Batcher:
        model.fail_over_to_local()
        return model.batcher(parallel)

    batcher = model.batcher(parallel)
    calibration = batcher.calibrate() if calibrate else None
    worker = BatchWorker(batcher, fail_over if model.rpc else None)
    return [BatchSlot(worker) for _ in range(parallel)], worker, calibration
