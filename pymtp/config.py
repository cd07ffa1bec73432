"""Defaults and the frozen settings that travel between the layers."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512
DEFAULT_DRAFT_MAX = 3
# Recurrent snapshots per sequence (the most drafts one round can roll back in O(1)).
# Each snapshot is one more copy of the recurrent state, so this also caps memory.
DEFAULT_DRAFT_LIMIT = 4
DEFAULT_RS_BUDGET_BYTES = 2 << 30
DEFAULT_MAX_TOKENS = 128

Spec = Literal["mtp", "none"]
Rollback = Literal["auto", "checkpoint"]
Accept = Literal["rejection", "exact"]


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded and how big its contexts are."""

    n_ctx: int = DEFAULT_N_CTX
    n_batch: int = DEFAULT_N_BATCH
    threads: int | None = None
    n_gpu_layers: int = -1
    draft_limit: int | None = None     # None: DEFAULT_DRAFT_LIMIT, lowered to fit the budget
    rs_budget_bytes: int = DEFAULT_RS_BUDGET_BYTES
    extra_bufts: bool | None = None    # None: on, except on AMX CPUs (see cpu_has_amx)
    # What the MTP KV keeps of accepted drafts: "target" re-decodes them with the target's
    # hidden rows (best acceptance); "keep" keeps the draft chain's own rows, so a round
    # decodes one MTP row instead of a+1 (-1 pp acceptance at depth 3 on the shared tiny
    # model). "auto": keep on a GPU, where one-row decodes replay as CUDA graphs.
    draft_kv: str = "auto"
    # Catch-up rows as one-row decodes (one graph shape per round); None: on a GPU.
    row_by_row: bool | None = None
    # Flash attention: "auto", "on" or "off"; None picks per backend. On the CPU backend
    # the flash-attention kernel rounds a multi-row batch differently from one row, so a
    # verify batch drifts from plain decoding (demo model: 0.12 max logit difference, 3/4
    # prompts identical); without it batched rows are bit-identical to one-row decodes.
    # On CUDA no setting makes them identical (docs/exactness.md), so None keeps "auto".
    flash_attn: str | None = None
    verbose: bool = False


def cpu_has_amx() -> bool:
    """Whether ggml would use its AMX buffer type here, which crashes (SIGSEGV in
    ggml_backend_amx_mul_mat) on Q8_0 weights in the pinned build; pymtp keeps the extra
    buffer types off on such CPUs, and ``pymtp bench`` starts llama-server with
    --no-repack (vendor/llama.cpp/README.md). Reads /proc/cpuinfo; needs no llama.cpp."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore")
    except OSError:
        return False


@dataclass(frozen=True)
class DecodeParams:
    """One generation request, as the engine sees it (token ids, no text)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    spec: Spec = "mtp"
    draft_max: int = DEFAULT_DRAFT_MAX
    p_min: float = 0.0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    # temperature > 0: "rejection" samples drafts from q and accepts with min(1, p/q);
    # "exact" is llama.cpp's rule (argmax drafts count only if the target samples them).
    accept: Accept = "rejection"
    # "checkpoint" forces the save/restore fallback even where snapshots could roll back.
    rollback: Rollback = "auto"
    ignore_eos: bool = False


def _is_int(x: object) -> bool:
    """An integer, not a bool (True would pass for 1 and hide a mistake)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_types(p: DecodeParams) -> None:
    """Numbers must be numbers: a str or bool used to fail deep inside as a TypeError."""
    for name in ("p_min", "temperature", "top_p", "min_p"):
        value = getattr(p, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
            raise ValueError(f"{name} must be a number, got {value!r}")
    for name in ("max_tokens", "draft_max", "top_k"):
        if not _is_int(getattr(p, name)):
            raise ValueError(f"{name} must be an integer, got {getattr(p, name)!r}")
    if p.seed is not None and not _is_int(p.seed):
        raise ValueError(f"seed must be an integer, got {p.seed!r}")
    if p.seed is not None and p.seed < 0:     # numpy's own message named no parameter
        raise ValueError(f"seed must be an integer >= 0 (or None for a fresh one), got {p.seed!r}")


def validate_decode_params(p: DecodeParams, draft_limit: int) -> None:
    """Raise ValueError naming the bad field and the accepted range."""
    if p.spec not in ("mtp", "none"):
        raise ValueError(f"spec must be 'mtp' or 'none', got {p.spec!r}")
    _check_types(p)
    if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {p.max_tokens!r}")
    if p.spec == "mtp":
        if not isinstance(p.draft_max, int) or p.draft_max < 1:
            raise ValueError(f"draft_max must be an integer >= 1, got {p.draft_max!r}")
        if p.draft_max > draft_limit:
            raise ValueError(
                f"draft_max={p.draft_max} exceeds this model's snapshot limit of {draft_limit}; "
                f"lower draft_max or load the model with draft_limit={p.draft_max}")
    if not (0.0 <= float(p.p_min) <= 1.0):
        raise ValueError(f"p_min must be in [0, 1], got {p.p_min!r}")
    if not isinstance(p.temperature, (int, float)) or p.temperature < 0.0:
        raise ValueError(f"temperature must be a number >= 0, got {p.temperature!r}")
    if p.accept not in ("rejection", "exact"):
        raise ValueError(f"accept must be 'rejection' or 'exact', got {p.accept!r}")
    if p.seed is not None and not isinstance(p.seed, int):
        raise ValueError(f"seed must be an integer, got {p.seed!r}")
    from .sampling import make_sampler

    make_sampler(p.temperature, p.top_k, p.top_p, p.min_p, seed=0)   # raises on a bad filter value
    if p.rollback not in ("auto", "checkpoint"):
        raise ValueError(f"rollback must be 'auto' or 'checkpoint', got {p.rollback!r}")
