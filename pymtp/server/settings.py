"""How one server runs: its speculative defaults, slots, queue and access key."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..config import DecodeParams, check_reasoning_format as check_format

# 16 MiB is thousands of times the longest prompt a context holds; a 50 MB body once took
# 43 s and 5.6 GB to parse before its 400.
DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 30.0
# On SIGTERM/SIGINT, how long running requests may finish (drain.py): with the 2-3 s that
# ending the rest and uvicorn's shutdown take after it, inside docker stop's default 10 s
# grace before its SIGKILL (Kubernetes' is 30 s).
DEFAULT_SHUTDOWN_TIMEOUT = 7.0


@dataclass(frozen=True)
class ServerSettings:
    # What a request gets for each decoding field it leaves out (spec, draft_max and p_min
    # from the command line, the library's defaults for the rest).
    decode: DecodeParams = field(default_factory=DecodeParams)
    parallel: int = 1                 # slots: sequences decoded at the same time
    engines: int | None = None        # batched engines sharing the slots; None: batching.default_engines
    queue: int | None = None          # requests that may wait for a slot; None: 4 per slot
    # any one of these keys is let in (none: no key asked for), as llama-server's --api-key K1,K2
    api_keys: tuple[str, ...] = ()
    model_id: str | None = None       # None: the GGUF's general.name
    aliases: tuple[str, ...] = ()     # more names /v1/models lists (--alias NAME,ALIAS...)
    # --served-model-name NAME,ALIAS...: NAME is the id, and only these names are accepted.
    # Without it any requested name is answered by the one model, as llama-server does,
    # because clients hard-code model names.
    served_names: tuple[str, ...] = ()
    retry_after: int = 1              # seconds, sent with a 503
    max_body_size: int = DEFAULT_MAX_BODY_SIZE    # bytes; a larger body is a 413
    body_timeout: float = DEFAULT_BODY_TIMEOUT    # seconds from the headers to the body's end
    webui: bool = True                # the chat page on GET / (--no-webui turns it off)
    # With draft_max "auto" by default: run auto's search for a full batch at start
    # (Batcher.calibrate) rather than on the first requests (--calibrate). Off: under load
    # on the H100 it raised auto on the small model and lowered it on the demo model
    # (benchmarks/README.md, session 30).
    calibrate: bool = False
    # chat: what a request without "reasoning_format" gets (config.REASONING_FORMATS; llama-server's
    # default, "auto", hands a leading <think> block back as reasoning_content)
    reasoning_format: str = "auto"
    # chat with a thinking template: the most tokens a reply's <think> block may take before
    # its end is forced (reasoning_budget.py), what is written before the end tag then;
    # -1: no budget. llama-server's --reasoning-budget and --reasoning-budget-message; a
    # request's "reasoning_budget_tokens" (or "thinking_budget_tokens") overrides it
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    # /infill puts the suffix before the prefix (llama-server's --spm-infill), as some
    # FIM models were trained
    spm_infill: bool = False
    # GET /slots: each slot's state and last request (llama-server's --slots, on by default)
    slots_endpoint: bool = True
    # CORS: the origins whose browser pages may call the API (cors_origins: "*", as
    # llama-server's --cors-origins default; () answers no preflight)
    cors_origins: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        check_format(self.reasoning_format)      # a ParamError, which is a ValueError
        DecodeParams(reasoning_budget=self.reasoning_budget,
                     reasoning_budget_message=self.reasoning_budget_message).validate(0)

    @property
    def max_queue(self) -> int:
        return 4 * self.parallel if self.queue is None else self.queue


# llama-server's --cors-origins localhost: the Origin of a page served from this machine
LOCALHOST_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?"


def cors_origins(value: str) -> tuple[str, ...]:
    """``--cors-origins`` as llama-server reads it: "*" (any page), "localhost" (pages of
    this machine), or a comma-separated list of origins; "" turns CORS off."""
    return tuple(o.strip() for o in value.split(",") if o.strip())


def default_threads(parallel: int) -> int:
    """Every core: on a CPU the slots share one batched engine (batching.default_engines),
    which makes one decode per round (``parallel`` is kept for callers; it no longer
    splits the cores)."""
    return max(1, os.cpu_count() or 1)
