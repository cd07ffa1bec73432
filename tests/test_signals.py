"""A signal whose handler runs inside llama.cpp's log callback (the only Python a long C
call runs) is put off to the end of that call, not dropped by ctypes (signals.py)."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from pymtp import native, signals


class Stop(BaseException):
    """What the test's handler raises (a BaseException, as KeyboardInterrupt and SystemExit are)."""


def test_a_handler_is_put_off_inside_a_callback_and_runs_after_it():
    seen = []

    def handler(signum, frame):
        seen.append(signum)
        raise Stop(signum)

    @signals.callback
    def called_from_c():
        signals.deferring(handler)(signal.SIGUSR1, sys._getframe())     # as if the signal landed here

    previous = signal.signal(signal.SIGUSR1, signals.deferring(handler))
    try:
        called_from_c()
        assert seen == [] and signals.pending()
        with pytest.raises(Stop):
            signals.raise_pending()
        assert seen == [signal.SIGUSR1] and not signals.pending()
        with pytest.raises(Stop):        # outside a callback it runs at once
            signals.deferring(handler)(signal.SIGUSR1, sys._getframe())
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_during_a_models_load_is_raised_when_the_load_returns(dense_path):
    """The handler ran in the log callback and what it raised was dropped: the load went on
    (Ctrl-C during `pymtp serve`'s load, then the server came up; a SIGTERM'd bench ran on)."""
    def handler(signum, frame):
        raise Stop(signum)

    native._init_backend(False)
    last = native._LOG_TAIL[-1] if native._LOG_TAIL else None

    def signal_once_it_logs() -> None:
        deadline = time.monotonic() + 30
        while (native._LOG_TAIL[-1] if native._LOG_TAIL else None) is last and time.monotonic() < deadline:
            time.sleep(0.0005)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, signals.deferring(handler))
    sender = threading.Thread(target=signal_once_it_logs)
    try:
        sender.start()
        with pytest.raises(Stop):
            model = native.NativeModel(str(dense_path), n_gpu_layers=0)
            model.close()        # loaded: the signal never came through
            sender.join()
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, previous)
    assert not signals.pending()
