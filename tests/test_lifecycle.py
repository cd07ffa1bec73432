"""Use after close and a second generation on a busy session: errors, never a dead process.

Each scenario runs in a child process: before the fix these aborted (SIGABRT), segfaulted
or deadlocked, which would take pytest down with them.
"""

from __future__ import annotations

import contextlib
import dis
import subprocess
import sys
import textwrap
import threading
import types

import pytest

MODEL_CLOSED = "ClosedError: this model is closed; load it again with pymtp.load()"
SESSION_CLOSED = "ClosedError: this session is closed; make a new one with model.session()"
BUSY = ("SessionBusyError: a stream on this session is still open in this thread, and a second "
        "generation would wait for it forever; finish the first stream or call its .close(), or run "
        "the second one on another session (model.session())")

PRELUDE = """
import sys, threading
import pymtp
m = pymtp.load(sys.argv[1], threads=1, n_ctx=512)

def report(fn):
    try:
        fn()
        print("no error")
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
"""


def run_script(body: str, model_path) -> list[str]:
    """Run PRELUDE + body in a child; return its stdout lines (it must exit 0)."""
    code = PRELUDE + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True, text=True,
                       timeout=60)   # a deadlock fails here instead of hanging the suite
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stderr}"
    return p.stdout.splitlines()


@pytest.mark.parametrize("call", [
    'm.generate("x", max_tokens=2)',
    'list(m.stream("x", max_tokens=2))',
    'm.tokenize("hello")',
    'm.detokenize([1, 2])',
    'm.is_eog(1)',
    'm.session()',
])
def test_model_used_after_close_raises(dense_path, call):
    out = run_script(f"""
        m.close()
        m.close()          # closing twice is fine
        report(lambda: {call})
    """, dense_path)
    assert out == [MODEL_CLOSED]


def test_session_used_after_close_raises(dense_path):
    out = run_script("""
        s = m.session()
        s.close()
        report(lambda: s.generate("x", max_tokens=2))
        print(len(m.generate("x", max_tokens=2, ignore_eos=True).tokens))   # the model is still open
    """, dense_path)
    assert out == [SESSION_CLOSED, "2"]


def test_open_stream_resumed_after_close_raises(dense_path):
    out = run_script("""
        it = m.stream("hello", max_tokens=50, ignore_eos=True)
        next(it)
        m.close()          # same thread, stream suspended: must not wait for it
        report(lambda: next(it))
    """, dense_path)
    assert out == [MODEL_CLOSED]


@pytest.mark.parametrize("target, message", [("m", MODEL_CLOSED), ("s", SESSION_CLOSED)])
def test_close_while_another_thread_generates(dense_path, target, message):
    out = run_script(f"""
        s = m.session()
        started, errors = threading.Event(), []

        def work():
            try:
                while True:     # generate until closed, so close always meets running work
                    for _ in s.stream("hello", max_tokens=400, ignore_eos=True, draft_max=2):
                        started.set()
            except Exception as exc:
                errors.append(f"{{type(exc).__name__}}: {{exc}}")

        t = threading.Thread(target=work)
        t.start()
        started.wait()
        {target}.close()
        t.join()
        print(errors[0])
    """, dense_path)
    assert out == [message]


def test_close_during_a_long_prompt_waits_one_round_of_it(dense_path):
    """A prompt of many chunks (n_batch 64) is closed from another thread during its
    second round: the generation stops at its next round with ClosedError. Its rounds
    emitted nothing, and the engine ran them all inside one guarded step, so close()
    waited for the whole prompt (10 s of a 7,000-token prompt on CPU, a review's)."""
    out = run_script("""
        import time
        import pymtp.rounds as R
        m2 = pymtp.load(sys.argv[1], threads=1, n_ctx=2048, n_batch=64)
        ids = m2.tokenize("the quick brown fox jumps over the lazy dog " * 80)[:900]
        launches, closer, launch = [], [], R.Rounds.launch

        def counted(self, *a, **k):
            launches.append(1)
            if len(launches) == 2:
                closer.append(threading.Thread(target=m2.close))
                closer[0].start()
                while not m2._guard.closed:
                    time.sleep(0.001)
            return launch(self, *a, **k)

        R.Rounds.launch = counted
        report(lambda: m2.generate(ids, max_tokens=2))
        closer[0].join()
        print(len(ids), len(launches))
    """, dense_path)
    assert out == [MODEL_CLOSED, "900 2"]


