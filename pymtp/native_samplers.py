"""llama.cpp's sampler objects, for the C sampler chain (a filter pass over a
llama_token_data_array we fill) and for backend sampling (a chain attached to a context,
run inside its graph). Which filters to chain, and what to do with the result, is
sampling.py's business.

Thin as native.py: one method per C call, ``NativeError`` on failure.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np

from .native import _LOG_TAIL, C, NativeError, NativeModel, _Owned


# llama_token_data {int32 id; float logit; float p}: 12 bytes, no padding
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert TOKEN_DATA.itemsize == ctypes.sizeof(C.llama_token_data)


class TokenDataArray:
    """A ``llama_token_data_array`` over a numpy record array we own, reused call after call."""

    def __init__(self, capacity: int) -> None:
        self.buf = np.zeros(capacity, dtype=TOKEN_DATA)
        self._id, self._logit = self.buf["id"], self.buf["logit"]   # strided field views
        self.ids = np.arange(capacity, dtype=np.int32)
        self._data = self.buf.ctypes.data_as(C.llama_token_data_p)
        self.struct = C.llama_token_data_array()
        self.ref = ctypes.byref(self.struct)

    def set(self, logits: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Fill it with [n] logits, unsorted: token ids[i] (i when ids is None) has logits[i]."""
        n = logits.shape[0]
        if n > self.buf.size:
            raise ValueError(f"row of {n} logits exceeds the array's capacity {self.buf.size}")
        # ids every time: the samplers reorder the entries in place
        self._id[:n] = self.ids[:n] if ids is None else ids
        self._logit[:n] = logits
        self.struct.data = self._data
        self.struct.size = n
        self.struct.selected = -1
        self.struct.sorted = False

    def result(self) -> np.ndarray:
        """The entries the samplers kept: a [size] view of TOKEN_DATA records.

        llama.h lets a sampler point ``data`` elsewhere; none that SamplerChain adds does
        (top_k, top_p, min_p, infill, temp, dist, greedy and penalties work in place), so the kept
        entries are the first ``size`` of our buffer."""
        return self.buf[: self.struct.size]

    @property
    def selected(self) -> int:
        return int(self.struct.selected)


# llama.cpp's seed for "draw one from the system's entropy" (LLAMA_DEFAULT_SEED): a dist
# made with it takes a fresh seed at its creation and at every reset (get_rng_seed,
# src/llama-sampler.cpp)
FRESH_SEED = 0xFFFFFFFF


def dist_seed(seed: int | None) -> int:
    """The 32-bit seed llama.cpp's dist takes for ``seed`` (None: fresh entropy). A seed
    whose low 32 bits are FRESH_SEED gives 0: taken as it is, it would not replay."""
    if seed is None:
        return FRESH_SEED
    seed &= 0xFFFFFFFF
    return 0 if seed == FRESH_SEED else seed


