"""Use-after-close protection for objects that own llama.cpp handles.

A llama.cpp call on a freed model or context does not raise: it aborts or segfaults the
whole process. So every native call of a Model or Session runs inside ``Guard.use()``,
which raises ``ClosedError`` once the object is closed, and ``Guard.close()`` frees once
the calls under way have returned. A generation running in another thread therefore
stops at its next round with ``ClosedError``; so does one in the thread that closes it
from a signal handler, where waiting would never end: the free runs as its call returns.
"""

from __future__ import annotations

import threading
import weakref


class ClosedError(RuntimeError):
    """The model or session was closed; its native handles are gone."""


class _Depth(threading.local):
    depth = 0       # this thread's calls of one guard, from the start of enter to the end of exit


class Guard:
    """Counts native calls in flight and refuses new ones after ``close()``.

    ``with guard.use():`` wraps each call. It is a plain context manager, not a generator
    one: a plain decode round enters two of them per token, and right after a CPU decode
    each Python frame it adds runs on cold caches. The lock is reentrant because a signal
    handler may close the guard while its thread is inside ``__enter__`` or ``__exit__``."""

    def __init__(self, message: str) -> None:
        self.message = message          # what ClosedError says: what is closed, what to do
        self.closed = False
        self._active = 0                # calls inside the guarded block, all threads
        self._local = _Depth()
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)     # close() waits on it
        self._then = None               # the free, when close() could not wait for it

    def use(self) -> Guard:
        return self

    def __enter__(self) -> None:
        self._local.depth += 1
        with self._lock:
            if not self.closed:
                self._active += 1
                return
        self._leave()
        raise ClosedError(self.message)

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self.closed:
                self._idle.notify_all()
        self._leave()

    def _leave(self) -> None:
        """End of this thread's call: run a free that close() left for it, once idle."""
        try:
            if self._then is not None:
                with self._lock:
                    then = self._then if self._active == 0 else None
                    if then is not None:
                        self._then = None
                if then is not None:
                    then()
        finally:
            self._local.depth -= 1

    def check(self) -> None:
        if self.closed:
            raise ClosedError(self.message)

    def close(self, then=None) -> bool:
        """Refuse new calls, then ``then()`` once those in flight have returned; False if
        it was already closed. Called inside a call of this thread (a signal handler), it
        cannot wait: the call's exit runs ``then``."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            if self._active and self._local.depth:
                self._then = then
                return True
            self._idle.wait_for(lambda: self._active == 0)
        if then is not None:
            then()
        return True


class _Both:
    """The model's guard, then the engine's, as one context manager (GuardedEngine._open)."""

    __slots__ = ("outer", "inner")

    def __init__(self, outer: Guard, inner: Guard) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        try:
            self.inner.__enter__()
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
