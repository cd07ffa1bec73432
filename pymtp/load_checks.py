"""LoadOptions judged before a model file is read: each option that can be judged alone,
so that a wrong one is refused at ``load`` with its name, not later, far from it, or after
the weights have loaded.
"""

from __future__ import annotations

import numbers
from typing import get_args

from .config import N_CTX_MIN, THREADS_MAX, DraftKV, FlashAttn, LoadOptions, ParamError, SamplingPath
from .rpc import parse_endpoints, shares_ok

# LoadOptions' integers: (name, least value, whether None is allowed, what it means)
_SIZES = (("n_ctx", N_CTX_MIN, False, "tokens a context holds"), ("n_batch", 1, False, "tokens a decode takes"),
          ("threads", 1, True, "CPU threads; None: all cores"), ("n_gpu_layers", -1, False, "-1: all layers"),
          ("draft_limit", 1, True, "most drafts a round; None: picked for the model"),
          ("draft_vocab", 1, True, "ids the MTP head drafts over; None: all"),
          ("rs_budget_bytes", 1, False, "bytes of recurrent state the drafts' rollback may hold"))
# LoadOptions' switches: (name, whether None is allowed: picked for the backend)
_SWITCHES = (("verbose", False), ("row_by_row", True), ("extra_bufts", True))


# the largest context llama.cpp can count: its token counts and positions are 32-bit ints
N_CTX_MAX = 2**31 - 1


def check_options(o: LoadOptions) -> None:
    """Every option that can be judged alone, before the file is read: a wrong one failed
    later, far from it, or after the model had loaded."""
    for name, least, optional, meaning in _SIZES:
        value = getattr(o, name)
        if value is None and optional:
            continue
        if name == "n_ctx" and value == 0 and type(value) is int:
            continue        # as llama.cpp's -c 0: the length the model was trained for
        if type(value) is not int or value < least:
            zero = ", or 0 for the length the model was trained for" if name == "n_ctx" else ""
            raise ParamError(name, f"{name} must be an integer >= {least} ({meaning}){zero}, got {value!r}")
    for name, optional in _SWITCHES:
        value = getattr(o, name)
        # a string such as "false" is true to Python: it turned the switch on
        if not isinstance(value, bool) and not (value is None and optional):
            either = "True, False or None (picked for the backend)" if optional else "True or False"
            raise ParamError(name, f"{name} must be {either}, got {value!r}")
    if o.threads is not None and o.threads > THREADS_MAX:
        raise ParamError("threads", f"threads must be at most {THREADS_MAX} (ggml's thread pool holds no more), "
                         f"got {o.threads}; more threads than cores only slow decoding down")
    if o.n_ctx > N_CTX_MAX:
        raise ParamError("n_ctx", f"n_ctx must be at most {N_CTX_MAX} (llama.cpp counts positions in 32 bits), "
                         f"got {o.n_ctx}; a context holds the prompt and the reply, and its memory grows with it")
    for name, allowed in (("draft_kv", get_args(DraftKV)), ("flash_attn", (None, *get_args(FlashAttn))),
                          ("sampling", get_args(SamplingPath))):
        if getattr(o, name) not in allowed:
            names = ", ".join(repr(a) for a in allowed if a is not None)
            raise ParamError(name, f"{name} must be one of {names}, got {getattr(o, name)!r}")
    if isinstance(o.prompt_cache_mib, bool) or not isinstance(o.prompt_cache_mib, numbers.Real) \
            or not 0 <= o.prompt_cache_mib < float("inf"):
        raise ParamError("prompt_cache_mib", f"prompt_cache_mib must be a number >= 0 (0 turns the prompt cache "
                         f"off), got {o.prompt_cache_mib!r}")
    if isinstance(o.checkpoint_every, bool) or not isinstance(o.checkpoint_every, int) or o.checkpoint_every < 0:
        raise ParamError("checkpoint_every", f"checkpoint_every must be an integer >= 0 (0: snapshots only at the "
                         f"ends of prompts and generations), got {o.checkpoint_every!r}")
    if o.rpc_timeout is not None and (isinstance(o.rpc_timeout, bool) or not isinstance(o.rpc_timeout, numbers.Real)
                                      or not 0 < o.rpc_timeout < float("inf")):
        raise ParamError("rpc_timeout", f"rpc_timeout must be a number of seconds > 0 (None: no limit), "
                         f"got {o.rpc_timeout!r}")
    try:
        parse_endpoints(o.rpc)
    except ValueError as exc:
        raise ParamError("rpc", str(exc)) from None
    if o.tensor_split is not None and not o.rpc:
        raise ParamError("tensor_split", "tensor_split splits the layers between this host and rpc workers: "
                         "pass rpc='host:port[,host:port...]' too")
    if o.tensor_split is not None and not _shares(o.tensor_split):
        raise ParamError("tensor_split", f"tensor_split must be finite numbers >= 0 with a positive sum, one per "
                         f"device (this host's first), got {o.tensor_split!r}")
    if o.draft_vocab is not None and o.rpc:      # refused before the weights go to the workers
        raise ParamError("draft_vocab", "draft_vocab with rpc workers is not supported: leave one of them unset")


def _shares(value: object) -> bool:
    return isinstance(value, (tuple, list)) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value) and shares_ok(value)


def check_verify_room(n_batch: int, n_ctx: int, draft_limit: int, name: str = "draft_limit") -> None:
    """A verify batch of ``draft_limit`` + 1 tokens must fit in one ubatch with room to
    spare: llama.cpp's split keeps a drafting sequence's last draft_limit + 1 rows together
    and asserts the ubatch is larger (GGML_ASSERT(n_ubatch > n_keep_tail), an abort), and
    it caps a batch at the context asked for (``n_ctx``; 0: the trained length, larger).
    ``name``: the option that set the limit, refused as the one to lower (the CLI's
    draft_max); by default n_batch or n_ctx, whichever is short."""
    room = min(n_batch, n_ctx) if n_ctx else n_batch
    if draft_limit + 2 <= room:
        return
    short = "n_batch" if room == n_batch else "n_ctx"
    if name != "draft_limit":
        why = f" of {n_batch}" if short == "n_batch" else f", and llama.cpp caps a batch at the context's {n_ctx}"
        raise ParamError(name, f"{name} must be at most {room - 2} (one verify batch holds {name} + 2 "
                               f"tokens{why}), got {draft_limit}")
    caps = "" if short == "n_batch" else "llama.cpp caps a batch at the context, and "
    raise ParamError(short, f"{short}={room} is too small for draft_limit={draft_limit}: {caps}a verify batch of "
                            f"draft_limit+1 tokens must fit in one ubatch with room to spare ({short} >= "
                            f"{draft_limit + 2}, or draft_limit <= {room - 2})")
