"""Thin wrapper over llama.cpp's C API through llama-cpp-python's ctypes bindings.

One Python method per C call, ``NativeError`` on failure, handles freed in one place.
Nothing here decides anything about tokens: that lives in the drafter and the engine.

Arrays cross the boundary as numpy views over llama.cpp's own buffers (logits, hidden
rows) or over numpy arrays we own (``Batch``), so no per-token Python loop is needed.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import signals
from .config import cpu_has_amx
from .guard import LlamaCppMissing

if TYPE_CHECKING:
    from .native_samplers import SamplerChain

LLAMA_CPP_PIN = "0.3.36"

try:
    from llama_cpp import llama_cpp as C
    from llama_cpp import llama_cpp_ext as X
except ImportError as exc:  # exercised only without the dependency (tests hide it)
    raise LlamaCppMissing(
        f"pymtp needs llama-cpp-python=={LLAMA_CPP_PIN} (pip install 'llama-cpp-python=={LLAMA_CPP_PIN}'); "
        f"importing it failed: {exc}", name="llama_cpp"
    ) from exc


def version_mismatch(found: str) -> str | None:
    """What to tell a user whose llama-cpp-python is not the pinned one (installed with
    ``--no-deps`` or upgraded since): pymtp's ctypes calls assume 0.3.36's structs and
    functions, so another version may fail in ways that name nothing."""
    if found == LLAMA_CPP_PIN:
        return None
    return (f"pymtp is built against llama-cpp-python {LLAMA_CPP_PIN} but found {found}: its C API may differ "
            f"(pip install 'llama-cpp-python=={LLAMA_CPP_PIN}')")


if (_mismatch := version_mismatch(getattr(sys.modules.get("llama_cpp"), "__version__", "unknown"))):
    warnings.warn(_mismatch, RuntimeWarning, stacklevel=1)


class NativeError(RuntimeError):
    """A llama.cpp call failed; the message carries llama.cpp's last log lines."""


class TooManyTokens(NativeError):
    """``tokenize(..., limit=)`` met a text of more tokens than ``limit``."""

    def __init__(self, n_tokens: int, limit: int) -> None:
        super().__init__(f"text has {n_tokens} tokens, more than the limit {limit}")
        self.n_tokens, self.limit = n_tokens, limit


# ---------------------------------------------------------------------------- logging
# llama.cpp logs to stderr by default. We keep the last lines so errors can quote them,
# and print only when verbose.

_LOG_TAIL: collections.deque[str] = collections.deque(maxlen=20)
_VERBOSE = bool(os.environ.get("PYMTP_VERBOSE"))


