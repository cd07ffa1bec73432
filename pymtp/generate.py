"""The public model object: a loaded GGUF, its tokenizer, sessions and batches.

The engine works on token ids; a Session (session.py) turns its steps into text, stop
strings and stats (results.py); this layer loads the model, checks the load options,
tokenizes, and hands generations to a default session or a batcher.
"""

from __future__ import annotations

import numbers
import os
import re
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import fields, replace
from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .chat import template_for
from .config import (DEFAULT_DRAFT_LIMIT, DEFAULT_N_CTX, DecodeParams, LoadOptions, ParamError, check_unicode,
                     held_tokens)
from .gguf_info import ModelInfo, gguf_bytes, inspect
from .guard import Guard
from .load_checks import N_CTX_MAX, check_options, check_verify_room
from .prompt_cache import CacheBudget
from .results import Calibration, Chunk, Result
from .rounds import prompt_too_long
from .rpc import Placement, RpcError, parse_endpoints, place
from .scheduler import round_rows, slots_that_fit
from .session import Session

# A prompt longer than this many characters per context token is judged by its head first
# (no tokenizer packs more than a few characters into a token of ordinary text).
PROMPT_HEAD_CHARS_PER_TOKEN = 64
# The most slots generate_batch's and stream_batch's batcher decodes at once; the prompts
# beyond wait for one (a slot is a context's memory; Model.batcher(slots) for more)
BATCH_SLOTS = 16

DEFAULT_MODEL_NAME = "qwen35-tiny-mtp-q8_0.gguf"


def default_model_path() -> Path:
    """The small trained Qwen3.5 model with an MTP head that ships inside the package."""
    return Path(str(resources.files("pymtp") / "data" / DEFAULT_MODEL_NAME))


def _prompt_list(prompts: object) -> list:
    """A batch's prompts as a list: one string is one prompt (not one per character, as
    iterating it would give, and as vLLM's ``generate`` reads it), a generator is read out."""
    if prompts is None:
        raise ParamError("prompts", "prompts must be a list of prompts (strings or lists of token ids), got None")
    if isinstance(prompts, (str, np.ndarray)) and not (isinstance(prompts, np.ndarray) and prompts.ndim == 2):
        return [prompts]
    try:
        return list(prompts)
    except TypeError:
        raise ParamError("prompts", f"prompts must be a list of prompts (strings or lists of token ids), "
                         f"got {type(prompts).__name__}") from None


