"""Several generations decoded together: text in, text out, over one ``BatchEngine``.

A ``Batcher`` is to the batched engine (scheduler.py) what a ``Session`` is to the
single-sequence one: it checks a request as ``Session.stream`` does, and turns each
round's tokens into text with the same stop-string rules, so every request's chunks are
the ones it would get alone. ``Model.generate_batch`` and ``Model.stream_batch`` run a
list of prompts through one; the server drives one with ``submit`` and ``step``.
"""

from __future__ import annotations

import codecs
import contextlib
import numbers
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from .config import ParamError
from .depth_batched import Bucket, Epochs, Following, occupancy
from .results import Calibration, Chunk, Result, Stats
from .session import (CALIBRATION_BUDGET_S, CALIBRATION_MAX_TOKENS, CALIBRATION_PROMPT, _stop_list, decode_params,
                      step_chunk)
from .guard import Guard, GuardedEngine
from .logprobs import TokenLogprob
from .scheduler import BatchEngine, BatchMetrics, Request
from .stops import StopMatcher

if TYPE_CHECKING:
    from .round_state import Step
    from .generate import Model


class RoundFailed(RuntimeError):
    """A generation ended because the batched round it was in failed (in any thread)."""


@dataclass(eq=False)
class BatchRun:
    """One request of a Batcher: its engine request and the text made so far."""

    request: Request
    stops: list[str]
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    matcher: StopMatcher | None = None
    finish_reason: str | None = None      # set with the last chunk
    # a public ``Batcher.step`` handed some of its chunks to the caller, so a drive
    # (``results``, ``stream``) would collect only the rest: it refuses the run instead
    stepped: bool = False
    # chunks a step in another thread's ``Batcher._drive`` made for this run, which that
    # thread does not own: this run's own drive reads them
    inbox: deque = field(default_factory=deque)
    # its last chunk was handed out by a drive: a second drive would collect nothing
    drained: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def error(self) -> BaseException | None:
        """Why the run failed alone (its last chunk's finish_reason is "error"), else None."""
        return self.request.error

    @property
    def stats(self) -> Stats:
        r = self.request
        return Stats.from_run(r.stats, r.params.spec == "mtp")

    @property
    def queue_seconds(self) -> float | None:
        """From submit to the start of its prefill."""
        r = self.request
        return None if r.t_admit is None else r.t_admit - r.t_submit

    @property
    def ttft_seconds(self) -> float | None:
        """From submit to its first token."""
        r = self.request
        return None if r.t_first is None else r.t_first - r.t_submit