class SamplerChain(_Owned):
    """A ``llama_sampler_chain`` (llama_sampler_chain_init); each ``add_*`` appends one
    ``llama_sampler_init_*`` the chain then owns and frees."""

    def __init__(self) -> None:
        params = C.llama_sampler_chain_default_params()
        params.no_perf = True
        self.ptr = C.llama_sampler_chain_init(params)
        if not self.ptr:
            raise NativeError("llama_sampler_chain_init returned NULL")

    def _add(self, smpl, what: str) -> SamplerChain:
        if not smpl:
            raise NativeError(f"llama_sampler_init_{what} returned NULL")
        C.llama_sampler_chain_add(self.ptr, smpl)
        return self

    def add_penalties(self, last_n: int, repeat: float, freq: float, present: float) -> SamplerChain:
        return self._add(C.llama_sampler_init_penalties(last_n, repeat, freq, present), "penalties")

    def add_logit_bias(self, n_vocab: int, ids, values) -> SamplerChain:
        """llama.cpp's logit_bias sampler: ``values[i]`` added to token ``ids[i]``'s logit
        (the reference ``sampling_filters.bias_logits`` is held to)."""
        pairs = (C.llama_logit_bias * len(ids))(*[C.llama_logit_bias(int(t), float(b)) for t, b in zip(ids, values)])
        return self._add(C.llama_sampler_init_logit_bias(n_vocab, len(ids), pairs), "logit_bias")

    def add_top_k(self, k: int) -> SamplerChain:
        return self._add(C.llama_sampler_init_top_k(k), "top_k")

    def add_top_p(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add(C.llama_sampler_init_top_p(p, min_keep), "top_p")

    def add_min_p(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add(C.llama_sampler_init_min_p(p, min_keep), "min_p")

    def add_infill(self, vocab) -> SamplerChain:
        """llama.cpp's infill sampler over ``vocab`` (a ``llama_vocab`` pointer): it reads
        each candidate's text and whether it ends generation."""
        return self._add(C.llama_sampler_init_infill(vocab), "infill")

    def add_temp(self, t: float) -> SamplerChain:
        return self._add(C.llama_sampler_init_temp(t), "temp")

    def add_dist(self, seed: int | None) -> SamplerChain:
        """llama.cpp's draw, seeded by ``seed`` (``dist_seed``); None draws from fresh entropy."""
        return self._add(C.llama_sampler_init_dist(dist_seed(seed)), "dist")

    def add_greedy(self) -> SamplerChain:
        return self._add(C.llama_sampler_init_greedy(), "greedy")

    def __len__(self) -> int:
        return int(C.llama_sampler_chain_n(self.ptr))

    def names(self) -> list[str]:
        """Each sampler's name; once the chain is attached to a context, llama.cpp marks
        one that runs in the graph "+name" and one whose ops the device lacks "-name"."""
        return [C.llama_sampler_name(C.llama_sampler_chain_get(self.ptr, i)).decode()
                for i in range(len(self))]

    def apply(self, cur: TokenDataArray) -> None:
        C.llama_sampler_apply(self.ptr, cur.ref)

    def accept(self, token: int) -> None:
        C.llama_sampler_accept(self.ptr, token)

    def reset(self) -> None:
        C.llama_sampler_reset(self.ptr)

    def _free(self, ptr) -> None:
        C.llama_sampler_free(ptr)


class Grammar(_Owned):
    """A ``llama_sampler_init_grammar``: a GBNF grammar and its parse state over a model's
    vocabulary. ``apply`` sets the logit of every candidate the state refuses to -inf;
    ``accept`` moves the state past a token, which llama.cpp requires the state to allow
    (it aborts the process on a refused end-of-generation token): check first."""

    _stderr_lock = threading.Lock()

    def __init__(self, model: NativeModel, text: str, root: str = "root", *, _ptr=None) -> None:
        self.model = model
        if _ptr is not None:
            self.ptr = _ptr
            return
        # llama.cpp's parser prints why it refuses a grammar to stderr (its log says only
        # "failed to parse grammar"): stderr is captured for the call, and handed on
        # unless it holds that reason
        with self._stderr_lock, _captured_fd(2) as out:
            _LOG_TAIL.clear()
            self.ptr = C.llama_sampler_init_grammar(model.vocab, text.encode("utf-8"), root.encode("utf-8"))
            log = list(_LOG_TAIL)
        with out:
            printed = out.read()
        if self.ptr:
            if printed:
                os.write(2, printed)
            return
        lines = [ln.strip() for ln in printed.decode("utf-8", errors="replace").splitlines()]
        reasons = [ln.split("error parsing grammar:", 1)[1].strip() for ln in lines if "error parsing grammar:" in ln]
        reasons += [ln.strip() for ln in log if ln.strip() and "failed to parse grammar" not in ln]
        raise NativeError(f"llama.cpp refused the grammar: {'; '.join(reasons) or 'failed to parse grammar'}")

    def clone(self) -> Grammar:
        """A copy of the grammar in its current state (llama_sampler_clone)."""
        ptr = C.llama_sampler_clone(self.ptr)
        if not ptr:
            raise NativeError("llama_sampler_clone returned NULL")
        return Grammar(self.model, "", _ptr=ptr)

    def apply(self, cur: TokenDataArray) -> None:
        C.llama_sampler_apply(self.ptr, cur.ref)

    def accept(self, token: int) -> None:
        C.llama_sampler_accept(self.ptr, token)

    def _free(self, ptr) -> None:
        C.llama_sampler_free(ptr)


class _captured_fd:
    """Redirect a file descriptor into a temporary file for the span of a ``with``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self):
        import tempfile

        sys.stderr.flush()
        self.out = tempfile.TemporaryFile()
        self.saved = os.dup(self.fd)
        os.dup2(self.out.fileno(), self.fd)
        return self.out

    def __exit__(self, *exc) -> None:
        os.dup2(self.saved, self.fd)
        os.close(self.saved)
        self.out.seek(0)
