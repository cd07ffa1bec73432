"""Signals that arrive while llama.cpp works in a long C call (a model's load, a decode).

Such a call runs no Python but llama.cpp's log callback, so a Ctrl-C or SIGTERM handler
runs at that callback's first line, and ctypes prints and drops what the handler raises:
the load went on, the server came up, a terminated bench ran on. A handler wrapped by
``deferring`` notes the signal there instead, and the main thread's next native call
raises it once the C call has returned (``raise_pending``). Needs no llama.cpp.
"""

from __future__ import annotations

import signal
import threading
from types import CodeType, FrameType
from typing import Any, Callable

_CALLBACKS: set[CodeType] = set()    # the Python functions C calls back into
_PENDING: list[int] = []             # signals noted inside one, oldest first


def callback(fn: Callable) -> Callable:
    """Mark ``fn`` as one llama.cpp calls from C (a handler defers while it runs)."""
    _CALLBACKS.add(fn.__code__)
    return fn


def in_callback(frame: FrameType | None) -> bool:
    """Whether ``frame`` (a handler's) is inside a C callback."""
    while frame is not None:
        if frame.f_code in _CALLBACKS:
            return True
        frame = frame.f_back
    return False


def deferring(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """``handler``, put off to the end of the C call when the signal lands in a callback."""
    def handle(signum: int, frame: FrameType | None) -> Any:
        if in_callback(frame):
            _PENDING.append(signum)
            return None
        return handler(signum, frame)

    return handle


def defer_interrupts() -> None:
    """Ctrl-C's default handler (KeyboardInterrupt), deferred out of callbacks; a handler
    the program set itself is left as it is. Main thread only (Python's rule)."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, deferring(signal.default_int_handler))


def raise_pending() -> None:
    """In the main thread, after a native call: run the handler of a signal a callback
    put off (it raises here, where Python can hear it)."""
    if pending():
        signum = _PENDING[0]
        _PENDING.clear()
        signal.raise_signal(signum)


def pending() -> bool:
    """A signal a callback put off waits (for the main thread)."""
    return bool(_PENDING) and threading.current_thread() is threading.main_thread()
