"""``--parallel N`` as batched engines: N slots of one ``Batcher`` stepped by one thread,
or of ``--engines`` batchers, each stepped by a thread of its own (``default_engines``
says when and why).

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

from ..batch import Batcher, BatchRun, calibrate_engines, engine_sizes
from ..generate import Model
from ..results import Calibration, Chunk
from ..scheduler import Request
from ..guard import ClosedError
from ..rpc import RpcError, RpcWorkerLost
from .errors import unavailable, worker_lost

log = logging.getLogger("pymtp.server")
# rows of one idle catch-up decode: what a request arriving meanwhile may wait for (a
# 64-row piece kept the next chat turn waiting up to 16 ms on two CPU threads; 16 rows,
# at most about 3.5 ms)
IDLE_ROWS = 16


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_INTERRUPT = object()     # BatchSlot.interrupt's word to its relay


class _Placed:
    """A request got its seq id: it comes before the request's chunks."""

    def __init__(self, seq: int) -> None:
        self.seq = seq


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
        self._unplaced: set[BatchRun] = set()     # runs not yet told their seq id
        self._closed = False
        batcher.engine.on_admit = self._admitted
        self._thread = threading.Thread(target=self._loop, name="pymtp-batch", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int] | str, *, stop=None, arrived: float | None = None,
               **params) -> tuple[BatchRun, queue.SimpleQueue]:
        """Queue a request (a bad one raises here, as ``Session.stream`` does)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or not self._failing_over)
            if self._closed:
                raise ClosedError("the server's batched engine is closed")
            if self.broken is not None:
                raise unavailable(self.broken)
            run = self.batcher.submit(prompt, stop=stop, arrived=arrived, **params)
            chunks: queue.SimpleQueue = queue.SimpleQueue()
            self._queues[run] = chunks
            self._unplaced.add(run)
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
            except BaseException as exc:      # the round's requests end with it; the engine goes on
                lost = isinstance(exc, RpcWorkerLost)
                if lost:
                    with self._cond:
                        self._failing_over = True
                self._fail(RpcWorkerLost(exc.failure, "the server goes on without it: send the request again")
                           if lost and self.replace is not None else exc, queued=lost)
                if lost:
                    self._fail_over(exc)
                continue
            # the last request ended: prepare the next turn, a piece at a time while none comes
            try:
                while not self.batcher.busy and not self._closed and self.batcher.catch_up_idle(IDLE_ROWS):
                    pass
            except Exception:          # an optimisation: the next request does it anyway
                log.exception("catching the drafter up between requests failed")

    def _admitted(self, req: Request) -> None:
        """The engine gave ``req`` its seq id: its request hears so now, not after the
        round that decodes the first piece of its prompt (seconds, for a long one)."""
        with self._cond:
            for run in [r for r in self._unplaced if r.request is req]:
                self._unplaced.discard(run)
                self._queues[run].put(_Placed(req.slot))

    @property
    def stepping(self) -> bool:
        """The engine goes on stepping: not closed, and not broken by a lost worker."""
        return not self._closed and self.broken is None

    def _hand_on(self, out: list[tuple[BatchRun, Chunk]]) -> None:
        """Each chunk to its request's queue, after its seq id once it has one; a finished
        request's queue is dropped."""
        with self._cond:
            for run in [r for r in self._unplaced if r.request.slot is not None or r.done]:
                self._unplaced.discard(run)
                if run.request.slot is not None and run in self._queues:
                    self._queues[run].put(_Placed(run.request.slot))
            for run, chunk in out:
                q = self._queues.get(run)
                if q is not None:      # a request that failed alone gets its error, not a chunk
                    q.put(chunk if run.error is None else _Failed(run.error))
            for run in [r for r in self._queues if r.done]:
                self._queues.pop(run)
                self._unplaced.discard(run)

    def _fail_over(self, exc: RpcWorkerLost) -> None:
        """The split model cannot decode any more: go on with what ``replace`` makes (the
        log says so, not the exception's advice to load the model again)."""
        log.error("%s", exc if self.replace is None else f"{exc.failure}; failing over to this host")
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
            self.batcher.engine.on_admit = self._admitted
            self.broken = broken
            self._failing_over = False
            self._cond.notify_all()
        if batcher is not None:
            log.warning("failed over: the model now runs on this host alone")

    def _fail(self, exc: BaseException, *, queued: bool) -> None:
        """A step raised: the requests its round ended (Batcher.step) get ``exc``; the
        queued ones start in a later round, as llama-server fails only the failed batch's
        slots. All of them end where ``queued`` (a lost worker: they would never start on
        this batcher) or where the step ended none (the error came before any request,
        and the next step would raise it again)."""
        with self._cond:      # no submit between the engine's failing and the queues': it would get both
            ended = [run for run in self._queues if run.done]
            if queued or not ended:
                self.batcher.fail_all(exc)
                ended = list(self._queues)
            for run in ended:
                self._queues.pop(run).put(_Failed(exc))
                self._unplaced.discard(run)

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
    """What the slot pool lends: one of the batched engine's slots, used like a Session.

    The slots of a worker are alike: the pool lends any free one, and the engine gives the
    request the seq id whose prompt cache serves it best (scheduler.py). ``seq`` names
    this slot's seq id, so that the server can tell which slot a request really ran on."""

    def __init__(self, worker: BatchWorker, seq: int = 0) -> None:
        self.worker = worker
        self.seq = seq
        self._chunks: queue.SimpleQueue | None = None     # the running request's

    def stream(self, prompt: Sequence[int] | str, *, stop=None, stats_out: list | None = None,
               placed: Callable[[int], None] | None = None, arrived: float | None = None,
               **params) -> Iterator[Chunk]:
        """As ``Session.stream``: the request is checked now, its chunks come as rounds end;
        ``placed`` is called with the seq id the engine gives it, before its first chunk;
        ``arrived`` is when the request came, before it waited for this slot (its queue time)."""
        run, chunks = self.worker.submit(prompt, stop=stop, arrived=arrived, **params)
        self._chunks = chunks
        return self._relay(run, chunks, stats_out, placed)

    def interrupt(self) -> None:
        """End the running request's stream now, from any thread: its relay waits for the
        next chunk, which a long prompt's prefill keeps from coming for seconds, and a
        cancel seen only after a chunk held the slot for all of it (slots.Generation.cancel)."""
        chunks = self._chunks
        if chunks is not None:
            chunks.put(_INTERRUPT)

    def _settle(self, run: BatchRun, chunks: queue.SimpleQueue) -> None:
        """Wait for the engine to let a cancelled run go, at the end of the round under way
        (a piece of a prompt at most): what that round decodes for it counts in its stats,
        which /metrics and /slots read (a client gone during its prompt's prefill counted
        the pieces before the one under way, or none)."""
        while not run.done and self.worker.stepping:
            try:
                chunks.get(timeout=0.05)
            except queue.Empty:
                pass

    def _relay(self, run: BatchRun, chunks: queue.SimpleQueue, stats_out: list | None,
               placed: Callable[[int], None] | None) -> Iterator[Chunk]:
        try:
            while True:
                item = chunks.get()
                if item is _INTERRUPT:
                    return
                if isinstance(item, _Placed):
                    if placed is not None:
                        placed(item.seq)
                    continue
                if isinstance(item, _Failed):
                    if isinstance(item.exc, RpcError):
                        raise worker_lost(item.exc)
                    raise item.exc
                yield item
                if item.finish_reason:
                    return
        finally:
            if self._chunks is chunks:
                self._chunks = None
            if not run.done:
                self.worker.cancel(run)
                if stats_out is not None:
                    self._settle(run, chunks)
            if stats_out is not None:
                stats = run.request.stats
                if stats.t_end == 0.0:      # cancelled: the engine frees it at the next round
                    stats.t_end = time.perf_counter()
                stats_out.append(run.stats)

    def close(self) -> None:
        """The worker is closed once, by the service, for all its slots."""


