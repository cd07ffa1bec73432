"""Use-after-close protection for objects that own llama.cpp handles.

A llama.cpp call on a freed model or context does not raise: it aborts or segfaults the
whole process. So every native call of a Model or Session runs inside ``Guard.use()``,
which raises ``ClosedError`` once the object is closed, and ``Guard.close()`` waits for
the calls under way to return before the caller frees anything. A generation running in
another thread therefore stops at its next round with ``ClosedError``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class ClosedError(RuntimeError):
    """The model or session was closed; its native handles are gone."""


class Guard:
    """Counts native calls in flight and refuses new ones after ``close()``."""

    def __init__(self, message: str) -> None:
        self.message = message          # what ClosedError says: what is closed, what to do
        self.closed = False
        self._active = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        with self._cond:
            if self.closed:
                raise ClosedError(self.message)
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    def check(self) -> None:
        if self.closed:
            raise ClosedError(self.message)

    def close(self) -> bool:
        """Refuse new calls and wait for those in flight; False if it was already closed."""
        with self._cond:
            if self.closed:
                return False
            self.closed = True
            self._cond.wait_for(lambda: self._active == 0)
            return True


class GuardedEngine:
    """Base of Session and Batcher: an engine's contexts on a model, each with its Guard.

    Subclasses set ``model``, ``engine`` and ``_guard``; every native call runs inside
    ``_open()``, so it needs the model and this object both open.
    """

    model: "object"
    engine: "object"
    _guard: Guard

    def close(self) -> None:
        """Free the contexts, after the round under way in another thread, if any."""
        if self._guard.close():
            self.engine.close()

    @contextlib.contextmanager
    def _open(self) -> Iterator[None]:
        with self.model._guard.use(), self._guard.use():
            yield