class Model:
    """A loaded Qwen3.5 GGUF. ``generate``/``stream`` use a default session; make more
    with ``session()`` to decode several sequences at once."""

    def __init__(self, path: str | os.PathLike | None = None, options: LoadOptions | None = None) -> None:
        self.options = options or LoadOptions()
        check_options(self.options)
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ParamError("path", f"path must be a GGUF file's path (a str or a pathlib.Path), "
                             f"got {type(path).__name__}")
        if path is not None and not os.fspath(path):     # Path("") is "." : "a directory" misled
            raise ParamError("path", "path is empty: pass a GGUF file's path, or none for the embedded demo model")
        self.path = Path(path) if path is not None else default_model_path()
        self.info: ModelInfo = inspect(self.path)
        o = self.options
        if o.draft_limit is not None:
            self.draft_limit = o.draft_limit
        else:
            per_plane = max(self.info.recurrent_bytes, 1)
            self.draft_limit = max(1, min(DEFAULT_DRAFT_LIMIT, o.rs_budget_bytes // per_plane - 1))
        check_verify_room(o.n_batch, o.n_ctx, self.draft_limit)
        self.rpc: tuple[str, ...] = parse_endpoints(o.rpc)
        self.placement: Placement | None = None     # where the layers went, with rpc workers
        self._native = self._load_native()
        if o.n_ctx == 0:    # llama.cpp's -c 0; a GGUF without a trained length gets the default
            self.options = o = replace(o, n_ctx=min(self._native.n_ctx_train, N_CTX_MAX) or DEFAULT_N_CTX)
        self._draft = self._load_draft()
        on_gpu = self._native.offloaded and o.n_gpu_layers != 0
        self.on_gpu: bool = on_gpu        # layers on a GPU of this host
        self.draft_kv = ("keep" if on_gpu else "target") if o.draft_kv == "auto" else o.draft_kv
        self.row_by_row = on_gpu if o.row_by_row is None else bool(o.row_by_row)
        self.flash_attn = ("auto" if on_gpu else "off") if o.flash_attn is None else o.flash_attn
        self.sampling = o.sampling      # "auto": sampling_route.samples_in_graph decides per run
        # one budget for the prompt caches of every session and batcher of this model
        self.cache_budget = CacheBudget(int(o.prompt_cache_mib * 2**20)) if o.prompt_cache_mib > 0 else None
        self._guard = Guard("this model is closed; load it again with pymtp.load()")
        self._template = None
        self._special_texts: list[bytes] | None = None    # _parse_special_texts reads them
        self._special_split: re.Pattern | bool | None = None     # split_special's, from them
        # sessions and batchers, closed with the model (before it frees the llama model their
        # contexts use); one closed before leaves the set (GuardedEngine.close), one dropped
        # by the app goes by itself (held weakly: the engine holds the model)
        self._sessions: weakref.WeakSet = weakref.WeakSet()
        self._batchers: dict = {}          # engine -> the Batcher generate_batch uses
        # held from picking a batcher to queueing on it: another thread's pick would close it
        self._batch_lock = threading.Lock()
        self._default = self._session(owned=True)

    def _load_native(self):
        """The llama.cpp model: on this host, or split with the RPC workers (pymtp/rpc.py)."""
        from .native import NativeModel

        o = self.options
        kw = {"n_gpu_layers": o.n_gpu_layers}
        if self.rpc:
            # block_count + 1: llama.cpp counts the output layer as one more to place
            self.placement = place(self.rpc, self.info.block_count + 1, o.tensor_split, o.rpc_timeout)
            kw = {"n_gpu_layers": self.placement.split.n_gpu_layers, "remote": self.placement.remote,
                  "devices": [d.ptr for d in self.placement.devices],
                  "tensor_split": self.placement.split.tensor_split}
        return NativeModel(str(self.path), load_mtp=self.info.has_mtp, extra_bufts=o.extra_bufts,
                           verbose=o.verbose, **kw)

    def _load_draft(self):
        """The drafter's own model over ``draft_vocab`` ids (draft_vocab.py), or None."""
        from .draft_vocab import DraftHead, DraftVocabError, draft_file

        o = self.options
        if o.draft_vocab is None:
            return None
        try:
            if not self.info.has_mtp:
                raise DraftVocabError(f"draft_vocab sizes the MTP head's drafts, and {self.path.name} has no MTP "
                                      "head; graft one with gguf_graft or leave draft_vocab unset")
            path = draft_file(self.path, o.draft_vocab)
            return DraftHead.load(path, self._native.n_vocab, n_gpu_layers=o.n_gpu_layers,
                                  extra_bufts=o.extra_bufts, verbose=o.verbose)
        except BaseException:
            self._native.close()
            raise

    def fail_over_to_local(self) -> None:
        """After ``RpcWorkerLost``: load the same file on this host alone and start over.

        The split model and its contexts are leaked, not freed (freeing would talk to the
        lost worker); sessions and batchers made before are closed, so make new ones.
        Raises ``RpcError`` when the file does not fit this host's free memory."""
        from .ggml_devices import cpu_device, device_memory

        size = gguf_bytes(self.path)
        free = device_memory(cpu_device())[0]
        if size > free:
            raise RpcError(f"an RPC worker was lost and {self.path.name} ({size / 2**30:.1f} GiB) does not "
                           f"fit this host's free memory ({free / 2**30:.1f} GiB): restart the worker "
                           f"and load the model again")
        for s in list(self._sessions):
            try:
                s.close()
            except RpcError:       # what it would free is on the lost worker's side
                pass
        self._sessions.clear()
        self._batchers.clear()
        self.options = replace(self.options, rpc=None, tensor_split=None)
        self.rpc, self.placement = (), None
        self._native = self._load_native()
        self._default = self._session(owned=True)

    def batcher(self, slots: int, *, prefill_chunk: int | None = None, follow=None):
        """A ``pymtp.batch.Batcher``: up to ``slots`` generations decoded together, every
        round in one target decode (continuous batching); each one's output is what it
        would be alone, greedy on CPUs (a seeded draw may part where another kernel moves
        a logit's last bits: docs/exactness.md, "Batched rounds"). ``follow``: a batcher
        stepped beside this one, whose draft_max="auto" search picks the depth for both
        (depth_batched.Following)."""
        return self._batcher(slots, prefill_chunk=prefill_chunk, follow=follow, owned=False)

    def _batcher(self, slots: int, *, prefill_chunk: int | None, follow, owned: bool):
        from .batch import Batcher

        self._guard.check()
        if type(slots) is not int or slots < 1:
            raise ParamError("slots", f"slots must be an integer >= 1 (generations decoded together), got {slots!r}")
        if slots > (fit := self._slots_that_fit()):
            raise ParamError("slots", f"slots={slots} do not fit in a round of n_batch={self.options.n_batch} with "
                             f"draft_limit={self.draft_limit}: use slots <= {fit}, or load the model with "
                             f"n_batch >= {round_rows(slots, self.draft_limit)}")
        if prefill_chunk is not None and (type(prefill_chunk) is not int or prefill_chunk < 1):
            raise ParamError("prefill_chunk", f"prefill_chunk must be an integer >= 1 (prompt tokens a round "
                             f"decodes; None: what the batch has room for), got {prefill_chunk!r}")
        if follow is not None and (not isinstance(follow, Batcher) or follow._model() is not self):
            raise ParamError("follow", f"follow must be another batcher of this model (model.batcher(n)), whose "
                             f"draft_max=\"auto\" depths this one drafts, got {follow!r}")
        # inside the guard: its contexts are made now, and a close() in another thread must
        # wait for them (it freed the model under llama_init_from_model: a segfault), then
        # find this batcher among those it closes
        with self._guard.use():
            b = Batcher(self, slots, prefill_chunk=prefill_chunk, follow=follow, owned=owned)
            self._sessions.add(b)
        return b

    def _slots_that_fit(self) -> int:
        return slots_that_fit(self.options.n_batch, self.draft_limit)

    def _batcher_for(self, n: int, i: int = 0, follow=None):
        """Batcher ``i`` for ``n`` prompts, kept for generate_batch and stream_batch: at
        most BATCH_SLOTS slots, and no more than n_batch holds a round of (the prompts
        beyond wait for one), one batcher per engine,
        grown while idle. A batcher a size, one slot a prompt, each slot a context's
        memory, grew without end (1.3 GB for 100 prompts of the demo model). One after
        the first follows the first's depths (``follow``), made anew with it. Only an idle
        batcher is replaced, and the first only while every engine is idle (its followers
        would be replaced next): closing one ended another thread's requests on it. The
        caller holds ``_batch_lock`` until its requests are queued."""
        slots = min(n, BATCH_SLOTS, self._slots_that_fit())
        b = self._batchers.get(i)
        idle = b is not None and not (any(x.busy for x in self._batchers.values()) if i == 0 else b.busy)
        if b is None or b._guard.closed or (idle and (follow is not None and b.follows is not follow
                                                      or b.slots < slots)):
            if b is not None:
                b.close()       # its contexts, and its place among its leader's followers
            b = self._batchers[i] = self._batcher(slots, prefill_chunk=None, follow=follow, owned=True)
        return b

    def _forget(self, engine) -> None:
        """A session or batcher closed before the model: the model no longer holds it."""
        self._sessions.discard(engine)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *, engines: int = 1,
                       **kwargs) -> list[Result]:
        """Generate for every prompt at once, in batched rounds; the keywords are
        ``Session.stream``'s, the same for every prompt (for one each, use
        ``batcher().submit``). Each Result is what ``generate`` gives for its prompt alone.

        ``engines``: share the prompts among that many batchers, each stepped by a thread
        of its own (as ``pymtp serve --engines``). On a GPU one's host work then overlaps
        another's decodes: four engines of two prompts ran 1.3-1.9x one of eight on an
        H100 (benchmarks/README.md, session 34). On a CPU they share the same cores."""
        prompts = _prompt_list(prompts)
        if not prompts:
            return []
        from .batch import engine_sizes

        if isinstance(engines, bool) or not isinstance(engines, numbers.Integral):
            raise ParamError("engines", f"engines must be an integer, got {engines!r}")
        try:
            sizes = engine_sizes(len(prompts), engines)
        except ValueError as e:
            raise ParamError("engines", str(e)) from None
        if engines == 1:
            with self._batch_lock:
                b = self._batcher_for(len(prompts))
                runs = b.submit_all(prompts, **kwargs)
            return b.results(runs)
        groups, start = [], 0
        try:        # every prompt is checked before any decodes
            with self._batch_lock:
                for i, n in enumerate(sizes):
                    b = self._batcher_for(n, i, groups[0][0] if groups else None)
                    groups.append((b, b.submit_all(prompts[start:start + n], first_index=start, **kwargs)))
                    start += n
        except BaseException:
            for b, runs in groups:
                for run in runs:
                    b.cancel(run)
            raise
        pool = ThreadPoolExecutor(len(groups), thread_name_prefix="pymtp-engine")
        try:
            futures = [pool.submit(b.results, runs) for b, runs in groups]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                raise failed
            return [r for f in futures for r in f.result()]
        except BaseException:
            # an engine failed, or Ctrl-C here: the other prompts would run on for no one (the
            # pool's exit waited for every engine to finish its whole batch)
            for b, runs in groups:
                for run in runs:
                    b.cancel(run)
            raise
        finally:
            pool.shutdown(wait=True)

    def stream_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs) -> Iterator[tuple[int, Chunk]]:
        """Yield (index of the prompt, chunk) as the batched rounds are accepted."""
        prompts = _prompt_list(prompts)
        if not prompts:     # still a stream: close() as on any other
            return _Holding(self, iter(()))
        with self._batch_lock:
            stream = self._batcher_for(len(prompts)).stream(prompts, **kwargs)
        return _Holding(self, stream)

    def session(self) -> Session:
        """A new decoding slot with its own contexts, for generations in parallel threads."""
        return self._session(owned=False)

    def _session(self, *, owned: bool) -> Session:
        self._guard.check()
        s = Session(self, owned=owned)
        self._sessions.add(s)
        return s

    @property
    def n_vocab(self) -> int:
        """Token ids run from 0 to n_vocab - 1."""
        return self._native.n_vocab

    @property
    def n_ctx(self) -> int:
        """The tokens each sequence's context holds, prompt and reply: ``options.n_ctx``
        rounded up as llama.cpp sizes contexts (``config.held_tokens``)."""
        return held_tokens(self.options.n_ctx)

    @property
    def facts(self) -> dict[str, int]:
        """What llama-server's /v1/models card says of a model (its ``meta``), as it names them."""
        n = self._native
        return {"vocab_type": n.vocab_type, "n_vocab": n.n_vocab, "n_ctx_train": n.n_ctx_train, "n_embd": n.n_embd,
                "n_params": n.n_params, "size": n.size}

    @property
    def bos_token(self) -> str:
        """The text of the beginning-of-sequence token, "" when the vocabulary has none
        (what chat templates receive as ``bos_token``)."""
        return self._special_text("tokenizer.ggml.bos_token_id")

    @property
    def eos_token(self) -> str:
        """The text of the end-of-sequence token, "" when the vocabulary has none."""
        return self._special_text("tokenizer.ggml.eos_token_id")

    @property
    def adds_bos(self) -> bool:
        """Whether tokenizing a prompt (``add_special``) puts the BOS token first."""
        with self._guard.use():
            return self._native.bos_added() is not None

    @property
    def adds_eos(self) -> bool:
        """Whether tokenizing a prompt (``add_special``) puts the EOS token last."""
        with self._guard.use():
            return self._native.eos_added()

    def _special_text(self, key: str) -> str:
        with self._guard.use():
            tid = self._native.meta(key)
            if tid is None or not tid.lstrip("-").isdigit() or int(tid) < 0:
                return ""
            return self._native.token_to_bytes(int(tid), special=True).decode("utf-8", errors="replace")

    @property
    def has_mtp(self) -> bool:
        return self.info.has_mtp

    @property
    def chat_template(self) -> str | None:
        return self.info.chat_template

    def chat_template_for_prompts(self):
        """The compiled ``pymtp.chat.ChatTemplate`` that ``chat`` renders with."""
        if self._template is None:
            self._template = template_for(self)
        return self._template

    def chat(self, messages: Sequence[dict], **kwargs) -> Result:
        """See ``Session.chat``; on the default session, whose prompt cache follows the chat."""
        return self._default.chat(messages, **kwargs)

    @property
    def exactness(self) -> str:
        """What greedy identity to plain decoding this backend gives (docs/exactness.md)."""
        if self._native.offloaded and self.options.n_gpu_layers != 0:
            if os.environ.get("GGML_CUDA_BATCH_INVARIANT") == "1":
                return ("GPU with GGML_CUDA_BATCH_INVARIANT=1: greedy MTP output is identical to plain "
                        "decoding where llama.cpp carries vendor/llama.cpp/patches (docs/exactness.md)")
            return ("GPU: greedy MTP output can part from plain decoding at near-ties; the verify "
                    "batch's kernels round differently from one-row decodes; a CUDA build with "
                    "vendor/llama.cpp/patches and GGML_CUDA_BATCH_INVARIANT=1 makes it identical "
                    "(docs/exactness.md)")
        if self.flash_attn != "off":
            return ("CPU with flash attention: verify batches round differently from one-row "
                    "decodes; use flash_attn='off' for identical greedy output")
        from .native import cpu_features

        if cpu_features().get("LLAMAFILE") == "1":
            return ("CPU: greedy MTP output is identical to plain decoding except at rare near-ties: "
                    "llamafile's sgemm rounds multi-row batches ~1e-7 apart, which later layers can grow "
                    "to a few hundredths of a logit (seen: 21-23 of 24 prompts on a Q8_0 model); a llama.cpp "
                    "built with -DGGML_LLAMAFILE=OFF is bit-identical")
        return "CPU: greedy MTP output is identical to plain decoding"

    def memory_report(self) -> str:
        mib = self.info.recurrent_bytes / 2**20
        report = (f"recurrent state {mib:.2f} MiB per sequence; {self.draft_limit} rollback snapshots "
                  f"-> {mib * (1 + self.draft_limit):.2f} MiB with MTP")
        b = self.cache_budget
        if b is None:
            return report + "; prompt cache off"
        return report + (f"; prompt cache {b.used / 2**20:.2f} of {b.budget / 2**20:.2f} MiB "
                         f"in {b.count} snapshots")

    def close(self) -> None:
        """Free the model and its sessions. Generations running stop at their next round
        with ``ClosedError`` (one in this thread, closed from a signal handler, too: the
        free waits for its round); any later use raises ``ClosedError``."""
        self._guard.close(self._free)

    def _free(self) -> None:
        for s in list(self._sessions):
            s.close()
        self._sessions.clear()
        if self._draft is not None:
            self._draft.close()
        self._native.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- text
    def tokenize(self, text: str, *, special: bool = False, add_special: bool = True,
                 fit_context: bool = False) -> list[int]:
        """``special``: parse special-token text such as ``<|im_end|>`` into those tokens.
        ``add_special``: add the BOS/EOS tokens the vocabulary asks for.
        ``fit_context``: refuse (``ParamError`` on ``prompt``) a text that cannot fit this
        model's context, with memory bounded by the context rather than by the text: the
        ids buffer holds at most the context (``n_ctx``), and a text of more than
        PROMPT_HEAD_CHARS_PER_TOKEN characters per context token is first judged by its head
        (a 15 MiB prompt cost ~0.5 GB in llama.cpp's tokenizer otherwise)."""
        from .native import TooManyTokens

        if not isinstance(text, str):
            raise ParamError("text", f"tokenize takes a string, got {type(text).__name__}")
        check_unicode(text, "prompt")
        with self._guard.use():
            if not fit_context:
                return self._native.tokenize(text, add_special=add_special, parse_special=special)
            limit = self.n_ctx
            head = limit * PROMPT_HEAD_CHARS_PER_TOKEN
            try:
                if len(text) > head:
                    self._native.tokenize(text[:head], add_special=add_special, parse_special=special, limit=limit)
                return self._native.tokenize(text, add_special=add_special, parse_special=special, limit=limit)
            except TooManyTokens as e:
                raise prompt_too_long(e.n_tokens if len(text) <= head else f"at least {e.n_tokens}",
                                      limit) from None

    def may_parse_special(self, text: str) -> bool:
        """False when tokenizing ``text`` with ``special`` gives what tokenizing it without
        does: none of the texts only special-token parsing knows occurs in it. Lets a chat
        skip tokenizing every message twice per request to find the rare one that spells
        ``<|im_end|>`` (most of a cached turn's time to first token on CPU otherwise)."""
        data = text.encode("utf-8")
        return any(t in data for t in self._parse_special_texts())     # an empty text matches all

    def _parse_special_texts(self) -> list[bytes]:
        if self._special_texts is None:         # one pass over the vocabulary, once
            with self._guard.use():
                self._special_texts = self._native.parse_special_texts()
        return self._special_texts

    def split_special(self, text: str) -> list[str]:
        """``text`` cut around the spellings of special tokens (``may_parse_special``'s texts):
        plain text, spelling, plain text, ... as ``re.split`` with a group gives them, one item
        where none occurs. The longest spelling wins where two start at one place, so no
        plain part is left holding one. A chat sets each spelling in message content apart,
        to be tokenized as text, and leaves the rest to its template (chat.render_pieces)."""
        if self._special_split is None:
            spellings = set()
            for t in self._parse_special_texts():
                try:
                    spellings.add(t.decode("utf-8"))
                except UnicodeDecodeError:      # a piece of a character: no str spells it whole
                    pass
            spellings.discard("")
            self._special_split = re.compile("(" + "|".join(
                map(re.escape, sorted(spellings, key=len, reverse=True))) + ")") if spellings else False
        return self._special_split.split(text) if self._special_split else [text]

    def token_bytes(self, token: int, *, special: bool = True) -> bytes:
        """The bytes of one token (``special``: control tokens as their text, such as
        ``<|im_end|>``, instead of nothing); a piece of a UTF-8 character where a token
        holds one."""
        if type(token) is not int or not 0 <= token < self.n_vocab:     # (the common case at once)
            (token,) = self._vocab_ids([token], "token", "an id from model.tokenize()")
        with self._guard.use():
            return self._native.token_to_bytes(token, special=special)

    def _vocab_ids(self, ids: Sequence[int], param: str, hint: str) -> list[int]:
        """``ids`` as ints, each in the vocabulary, else a ``ParamError`` naming ``param``:
        llama.cpp takes an id outside it as an error code, or aborts the process."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ParamError(param, f"{param} must be a list of token ids, got {type(ids).__name__}; pass {hint}")
        ids = list(ids)
        n_vocab = self.n_vocab
        if set(map(type, ids)) <= {int}:    # plain ints (a chat's ids): checked at C speed
            in_range = not ids or (min(ids) >= 0 and max(ids) < n_vocab)
            bad = None if in_range else next(t for t in ids if not 0 <= t < n_vocab)
        else:
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
                        or not 0 <= t < n_vocab), None)
        if isinstance(bad, bool) or (bad is not None and not isinstance(bad, numbers.Integral)):
            raise ParamError(param, f"{param} holds {bad!r} ({type(bad).__name__}), which is not a token id (an "
                             f"integer); pass {hint}")
        if bad is not None:
            raise ParamError(param, f"{param} holds token id {bad!r}, outside the vocabulary [0, {n_vocab}); "
                             f"pass {hint}")
        return [int(t) for t in ids]

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt as token ids, refused when empty or outside the vocabulary (such ids
        reach llama.cpp as an error code, or worse); a string is tokenized with special-token
        text parsed, as every generation tokenizes it."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, special=True, fit_context=True)
        elif isinstance(prompt, (bytes, bytearray, memoryview)) or not isinstance(prompt, Iterable):
            # bytes iterate as small ints, which would pass for token ids
            raise ParamError("prompt", f"prompt must be a string or a sequence of token ids, got "
                             f"{type(prompt).__name__}" + ("; decode bytes to text first"
                                                           if isinstance(prompt, (bytes, bytearray, memoryview)) else ""))
        else:
            ids = self._vocab_ids(prompt, "prompt", "a string or ids from model.tokenize()")
        if not ids:
            raise ParamError("prompt", "prompt is empty: give at least one token", code="empty_prompt")
        if len(ids) >= self.n_ctx:      # here, not at the stream's first round (Rounds.start)
            raise prompt_too_long(len(ids), self.n_ctx)
        return ids

    def infill_prompt(self, prefix: str | Sequence[int | str], suffix: str | Sequence[int | str],
                      extra: Sequence[tuple[str, str]] = (), prompt: str = "", *, n_predict: int = -1,
                      spm: bool = False, trim: bool = True) -> list[int]:
        """A fill-in-the-middle prompt for code completion, laid out as llama-server's
        ``/infill`` lays it out (pymtp/infill.py): ``prefix`` and ``suffix`` around the
        cursor (texts, or ids and texts mixed), other files' ``extra`` (name, text) pairs,
        ``prompt`` (special-token text parsed) after the prefix; ``n_predict`` leaves room
        to generate, ``spm`` puts the suffix first; ``trim`` False keeps every token of the
        texts (llama-server's cut is for editors' windows). Generate from the ids it returns.
        Raises ``InfillUnsupported`` where the vocabulary has no FIM tokens."""
        from .infill import INFILL_BATCH, FimTokens, infill_prompt

        with self._guard.use():
            n = self._native
            fim = FimTokens(*(n.fim_token(role) for role in ("pre", "suf", "mid", "rep", "sep")), bos=n.bos_added())
        for param, part in (("prefix", prefix), ("suffix", suffix)):
            if not isinstance(part, str):
                self._vocab_ids([x for x in part if not isinstance(x, str)], param, "text or ids from model.tokenize()")
        ids = self.tokenize(prompt, special=True, add_special=False) if prompt else []
        n_ctx = self.n_ctx
        return infill_prompt(fim, lambda text: self.tokenize(text, add_special=False), prefix, suffix, extra, ids,
                             n_batch=min(INFILL_BATCH, n_ctx) if trim else None, n_ctx=n_ctx,
                             n_predict=n_predict, spm=spm)

    def detokenize(self, tokens: Sequence[int]) -> str:
        tokens = self._vocab_ids(tokens, "tokens", "ids from model.tokenize()")
        with self._guard.use():
            return b"".join(self._native.token_to_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """Whether a token id ends a generation (an end-of-turn or end-of-text token)."""
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, numbers.Integral):
            raise ParamError("token", f"is_eog takes a token id (an integer), got {token!r}")
        if not 0 <= token < self.n_vocab:
            raise ParamError("token", f"token id {token} is outside this model's vocabulary of {self.n_vocab}")
        with self._guard.use():
            return self._native.is_eog(int(token))

    @property
    def eog_ids(self) -> tuple[int, ...]:
        """The vocabulary's end-of-generation tokens (those ``ignore_eos`` bans)."""
        with self._guard.use():
            return self._native.eog_ids

    # -- generation on the default session
    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[Chunk]:
        """See ``Session.stream``."""
        return _Holding(self, self._default.stream(prompt, **kwargs))

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Result:
        """See ``Session.stream`` for the keywords."""
        return self._default.generate(prompt, **kwargs)

    def calibrate(self, prompt: str | Sequence[int] | None = None, **kwargs) -> Calibration:
        """See ``Session.calibrate``; on the default session, whose requests it prices."""
        return self._default.calibrate(prompt, **kwargs)


