"""Use-after-close protection for objects that own llama.cpp handles.

A llama.cpp call on a freed model or context does not raise: it aborts or segfaults the
whole process. So every native call of a Model or Session runs inside ``Guard.use()``,
which raises ``ClosedError`` once the object is closed, and ``Guard.close()`` frees once
the calls under way have returned. A generation running in another thread therefore
stops at its next round with ``ClosedError``; so does one in the thread that closes it
from a signal handler, where waiting would never end: the free runs as its call returns.
"""

from __future__ import annotations

import sys
import threading
import weakref
from threading import get_ident

_PRUNE_EVERY_S = 0.1    # close()'s look for calls an interrupt left kept, while it waits


class LlamaCppMissing(ImportError):
    """llama-cpp-python cannot be imported: the commands say so in one line (it is raised
    on first use of the native layer, so ``--help`` and ``--version`` work without it)."""


class ClosedError(RuntimeError):
    """The model or session was closed; its native handles are gone."""


class Guard:
    """Keeps the native calls in flight and refuses new ones after ``close()``.

    ``with guard.use():`` wraps each call. It is a plain context manager, not a generator
    one: a plain decode round enters two of them per token, and right after a CPU decode
    each Python frame it adds runs on cold caches. The lock is reentrant because a signal
    handler may close the guard while its thread is inside ``__enter__`` or ``__exit__``.

    Each call in flight is kept as the frame of its ``with`` statement, per thread. Ctrl-C
    raises KeyboardInterrupt wherever the main thread is; landing inside ``__enter__``
    or ``__exit__`` (about 1 interrupt in 75) it leaves a call kept that has ended, and
    no count could tell it from one in flight. Its frame can: it is no longer on its
    thread's stack. ``close()`` drops such calls (``_prune``) instead of waiting for them.
    This needs what the round already keeps: no guarded block spans a ``yield``."""

    def __init__(self, message: str) -> None:
        self.message = message          # what ClosedError says: what is closed, what to do
        self.closed = False
        self._calls: dict[int, list] = {}   # thread id -> frames of its calls in flight, outermost first
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)     # close() waits on it
        self._then = None               # close()'s free, until it runs
        self._exits_free = False        # the last call's exit runs it: close() was inside a call

    def use(self) -> Guard:
        return self

    @property
    def in_flight(self) -> int:
        """Calls in flight, all threads."""
        return sum(map(len, list(self._calls.values())))

    def __enter__(self) -> None:
        self._enter(sys._getframe(1))

    def _enter(self, frame) -> None:
        with self._lock:
            if not self.closed:
                self._calls.setdefault(get_ident(), []).append(frame)
                return
        raise ClosedError(self.message)

    def __exit__(self, *exc) -> None:
        with self._lock:
            me = get_ident()
            frames = self._calls[me]
            frames.pop()
            if not frames:
                del self._calls[me]
                if self.closed:
                    self._prune()           # another thread's call an interrupt left kept
                    if not self._calls:
                        self._idle.notify_all()
                        if self._exits_free:
                            self._free_now()

    def _free_now(self) -> None:
        """Run close()'s free, then forget it; under the lock, so once at a time. An
        interrupt before the forgetting leaves it to the next close() again: the frees
        it runs are idempotent (llama.cpp handles are freed once, then None)."""
        if self._then is not None:
            self._then()
            self._then = None

    def _prune(self) -> None:
        """Drop the calls an interrupt left kept after they ended: their frames are off
        their threads' stacks (a thread that ended has none). Under the lock."""
        stacks = sys._current_frames()
        for thread in list(self._calls):
            on_stack, frame = set(), stacks.get(thread)
            while frame is not None:
                on_stack.add(id(frame))
                frame = frame.f_back
            live = [f for f in self._calls[thread] if id(f) in on_stack]
            if live:
                self._calls[thread] = live
            else:
                del self._calls[thread]

    def check(self) -> None:
        if self.closed:
            raise ClosedError(self.message)

    def close(self, then=None) -> bool:
        """Refuse new calls, then ``then()`` once those in flight have returned; False if
        it was already closed. Called inside a call of this thread (a signal handler), it
        cannot wait: the call's exit runs ``then``.

        ``then`` is kept from the start: an interrupt that cuts this close short, or the
        exit that was to run it, leaves it to the next close(), which runs it once
        nothing is in flight. A second close() from another thread waits for it too: a
        caller that frees what the handles used must not run before the free has."""
        with self._lock:
            first = not self.closed
            if first:
                self.closed, self._then = True, then
            self._prune()
            if get_ident() in self._calls:
                self._exits_free = self._exits_free or first
                return first
            # a call kept after this prune can still end without its exit (an interrupt)
            while not self._idle.wait_for(lambda: not self._calls, timeout=_PRUNE_EVERY_S):
                self._prune()
            self._free_now()
        return first


class _Both:
    """The model's guard, then the engine's, as one context manager (GuardedEngine._open)."""

    __slots__ = ("outer", "inner")

    def __init__(self, outer: Guard, inner: Guard) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        frame = sys._getframe(1)        # the with statement's: both calls end with it
        self.outer._enter(frame)
        try:
            self.inner._enter(frame)
        except BaseException:
            self.outer.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.outer.__exit__(*exc)


class GuardedEngine:
    """Base of Session and Batcher: an engine's contexts on a model, each with its Guard.

    Subclasses call ``_bind`` and set ``engine`` and ``_guard``; every native call runs
    inside ``_open()``, so it needs the model and this object both open.
    """

    engine: "object"
    _guard: Guard
    _model: "object"

    def _bind(self, model, *, owned: bool) -> None:
        """``owned``: the model keeps this engine (its default session, generate_batch's
        batchers) and this engine holds it weakly. Strong both ways, a dropped Model was a
        cycle that only a garbage collection freed: its llama.cpp memory stayed (2.3 GB
        after 30 loads of a small model), then went in any order, the model before its
        contexts. A stream from an owned engine holds the model itself (Model.stream)."""
        self._model = weakref.ref(model) if owned else (lambda: model)

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise ClosedError("this engine's model was deleted; load it again with pymtp.load()")
        return model

    def close(self) -> None:
        """Free the contexts, after the round under way, if any; the model holds this
        engine (to close it with itself) until then."""
        self._guard.close(self._free)

    def _free(self) -> None:
        self.engine.close()
        model = self._model()
        if model is not None:
            model._forget(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self) -> _Both:
        """Both guards, the model's first: its ClosedError names what was closed."""
        return _Both(self.model._guard, self._guard)