class Batcher(GuardedEngine):
    """Up to ``slots`` generations decoded at once, in one target and one MTP context.

    Every round decodes the verify rows of all running requests in one target decode;
    waiting requests start as soon as a slot frees, their prompts prefilled a chunk per
    round (``prefill_chunk`` tokens at most; None: what the batch has room for). One
    thread steps it at a time; ``submit`` and ``cancel`` may come from others. With
    ``follow`` (another batcher of the model, stepped beside it), its draft_max="auto"
    requests draft the depth that one's search picks.
    """

    def __init__(self, model: "Model", slots: int, *, prefill_chunk: int | None = None,
                 follow: "Batcher | None" = None, owned: bool = False) -> None:
        o = model.options
        self._bind(model, owned=owned)
        # engines side by side draft one depth, the one ``follow``'s search picks (depth_batched.Following)
        leader = follow.engine.rounds.epochs if follow is not None else None
        leader = leader.leader if isinstance(leader, Following) else leader     # one leader for all
        self.engine = BatchEngine(model._native, slots=slots, n_ctx=o.n_ctx, n_batch=o.n_batch,
                                  threads=o.threads, draft_limit=model.draft_limit, spec=model.has_mtp,
                                  draft_kv=model.draft_kv, row_by_row=model.row_by_row,
                                  flash_attn=model.flash_attn, prefill_chunk=prefill_chunk,
                                  sampling=model.sampling, cache_budget=model.cache_budget,
                                  checkpoint_every=o.checkpoint_every, draft=model._draft,
                                  follow=leader if isinstance(leader, Epochs) else None)
        self.slots = slots
        self.follows = follow
        self._runs: dict[Request, BatchRun] = {}
        self._step_lock = threading.Lock()
        # a step and the handing out of its chunks (_drive); reentrant: a suspended drive the
        # garbage collector finalizes inside one in this thread must not wait on itself
        self._drive_lock = threading.RLock()
        self._guard = Guard("this batcher is closed; make a new one with model.batcher()")

    @property
    def metrics(self) -> BatchMetrics:
        return self.engine.metrics

    # -- requests
    def submit(self, prompt: str | Sequence[int], *, stop: str | Sequence[str] | None = None,
               arrived: float | None = None, **params) -> BatchRun:
        """Queue a generation; the keywords are ``Session.stream``'s and are checked here.
        ``arrived``: when the request came (perf_counter), where it waited before this."""
        self.model._guard.check()
        self._guard.check()
        decode = decode_params(self.model, params)
        stops = _stop_list(stop)
        ids = self.model.prompt_ids(prompt)
        run = BatchRun(self.engine.request(ids, decode), stops)
        run.matcher = StopMatcher(stops)
        self._runs[run.request] = run      # before a step in another thread can see it
        self.engine.enqueue(run.request, arrived)
        return run

    def cancel(self, run: BatchRun) -> None:
        """End a request at the next round; its slot is free for the next one at once."""
        self.engine.cancel(run.request)

    def _free(self) -> None:
        """The contexts, then the runs still going or waiting: they end "cancelled", as a
        cancelled run does (their ``done`` stayed False, and a loop waiting on it, forever),
        each with its last chunk saying so (a stream ended without one, as if whole). A
        drive (``results``, a stream) that reads that chunk raises ``ClosedError``, in
        whichever thread: the one whose step met the close raised it, and the others
        returned results cut short as if whole."""
        super()._free()
        for req, run in list(self._runs.items()):
            req.done, req.finish = True, "cancelled"
            run.finish_reason = "cancelled"
            run.inbox.append(Chunk("", [], "cancelled"))
        self._runs.clear()

    def reusable(self, prompt: Sequence[int]) -> int:
        """The most of ``prompt``'s tokens the prompt cache of a free seq id of this
        batcher could skip (0 without a cache or a free id), a conversation it shelved
        included: where a server with several engines sends it. A busy id's rows are its
        request's until it ends, and the engine would place the prompt on a free one. Safe
        from any thread (the cache's reads take its budget's lock)."""
        cache = self.engine.cache
        free = self.engine.free_ids()
        if cache is None or not free:
            return 0
        shelved = cache.shelved_for(prompt, False, False)
        return max([cache.view(seq, prompt, None).reusable for seq in free] + [shelved[1] if shelved else 0])

    @property
    def busy(self) -> bool:
        """Requests are running or waiting (none once closed: they ended "cancelled")."""
        return not self._guard.closed and not self.engine.idle()

    def catch_up_idle(self, most: int | None = None) -> int:
        """Work for a moment with no request: the drafter catches up on what the last
        requests left for their next turn (BatchEngine.catch_up_idle), ``most`` rows at a
        time. Rows decoded; 0 once nothing is left."""
        with self._step_lock, self._open():
            return self.engine.catch_up_idle(most)

    def step(self, hand_on: Callable[[list[tuple[BatchRun, Chunk]]], None] | None = None,
             ) -> list[tuple[BatchRun, Chunk]]:
        """One round: the chunk of text each request made in it (its last has finish_reason).
        A request that failed alone (its start, in this thread) gets one empty chunk with
        finish_reason "error"; ``run.error`` says why. An error of the round itself raises,
        once the requests in the round have ended (``_fail``).

        With ``hand_on``, the landed chunks go to it before the next round is launched
        where launching decodes that round (a CPU: BatchEngine.overlapped), instead of
        waiting for it; the rest are returned."""
        def handing(chunks: list[tuple[BatchRun, Chunk]]) -> None:
            _mark_stepped(chunks)
            hand_on(chunks)

        with self._step_lock:
            made = self._step_locked(None if hand_on is None else handing)
        _mark_stepped(made)
        return made

    def _step_locked(self, hand_on: Callable[[list[tuple[BatchRun, Chunk]]], None] | None,
                     ) -> list[tuple[BatchRun, Chunk]]:
        with self._open():
            made: list[tuple[BatchRun, Chunk]] = []      # filled as they are made: an error keeps them
            try:
                self._chunks(self.engine.land(), made)
                if hand_on is not None and made and not self.engine.overlapped:
                    handed, made = made, []
                    hand_on(handed)
                # after the stop strings had their say: a request they ended is not launched
                self._chunks(self.engine.launch(), made)
                return made
            except BaseException as exc:
                if hand_on is not None and made:      # the server's queues: a finished request keeps its last chunk
                    handed, made = made, []
                    with contextlib.suppress(Exception):
                        hand_on(handed)
                self._fail(exc, made)
                raise

    def fail_all(self, exc: BaseException) -> None:
        """After an error in ``step`` (the server's worker): the waiting requests end too."""
        self._fail(exc, [], waiting=True)

    def _fail(self, exc: BaseException, made: list[tuple[BatchRun, Chunk]], waiting: bool = False) -> None:
        """An error (Ctrl-C, say) stopped a round part way: the requests in it end with
        finish_reason "error" and their ids are dropped (BatchEngine.fail_active), and with
        ``waiting`` the queued ones too. The chunks the step had ``made`` go to their runs'
        inboxes first (a request that finished in the round keeps its last one); then
        each ended run gets an empty last chunk and an error saying why, so a thread
        driving its own requests on this batcher raises that instead of waiting for them."""
        for run, chunk in made:
            run.inbox.append(chunk)
        if waiting:
            self.engine.fail_all()
        else:
            self.engine.fail_active()
        for req, run in list(self._runs.items()):
            if not req.done:       # waiting: a later step starts it
                continue
            if not run.done:       # ended by now: in the round, or its start raised
                if req.error is None:
                    req.error = RoundFailed(f"the batched round this generation was in stopped: {exc!r}")
                    req.error.__cause__ = exc
                run.finish_reason = "error"
            del self._runs[req]    # after: a drive that finds it gone reads it done, not another's
            run.inbox.append(Chunk("", [], "error"))

    def calibrate(self, prompt: str | Sequence[int] | None = None, *,
                  budget_s: float = CALIBRATION_BUDGET_S, **params) -> Calibration:
        """Run batched auto's search (depth_batched.Epochs) for a full batch now: ``slots`` copies
        of ``prompt`` (CALIBRATION_PROMPT by default) decoded together with
        draft_max="auto", until the full batch's bucket has no depth left to search or
        ``budget_s`` is spent, instead of on the first requests that fill the batch.
        Engines side by side calibrate together (``calibrate_engines``); one that
        follows another's depths has no search of its own to run.

        Why: the search probes every depth for PROBE rounds, and under load on the H100
        (small model, 16 clients, 8 slots) those probes were 320 of the first pass's 3,379
        sequence-rounds, which then ran at 0.85x of the plain server. The keywords are
        ``submit``'s; max_tokens, ignore_eos and cache_prompt default to
        CALIBRATION_MAX_TOKENS, True and False. The prices come from that prompt (see
        ``Session.calibrate``); the requests after it correct them as they run: their
        first measure of a depth replaces the calibration's, and where nothing had drafted
        before, the full batch's next pick drafts at the limit for PROBE rounds, whose
        acceptance replaces the prompt's (``Epochs.calibrated``). Whether it
        pays depends on the load: under load on the H100 it raised auto on the small model
        and lowered it on the demo model (benchmarks/README.md, session 30). Returns
        the depths measured, the seconds it took and the bucket's estimated tokens a
        second per depth."""
        epochs = self._calibration_epochs(budget_s)
        if isinstance(epochs, Following):
            raise ValueError("this batcher drafts the depths of the batcher it follows, whose search "
                             "it runs with: calibrate that one, or both with calibrate_engines()")
        # alone: its followers, idle, add no sequence to its rounds (Epochs.sharing)
        bucket, texts = (occupancy(self.slots), False), prompt is None and not epochs.drafted()
        calibration = self._search(prompt, budget_s, bucket, None, params)
        epochs.calibrated(bucket, texts)
        return calibration

    def _calibration_epochs(self, budget_s: float) -> "Epochs | Following":
        if not (isinstance(budget_s, numbers.Real) and budget_s >= 0):
            raise ParamError("budget_s", f"budget_s must be a number of seconds >= 0, got {budget_s!r}")
        epochs = self.engine.rounds.epochs
        if epochs is None:
            raise ParamError("spec", f"{self.model.path.name} has no MTP block, so draft_max='auto' has "
                             "nothing to calibrate")
        return epochs

    def _search(self, prompt: str | Sequence[int] | None, budget_s: float, bucket: Bucket,
                stop: threading.Event | None, params: dict) -> Calibration:
        """``calibrate``'s runs until ``bucket`` has no depth left to search (in this
        batcher's epochs, or the ones it follows), ``budget_s`` is spent or ``stop`` is set."""
        epochs = self.engine.rounds.epochs
        params = {"max_tokens": CALIBRATION_MAX_TOKENS, "ignore_eos": True, "cache_prompt": False,
                  **params, "spec": "mtp", "draft_max": "auto"}
        text = CALIBRATION_PROMPT if prompt is None else prompt
        t0 = time.perf_counter()

        def done() -> bool:
            return (time.perf_counter() - t0 >= budget_s or (stop is not None and stop.is_set())
                    or bucket in epochs.arms and epochs.arms[bucket].untried() is None)

        while not done():
            ran = False
            with contextlib.closing(self.stream([text] * self.slots, **params)) as chunks:
                for _ in chunks:
                    ran = True
                    if done():
                        break
            if not ran:
                break
        estimates = {k: round(rate, 1) for b, k, _, rate in epochs.estimates() if b == bucket}
        return Calibration(sorted(estimates), time.perf_counter() - t0, estimates)

    def _chunks(self, steps: list[tuple[Request, "Step"]], out: list[tuple[BatchRun, Chunk]]) -> None:
        """The chunks of the runs still going, onto ``out``; a run a stop string ends is cancelled."""
        for req, step in steps:
            run = self._runs.get(req)
            if run is None or run.done:
                continue
            chunk = self._chunk(run, step)
            if chunk is not None:
                out.append((run, chunk))
            if run.done:
                self._runs.pop(req, None)
                if not req.done:       # a stop string ended it before the engine did
                    self.engine.cancel(req)

    def _chunk(self, run: BatchRun, step: "Step") -> Chunk | None:
        """The text of one Step, cut at a stop string as Session.stream cuts it."""
        if step.finish == "error":      # its start failed (run.request.error says why)
            run.finish_reason = "error"
            return Chunk("", [], "error")
        pieces = [self.model._native.token_to_bytes(t) for t in step.tokens]
        chunk, past = step_chunk(run.decoder, run.matcher, step, pieces)
        if past:
            run.request.stats.stopped_inside(step, past)
        if chunk is not None:
            chunk.cached_tokens = run.request.stats.cached_tokens
            if chunk.finish_reason:
                run.finish_reason = chunk.finish_reason
        return chunk

    # -- whole lists of prompts
    def submit_all(self, prompts: Sequence[str | Sequence[int]], *, stop: str | Sequence[str] | None = None,
                   first_index: int = 0, **params) -> list[BatchRun]:
        """``submit`` every prompt, or none: a prompt refused (too long, say) cancels the
        ones queued before it, which would otherwise run for no one, and is named by its
        index (``first_index`` is the first prompt's in the caller's list)."""
        runs: list[BatchRun] = []
        try:
            for i, p in enumerate(prompts):
                try:
                    runs.append(self.submit(p, stop=stop, **params))
                except ParamError as exc:
                    if exc.param != "prompt":
                        raise
                    raise ParamError(f"prompts[{first_index + i}]", f"prompts[{first_index + i}]: {exc}",
                                     exc.code, exc.details) from None
        except BaseException:
            for run in runs:
                self.cancel(run)
            raise
        return runs

    def stream(self, prompts: Sequence[str | Sequence[int]], *, stop: str | Sequence[str] | None = None,
               **params) -> Iterator[tuple[int, Chunk]]:
        """Yield (index of the prompt, chunk) as rounds are accepted, all prompts decoded
        together; each prompt's chunks are what ``Session.stream`` yields for it alone."""
        return BatchStream(self, self.submit_all(prompts, stop=stop, **params))

    def generate(self, prompts: Sequence[str | Sequence[int]], *, stop: str | Sequence[str] | None = None,
                 **params) -> list[Result]:
        """Run every prompt to completion, together; see ``stream`` for the keywords."""
        return self.results(self.submit_all(prompts, stop=stop, **params))

    def results(self, runs: list[BatchRun]) -> list[Result]:
        """Step until ``runs`` (submitted here) are done; their Results, in order."""
        # a run that ended before this drive (its batcher closed: "cancelled") keeps its reason
        parts = [dict(text=[], tokens=[], finish=run.finish_reason or "length", logprobs=None, prompt_logprobs=None)
                 for run in runs]
        for i, chunk in self._drive(runs):
            _collect(parts[i], chunk)
        return [Result("".join(p["text"]), p["tokens"], run.stats, p["finish"], prompt_tokens=list(run.request.prompt),
                       logprobs=p["logprobs"], prompt_logprobs=p["prompt_logprobs"])
                for p, run in zip(parts, runs)]

    def _drive(self, runs: list[BatchRun]) -> Iterator[tuple[int, Chunk]]:
        """Step until ``runs`` are done; a consumer that stops early cancels the rest.

        Threads may drive lists of their own on one batcher at once (``generate_batch``
        from two threads): every chunk a step makes goes to its run's inbox, and each
        drive reads its own runs' inboxes, so a step in one thread hands the other
        thread's chunks on instead of dropping them."""
        index = {run: i for i, run in enumerate(runs)}
        for run, i in index.items():      # another's run would never be stepped here: a wait forever
            if not run.done and self._runs.get(run.request) is not run:
                raise ParamError("runs", f"runs[{i}] was submitted to another batcher; pass it to that "
                                 "batcher's results() or stream")
            if run.stepped:
                raise ParamError("runs", f"runs[{i}]'s chunks were handed out by step() already, so its text "
                                 "here would lack them: collect it from those chunks, or drive a run either "
                                 "with step() or with results()/stream, not both")
            if run.drained:
                raise ParamError("runs", f"runs[{i}] was collected already (its chunks, its last one included, "
                                 "were handed out): keep the Result or chunks that drive gave")
        try:
            while True:
                with self._drive_lock:       # one block: a chunk handed on between two would come late
                    finished = all(r.done for r in runs)    # read before the inboxes: a done run's last chunk is in
                    if not finished:
                        with self._step_lock:
                            made = self._step_locked(None)
                        for run, chunk in made:
                            run.inbox.append(chunk)
                    got = [(run, run.inbox.popleft()) for run in runs for _ in range(len(run.inbox))]
                for run, chunk in got:
                    if run.error is not None:
                        raise run.error
                    # ended by a close? This thread hears it as the stepping one did (ClosedError)
                    if chunk.finish_reason == "cancelled":
                        self.model._guard.check()
                        self._guard.check()
                    run.drained = run.drained or chunk.finish_reason is not None
                    yield index[run], chunk
                if finished:
                    break
        finally:
            for run in runs:
                if not run.done:
                    self.cancel(run)
            if any(not r.request.done for r in runs):
                self._free_cancelled()

    def _free_cancelled(self) -> None:
        """Step once so that cancelled requests give their slots back now, unless another
        drive or a step is under way: its next launch frees them. Not waiting matters:
        the garbage collector can close an abandoned stream's drive inside a step of this
        very thread, whose lock a wait would never get (or inside the server's step, while
        a drive in another thread waits for that step's lock with the drive lock held)."""
        if not self._drive_lock.acquire(blocking=False):
            return
        try:
            if not self._step_lock.acquire(blocking=False):
                return
            try:
                made = self._step_locked(None)
            except Exception:
                return
            finally:
                self._step_lock.release()
            for run, chunk in made:      # under the drive lock: a drive reads a done run's last chunk
                run.inbox.append(chunk)
        finally:
            self._drive_lock.release()


