"""Per-round trace of pymtp servers under load: on PYTHONPATH with ROUND_TRACE_DIR set,
every Python process that imports pymtp.rounds appends one JSON line per landed round
(rounds.Rounds.land) to ROUND_TRACE_DIR/<pid>.jsonl. Summarise with report.py.

    ROUND_TRACE_DIR=TRACE_DIR PYTHONPATH=benchmarks/round_trace python benchmarks/load_server.py ...
    python benchmarks/round_trace/report.py TRACE_DIR

(``device_cuda.sh load`` does both with TRACE=1.) A line: the landing time ``t``, the
sequences decoded ``n``, the tokens they emitted ``tok``, the batched auto depth in force
``k`` (meaningful only on an auto server), the untimed rounds at a new depth left, this
one included (``settling``; 0 once timed), the verify batch's rows (``rows``), the prompt
rows among them (``prompt``), the seconds in ``launch`` and ``land`` and the llama.cpp log
lines since the round before it by kind (``logs``: "reused" where ggml-cuda replayed a CUDA
graph, "warmup ..." where it ran one eagerly); ``{"idle": t}`` where the loop went idle (the
next round is not timed from the last landing).

ROUND_TRACE_MUTE=1 points ggml's log (not llama.cpp's) at a C function that does nothing:
ggml-cuda logs a line at every decode that replays a CUDA graph, and pymtp's Python
callback for it takes the GIL inside llama_decode, where the server's other threads may
hold it.

ROUND_TRACE_PIN=K also holds batched auto at depth K (depth_batched.Epochs never picks another):
what a depth costs inside a server, without the search around it.
"""

import os
import sys

_DIR = os.environ.get("ROUND_TRACE_DIR")


def _patch(rounds) -> None:
    import json
    import time

    R = rounds.Rounds
    from pymtp import native

    logs = _count_logs(native)
    out = open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)
    out.write(json.dumps({"argv": sys.argv}) + "\n")
    launch, land, idle = R.launch, R.land, R.idle

    def traced_launch(self, *a, **kw):
        t0 = time.perf_counter()
        r = launch(self, *a, **kw)
        self._trace_launch = (time.perf_counter() - t0, self.verify_rows)
        return r

    def traced_land(self, *a, **kw):
        ep = self.epochs
        k, settling = (ep.k, ep.settling) if ep is not None else (-1, 0)
        f = self.flight
        n, prompt = (len(f.decoding), sum(c.n for c in f.chunks)) if f is not None else (0, 0)
        t0 = time.perf_counter()
        r = land(self, *a, **kw)
        t1 = time.perf_counter()
        launch_s, rows = getattr(self, "_trace_launch", (0.0, 0))
        out.write(json.dumps({"t": t1, "n": n, "tok": sum(len(st.tokens) for _, st in r), "k": k,
                              "settling": settling, "rows": rows, "prompt": prompt, "launch_s": launch_s,
                              "land_s": t1 - t0, "logs": dict(logs)}) + "\n")
        logs.clear()
        return r

    def traced_idle(self):
        out.write(json.dumps({"idle": time.perf_counter()}) + "\n")
        return idle(self)

    R.launch, R.land, R.idle = traced_launch, traced_land, traced_idle
    pin = os.environ.get("ROUND_TRACE_PIN")
    if pin is not None:
        from pymtp import depth_batched

        depth_batched.Epochs.pick = lambda self, bucket: int(pin)
        start = depth_batched.Epochs.__post_init__

        def pinned(self):
            start(self)
            self.k = int(pin)

        depth_batched.Epochs.__post_init__ = pinned


def _count_logs(native):
    """llama.cpp's log lines by kind, counted by the callback pymtp installs (it keeps
    its tail for error messages as before)."""
    import collections
    import ctypes

    counts = collections.Counter()
    kinds = (("reused", "CUDA Graph id"), ("warmup complete", "warmup complete"), ("warmup reset", "warmup reset"))
    tail = native._LOG_TAIL

    @native.C.llama_log_callback
    def counting(level, text, user_data):
        line = text.decode("utf-8", errors="replace")
        tail.append(line)
        counts[next((k for k, mark in kinds if mark in line), "other")] += 1

    native._log_callback = counting          # what native._init_backend installs
    if native._initialized:
        native.C.llama_log_set(counting, ctypes.c_void_p(0))
    if os.environ.get("ROUND_TRACE_MUTE") == "1":
        init = native._init_backend
        # getpid ignores its arguments: ggml's log lines then run no Python
        noop = ctypes.cast(ctypes.CDLL(None).getpid, native.C.llama_log_callback)
        ggml_log_set = native.C._lib.ggml_log_set
        ggml_log_set.argtypes, ggml_log_set.restype = [native.C.llama_log_callback, ctypes.c_void_p], None

        def muted(verbose):
            init(verbose)
            ggml_log_set(noop, None)

        native._init_backend = muted
        native._mute_keep = noop
    return counts


if _DIR:
    import importlib.abc
    import importlib.machinery

    class _AfterEngine(importlib.abc.MetaPathFinder):
        """Patches pymtp.rounds as it is imported, in whatever process imports it."""

        def find_spec(self, name, path, target=None):
            if name != "pymtp.rounds":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterEngine())