@signals.callback
def _log_lines(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", errors="replace")
    _LOG_TAIL.append(line)
    if _VERBOSE:
        print(line, end="", flush=True, file=sys.stderr)


_log_callback = C.llama_log_callback(_log_lines)


def cpu_features() -> dict[str, str]:
    """The CPU backend's build features as llama.cpp reports them ("LLAMAFILE": "1", ...)."""
    info = C.llama_print_system_info().decode(errors="replace")
    items = (item.split(":", 1)[-1] for item in info.split("|"))   # "CPU : SSE3 = 1" -> "SSE3 = 1"
    pairs = (item.split("=", 1) for item in items if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs}


_init_lock = threading.Lock()
_initialized = False


def _init_backend(verbose: bool) -> None:
    global _initialized, _VERBOSE
    _VERBOSE = _VERBOSE or verbose
    with _init_lock:
        if _initialized:
            return
        C.llama_log_set(_log_callback, ctypes.c_void_p(0))
        signals.defer_interrupts()
        C.llama_backend_init()
        _initialized = True


def _log_tail(n: int = 4) -> str:
    lines = [ln.strip() for ln in list(_LOG_TAIL)[-n:] if ln.strip()]
    return (" (llama.cpp: " + " | ".join(lines) + ")") if lines else ""


class _Owned:
    """A llama.cpp object this wrapper frees once: by ``close()``, or when collected."""

    ptr = None

    def _free(self, ptr) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if getattr(self, "ptr", None):
            self._free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------- model


class NativeModel(_Owned):
    """A loaded ``llama_model`` (weights shared by every context made from it).

    ``devices`` (ggml device handles) and ``tensor_split`` place the layers, as
    ``llama_model_params`` does; ``remote`` runs every call that may reach an RPC worker
    (pymtp/rpc.py), and once it has lost one this model and its contexts are leaked,
    not freed, since freeing would talk to the dead worker."""

    def __init__(self, path: str, *, n_gpu_layers: int = -1, load_mtp: bool = True,
                 extra_bufts: bool | None = None, verbose: bool = False,
                 devices: list[int] | None = None, tensor_split: tuple[float, ...] | None = None,
                 remote=None) -> None:
        from . import ggml_devices

        _init_backend(verbose)
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.load_mtp = load_mtp
        params.use_extra_bufts = (not cpu_has_amx()) if extra_bufts is None else extra_bufts
        if devices is not None:       # NULL-terminated; llama.cpp copies the list at load
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            params.devices = ctypes.addressof(self._devices)
        if tensor_split is not None:
            self._split = (ctypes.c_float * C.llama_max_devices())(*tensor_split)
            params.tensor_split = self._split
        self.remote = remote
        self.path = path
        if remote is None:
            self.ptr = C.llama_model_load_from_file(os.fsencode(path), params)
        else:       # the weights go to the workers in this call: bounded by their bytes
            from .gguf_info import gguf_bytes

            self.ptr = remote.call(C.llama_model_load_from_file, os.fsencode(path), params,
                                   timeout=remote.load_timeout(gguf_bytes(Path(path))))
        if not self.ptr:
            if remote is not None:
                remote.close()
            signals.raise_pending()        # an interrupt, not the file, may have ended the load
            raise NativeError(f"llama.cpp could not load {path!r}{_log_tail()}")
        if signals.pending():       # interrupted while it loaded: the weights go, then the interrupt is raised
            C.llama_model_free(self.ptr)
            self.ptr = None
            signals.raise_pending()
        self.vocab = C.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = C.llama_vocab_n_tokens(self.vocab)
        self.n_embd: int = C.llama_model_n_embd(self.ptr)
        self.n_embd_out: int = C.llama_model_n_embd_out(self.ptr)
        self.n_layer: int = C.llama_model_n_layer(self.ptr)
        self.n_layer_nextn: int = C.llama_model_n_layer_nextn(self.ptr)
        self.n_ctx_train: int = C.llama_model_n_ctx_train(self.ptr)
        # what llama-server's /v1/models card says of the model
        self.n_params: int = C.llama_model_n_params(self.ptr)
        self.size: int = C.llama_model_size(self.ptr)         # bytes of its tensors
        self.vocab_type: int = C.llama_vocab_type(self.vocab)
        # M-RoPE models (Qwen3.5 among them) let a sequence's positions jump forward in the
        # KV; others need each decode to start right after what the KV holds
        self.positions_jump: bool = C.llama_model_rope_type(self.ptr) in (C.LLAMA_ROPE_TYPE_MROPE,
                                                                           C.LLAMA_ROPE_TYPE_IMROPE)
        # True when the layers were offloaded to a GPU of this host. Not
        # llama_supports_gpu_offload(), which an RPC build answers True on a CPU-only host.
        self.offloaded: bool = bool(ggml_devices.local_gpus()) and n_gpu_layers != 0
        # each token's bytes, by (token, special), filled as tokens are detokenized
        self._pieces: dict[tuple[int, bool], bytes] = {}
        # the contexts made on it and not yet freed, freed before it (_free): the garbage
        # collector finalizes a dropped cycle's objects in any order, and llama_free on a
        # context whose model is gone reads freed memory
        self._contexts: set[int] = set()
        # a context's free and the model's in one order across threads (a session dropped in
        # one while another closes the model); reentrant for a signal handler's close()
        self._frees = threading.RLock()
        self._freeing = 0               # context frees under way in this lock's holder
        self._free_after: int | None = None     # the model's free, left to the last of them

    def run(self, fn, *args):
        """Call ``fn`` directly, or on the RPC guard's thread when workers hold layers; a
        signal's handler that ran in its log lines raises after it."""
        out = fn(*args) if self.remote is None else self.remote.call(fn, *args)
        signals.raise_pending()
        return out

    @property
    def usable(self) -> bool:
        """False once an RPC worker this model used was lost (its handles are leaked)."""
        return self.remote is None or self.remote.lost is None

    def _free(self, ptr) -> None:
        if self.usable:
            with self._frees:
                for ctx in list(self._contexts):
                    self.free_context(ctx)
                if self._freeing:        # a handler interrupted a context's free: after it
                    self._free_after = ptr
                else:
                    self.run(C.llama_model_free, ptr)
        if self.remote is not None:
            self.remote.close()

    def free_context(self, ctx: int) -> None:
        """Free a context made on this model, once, whoever asks first (it or the model),
        and never after the model."""
        with self._frees:
            if ctx not in self._contexts:
                return
            self._contexts.discard(ctx)
            self._freeing += 1
            try:
                # a launched decode may still run on the device (rounds.Rounds.launch)
                self.run(C.llama_synchronize, ctx)
                self.run(C.llama_free, ctx)
            finally:
                self._freeing -= 1
                if not self._freeing and self._free_after is not None:
                    ptr, self._free_after = self._free_after, None
                    self.run(C.llama_model_free, ptr)

    # -- vocabulary
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False,
                 limit: int | None = None) -> list[int]:
        """``limit``: room for that many ids only; a longer text raises ``TooManyTokens`` (its
        count comes from llama.cpp), so a huge text costs no ids buffer or list of its size."""
        data = text.encode("utf-8")
        # a text of n bytes makes at most n ids and the specials added: a buffer the size of a
        # huge ``limit`` (a context's) would cost its memory for a short text
        cap = len(data) + 8 if limit is None else min(limit, len(data) + 8)
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0 and limit is not None and -n > limit:
            raise TooManyTokens(-n, limit)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise NativeError(f"llama_tokenize returned {n}")
        return list(buf[:n])

    def token_to_bytes(self, token: int, *, special: bool = False) -> bytes:
        """A token's bytes, from the table once it has been asked for: every emitted token
        is detokenized, and a dict lookup replaces a ctypes call and a buffer per token."""
        key = (token, special)
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._pieces[key] = self._piece(token, special)
        return piece

    def _piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def parse_special_texts(self) -> list[bytes]:
        """The texts only special-token parsing turns into tokens: those of control and
        unknown tokens (llama.cpp splits user-defined ones out of the text either way).
        One pass over the vocabulary: a caller keeps the list."""
        want = C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN
        get_attr, get_text, vocab = C.llama_vocab_get_attr, C.llama_vocab_get_text, self.vocab
        return [get_text(vocab, t) or b"" for t in range(self.n_vocab) if get_attr(vocab, t) & want]

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    @functools.cached_property
    def eog_ids(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (one pass over it: kept)."""
        is_eog, vocab = C.llama_vocab_is_eog, self.vocab
        return tuple(t for t in range(self.n_vocab) if is_eog(vocab, t))

    def fim_token(self, role: str) -> int | None:
        """The vocabulary's fill-in-the-middle token for ``role`` (pre, suf, mid, pad, rep,
        sep: ``llama_vocab_fim_<role>``), None where it has none."""
        token = getattr(C, f"llama_vocab_fim_{role}")(self.vocab)
        return None if token < 0 else int(token)

    def bos_added(self) -> int | None:
        """The BOS token where the vocabulary adds one to a prompt, else None."""
        if not C.llama_vocab_get_add_bos(self.vocab):
            return None
        token = C.llama_vocab_bos(self.vocab)
        return None if token < 0 else int(token)

    def eos_added(self) -> bool:
        """Whether the vocabulary adds EOS at the end of a prompt it tokenizes."""
        return bool(C.llama_vocab_get_add_eos(self.vocab))

    def is_control(self, token: int) -> bool:
        """A control token: its text shows only when detokenized with ``special``."""
        return bool(C.llama_vocab_get_attr(self.vocab, token) & C.LLAMA_TOKEN_ATTR_CONTROL)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- batch


class Batch:
    """A ``llama_batch`` whose arrays are numpy arrays we own, filled with slices.

    Each row belongs to one sequence. ``embd_width`` > 0 adds an embedding row per token
    (the MTP context takes a token *and* the target hidden state of the row before it).
    """

    def __init__(self, capacity: int, embd_width: int = 0) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.n_seq = np.ones(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        self.embd = np.zeros((capacity, embd_width), dtype=np.float32) if embd_width else None
        # llama_batch.seq_id is an array of pointers, one per row, into self.seq: their
        # addresses written by numpy at once (a ctypes.cast per row took 1.2 ms at 512
        # rows, paid by every single-stream run, whose Rounds makes its batch)
        self._seq_ptrs = self.seq.ctypes.data + self.seq.itemsize * np.arange(capacity, dtype=np.uintp)
        self.struct = C.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(C.llama_token))
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(C.llama_pos))
        self.struct.n_seq_id = self.n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self._seq_ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(C.llama_seq_id)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.struct.embd = (self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                            if self.embd is not None else None)
        self.n = 0

    def set(self, tokens: np.ndarray, pos0: int, seq: int = 0, *, outputs: str | np.ndarray = "last",
            embd: np.ndarray | None = None) -> None:
        """Fill rows [0, len(tokens)) of one sequence at positions pos0, pos0+1, ...

        ``outputs``: "last", "all", "none" or a boolean mask.
        """
        self.clear()
        self.add(tokens, pos0, seq, outputs=outputs, embd=embd)

    def clear(self) -> None:
        self.n = 0
        self.struct.n_tokens = 0

    def add(self, tokens: np.ndarray, pos0: int, seq: int = 0, *, outputs: str | np.ndarray = "last",
            embd: np.ndarray | None = None) -> int:
        """Append rows of one sequence at positions pos0, pos0+1, ...; returns the first row's index.

        Several sequences share a batch this way, each row carrying its own seq id.
        """
        n, i = len(tokens), self.n
        if i + n > self.capacity:
            raise ValueError(f"batch of {i + n} rows exceeds capacity {self.capacity}")
        if n == 1 and isinstance(outputs, str):
            # a plain round's row, or a draft step's: item writes, no temporary arrays
            self.token[i], self.pos[i], self.seq[i] = tokens[0], pos0, seq
            self.logits[i] = outputs in ("all", "last")
            if self.embd is not None:
                if embd is None:
                    raise ValueError("this batch carries embeddings: pass embd rows")
                self.embd[i] = embd[0]
            self.n = self.struct.n_tokens = i + 1
            return i
        rows = slice(i, i + n)
        self.token[rows] = tokens
        self.pos[rows] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.seq[rows] = seq
        if isinstance(outputs, str):
            self.logits[rows] = 1 if outputs == "all" else 0
            if outputs == "last" and n:
                self.logits[i + n - 1] = 1
        else:
            self.logits[rows] = outputs
        if self.embd is not None:
            if embd is None:
                raise ValueError("this batch carries embeddings: pass embd rows")
            self.embd[rows] = embd
        self.n = i + n
        self.struct.n_tokens = self.n
        return i

    @property
    def n_outputs(self) -> int:
        return int(np.count_nonzero(self.logits[: self.n]))


# ---------------------------------------------------------------------------- context


@dataclass(frozen=True)
class ContextConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_rs_seq: int = 0
    threads: int | None = None
    mtp: bool = False           # LLAMA_CONTEXT_TYPE_MTP
    n_outputs_max: int = 0      # 0 = n_batch
    n_outputs_max_per_seq: int = 0  # 0 = n_outputs_max; bounds a backend sampler's rows per decode
    flash_attn: str = "auto"    # "auto", "on", "off" (llama_context_params.flash_attn_type)
    # One KV buffer for all sequences instead of one stream each. Off: each sequence's
    # cells are laid out as in a context of its own, so its attention rounds as it would
    # alone (pymtp.scheduler says why that matters); n_ctx is then split between them.
    kv_unified: bool = False


FLASH_ATTN = {"auto": C.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": C.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": C.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def _address_of(fn):
    """``fn``, a binding that returns a float pointer, returning the address as an int: a
    plain round reads its logits once a token, and the pointer object, its ``contents``
    and ``addressof`` were three more Python objects made right after the decode."""
    return ctypes.CFUNCTYPE(ctypes.c_void_p, *fn.argtypes)(ctypes.cast(fn, ctypes.c_void_p).value)


_LOGITS_AT = _address_of(C.llama_get_logits)
_NEXTN_AT = _address_of(X.llama_get_embeddings_nextn)
# a rejection-sampling round reads a backend-sampled row per draft and per verify row
_CANDIDATES_AT = _address_of(C.llama_get_sampled_candidates_ith)
_PROBS_AT = _address_of(C.llama_get_sampled_probs_ith)
# no round reads the sampled logits; they share the one read path (_sampled_row)
_SAMPLED_LOGITS_AT = _address_of(C.llama_get_sampled_logits_ith)


class NativeContext(_Owned):
    """A ``llama_context`` on a ``NativeModel``: decode, read logits and hidden rows, memory ops."""

    def __init__(self, model: NativeModel, cfg: ContextConfig) -> None:
        self.model = model
        self.cfg = cfg
        p = C.llama_context_default_params()
        p.n_ctx = cfg.n_ctx
        p.n_batch = cfg.n_batch
        p.n_ubatch = cfg.n_ubatch
        p.n_seq_max = cfg.n_seq_max
        p.n_rs_seq = cfg.n_rs_seq
        p.n_outputs_max = cfg.n_outputs_max
        p.n_outputs_max_per_seq = cfg.n_outputs_max_per_seq
        p.kv_unified = cfg.kv_unified
        p.flash_attn_type = FLASH_ATTN[cfg.flash_attn]
        threads = cfg.threads or max(1, (os.cpu_count() or 2))
        p.n_threads = threads
        p.n_threads_batch = threads
        p.embeddings = False
        p.no_perf = True
        p.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP if cfg.mtp else C.LLAMA_CONTEXT_TYPE_DEFAULT
        self.ptr = model.run(C.llama_init_from_model, model.ptr, p)
        if not self.ptr:
            kind = "MTP" if cfg.mtp else "target"
            raise NativeError(f"llama.cpp could not create the {kind} context{_log_tail()}")
        model._contexts.add(self.ptr)
        self.mem = C.llama_get_memory(self.ptr)
        self.n_ctx: int = C.llama_n_ctx(self.ptr)
        self.n_ctx_seq: int = C.llama_n_ctx_seq(self.ptr)     # what one sequence can hold
        self.n_seq_max: int = C.llama_n_seq_max(self.ptr)
        self.n_batch: int = C.llama_n_batch(self.ptr)
        self.n_rs_seq: int = C.llama_n_rs_seq(self.ptr)
        # rows one decode may output (llama.cpp asserts on more); 0 asks for n_batch
        self.n_outputs_max: int = min(cfg.n_outputs_max or self.n_batch, self.n_batch)
        self.n_vocab = model.n_vocab
        self.n_embd_out = model.n_embd_out
        self._views: dict[tuple, np.ndarray] = {}

    def _free(self, ptr) -> None:
        if self.model.usable:
            self.model.free_context(ptr)

    def set_threads(self, n: int) -> None:
        C.llama_set_n_threads(self.ptr, n, n)

    def set_nextn_output(self, enabled: bool, masked: bool = False) -> None:
        """Ask for the hidden row that feeds the MTP head (every batch row when unmasked)."""
        X.llama_set_embeddings_nextn(self.ptr, enabled, masked)

    def decode(self, batch: Batch) -> None:
        rc = self.model.run(C.llama_decode, self.ptr, batch.struct)
        if rc != 0:
            raise NativeError(f"llama_decode returned {rc}{_log_tail()}")

    def logits(self, n_outputs: int) -> np.ndarray:
        """View of the last decode's logits, one row per output row: [n_outputs, n_vocab]."""
        # through model.run: the read waits for the decode, which may be on a lost RPC worker
        ptr = self.model.run(_LOGITS_AT, self.ptr)
        if not ptr:
            raise NativeError("llama_get_logits returned NULL")
        return self._view(ptr, n_outputs, self.n_vocab)

    def hidden(self, n_rows: int) -> np.ndarray:
        """View of the last decode's unmasked nextn rows, one per batch row: [n_rows, n_embd]."""
        ptr = self.model.run(_NEXTN_AT, self.ptr)
        if not ptr:
            raise NativeError("llama_get_embeddings_nextn returned NULL (nextn output not enabled?)")
        return self._view(ptr, n_rows, self.n_embd_out)

    def _view(self, addr: int, rows: int, width: int, ctype=ctypes.c_float) -> np.ndarray:
        """[rows, width] view of the ``ctype`` items at ``addr``, made once per address,
        shape and type: np.ctypeslib.as_array costs ~2 us a call (more right after a CPU
        decode has flushed the caches) and a k=3 round reads five, nine with backend
        sampling. llama.cpp moves a buffer only when it grows it, and then the address is
        another key."""
        key = (addr, rows, width, ctype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 256:
                self._views.clear()
            ptr = ctypes.cast(addr, ctypes.POINTER(ctype))
            view = self._views[key] = np.ctypeslib.as_array(ptr, shape=(rows, width))
        return view

    # -- backend sampling (llama.h, "backend sampling API [EXPERIMENTAL]")
    def set_sampler(self, seq: int, chain: SamplerChain | None) -> bool:
        """Run ``chain`` inside this context's graph for ``seq`` (None detaches it). False
        when llama.cpp cannot offload every sampler of the chain and runs none of it.
        The context does not own the chain: keep it alive while attached."""
        return bool(C.llama_set_sampler(self.ptr, seq, chain.ptr if chain is not None else None))

    def sample(self, chain: SamplerChain, i: int) -> int:
        """The token ``chain`` (ending in a dist) draws from batch row i's logits: one call
        (llama_sampler_sample) where numpy would build the distribution first."""
        return int(self.model.run(C.llama_sampler_sample, chain.ptr, self.ptr, i))

    def sampled_token(self, i: int) -> int:
        """The token the backend sampler chain drew for batch row i."""
        token = int(self.model.run(C.llama_get_sampled_token_ith, self.ptr, i))
        if token < 0:
            raise NativeError(f"no backend-sampled token for row {i}: is a sampler chain with dist attached?")
        return token

    def sampled_candidates(self, i: int) -> np.ndarray | None:
        """The token ids the backend filters kept for batch row i: [m] int32 view, or None."""
        return self._sampled_row(C.llama_get_sampled_candidates_count_ith, _CANDIDATES_AT, i, C.llama_token)

    def sampled_probs(self, i: int) -> np.ndarray | None:
        """The backend's probabilities for row i, parallel to ``sampled_candidates``: [m] view."""
        return self._sampled_row(C.llama_get_sampled_probs_count_ith, _PROBS_AT, i)

    def sampled_logits(self, i: int) -> np.ndarray | None:
        """The backend's filtered logits for row i (-inf where a filter dropped one): [m] view."""
        return self._sampled_row(C.llama_get_sampled_logits_count_ith, _SAMPLED_LOGITS_AT, i)

    def _sampled_row(self, count_of, address_of, i: int, ctype=ctypes.c_float) -> np.ndarray | None:
        """Row i of one of the backend's per-row arrays, through the view cache; None where
        the chain left it empty."""
        n = int(self.model.run(count_of, self.ptr, i))
        addr = address_of(self.ptr, i) if n else None
        return self._view(addr, 1, n, ctype)[0] if addr else None

    # -- memory
    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return bool(self.model.run(C.llama_memory_seq_rm, self.mem, seq, p0, p1))

    def seq_pos_max(self, seq: int) -> int:
        """The last position ``seq`` holds (-1: none)."""
        return int(C.llama_memory_seq_pos_max(self.mem, seq))

    def clear(self) -> None:
        self.model.run(C.llama_memory_clear, self.mem, True)

    # -- recurrent-state checkpoints (the partial-only flag saves just the recurrent part)
    def state_size(self, seq: int, flags: int = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) -> int:
        return int(C.llama_state_seq_get_size_ext(self.ptr, seq, flags))

    def state_get(self, seq: int, buf: np.ndarray,
                  flags: int = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) -> int:
        n = self.model.run(
            C.llama_state_seq_get_data_ext, self.ptr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), buf.nbytes, seq, flags)
        if n == 0:
            raise NativeError(f"llama_state_seq_get_data_ext saved nothing{_log_tail()}")
        return int(n)

    def state_set(self, seq: int, buf: np.ndarray, n: int,
                  flags: int = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) -> None:
        rc = self.model.run(
            C.llama_state_seq_set_data_ext, self.ptr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, seq, flags)
        if rc == 0:
            raise NativeError(f"llama_state_seq_set_data_ext failed{_log_tail()}")
