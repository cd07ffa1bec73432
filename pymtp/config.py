"""Defaults, the frozen settings that travel between the layers, and their checks.

Each generation parameter has its default in ``DecodeParams`` and its check in
``DecodeParams.validate``, nowhere else: the CLI, the server and the Python API only
translate their input into a ``DecodeParams`` (reading ``DEFAULTS`` for what they show),
and a refusal, a ``ParamError``, into their own kind of error. ``ParamError.param`` names
the parameter, so they can point at their own spelling of it without reading the message.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

DEFAULT_N_CTX = 4096
# llama.cpp sizes a context in steps of this many tokens (llama_context rounds n_ctx up)
CTX_STEP = 256
# the smallest context a load takes (0 aside: the length the model was trained for)
N_CTX_MIN = 16
DEFAULT_N_BATCH = 512
# Recurrent snapshots per sequence (the most drafts one round can roll back in O(1)).
# Each snapshot is one more copy of the recurrent state, so this also caps memory.
DEFAULT_DRAFT_LIMIT = 4
DEFAULT_RS_BUDGET_BYTES = 2 << 30
# ggml's GGML_MAX_N_THREADS: its thread pool holds no more (99,999 crashed the process)
THREADS_MAX = 512
# The prompt cache (issue #11): snapshots of recurrent state kept across requests, in MiB
# for all of a model's sessions together (llama-server's --cache-ram defaults to 8 GiB),
# and a snapshot every this many tokens of a long prefill.
DEFAULT_PROMPT_CACHE_MIB = 2048
DEFAULT_CHECKPOINT_EVERY = 1024
# Seconds one llama.cpp call may wait on an RPC worker before the worker counts as lost
# (a host that vanished without closing its socket would otherwise be waited on forever).
DEFAULT_RPC_TIMEOUT = 300.0
# Most alternatives per position a request of the OpenAI routes may ask logprobs for:
# OpenAI's chat limit (top_logprobs), and vLLM's default max_logprobs, which it applies to
# completions too. The Python API and llama-server's /completion (n_probs) take any count,
# the vocabulary's tokens at most being listed, as llama-server's.
MAX_LOGPROBS = 20
# The most candidates the infill sampler may compare pairwise (DecodeParams.infill): on
# the small model's 8,192-token rows its pass took 0.2 ms at top_k 40, 1 ms at 200, 24 ms
# at 1000, and 0.56 s with no top_k and top_p 0.99 (a flat random row, 2-core CPU); at
# 248,320 tokens, unbounded, one row could hold a slot for minutes.
INFILL_TOP_K_MAX = 1000

# The values a text option takes, written once: the checks and the CLI's choices read them
# with typing.get_args.
Spec = Literal["mtp", "none"]
Rollback = Literal["auto", "checkpoint"]
Accept = Literal["rejection", "exact"]
DraftKV = Literal["auto", "target", "keep"]
FlashAttn = Literal["auto", "on", "off"]
SamplingPath = Literal["auto", "chain", "numpy", "backend"]
# a fixed number of drafts per round, or "auto": the depth policy picks k in 0..draft_limit
# each round (depth.py)
DraftMax = int | Literal["auto"]


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
    draft_kv: DraftKV = "auto"
    # Catch-up rows as one-row decodes (one graph shape per round); None: on a GPU.
    row_by_row: bool | None = None
    # The MTP head drafts over the first draft_vocab ids (and the control tokens after
    # them) instead of the whole vocabulary: its step's LM matmul shrinks with it, the
    # output stays the target's (draft_vocab.py). None: the whole vocabulary.
    draft_vocab: int | None = None
    # Flash attention: "auto", "on" or "off"; None picks per backend. On the CPU backend
    # the flash-attention kernel rounds a multi-row batch differently from one row, so a
    # verify batch drifts from plain decoding (demo model: 0.12 max logit difference, 3/4
    # prompts identical); without it batched rows are bit-identical to one-row decodes.
    # On CUDA no setting makes them identical (only the patch in vendor/llama.cpp/patches with
    # GGML_CUDA_BATCH_INVARIANT=1 does, docs/exactness.md), so None keeps "auto".
    flash_attn: FlashAttn | None = None
    # Where temperature > 0 builds its distributions: "chain" runs llama.cpp's filters (its
    # C sampler chain) on the host over the copied logits, "numpy" the pure numpy filters,
    # "backend" llama.cpp's filters inside the decode graph, so only the filtered
    # candidates and their probabilities leave the device (runs with penalties stay on
    # the host); at temperature 0 "backend" takes llama.cpp's greedy sampler, the argmax
    # in the graph, where the others take it on the host. "auto" is "chain" (on the CPU
    # the fastest: backend sampling works there but costs ms per row at 248k,
    # benchmarks/sampling_cost.py), except on a GPU at a large vocabulary for plain runs
    # and for greedy ones, which take the graph (sampling_route.samples_in_graph says what was
    # measured).
    sampling: SamplingPath = "auto"
    # Prompt cache: a new prompt that starts with what a session or slot holds decodes only
    # the rest. The budget bounds the snapshots of recurrent state it keeps (0: no cache,
    # every generation starts from an empty context); a long prompt is snapshotted every
    # ``checkpoint_every`` tokens (0: only near and at its end, and at a generation's end).
    prompt_cache_mib: float = DEFAULT_PROMPT_CACHE_MIB
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    # llama.cpp RPC workers ("host:port", or several, comma-separated) that hold a share of
    # the layers (pymtp/rpc.py); tensor_split gives the shares, this host's device(s)
    # first, then one per worker device (None: by free memory). rpc_timeout bounds one
    # llama.cpp call that reaches a worker: a worker silent that long counts as lost.
    rpc: str | tuple[str, ...] | None = None
    tensor_split: tuple[float, ...] | None = None
    rpc_timeout: float | None = DEFAULT_RPC_TIMEOUT
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


# llama-server's names for --reasoning-format / "reasoning_format": "auto" and "deepseek"
# split the block off; "none" leaves the reply as the model wrote it; "deepseek-legacy" is
# "deepseek" at the pinned llama.cpp (its server marks a stream's thinking for its content,
# a flag its parsers there no longer read: it splits streams too)
REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")


class ParamError(ValueError):
    """A generation parameter the library refuses.

    ``param`` is its name in the Python API; ``code`` says what kind of refusal it is
    ("invalid_value", or for the prompt "empty_prompt" and "context_length_exceeded");
    ``details`` the numbers behind it, for callers that read them (the server's error
    body carries them: llama-server's ``n_prompt_tokens`` and ``n_ctx``).
    """

    def __init__(self, param: str, message: str, code: str = "invalid_value",
                 details: dict | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.details = details or {}


def check_reasoning_format(fmt: object) -> str:
    """``fmt`` if it is one of REASONING_FORMATS, else a ``ParamError`` naming ``reasoning_format``."""
    if fmt not in REASONING_FORMATS:
        names = ", ".join(map(repr, REASONING_FORMATS))
        raise ParamError("reasoning_format", f"reasoning_format must be one of {names}, got {fmt!r} "
                         '("none" leaves the thinking in the content)')
    return fmt


def check_unicode(value: Any, where: str, param: str | None = None) -> None:
    """Refuse a string UTF-8 cannot hold, in ``value`` (a string, or objects and lists of
    them, keys too): a lone surrogate, which JSON's ``"\\ud800"`` decodes to and llama.cpp's
    C strings cannot take. ``where`` names ``value`` in the message, ``param`` (``where`` if
    None) in the error."""
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack += [(f"{path}.{k}", v) for k, v in value.items()]
            value = "".join(k for k in value if isinstance(k, str))      # the keys
        elif isinstance(value, (list, tuple)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
            continue
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ParamError(param or path, f"{path} holds a lone surrogate ({value[exc.start]!r}), which is "
                                 "not Unicode text; send each character as itself or as a surrogate pair",
                                 "invalid_unicode") from None


@dataclass(frozen=True)
class DecodeParams:
    """One generation request, as the engine sees it (token ids, no text).

    The defaults here are pymtp's defaults, for every caller (see ``DEFAULTS``).
    """

    max_tokens: int = 128
    spec: Spec = "mtp"
    # most drafts per round (<= the model's draft_limit), or "auto": pymtp picks it (depth.py);
    # None, the default: "auto", but SEEDED_DEPTH for a request sampled with a seed (pin_seeded)
    draft_max: DraftMax | None = None
    p_min: float = 0.0                 # stop drafting below this top probability; 0 = never
    temperature: float = 0.0           # 0 = greedy
    top_k: int = 0                     # 0 = off
    top_p: float = 1.0                 # 1 = off
    min_p: float = 0.0                 # 0 = off
    seed: int | None = None            # None = fresh entropy
    # Penalties on the last repeat_last_n tokens (prompt included; -1 = all), llama.cpp's:
    # logit / repeat_penalty (x it when <= 0), then - count * frequency - presence.
    repeat_penalty: float = 1.0        # 1 = off
    frequency_penalty: float = 0.0     # 0 = off
    presence_penalty: float = 0.0      # 0 = off
    repeat_last_n: int = 64            # 0 = penalties off
    # Added to chosen tokens' logits before the penalties and filters, as llama.cpp's
    # logit_bias sampler does (OpenAI's logit_bias): token id -> bias in [-100, 100], or
    # -inf to ban the token. Logprobs stay the raw row's (logprobs.py).
    logit_bias: dict[int, float] | None = None
    # llama.cpp's infill sampler after the filters (llama-server's samplers list "infill",
    # which code-completion clients send to /infill): it keeps end-of-generation tokens,
    # folds tokens whose text starts another's into the likelier, and drops the unlikely
    # rest, so a completion ends where the gap does. A support filter: the draw is still
    # the softmax of the row's logits over what it kept. Needs temperature > 0.
    infill: bool = False
    # temperature > 0: "rejection" samples drafts from q and accepts with min(1, p/q);
    # "exact" is llama.cpp's rule (argmax drafts count only if the target samples them).
    accept: Accept = "rejection"
    # "checkpoint" forces the save/restore fallback even where snapshots could roll back.
    rollback: Rollback = "auto"
    # ban every end-of-generation token, as llama-server's ignore_eos does: the text goes
    # on to max_tokens (benchmarks use it for fixed lengths)
    ignore_eos: bool = False
    # Report each generated token's logprob with this many most likely alternatives
    # (0: the token's own only); ``prompt_logprobs`` the same for the prompt's tokens.
    # None: not computed at all (logprobs.py says what a logprob is).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Reuse what the session or slot holds of the prompt (the prompt cache), and keep
    # this one for the next; False decodes it all from an empty sequence.
    cache_prompt: bool = True
    # Constrained decoding (constraint.py): every generated token keeps the text inside a
    # GBNF grammar (llama.cpp's format, start rule "root"), or inside a JSON schema (a dict,
    # or its JSON text); at most one of the two. Drafts and verify rows are masked alike,
    # so speculative output stays what constrained plain decoding gives.
    grammar: str | None = None
    json_schema: dict | str | None = None
    # OpenAI's Predicted Outputs (prediction.py): token ids the reply is expected to repeat
    # (the Python API and the server take the text too). Where the reply runs along them
    # they are the round's drafts instead of the MTP head's; the output is unchanged, only
    # its speed. MTP runs only (they roll the target back); plain decoding ignores it.
    prediction: tuple[int, ...] | None = None
    # A reasoning budget (reasoning_budget.py, llama-server's --reasoning-budget): the most
    # tokens a <think> block may take before its end tag is forced, which
    # reasoning_budget_message precedes; 0 closes a block the prompt opened at once; None or
    # -1: no budget. Forced tokens are masks, so speculative output stays plain decoding's.
    reasoning_budget: int | None = None
    reasoning_budget_message: str = ""
    # whether the prompt leaves a <think> block open for the budget to count in: a chat's
    # (reasoning.block_at_start); None reads the prompt's last tokens (a raw prompt)
    reasoning_opened: bool | None = None

    @property
    def budgeted(self) -> bool:
        """Whether a reasoning budget applies (``reasoning_budget`` >= 0)."""
        return self.reasoning_budget is not None and self.reasoning_budget >= 0

    @property
    def bans_end(self) -> bool:
        """Whether ``ignore_eos`` bans the end tokens: without a grammar or schema, whose
        states leave them out instead while they allow anything else (constraint.Mask), so
        that a grammar's end still ends the text."""
        return self.ignore_eos and self.grammar is None and self.json_schema is None

    def validate(self, draft_limit: int) -> None:
        """Raise ``ParamError`` naming the first bad field and what it accepts.

        ``draft_limit`` is the loaded model's snapshot count, the most drafts it can
        roll back (``Model.draft_limit``).
        """
        _choice("spec", self.spec, get_args(Spec))
        _integer("max_tokens", self.max_tokens, minimum=1)
        # draft_max matters only with MTP; plain decoding takes any integer there
        if self.draft_max not in ("auto", None):
            if not is_int(self.draft_max):
                raise ParamError("draft_max", f'draft_max must be an integer or "auto", got {self.draft_max!r}')
            _integer("draft_max", self.draft_max, minimum=1 if self.spec == "mtp" else None,
                     hint=' (or "auto")')
        if self.spec == "mtp" and self.draft_max not in ("auto", None) and self.draft_max > draft_limit:
            raise ParamError("draft_max", (
                f"draft_max={self.draft_max} exceeds this model's snapshot limit of {draft_limit}; "
                f"lower draft_max, or load the model for {self.draft_max} drafts (pymtp's --draft-max "
                f"{self.draft_max} at start, load(..., draft_limit={self.draft_max}) in Python)"))
        _fraction("p_min", self.p_min)
        check_temperature(self.temperature)
        check_top_k(self.top_k)
        check_top_p(self.top_p)
        check_min_p(self.min_p)
        check_repeat_penalty(self.repeat_penalty)
        check_frequency_penalty(self.frequency_penalty)
        check_presence_penalty(self.presence_penalty)
        check_repeat_last_n(self.repeat_last_n)
        check_logit_bias(self.logit_bias)
        if not isinstance(self.infill, bool):
            raise ParamError("infill", f"infill must be true or false, got {self.infill!r}")
        if self.infill and (self.grammar is not None or self.json_schema is not None):
            raise ParamError("infill", "the infill sampler cannot follow a grammar or json_schema: its "
                             "end-of-text fallback can break the grammar; send one or the other")
        if self.infill and self.temperature == 0.0:
            raise ParamError("infill", "the infill sampler needs temperature > 0: greedy decoding takes "
                             "the row's argmax, which the infill sampler would change; raise temperature "
                             "or leave infill off")
        if self.infill and not 1 <= self.top_k <= INFILL_TOP_K_MAX:
            raise ParamError("top_k", f"the infill sampler compares every pair of candidates, so it needs top_k "
                             f"from 1 to {INFILL_TOP_K_MAX} (got {self.top_k}: send top_k, and on the server list "
                             f"top_k in samplers too; code-completion plugins send 40)")
        if self.seed is not None:    # numpy's own message for a negative seed named no parameter
            _integer("seed", self.seed, minimum=0, hint=" (or None for a fresh one)")
        _choice("accept", self.accept, get_args(Accept))
        _choice("rollback", self.rollback, get_args(Rollback))
        for name in ("cache_prompt", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ParamError("grammar", f"grammar must be a GBNF grammar as a string, got {type(self.grammar).__name__}")
        if self.grammar is not None:
            check_unicode(self.grammar, "grammar")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise ParamError("json_schema", "json_schema must be a JSON schema (a dict or its JSON text), "
                             f"got {type(self.json_schema).__name__}")
        if self.grammar is not None and self.json_schema is not None:
            raise ParamError("json_schema", "give grammar or json_schema, not both: a JSON schema is "
                             "turned into a grammar of its own")
        if self.reasoning_budget is not None:
            _integer("reasoning_budget", self.reasoning_budget, minimum=-1,
                     hint=" (the most tokens of thinking; -1 or None for no budget)")
        if not isinstance(self.reasoning_budget_message, str):
            raise ParamError("reasoning_budget_message", "reasoning_budget_message must be a string (the text "
                             f"written before the forced end tag), got {type(self.reasoning_budget_message).__name__}")
        check_unicode(self.reasoning_budget_message, "reasoning_budget_message")
        if not (self.reasoning_opened is None or isinstance(self.reasoning_opened, bool)):
            raise ParamError("reasoning_opened", "reasoning_opened must be True, False or None (read from the "
                             f"prompt), got {self.reasoning_opened!r}")
        if self.infill and self.budgeted:
            raise ParamError("infill", "the infill sampler cannot follow a reasoning budget: its end-of-text "
                             "fallback can refuse the forced end tag; send one or the other")
        if self.prediction is not None and not (
                isinstance(self.prediction, tuple) and all(is_int(t) and t >= 0 for t in self.prediction)):
            raise ParamError("prediction", "prediction must be the token ids the reply is expected to repeat, "
                             "as a tuple (generate, stream, submit and the server take the text, or a list, "
                             f"too), got {_short(self.prediction)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 0):
                raise ParamError(name, f"{name} must be an integer >= 0 (the most likely alternatives "
                                 f"listed, the vocabulary's at most; None for none), got {value!r}")


DEFAULTS = DecodeParams()

# The depth a request sampled with a seed drafts where it left draft_max to its default
# (``pin_seeded``): the fixed default before auto was.
SEEDED_DEPTH = 3


def pin_seeded(p: DecodeParams, draft_limit: int) -> DecodeParams:
    """``p`` with its default draft_max (None) made what a request runs: "auto", or
    SEEDED_DEPTH (within ``draft_limit``) where it samples (temperature > 0) with a seed.

    Every depth is lossless, but at temperature > 0 the text a seed gives depends on the
    depth: rejection sampling draws a uniform per examined draft, plain decoding draws
    its own. Auto's depth follows measured speed, so the same seed would not give the
    same text twice; at one fixed depth it does, as a user of llama-server or vLLM
    expects of a seed. A request that asks for "auto" gets it, seed or not (``pymtp
    bench`` measures auto so)."""
    if p.draft_max is not None:
        return p
    return replace(p, draft_max=min(SEEDED_DEPTH, draft_limit) if drafts_steer_seed(p) else "auto")


def drafts_steer_seed(p: DecodeParams) -> bool:
    """Whether the drafts decide which text ``p``'s seed gives: an MTP request sampled
    with a seed (the distribution never depends on them, greedy tokens neither). Such a
    request gets a fixed depth (``pin_seeded``) and a drafter that holds every row a cold
    run's would (``PromptCache.usable``'s ``exact``)."""
    return p.spec == "mtp" and p.seed is not None and p.temperature > 0


def parse_draft_max(value: object) -> DraftMax:
    """A draft_max from text or JSON: "auto" or an integer (validate() checks its range)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ParamError("draft_max", f'draft_max must be an integer or "auto", got {value!r}')


def shown_draft_max(draft_max: DraftMax | None) -> DraftMax:
    """The default (None) as a user reads it: "auto" (``pin_seeded``'s exception aside)."""
    return "auto" if draft_max is None else draft_max


def held_tokens(n_ctx: int) -> int:
    """The tokens a sequence's context holds when asked for ``n_ctx``: llama.cpp rounds it
    up to a multiple of CTX_STEP (300 holds 512), for each sequence of a batched one too."""
    return -(-n_ctx // CTX_STEP) * CTX_STEP


def draft_limit_for(draft_max: DraftMax | None) -> int | None:
    """The ``draft_limit`` to load a model with so that it can serve ``draft_max``:
    None (the load default, DEFAULT_DRAFT_LIMIT or fewer to fit the memory budget) when
    that covers it ("auto" included: it drafts up to whatever the model has), else
    ``draft_max`` itself."""
    return draft_max if draft_max not in ("auto", None) and draft_max > DEFAULT_DRAFT_LIMIT else None


# -- the checks, shared with the sampling module's filters ------------------------------

# Positive temperatures outside these scale float32 logits past their range: a row of
# inf or of zeros, which drew wrong tokens (1e-38 on llama.cpp's chain) or raised (1e39
# with top_p in the graph)
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-30, 1e30


def check_temperature(value: object) -> None:
    _number("temperature", value)
    if not 0.0 <= value < math.inf:
        raise ParamError("temperature", f"temperature must be finite and >= 0, got {value!r}")
    if value and not TEMPERATURE_MIN <= value <= TEMPERATURE_MAX:
        raise ParamError("temperature", f"temperature must be 0 (greedy) or from {TEMPERATURE_MIN:g} to "
                         f"{TEMPERATURE_MAX:g}, got {value!r}: past them float32 logits overflow")


def check_top_k(value: object) -> None:
    _integer("top_k", value, minimum=0, hint=" (0 disables it)")


def check_top_p(value: object) -> None:
    _fraction("top_p", value, zero=False)


def check_min_p(value: object) -> None:
    _fraction("min_p", value)


def check_repeat_penalty(value: object) -> None:
    _number("repeat_penalty", value)
    if not 0.0 < value < math.inf:
        raise ParamError("repeat_penalty", f"repeat_penalty must be finite and > 0 (1 disables it), got {value!r}")


def check_frequency_penalty(value: object) -> None:
    _penalty("frequency_penalty", value)


def check_presence_penalty(value: object) -> None:
    _penalty("presence_penalty", value)


def check_repeat_last_n(value: object) -> None:
    _integer("repeat_last_n", value, minimum=-1, hint=" (0 disables penalties, -1 looks at every token)")


# OpenAI's range for a logit_bias value; -inf (llama-server's ``false``) bans the token.
LOGIT_BIAS_MAX = 100.0


def in_bias_range(bias: float) -> bool:
    """OpenAI's range for one bias, or -inf (llama-server's ban)."""
    return -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX or bias == -math.inf


def added_bias(a: float, b: float) -> float:
    """Two biases one token was given, as llama.cpp applies both: their sum, held within
    the range each was checked against (two -60s are -100, not a refused -120)."""
    total = a + b
    return total if math.isinf(total) else min(max(total, -LOGIT_BIAS_MAX), LOGIT_BIAS_MAX)


def check_logit_bias(value: object, n_vocab: int | None = None) -> None:
    """A mapping of token ids (within ``n_vocab`` once a model is known) to biases."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ParamError("logit_bias", f"logit_bias must map token ids to biases (a dict), got {value!r}")
    for token, bias in value.items():
        if not is_int(token) or token < 0:
            raise ParamError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if n_vocab is not None and token >= n_vocab:
            raise ParamError("logit_bias", f"logit_bias names token {token}, but this model's vocabulary has "
                             f"{n_vocab} tokens (ids 0 to {n_vocab - 1})")
        _number("logit_bias", bias)
        if not in_bias_range(bias):
            raise ParamError("logit_bias", f"logit_bias for token {token} must be in [-100, 100] "
                             f"(or -inf to ban it), got {bias!r}")


def check_bans(banned: int, n_vocab: int) -> None:
    """Something must be left to draw: ``banned`` distinct ids (logit_bias's -inf, and the
    end tokens ignore_eos bans) against the vocabulary's ``n_vocab``."""
    if banned >= n_vocab:
        # each path went its own way: llama.cpp's draw took a banned token, numpy's raised
        raise ParamError("logit_bias", f"logit_bias bans every token of the vocabulary ({n_vocab}), so nothing is "
                         "left to draw: leave at least one token unbanned (ignore_eos bans the end tokens too)")


def _penalty(name: str, value: object) -> None:
    """OpenAI's range for its presence and frequency penalties."""
    _number(name, value)
    if not -2.0 <= value <= 2.0:
        raise ParamError(name, f"{name} must be in [-2, 2] (0 disables it), got {value!r}")


def is_int(x: object) -> bool:
    """An integer, not a bool (True would pass for 1 and hide a mistake)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _short(value: object) -> str:
    """A value's repr for a message, cut where it would swamp it (a prediction may be a file)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _integer(name: str, value: object, *, minimum: int | None, hint: str = "") -> None:
    if not is_int(value):
        raise ParamError(name, f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ParamError(name, f"{name} must be an integer >= {minimum}{hint}, got {value!r}")


def _number(name: str, value: object) -> None:
    """A real number, not a bool, not NaN (a str or None used to fail deep inside as a TypeError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ParamError(name, f"{name} must be a number, got {value!r}")


def _fraction(name: str, value: object, *, zero: bool = True) -> None:
    """A number in [0, 1], or in (0, 1] where 0 has no meaning (``zero=False``)."""
    _number(name, value)
    if not ((0.0 <= value if zero else 0.0 < value) and value <= 1.0):
        raise ParamError(name, f"{name} must be in {'[' if zero else '('}0, 1], got {value!r}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ParamError(name, f"{name} must be {' or '.join(map(repr, choices))}, got {value!r}")
