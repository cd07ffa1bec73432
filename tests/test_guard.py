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


def test_a_second_close_from_another_thread_returns_after_the_free():
    g = Guard("closed")
    entered, release, freed = threading.Event(), threading.Event(), []

    def call():
        with g.use():
            entered.set()
            release.wait(5)

    def free():
        time.sleep(0.05)
        freed.append("freed")

    caller = threading.Thread(target=call)
    caller.start()
    entered.wait(5)
    first = threading.Thread(target=g.close, args=(free,))
    first.start()
    while not g.closed:
        time.sleep(0.001)
    threading.Timer(0.1, release.set).start()
    assert g.close() is False
    assert freed == ["freed"]          # not []: it returned while the call was in flight
    first.join(5)
    caller.join(5)
    assert freed == ["freed"]


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
    assert pair.model._guard.in_flight == 0
    assert pair.model._guard.close() is True     # nothing in flight: it returns at once


def test_the_model_guard_speaks_first_and_both_count_while_open():
    pair = _Pair()
    with pair._open():
        assert (pair.model._guard.in_flight, pair._guard.in_flight) == (1, 1)
    assert (pair.model._guard.in_flight, pair._guard.in_flight) == (0, 0)
    pair.model._guard.close()
    pair._guard.close()
    with pytest.raises(ClosedError, match="model closed"):
        with pair._open():
            pass


def test_close_inside_a_call_of_its_own_thread_frees_as_the_call_returns():
    """A signal handler runs inside the call of its thread: waiting there never ends, so
    the free runs at the call's exit, once, and calls after it are refused."""
    g = Guard("closed")
    freed = []
    with g.use():
        with g.use():                   # a nested call: the outer one still runs after it
            assert g.close(lambda: freed.append("free")) is True
            assert freed == []
        assert freed == []
    assert freed == ["free"]
    assert g.close(lambda: freed.append("again")) is False
    with pytest.raises(ClosedError, match="closed"):
        with g.use():
            pass
    assert freed == ["free"] and g.in_flight == 0


def test_a_deferred_free_waits_for_the_other_threads_calls_too():
    g = Guard("closed")
    freed, inside, leave = [], threading.Event(), threading.Event()

    def other():
        with g.use():
            inside.set()
            leave.wait(5)
            freed.append("other returned")

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    with g.use():
        g.close(lambda: freed.append("free"))
    assert freed == []                  # this thread's call returned; the other's still runs
    leave.set()
    t.join(5)
    assert freed == ["other returned", "free"]


def test_no_guarded_block_spans_a_yield():
    """close() tells a call in flight from one an interrupt left kept by its frame being
    on its thread's stack (Guard._prune); a generator suspended inside a guarded block is
    on none, so such a block would be freed under. Every with statement that enters a
    guard (``.use()``, ``._open()``) is read here for a yield."""
    import ast
    from pathlib import Path

    import pymtp

    guarded = 0
    for path in Path(pymtp.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.With, ast.AsyncWith)):
                continue
            if not any(isinstance(item.context_expr, ast.Call) and isinstance(item.context_expr.func, ast.Attribute)
                       and item.context_expr.func.attr in ("use", "_open") for item in node.items):
                continue
            guarded += 1
            inner = [n for stmt in node.body for n in ast.walk(stmt)
                     if isinstance(n, (ast.Yield, ast.YieldFrom, ast.Await))]
            assert not inner, f"{path.name}:{node.lineno}: a guarded block yields (line {inner[0].lineno})"
    assert guarded >= 13        # the guarded with statements the package has when this was written


def test_a_free_left_for_an_interrupted_exit_runs_at_the_next_close():
    """A signal handler's close() inside a call leaves the free for that call's exit; if
    the handler then raises (Ctrl-C's KeyboardInterrupt, sys.exit) into that very exit,
    the exit never ran it. The next close() does. Each place Ctrl-C can land in
    guard.py is tried in turn (the first close too: it keeps its free from the start)."""
    import pymtp.guard
    from test_lifecycle import _interrupt_at

    for n in range(1, 1000):
        g, freed = Guard("closed"), []

        def free():
            freed.append("free")

        def call():
            with g.use():
                g.close(free)

        landed = _interrupt_at(n, pymtp.guard, call)
        g.close(free)         # the first close if the interrupt came before the handler's
        # twice only where the interrupt lands between the free and its forgetting
        # (Guard._free_now): the frees a model runs are idempotent
        assert freed in (["free"], ["free", "free"]), f"place {n}: freed {len(freed)} times"
        if not landed:
            break
    assert n > 10