def test_close_while_another_thread_makes_a_batchers_contexts(dense_path):
    """A batcher's contexts were made outside the model's guard: close() freed the model
    under llama_init_from_model (a segfault or "pure virtual method called" abort, in 5 of
    5 runs of this loop). Now close waits for them, and the batching thread meets
    ClosedError."""
    code = textwrap.dedent("""
        import random, sys, threading
        import pymtp
        random.seed(0)
        for it in range(24):
            m = pymtp.load(sys.argv[1], threads=1, n_ctx=256)
            errors = []

            def work():
                try:
                    while True:
                        m.generate_batch(["a", "b b"], max_tokens=4)
                        m.batcher(2).close()
                except pymtp.ClosedError as exc:
                    errors.append(exc)

            t = threading.Thread(target=work)
            t.start()
            threading.Event().wait(random.uniform(0, 0.05))
            m.close()
            t.join()
            assert errors and not m._sessions, (errors, m._sessions)
        print("survived")
    """)
    p = subprocess.run([sys.executable, "-c", code, str(dense_path)], capture_output=True, text=True, timeout=300)
    assert (p.returncode, p.stdout.strip()) == (0, "survived"), p.stderr[-2000:]


@pytest.mark.parametrize("closed", ["m", "s"])
def test_close_from_a_signal_handler_during_a_generation(dense_path, closed):
    """A signal handler runs in the generating thread, inside its round: close() waited
    for that round to return, which it never could (a hang). The free now runs as the
    round returns, and the generation stops at the next one with ClosedError."""
    out = run_script(f"""
        import signal
        m = pymtp.load(sys.argv[1], threads=1, n_ctx=16384)     # a generation far longer than 0.2 s
        s = m.session()
        signal.signal(signal.SIGALRM, lambda *a: {closed}.close())
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        report(lambda: s.generate("the cat", max_tokens=100000, ignore_eos=True))
        report(lambda: s.generate("x", max_tokens=2))
    """, dense_path)
    assert out == [MODEL_CLOSED if closed == "m" else SESSION_CLOSED] * 2


def test_second_generation_on_a_busy_session_in_the_same_thread(dense_path):
    out = run_script("""
        it = m.stream("hello", max_tokens=8, ignore_eos=True)
        first = next(it)
        report(lambda: m.generate("x", max_tokens=2))
        report(lambda: m.stream("x", max_tokens=2))
        print(len(m.session().generate("x", max_tokens=3, ignore_eos=True).tokens))  # another session works
        it.close()
        print(len(m.generate("x", max_tokens=2, ignore_eos=True).tokens))   # and so does this one now
    """, dense_path)
    assert out == [BUSY, BUSY, "3", "2"]


def test_generation_from_another_thread_waits_for_the_open_stream(dense_path):
    out = run_script("""
        it = m.stream("hello", max_tokens=4, ignore_eos=True)
        next(it)
        result = []
        t = threading.Thread(target=lambda: result.append(m.generate("x", max_tokens=3, ignore_eos=True)))
        t.start()
        rest = list(it)    # the other thread waits on the session, it does not raise
        t.join()
        print(len(result[0].tokens))
    """, dense_path)
    assert out == ["3"]