class _Holding:
    """``chunks``, from one of the model's own engines, holding the model until they end:
    the engine holds it weakly (GuardedEngine._bind), and ``for c in load(p).stream(x)``
    drops it at once. A class, not a generator: closing a generator that never started
    runs nothing on Python 3.12 and keeps its locals, so ``chunks`` (a BatchStream whose
    requests are queued at the call) would never hear the close and decode for no one."""

    __slots__ = ("_model", "_chunks")

    def __init__(self, model: Model, chunks: Iterator) -> None:
        self._model, self._chunks = model, chunks

    def __iter__(self) -> "_Holding":
        return self

    def __next__(self):
        try:
            return next(self._chunks)
        except StopIteration:
            self._model = None          # ended: the model may go (a generator dropped it too)
            raise

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()
        self._model = None


# what a generation takes, which load() refuses by pointing there
_GENERATION_KEYWORDS = frozenset({"stop", "messages", *(f.name for f in fields(DecodeParams))})


def load(path: str | os.PathLike | None = None, **options) -> Model:
    """Load a Qwen3.5 GGUF (the embedded demo model when ``path`` is None).

    ``options`` are the fields of ``pymtp.LoadOptions`` (n_ctx, n_batch, threads,
    n_gpu_layers, draft_limit, flash_attn, sampling, draft_vocab, prompt_cache_mib,
    checkpoint_every, rpc, tensor_split, rpc_timeout, ...; its source says what each does),
    checked here: a wrong one is a ``ParamError`` naming it. How a generation decodes
    (spec, draft_max, temperature, ...) is that call's keyword, not the model's."""
    unknown = sorted(set(options) - {f.name for f in fields(LoadOptions)})
    if unknown:
        generation = [name for name in unknown if name in _GENERATION_KEYWORDS]
        hint = (f"; {', '.join(generation)} {'is a' if len(generation) == 1 else 'are'} generation keyword"
                f"{'s' * (len(generation) > 1)}: pass {'it' if len(generation) == 1 else 'them'} to generate(), "
                f"stream() or chat()") if generation else ""
        raise TypeError(f"unknown load option(s) {', '.join(unknown)}; load takes the fields of "
                        f"pymtp.LoadOptions{hint}")
    return Model(path, LoadOptions(**options))
