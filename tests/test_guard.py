"""Guard: a call in flight holds close() back, a closed guard refuses, and the pair of
guards a session enters (GuardedEngine._open) leaves neither counted when one refuses."""

from __future__ import annotations

import threading
import time

import pytest

from pymtp.guard import ClosedError, Guard, GuardedEngine


def test_close_waits_for_the_call_in_flight_then_refuses_new_ones():
    g = Guard("closed: make a new one")
    order: list[str] = []
    entered = threading.Event()

    def call():
        with g.use():
            entered.set()
            time.sleep(0.2)
            order.append("call returned")

    t = threading.Thread(target=call)
    t.start()
    entered.wait(5)
    assert g.close() is True
    order.append("close returned")
    t.join(5)
    assert order == ["call returned", "close returned"]
    with pytest.raises(ClosedError, match="closed: make a new one"):
        with g.use():
            pass
    assert g.close() is False


class _Pair(GuardedEngine):
    def __init__(self) -> None:
        model = type("M", (), {})()
        model._guard = Guard("model closed")
        self._bind(model, owned=False)
        self._guard = Guard("session closed")


def test_a_refused_inner_guard_leaves_the_outer_one_free():
    pair = _Pair()
    pair._guard.close()
    with pytest.raises(ClosedError, match="session closed"):
        with pair._open():
            pass
    assert pair.model._guard._active == 0
    assert pair.model._guard.close() is True     # nothing in flight: it returns at once


def test_the_model_guard_speaks_first_and_both_count_while_open():
    pair = _Pair()
    with pair._open():
        assert (pair.model._guard._active, pair._guard._active) == (1, 1)
    assert (pair.model._guard._active, pair._guard._active) == (0, 0)
    pair.model._guard.close()
    pair._guard.close()
    with pytest.raises(ClosedError, match="model closed"):
        with pair._open():
            pass