def test_the_thread_that_iterates_a_stream_holds_the_session(dense_path):
    """A stream opened in the main thread and carried on by another: that thread's second
    generation would wait for itself (it hung), the main thread's waits for the stream
    (it was refused as if it would hang)."""
    out = run_script("""
        it = m.stream("hello", max_tokens=6, ignore_eos=True)
        next(it)
        t = threading.Thread(target=lambda: (next(it), report(lambda: m.generate("x", max_tokens=2))), daemon=True)
        t.start()
        t.join(20)
        print("worker done" if not t.is_alive() else "worker hung")
        threading.Timer(0.3, it.close).start()     # the main thread's generation waits for this
        print(len(m.generate("x", max_tokens=3, ignore_eos=True).tokens))
    """, dense_path)
    assert out == [BUSY, "worker done", "3"]


def test_ids_outside_the_vocabulary_are_refused_not_an_abort(dense_path):
    # llama.cpp threw std::out_of_range through ctypes for these: the process aborted
    out = run_script("""
        n = m.n_vocab
        for call in (lambda: m.detokenize([-1]), lambda: m.detokenize([1, n]), lambda: m.token_bytes(10 ** 6),
                     lambda: m.detokenize(["a"]), lambda: m.generate(b"hello", max_tokens=2)):
            report(call)
        print(m.detokenize(m.tokenize("hello")) == "hello")
    """, dense_path)
    assert [line.split(" holds")[0].split(" must")[0] for line in out] == [
        "ParamError: tokens", "ParamError: tokens", "ParamError: token", "ParamError: tokens", "ParamError: prompt",
        "True"], out


def test_closed_sessions_and_batchers_leave_the_model(dense_model):
    """A session or batcher closed (or left in a with block) is freed and leaves the model,
    which held every one until it closed itself (~48 MB a session of the demo model)."""
    import gc
    import weakref

    from pymtp import ClosedError

    with dense_model.session() as s:
        s.generate("x", max_tokens=2)
    with pytest.raises(ClosedError):
        s.generate("x", max_tokens=2)
    with dense_model.batcher(2) as b:
        b.generate(["x", "y"], max_tokens=2)
    with pytest.raises(ClosedError):
        b.generate(["x"], max_tokens=2)
    assert s not in dense_model._sessions and b not in dense_model._sessions
    gone = [weakref.ref(s), weakref.ref(b)]
    del s, b
    gc.collect()
    assert [r() for r in gone] == [None, None]


def test_a_result_holds_its_prompts_ids(dense_model):
    """Result.prompt_tokens (it was always empty): the ids the generation read, for
    generate, generate_batch and chat alike."""
    ids = dense_model.tokenize("The quick brown fox", special=True)
    r = dense_model.generate("The quick brown fox", max_tokens=2)
    assert r.prompt_tokens == ids and r.stats.prompt_tokens == len(ids)
    batch = dense_model.generate_batch(["The quick brown fox", [5, 6, 7]], max_tokens=2)
    assert [b.prompt_tokens for b in batch] == [ids, [5, 6, 7]]
    chat = dense_model.chat([{"role": "user", "content": "hi"}], max_tokens=2)
    assert len(chat.prompt_tokens) == chat.stats.prompt_tokens > 0


def test_generate_checks_in_streams_order(dense_path):
    # the session's state and the parameters before the prompt, as stream() checks them
    out = run_script("""
        s = m.session()
        report(lambda: s.generate([], max_tokens=-7))
        s.close()
        report(lambda: s.generate(""))
        report(lambda: list(s.stream("")))
    """, dense_path)
    assert out[0].startswith("ParamError: max_tokens") and out[1:] == [SESSION_CLOSED, SESSION_CLOSED], out