class BatchStream:
    """``Batcher.stream``'s iterator. Closed or dropped before its first chunk, it cancels
    its requests too: they were queued at the call, and a generator that never started
    runs no ``finally`` (they decoded for no one, slowing the next batch)."""

    def __init__(self, batcher: Batcher, runs: list[BatchRun]) -> None:
        self._batcher, self._runs = batcher, runs
        self._chunks = batcher._drive(runs)

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> tuple[int, Chunk]:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()        # a started drive cancels what is left and frees the slots
        for run in self._runs:
            if not run.done:
                self._batcher.cancel(run)

    def __del__(self) -> None:
        self.close()


def calibrate_engines(batchers: list[Batcher], prompt: str | Sequence[int] | None = None, *,
                      budget_s: float = CALIBRATION_BUDGET_S, **params) -> Calibration:
    """Calibrate batchers side by side (the first, and the ones that follow its depths) at
    once, each in a thread: the search then prices the depths as the engines will run
    them, every slot decoding. The first's result is returned; a failure in one thread
    stops the others and is raised here."""
    epochs = [b._calibration_epochs(budget_s) for b in batchers]
    lead = epochs[0]
    if isinstance(lead, Following) or any(not isinstance(e, Following) or e.leader is not lead
                                          for e in epochs[1:]):
        raise ValueError("calibrate_engines needs the batcher whose search runs first, then only "
                         "batchers made to follow it (model.batcher(n, follow=first))")
    bucket = (occupancy(sum(b.slots for b in batchers)), False)
    texts = prompt is None and not lead.drafted()
    stop = threading.Event()
    results: list[Calibration | BaseException | None] = [None] * len(batchers)

    def one(i: int) -> None:
        try:
            results[i] = batchers[i]._search(prompt, budget_s, bucket, stop, params)
        except BaseException as exc:       # re-raised below, in the caller's thread
            results[i] = exc
            stop.set()

    threads = [threading.Thread(target=one, args=(i,), name=f"pymtp-calibrate-{i}") for i in range(len(batchers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    lead.calibrated(bucket, texts)
    return results[0]


def engine_sizes(slots: int, engines: int) -> list[int]:
    """The slots of each of ``engines`` batched engines sharing ``slots`` (the first take
    what does not divide evenly)."""
    if not 1 <= engines <= slots:
        raise ValueError(f"engines must be between 1 and the slots ({slots}), got {engines}: "
                         "each engine decodes at least one slot")
    return [slots // engines + (i < slots % engines) for i in range(engines)]


def _mark_stepped(chunks: list[tuple[BatchRun, Chunk]]) -> None:
    for run, _ in chunks:
        run.stepped = True


def _collect(part: dict, chunk: Chunk) -> None:
    part["text"].append(chunk.text)
    part["tokens"].extend(chunk.tokens)
    if chunk.logprobs is not None:
        part["logprobs"] = (part["logprobs"] or []) + chunk.logprobs
    part["prompt_logprobs"] = part["prompt_logprobs"] or chunk.prompt_logprobs
    if chunk.finish_reason:
        part["finish"] = chunk.finish_reason


__all__ = ["BatchRun", "Batcher", "RoundFailed", "TokenLogprob", "engine_sizes"]
