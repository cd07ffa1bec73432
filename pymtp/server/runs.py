"""Starting and collecting a request's generations (its choices, or llama-server's several
prompts), watching the client while they run: the plumbing every generating route shares,
whatever shape its answer takes (app.py's OpenAI objects, llama_completion.py's).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..results import Chunk
from ..sampling_filters import NothingToDraw
from .errors import APIError, invalid
from .metrics import Metrics
from .schemas import GenerationRequest
from .service import Run, Service
from .sse import event

log = logging.getLogger("pymtp.server")


async def started(service: Service, request: Request, reqs: list[GenerationRequest]) -> list[Run] | None:
    """Every generation of ``reqs`` started (each past its first chunk), or None when the
    client left first. Nothing reads from the client while its request waits for a slot,
    so nothing would notice that it left: watch for that, or an abandoned request keeps
    its queue place (pushing live clients to 503) and later generates for nobody."""
    starting = asyncio.ensure_future(_start_all(service, reqs))
    watcher = asyncio.create_task(on_disconnect(request, starting.cancel))
    try:
        return await starting
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling() or not watcher.done():
            raise                     # we were cancelled, not the client gone
        return None
    finally:
        watcher.cancel()


async def in_turns(service: Service, request: Request, reqs: list[GenerationRequest],
                   answer: Callable[[int, list[GenerationRequest], list[Run]], Awaitable[list]]) -> list | None:
    """A whole answer's generations (several prompts, n choices) in turns of at most the
    slots, as llama-server answers a list of prompts longer than its slots by queueing
    them: each turn started, then ``answer(index of its first, its requests, its runs)``
    collects it; the answers of all, or None when the client left. Each generation's
    seed was fixed before (schemas.choices_of), so a turn's texts are what they would be
    side by side. A prompt too long for a later turn is refused before the first runs."""
    slots = service.pool.size
    await service.check_prompts(reqs[slots:])       # the first turn's: at its start
    out: list = []
    for first in range(0, len(reqs), slots):
        part = reqs[first:first + slots]
        runs = await started(service, request, part)
        if runs is None:
            return None
        out += await answer(first, part, runs)
    return out


async def first_turn(service: Service, request: Request, reqs: list[GenerationRequest]) -> list[Run] | None:
    """A stream's first turn of generations started (at most the slots), before the
    response's first byte so that its refusals are HTTP statuses, the later turns'
    prompts checked first (as ``in_turns``); None when the client left."""
    slots = service.pool.size
    await service.check_prompts(reqs[slots:])
    return await started(service, request, reqs[:slots])


async def stream_turns(service: Service, reqs: list[GenerationRequest], first: list[Run],
                       live: list[Run]) -> AsyncIterator[tuple[int, list[Run]]]:
    """A stream's generations in turns of the slots, as llama-server queues more than
    it has slots for: (index of the turn's first, its runs), ``first`` (``first_turn``'s)
    and then each next turn, started when asked for, once the consumer has streamed the
    one before to its end. ``live`` holds the turn's runs, for the response's canceller."""
    size, runs = len(first), first
    for start in range(0, len(reqs), size):
        if start:
            runs = await _start_all(service, reqs[start:start + size])
        live[:] = runs
        yield start, runs


def canceller(runs: list[Run]) -> Callable[[], None]:
    """Ends every run: a no-op after a normal end; stops the worker if we failed or the
    client went away."""
    def cancel() -> None:
        for run in runs:
            run.gen.cancel()
    return cancel


async def collected(request: Request, runs: list[Run],
                    chunks_of: Callable[[int, Run], AsyncIterator[Chunk]] | None = None) -> list[list[Chunk]]:
    """Each run's chunks, whole (``chunks_of(i, run)``'s where given: a route that may end
    a run's text early); the runs end early if the client goes away, which raises
    ``ClientDisconnect`` (a 499: their cut text was answered as a whole one, a 200)."""
    cancel = canceller(runs)
    watcher = asyncio.create_task(on_disconnect(request, cancel))

    async def one(i: int, run: Run) -> list[Chunk]:
        try:
            return await _collect(run) if chunks_of is None else [c async for c in chunks_of(i, run)]
        except NothingToDraw as exc:       # the request's own doing, however far it got: a 400, as at its start
            raise invalid(str(exc), code="invalid_value") from exc
    try:
        out = list(await asyncio.gather(*(one(i, run) for i, run in enumerate(runs))))
        if watcher.done():
            raise ClientDisconnect()
        return out
    finally:
        watcher.cancel()
        cancel()


async def _start_all(service: Service, reqs: list[GenerationRequest]) -> list[Run]:
    """Start every generation (each waits for a slot of its own, as separate requests
    would); a refusal of any, or a cancel, ends those already started."""
    if len(reqs) == 1:
        return [await service.start(reqs[0])]
    tasks = [asyncio.ensure_future(service.start(r)) for r in reqs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    except BaseException:
        # no await here: a second cancel (the client gone too) must not skip a run
        for t in tasks:
            t.cancel()      # a start still waiting ends its generation itself (Service.start)
            t.add_done_callback(_end_started)       # one that had started is ended here
        raise


def _end_started(task: asyncio.Future) -> None:
    """The generation of a choice that started before another was refused: end it."""
    if not task.cancelled() and task.exception() is None:
        task.result().gen.cancel()


async def _collect(run: Run) -> list[Chunk]:
    chunks = [run.first] if run.first is not None else []
    async for chunk in run.gen:    # ends once the slot is free and the stats are in
        chunks.append(chunk)
    return chunks


async def merged(streams: list) -> AsyncIterator[dict]:
    """The objects of several async generators as each makes them; the first error ends
    them all and is raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream) -> None:
        try:
            async for obj in stream:
                await queue.put(obj)
            await queue.put(done)
        except BaseException as exc:       # handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def on_disconnect(request: Request, action: Callable[[], object]) -> None:
    """Call ``action`` once the client has gone (the request's body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            action()
            return


async def framed(objects: AsyncIterator[dict], metrics: Metrics, done: bytes = b"", *,
                 frame: Callable[[dict], bytes] = event,
                 failure: Callable[[APIError], dict | list[dict]] = APIError.body) -> AsyncIterator[bytes]:
    """``objects`` as SSE events (``frame`` writes one; OpenAI's ``data:`` frame by default),
    then ``done``. The status line is sent by then, so a failure is reported in-band and
    ends the stream (with ``done``): an APIError (a shutdown) or any other exception (a
    500 of its own) as the object, or objects, ``failure`` makes of it, in each API's
    error shape."""
    try:
        async for obj in objects:
            yield frame(obj)
    except Exception as exc:
        if isinstance(exc, NothingToDraw):      # the request's own doing, as ``collected`` answers it
            exc = invalid(str(exc), code="invalid_value")
        elif not isinstance(exc, APIError):
            log.exception("generation failed mid-stream")
            exc = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                           code="internal_error")
        metrics.count_error(exc.type)
        said = failure(exc)
        for obj in said if isinstance(said, list) else [said]:
            yield frame(obj)
    if done:
        yield done