@pytest.mark.parametrize("use", ["generate", "stream", "generate_batch", "stream_batch", "session", "batcher"])
def test_a_dropped_model_is_freed_without_a_garbage_collection(dense_path, use):
    """The model and its own sessions held each other: a Model dropped without close()
    kept its llama.cpp model and contexts until a garbage collection (2.3 GB after 30
    loads of the small model), which then freed them in any order. The last reference
    frees them now; collection stays off to show it."""
    import gc
    import weakref

    import pymtp

    gc.disable()
    try:
        m = pymtp.load(dense_path, threads=1, n_ctx=256)
        if use == "generate":
            m.generate("x", max_tokens=2)
        elif use == "stream":
            list(m.stream("x", max_tokens=2))
        elif use == "generate_batch":
            m.generate_batch(["x", "y y"], max_tokens=2)
        elif use == "stream_batch":
            list(m.stream_batch(["x", "y y"], max_tokens=2))
        elif use == "session":
            m.session().generate("x", max_tokens=2)     # the app's own session, dropped at once
        else:
            m.batcher(2).generate(["x", "y y"], max_tokens=2)
        native = weakref.ref(m._native)
        del m
        assert native() is None
    finally:
        gc.enable()


def test_a_stream_holds_the_model_it_came_from(dense_path):
    """The model's own session and batchers hold it weakly, so a stream from a model
    nobody else holds keeps it: the same tokens as from a model kept in a variable."""
    import pymtp

    kw = dict(max_tokens=12, ignore_eos=True)
    with pymtp.load(dense_path, threads=1, n_ctx=256) as m:
        alone = m.generate("the cat", **kw).tokens
        batch = [r.tokens for r in m.generate_batch(["the cat", "a dog"], **kw)]
    streamed = [t for c in pymtp.load(dense_path, threads=1, n_ctx=256).stream("the cat", **kw) for t in c.tokens]
    assert streamed == alone
    got: list[list[int]] = [[], []]
    for i, c in pymtp.load(dense_path, threads=1, n_ctx=256).stream_batch(["the cat", "a dog"], **kw):
        got[i] += c.tokens
    assert got == batch


def test_a_native_model_frees_its_open_contexts_first(dense_path):
    """A garbage collection finalizes a dropped cycle's objects in any order: the llama
    model could go before its contexts, whose llama_free then read freed memory. The
    model frees the contexts still open first, and their own close() is then a no-op."""
    from pymtp.native import ContextConfig, NativeContext, NativeModel

    nm = NativeModel(str(dense_path), n_gpu_layers=0)
    contexts = [NativeContext(nm, ContextConfig(n_ctx=256, threads=1)) for _ in range(2)]
    contexts[1].close()
    assert nm._contexts == {contexts[0].ptr}
    nm.close()
    assert nm._contexts == set()
    contexts[0].close()
    assert contexts[0].ptr is None


def test_the_model_is_freed_after_a_context_free_it_interrupts(dense_path, monkeypatch):
    """A signal handler that closes the model while its thread frees a context (between
    llama_synchronize and llama_free): the model's free waits for that context's, where
    it ran before it and the context's llama_free read a freed model."""
    from pymtp import native
    from pymtp.native import ContextConfig, NativeContext, NativeModel

    nm = NativeModel(str(dense_path), n_gpu_layers=0)
    ctx = NativeContext(nm, ContextConfig(n_ctx=256, threads=1))
    order, sync, free, model_free = [], native.C.llama_synchronize, native.C.llama_free, native.C.llama_model_free

    def synchronize(p):
        sync(p)
        if not order:
            order.append("handler closes the model")
            nm.close()

    monkeypatch.setattr(native.C, "llama_synchronize", synchronize)
    monkeypatch.setattr(native.C, "llama_free", lambda p: (order.append("llama_free"), free(p))[1])
    monkeypatch.setattr(native.C, "llama_model_free", lambda p: (order.append("llama_model_free"), model_free(p))[1])
    ctx.close()
    assert order == ["handler closes the model", "llama_free", "llama_model_free"]
    assert nm.ptr is None and nm._contexts == set()


_BREAKERS = {"CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD"}    # CPython checks for a signal after these