# the most engines ``--engines auto`` makes: each has its own contexts (their compute
# buffers, on a large model hundreds of MB each), and each more one takes the GIL from the
# rest; 4 is the most measured (8 slots: 4 engines ran 1.28-1.29x 2 engines at k=3)
MAX_AUTO_ENGINES = 4


def default_engines(parallel: int, offloaded: bool, rpc: bool) -> int:
    """``--engines auto``: on a GPU of this host one engine per two slots, at most
    MAX_AUTO_ENGINES; otherwise one.

    Why: a batched round runs its MTP decodes, its target decode and its Python one after
    the other, and on a GPU the device idles under the host's part. Engines in their own
    threads overlap one's host work with another's decodes (llama.cpp releases the GIL
    while it decodes). On an H100 (8 slots, 32 requests x 128, greedy,
    benchmarks/engine_split.py) 4 engines of 2 slots ran 1.66x one engine of 8 at k=3
    on the demo model and 1.94x on a 519M model; without drafts 1.37x and 1.27x. On a
    CPU the engines' threads would share the same cores (two engines ran 0.86x at k=3 on
    two threads). Measured with CUDA only: Metal is taken to behave as a GPU. A model split
    over RPC workers fails over as one engine (``BatchWorker.replace``)."""
    if not offloaded or rpc:
        return 1
    return max(1, min(parallel // 2, MAX_AUTO_ENGINES))


def batch_slots(model: Model, parallel: int, calibrate: bool = False, engines: int = 1,
                ) -> tuple[list[BatchSlot], list[BatchWorker], Calibration | None]:
    """``parallel`` slots of ``engines`` batched engines on ``model`` (``engine_sizes``),
    each stepped by a worker thread of its own; the slots come in turn from each engine,
    so the pool's first requests go to different ones. With ``calibrate``, what auto's
    search for a full batch found before the workers started (Batcher.calibrate, every
    engine at once; the first engine's result is returned; a batcher made on a
    fail-over searches on its requests). The engines after the first draft the depths the
    first one's search picks (depth_batched.Following)."""
    sizes = engine_sizes(parallel, engines)
    if engines > 1 and model.rpc:
        raise ValueError("--engines above 1 cannot serve a model split over RPC workers (a lost worker "
                         "fails the model over to one engine on this host); leave --engines out")

    def fail_over() -> Batcher:
        model.fail_over_to_local()
        return model.batcher(parallel)

    batchers = [model.batcher(sizes[0])]
    # one depth for all: each engine's clock runs at what the others' rounds make it
    batchers += [model.batcher(n, follow=batchers[0]) for n in sizes[1:]]
    calibration = calibrate_engines(batchers) if calibrate else None
    workers = [BatchWorker(b, fail_over if model.rpc else None) for b in batchers]
    slots = [BatchSlot(workers[e], i) for i in range(max(sizes)) for e, n in enumerate(sizes) if i < n]
    return slots, workers, calibration