def _interrupt_at(n: int, module, fn) -> bool:
    """Run ``fn`` with KeyboardInterrupt raised at the n-th place in ``module``'s code
    where Ctrl-C can land: where CPython runs a signal's handler (a function's start,
    after a call and a backward jump). True if the n-th place came. Instruction events
    find the places: ``sys.monitoring``'s on Python 3.12+ (there the old tracer's opcode
    events never come), opcode trace events before."""
    count, last = 0, {}     # frame -> the opcode it ran last

    def at(frame, code, offset) -> None:
        nonlocal count
        before = last.get(frame)
        last[frame] = dis.opname[code.co_code[offset]]
        if count < n and (before is None or before in _BREAKERS):
            count += 1
            if count == n:
                raise KeyboardInterrupt

    try:
        with _instruction_events(module, at):
            fn()
    except KeyboardInterrupt:
        pass
    return count >= n


@contextlib.contextmanager
def _instruction_events(module, at):
    """``at(frame, code, offset)`` before each instruction of ``module``'s functions."""
    codes = _codes(module)
    if sys.version_info >= (3, 12):
        mon, tool = sys.monitoring, sys.monitoring.DEBUGGER_ID
        mon.use_tool_id(tool, "pymtp tests")
        mon.register_callback(tool, mon.events.INSTRUCTION, lambda code, offset: at(sys._getframe(1), code, offset))
        for code in codes:
            mon.set_local_events(tool, code, mon.events.INSTRUCTION)
        try:
            yield
        finally:
            for code in codes:
                mon.set_local_events(tool, code, 0)
            mon.register_callback(tool, mon.events.INSTRUCTION, None)
            mon.free_tool_id(tool)
        return

    def local(frame, event, arg):
        if event == "opcode":
            at(frame, frame.f_code, frame.f_lasti)
        return local

    def calls(frame, event, arg):
        if frame.f_code not in codes:
            return None
        frame.f_trace_opcodes = True
        return local

    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(None)


def _codes(module) -> list:
    """The code objects of ``module``'s functions, methods, properties and their lambdas."""
    found, todo = [], list(vars(module).values())
    while todo:
        v = todo.pop()
        if isinstance(v, type) and v.__module__ == module.__name__:
            todo.extend(vars(v).values())
        elif isinstance(v, property):
            todo += [v.fget, v.fset, v.fdel]
        elif isinstance(v, types.FunctionType) and v.__module__ == module.__name__:
            todo.append(v.__code__)
        elif isinstance(v, types.CodeType) and v not in found:
            found.append(v)
            todo.extend(c for c in v.co_consts if isinstance(c, types.CodeType))
    return found


@pytest.mark.parametrize("use, closer", [("generate", "other thread"), ("generate", "same thread"),
                                         ("generate_batch", "other thread")])
def test_an_interrupt_anywhere_in_a_guards_code_leaves_close_working(dense_path, use, closer):
    """Ctrl-C raises KeyboardInterrupt wherever the main thread is. Landing in a guard's
    own enter or exit (about 1 interrupt in 75), it left a call counted that had ended: a
    close() from another thread then waited for it for ever, one from the same thread
    never freed. The interrupt lands here on each instruction of guard.py in turn, in a
    whole generation; after each, close() frees the model."""
    import pymtp
    import pymtp.guard

    def run(m):
        if use == "generate":
            m.generate("the cat", max_tokens=1, ignore_eos=True)
        else:
            m.generate_batch(["the cat", "a dog"], max_tokens=1, ignore_eos=True)

    for n in range(1, 10_000):
        m = pymtp.load(dense_path, threads=1, n_ctx=256)
        landed = _interrupt_at(n, pymtp.guard, lambda: run(m))
        if closer == "same thread":
            m.close()
        else:
            t = threading.Thread(target=m.close, daemon=True)
            t.start()
            t.join(10)
            assert not t.is_alive(), f"close() hung after an interrupt at guard place {n}"
        assert m._native.ptr is None, f"close() did not free after an interrupt at guard place {n}"
        if not landed:
            break
    assert n > 50           # the whole generation ran under the tracer (67 places, 182 batched)
