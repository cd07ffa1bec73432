"""The public model object: text in, text out, with stop rules, timings and MTP stats.

The engine works on token ids; this layer adds tokenization, incremental UTF-8 decoding,
stop strings and the stats a user reads.
"""

from __future__ import annotations

import codecs
import numbers
import os
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from collections.abc import Iterable
from typing import Iterator, Sequence, get_args

import numpy as np

from .chat import chat_prompt, continuation, template_for
from .chat_messages import read_messages
from .constraint import constraint_for, json_schema_grammar
from .config import (DEFAULT_DRAFT_LIMIT, DEFAULT_N_CTX, N_CTX_MIN, THREADS_MAX, DecodeParams, DraftKV, FlashAttn,
                     LoadOptions, ParamError, SamplingPath, check_logit_bias, check_unicode, held_tokens)
from .depth import ARM_MIN_TOKENS
from .engine import Engine
from .round_state import RunStats, Step
from .scheduler import round_rows, slots_that_fit
from .rounds import prompt_too_long
from .prompt_cache import CacheBudget
from .rpc import Placement, RpcError, parse_endpoints, place
from .gguf_info import ModelInfo, gguf_bytes, inspect, require_mtp
from .guard import Guard, GuardedEngine
from .logprobs import TokenLogprob
from .reasoning import check_format, reply_split, split_reasoning, think_first
from .stops import StopMatcher
from .tools import ToolPlan, compiled_reply_constraint, template_messages

# A prompt longer than this many characters per context token is judged by its head first
# (no tokenizer packs more than a few characters into a token of ordinary text).
PROMPT_HEAD_CHARS_PER_TOKEN = 64
# The most slots generate_batch's and stream_batch's batcher decodes at once; the prompts
# beyond wait for one (a slot is a context's memory; Model.batcher(slots) for more)
BATCH_SLOTS = 16

DEFAULT_MODEL_NAME = "qwen35-tiny-mtp-q8_0.gguf"

# What ``calibrate`` decodes at each depth: plain prose, a timed run of at least twice
# the fewest tokens that draft_max="auto" times (depth.ARM_MIN_TOKENS); it runs until
# the budget is spent (the run under way finishes).
CALIBRATION_PROMPT = ("The history of the river towns is a story of trade, floods and bridges. "
                      "In the spring the water rose, and the merchants moved their goods uphill; "
                      "in the autumn the boats came back with grain, wool and news from the coast.")
CALIBRATION_TOKENS = 2 * ARM_MIN_TOKENS
CALIBRATION_WARM_TOKENS = 16     # an untimed run first at each depth: its decodes' first shapes
# ... whose speed sets the timed run's length: at least CALIBRATION_MIN_S of decoding (up to
# CALIBRATION_MAX_TOKENS), since 64 tokens on an H100 are 30 ms, which one stall can double
CALIBRATION_MIN_S = 0.25
CALIBRATION_MAX_TOKENS = 512
CALIBRATION_BUDGET_S = 10.0
_DECODE_FIELDS = frozenset(f.name for f in fields(DecodeParams))


def default_model_path() -> Path:
    """The small trained Qwen3.5 model with an MTP head that ships inside the package."""
    return Path(str(resources.files("pymtp") / "data" / DEFAULT_MODEL_NAME))


@dataclass(frozen=True)
class Stats:
    """Acceptance and speed of one generation (the CLI's --json ``stats`` object).

    The head's numbers (drafted, accepted, rounds, the per-position lists, mean_accept_len)
    count every round the engine verified, the last one whole where a stop string cut
    its tokens: those drafts were accepted, and the cut says nothing of the head (the
    pinned llama-server counts its drafts so too). ``generated_tokens`` counts the tokens
    output, and ``predicted_accepted`` the prediction's drafts the output kept."""

    drafted: int
    accepted: int
    acceptance_rate: float         # accepted / drafted
    mean_accept_len: float         # tokens a round made (accepted drafts + 1), before any stop string's cut
    accepted_per_position: list[float]
    rounds: int
    tokens_per_second: float       # tokens after the first / decode wall time (from_run)
    prompt_tokens: int
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    checkpoint_restores: int = 0
    cached_tokens: int = 0         # prompt tokens reused from the prompt cache, not decoded
    drafted_at: list[int] = field(default_factory=list)     # drafts made at position i
    accepted_at: list[int] = field(default_factory=list)    # ... and accepted
    # rounds by the drafts planned for them (0: a plain decode), MTP runs only; with
    # draft_max="auto" this is the depth policy's histogram
    depths: dict[int, int] = field(default_factory=dict)
    # a request with a prediction (prediction.py) of prediction_tokens tokens: its drafts,
    # in rounds apart from the head's (not in drafted/accepted/rounds above), and those
    # the output kept
    prediction_tokens: int = 0
    predicted_drafted: int = 0
    predicted_accepted: int = 0
    predicted_rounds: int = 0

    JSON_KEYS = ("drafted", "accepted", "acceptance_rate", "mean_accept_len",
                 "accepted_per_position", "rounds", "tokens_per_second", "prompt_tokens", "depths")

    @classmethod
    def from_run(cls, r: RunStats, spec: bool) -> "Stats":
        """llama-server's timings, so that ``pymtp bench`` compares like with like: the
        prompt phase ends once every context has processed the prompt (for MTP runs the
        drafter's decode of its rows, which pymtp makes after the first token), and the
        decode speed counts the tokens after the first (that one came from the prompt's
        decode) over the time after the prompt phase."""
        t0 = r.decode_from
        decode_s = max(r.t_end - t0, 0.0) if t0 else 0.0
        rounds = r.rounds if spec else 0
        made = r.generated - r.past_stop    # the tokens output, as plain decoding makes them
        return cls(
            drafted=r.drafted, accepted=r.accepted,
            acceptance_rate=(r.accepted / r.drafted) if r.drafted else 0.0,
            mean_accept_len=((r.accepted + r.rounds) / r.rounds) if (spec and r.rounds) else 0.0,
            accepted_per_position=[a / d for a, d in zip(r.accepted_at, r.drafted_at)],
            rounds=rounds,
            tokens_per_second=((made - 1) / decode_s) if decode_s > 0 and made > 1 else 0.0,
            prompt_tokens=r.prompt_tokens, generated_tokens=made,
            prompt_seconds=max(t0 - r.t_start, 0.0) if t0 else 0.0,
            decode_seconds=decode_s, checkpoint_restores=r.checkpoint_restores, cached_tokens=r.cached_tokens,
            drafted_at=list(r.drafted_at), accepted_at=list(r.accepted_at),
            depths=dict(sorted(r.depths.items())) if spec else {},
            prediction_tokens=r.prediction_tokens,
            predicted_drafted=r.predicted_drafted, predicted_accepted=r.predicted_accepted,
            predicted_rounds=r.predicted_rounds)

    def to_dict(self) -> dict:
        """The documented stats object (the CLI's --json ``stats``)."""
        d = asdict(self)
        return {k: d[k] for k in self.JSON_KEYS}


@dataclass(frozen=True)
class Calibration:
    """What a calibration ran: each run's depth in turn (``Session.calibrate``; the depths
    measured, in order, for ``Batcher.calibrate``), how long it took, and draft_max="auto"'s
    estimated tokens a second per depth after it."""

    depths: list[int]
    seconds: float
    estimates: dict[int, float]


@dataclass
class Chunk:
    """A piece of streamed output: the text safe to show and the tokens it came from.

    With ``logprobs=N`` each token has its ``TokenLogprob`` in ``logprobs``; with
    ``prompt_logprobs=N`` the first chunk carries one per prompt token (None for the
    first, which nothing predicts). pymtp/logprobs.py says what is scored.
    """

    text: str
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # the verify round behind ``tokens`` (round_state.Step): drafts verified and accepted,
    # and whether they were the request's prediction's (not the MTP head's);
    # pymtp.origins.token_origins names each token from them
    drafted: int = 0
    accepted: int = 0
    stop_word: str | None = None      # the stop string that ended the text (finish_reason "stop")
    predicted: bool = False
    # prompt tokens the prompt cache spared decoding (Stats.cached_tokens), known from the
    # first chunk on: what a stream's opening usage reports (Anthropic's message_start)
    cached_tokens: int = 0


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str
    prompt_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None                  # one per token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None    # one per prompt token, when asked
    tool_calls: list[dict] | None = None      # chat with tools: OpenAI tool calls the reply made
    reasoning: str | None = None              # chat: the reply's thinking, apart (reasoning.py)


class Session(GuardedEngine):
    """One decoding slot: its own target and MTP contexts on a shared model.

    Sessions on the same Model run in parallel threads without affecting each other's
    output (llama.cpp releases the GIL inside decode). One generation at a time per session:
    a second one from another thread waits for the first; one from the thread whose stream
    is still open raises ``SessionBusyError`` (waiting would deadlock).

    ``close()`` (or the model's) stops a generation running in another thread at its next
    round, where it raises ``ClosedError``; any later use raises ``ClosedError`` too.
    """

    def __init__(self, model: "Model", *, owned: bool = False) -> None:
        o = model.options
        self._bind(model, owned=owned)
        self.engine = Engine(model._native, n_ctx=o.n_ctx, n_batch=o.n_batch, threads=o.threads,
                             draft_limit=model.draft_limit, draft_kv=model.draft_kv,
                             row_by_row=model.row_by_row, flash_attn=model.flash_attn, sampling=model.sampling,
                             cache_budget=model.cache_budget, checkpoint_every=o.checkpoint_every,
                             draft=model._draft)
        self._lock = threading.Lock()
        self._owner: int | None = None    # thread holding _lock (an open stream), for the busy check
        self._guard = Guard("this session is closed; make a new one with model.session()")

    def _check_not_busy(self) -> None:
        if self._owner == threading.get_ident():
            raise SessionBusyError(
                "a stream on this session is still open in this thread, and a second generation "
                "would wait for it forever; finish the first stream or call its .close(), or "
                "run the second one on another session (model.session())")

    def stream(self, prompt: str | Sequence[int], *, stop: str | Sequence[str] | None = None,
               stats_out: list | None = None, **params) -> Iterator[Chunk]:
        """Yield text as rounds are accepted. The last chunk carries ``finish_reason``.

        ``params`` are the fields of ``pymtp.DecodeParams`` (max_tokens, spec, draft_max,
        p_min, temperature, top_k, top_p, min_p, seed, accept, rollback, ignore_eos,
        logprobs, prompt_logprobs), with its defaults. They are checked before the first chunk, so a bad one raises here, a
        ``ParamError`` naming it.
        ``stop`` is a string or a list of strings; the text ends before the first one found.
        ``stats_out``, if given, receives the run's ``Stats`` when the stream ends.
        """
        return self._stream(*self._prepare(prompt, stop, params), stats_out)

    def _prepare(self, prompt: str | Sequence[int], stop: str | Sequence[str] | None,
                 params: dict) -> tuple[list[int], DecodeParams, list[str]]:
        """A generation's checks, in their order, and its ids, parameters and stops."""
        self.model._guard.check()   # the model's message first: it says what was closed
        self._guard.check()
        decode = decode_params(self.model, params)
        self._check_not_busy()
        return self.model.prompt_ids(prompt), decode, _stop_list(stop)

    def _acquire(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._check_not_busy()
            self._lock.acquire()
        self._owner = threading.get_ident()

    def _release(self) -> None:
        self._owner = None
        self._lock.release()

    def _steps(self, ids: list[int], params: DecodeParams, run: RunStats) -> Iterator[tuple]:
        """The engine's steps with each token's bytes, each computed under the native guard.

        Nothing native runs while the consumer holds a chunk, so close() never waits on it.
        """
        native = self.model._native
        steps = self.engine.run(ids, params, run)
        try:
            while True:
                with self._open():
                    step = next(steps, None)
                    if step is None:
                        return
                    pieces = [native.token_to_bytes(t) for t in step.tokens]
                yield step, pieces
        finally:
            steps.close()   # the engine's cleanup touches no native handle (it may be freed)

    def _stream(self, ids: list[int], params: DecodeParams, stop, stats_out) -> Iterator[Chunk]:
        self._acquire()
        try:
            run = RunStats()
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            matcher = StopMatcher(stop)
            try:
                for step, pieces in self._steps(ids, params, run):
                    chunk, past = step_chunk(decoder, matcher, step, pieces)
                    if past:
                        run.stopped_inside(step, past)
                    if chunk is not None:
                        chunk.cached_tokens = run.cached_tokens
                        yield chunk
                        self._owner = threading.get_ident()     # whoever iterates it holds the session
                        if chunk.finish_reason:
                            return
            finally:
                if run.t_end == 0.0:
                    run.t_end = time.perf_counter()
                if stats_out is not None:
                    stats_out.append(Stats.from_run(run, params.spec == "mtp"))
        finally:
            self._release()

    def generate(self, prompt: str | Sequence[int], *, stop: str | Sequence[str] | None = None,
                 **params) -> Result:
        """Run to completion; see ``stream`` for the keywords."""
        stats: list[Stats] = []
        text, tokens, finish = [], [], "length"
        logprobs: list[TokenLogprob] | None = None
        prompt_logprobs = None
        ids, decode, stops = self._prepare(prompt, stop, params)
        for chunk in self._stream(ids, decode, stops, stats):
            text.append(chunk.text)
            tokens.extend(chunk.tokens)
            if chunk.logprobs is not None:
                logprobs = (logprobs or []) + chunk.logprobs
            prompt_logprobs = prompt_logprobs or chunk.prompt_logprobs
            if chunk.finish_reason:
                finish = chunk.finish_reason
        return Result("".join(text), tokens, stats[0], finish, prompt_tokens=ids, logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs)

    def calibrate(self, prompt: str | Sequence[int] | None = None, *,
                  budget_s: float = CALIBRATION_BUDGET_S, **params) -> Calibration:
        """Run draft_max="auto"'s search for one kind of request now, on ``prompt``
        (CALIBRATION_PROMPT by default), instead of on the first requests of that kind.

        The kind is what ``params`` make it (temperature, accept, p_min, a grammar:
        engine.arm_kind); spec and draft_max are "mtp" and "auto", and max_tokens (the
        fewest a timed run decodes), ignore_eos and cache_prompt default to
        CALIBRATION_TOKENS, True and False. Each timed run is a request at a depth not
        yet measured (the limit, plain decoding, then the rest from the limit down), timed
        as a request is, until none is left or ``budget_s`` is spent. The prices come
        from that prompt, whose acceptance is not the requests': a request's first
        measure of a depth replaces the calibration's price, and where no request of the
        kind had drafted, the next request drafts at the limit to replace the prompt's
        acceptance with the texts' (depth.Arms.calibrated). The requests after it start
        at the leader, and go on correcting the estimates as they would have. What this
        gives auto is measured in benchmarks/README.md (sessions 29, 36 and 37). A kind
        searched already runs only the depths it has not measured."""
        if not (isinstance(budget_s, numbers.Real) and budget_s >= 0):
            raise ParamError("budget_s", f"budget_s must be a number of seconds >= 0, got {budget_s!r}")
        params = {"max_tokens": CALIBRATION_TOKENS, "ignore_eos": True, "cache_prompt": False,
                  **params, "spec": "mtp", "draft_max": "auto"}
        decode = decode_params(self.model, params)
        if decode.max_tokens < ARM_MIN_TOKENS:
            raise ParamError("max_tokens", f"a calibration run needs max_tokens >= {ARM_MIN_TOKENS}: "
                             f"draft_max='auto' does not time a shorter request; got {decode.max_tokens}")
        arms = self.engine.arms_for(decode)
        texts = all(g is None for g in arms.gains)     # no request of this kind drafted yet
        text = CALIBRATION_PROMPT if prompt is None else prompt
        t0 = time.perf_counter()
        depths: list[int] = []
        # a run too short to time (an early end of generation) measures nothing: at most
        # one run a depth. Every depth, not only those the prompt's acceptance could put
        # ahead: that acceptance is replaced by the texts' (``calibrated``), which may put
        # another ahead, and a depth first measured on a request is priced by that
        # request's text too (H100, small model: k=2, measured on requests after the
        # texts' probe, led five of 16 and auto ran 0.92x of k=4)
        arms.exhaustive = True
        try:
            while ((k := arms.untried()) is not None and len(depths) <= self.model.draft_limit
                   and time.perf_counter() - t0 < budget_s):
                # Untimed first: a depth's first decodes pay for their shapes (compute buffers;
                # a GPU captures a CUDA graph a shape). Timed cold, the limit, run first, was
                # priced at 0.4-0.6x of its speed in the bench right after (H100 and two CPU
                # threads, benchmarks/README.md).
                warm = self.generate(text, **{**params, "max_tokens": CALIBRATION_WARM_TOKENS,
                                              **({"draft_max": k} if k else {"spec": "none"})})
                n = min(CALIBRATION_MAX_TOKENS, int(warm.stats.tokens_per_second * CALIBRATION_MIN_S))
                timed = self.generate(text, **{**params, "max_tokens": max(decode.max_tokens, n)})
                depths.append(max(timed.stats.depths, default=0))
        finally:
            arms.exhaustive = False
        arms.calibrated(depths, texts and prompt is None)    # a request's first measure replaces these
        return Calibration(depths, time.perf_counter() - t0,
                           {k: round(arms.rate(k), 1) for k in sorted(arms.round_s)})

    def chat(self, messages: Sequence[dict], *, stop: str | Sequence[str] | None = None,
             template_kwargs: dict | None = None, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool = True,
             reasoning_format: str = "auto", add_generation_prompt: bool | None = None,
             continue_final_message: bool | str | None = None, **kwargs) -> Result:
        """The assistant's reply to ``messages`` (``{"role": ..., "content": ...}`` dicts),
        rendered with the GGUF's chat template (plain ChatML without one, which also
        stops at ``<|im_end|>``); the keywords are ``stream``'s.

        ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are OpenAI's (pymtp/tools.py):
        the reply's calls come back in ``Result.tool_calls``, its other text in ``text``,
        and ``finish_reason`` is "tool_calls"; "required" or a named function constrains
        the reply to calls. A ``grammar`` or ``json_schema`` beside tools is the text
        reply's: under "auto" the reply is calls or that format. An assistant message may carry ``tool_calls`` and ``tool``
        messages the results.

        ``reasoning_format`` (llama-server's names, reasoning.FORMATS): other than "none",
        a reasoning model's leading ``<think>`` block comes back in ``Result.reasoning``
        and the rest in ``text`` (calls are read from that rest), where the chat template
        is a reasoning model's (it speaks of ``<think>``); "none" leaves ``text`` as the
        model wrote it. An assistant message may carry its ``reasoning_content``.

        Messages that end with an assistant message continue it, as the server does
        (``chat.continuation`` reads ``add_generation_prompt`` and ``continue_final_message``
        as llama-server does): the reply's ``text`` starts with that message's text.

        A conversation continued on the same session (its messages, this reply, a new
        message) decodes only what is new: the prompt cache holds the rest."""
        check_format(reasoning_format)
        messages = read_messages(messages)
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise ParamError("template_kwargs", f"template_kwargs must be a dict of the template's variables, got "
                             f"{type(template_kwargs).__name__}")
        template = self.model.chat_template_for_prompts()
        plan = ToolPlan.of(tools, tool_choice, parallel_tool_calls)
        extra = dict(template_kwargs or {})
        if plan is not None and plan.template_tools:
            extra["tools"] = plan.template_tools
        schema = kwargs.get("json_schema") is not None
        if plan is not None:        # beside a format the reply is calls or that format
            plan = plan.beside(schema or kwargs.get("grammar") is not None)
        kwargs["grammar"], kwargs["json_schema"] = compiled_reply_constraint(
            self.model._native, plan, kwargs.get("grammar"), kwargs.get("json_schema"), xml=template.xml_calls)
        messages = template_messages(list(messages))
        # a forced call, or calls or a schema's JSON: a grammar of pymtp's, which may think
        # first (a raw grammar is the caller's, with tools or not)
        forced = plan is not None and plan.parses and (plan.grammar is not None or schema)
        add, cont = continuation(messages, add_generation_prompt, continue_final_message,
                                 forced or kwargs.get("grammar") is not None or kwargs.get("json_schema") is not None)
        ids, tail = chat_prompt(self.model, template, messages, extra=extra, add_generation_prompt=add,
                                continue_final=cont)
        prefill = template.text_of(messages[-1].get("content")) if cont else ""
        opened = reply_split(reasoning_format, False, template.thinks, tail, prefill)
        if opened is not None and (forced or (kwargs.get("json_schema") is not None and kwargs.get("grammar") is None)):
            # a forced call or a schema formats the reply from its first token: let it think first
            source = kwargs["grammar"] if forced else json_schema_grammar(kwargs["json_schema"])
            kwargs.update(grammar=think_first(source, opened), json_schema=None)
        # the fallback template's end of turn as text, but where a grammar of pymtp's ends the
        # reply itself (the text may be inside its JSON)
        turn_ends = () if forced or schema else template.stop_strings
        result = self.generate(ids, stop=_stop_list(stop) + list(turn_ends), **kwargs)
        result.text = prefill + result.text
        if opened is not None:
            result.reasoning, result.text = split_reasoning(result.text, opened)
        if plan is not None:
            if result.finish_reason == "length":
                result.text = plan.uncut(result.text)
            content, calls = plan.read(result.text)
            if calls:
                result.text, result.tool_calls = content, calls
                if result.finish_reason == "stop":
                    result.finish_reason = "tool_calls"
        return result


def step_chunk(decoder, matcher: StopMatcher, step: Step, pieces: list[bytes]) -> tuple[Chunk | None, int]:
    """The Chunk of one engine Step (None: nothing to show yet), cut at a stop string as
    plain decoding would cut it, and how many of the Step's tokens came past that string."""
    text, n_hit = _feed(decoder, matcher, pieces)
    lps, prompt_lps = step.logprobs, step.prompt_logprobs
    rnd = dict(drafted=step.drafted, accepted=step.accepted, predicted=step.predicted)
    if n_hit is not None:    # the tokens after the stop are not output
        return Chunk(text, step.tokens[:n_hit], "stop", None if lps is None else lps[:n_hit], prompt_lps, **rnd,
                     stop_word=matcher.matched), len(step.tokens) - n_hit
    if step.finish:     # bytes of an unfinished character read as U+FFFD, which a stop may hold
        tail, hit = matcher.feed(decoder.decode(b"", final=True))
        if hit:
            return Chunk(text + tail, list(step.tokens), "stop", lps, prompt_lps, **rnd,
                         stop_word=matcher.matched), 0
        return Chunk(text + tail + matcher.flush(), list(step.tokens), step.finish, lps, prompt_lps, **rnd), 0
    if text or step.tokens:
        return Chunk(text, list(step.tokens), None, lps, prompt_lps, **rnd), 0
    return None, 0


def _feed(decoder, matcher: StopMatcher, pieces: list[bytes]) -> tuple[str, int | None]:
    """A step's text, its tokens fed one at a time as plain decoding feeds them, and how
    many of them it took to hit a stop string (None: no hit). Feeding the step whole
    could find a different stop string, or keep tokens plain decoding never made."""
    out = []
    for i, piece in enumerate(pieces):
        text, hit = matcher.feed(decoder.decode(piece))
        out.append(text)
        if hit:
            return "".join(out), i + 1
    return "".join(out), None


# What an OpenAI or llama-cpp-python keyword is in this API, for the error that refuses it
_INSTEAD = {
    "response_format": "pass json_schema= (the schema itself, a dict) or grammar= (GBNF)",
    "n": "call generate once per choice, with its own seed (or generate_batch with the prompt repeated)",
    "max_completion_tokens": "pass max_tokens=",
    "n_predict": "pass max_tokens=",
    "stream": "call stream() for chunks, generate() for the whole reply",
    "stats_out": "only stream() takes it; generate()'s Result carries .stats",
    "top_logprobs": "pass logprobs=N (alternatives per token, 0-20)",
    "repetition_penalty": "pass repeat_penalty=",
    "stop_sequences": "pass stop=",
}


def decode_params(model: "Model", params: dict) -> DecodeParams:
    """A generation's keywords as ``DecodeParams``, checked as every way to generate checks them."""
    unknown = sorted(set(params) - _DECODE_FIELDS)
    if unknown:
        hints = "".join(f"; {name}: {_INSTEAD[name]}" for name in unknown if name in _INSTEAD)
        raise TypeError(f"unknown keyword(s) {', '.join(unknown)}; generation takes stop and the fields of "
                        f"pymtp.DecodeParams (stream takes stats_out too){hints}")
    if "prediction" in params:
        params = {**params, "prediction": prediction_ids(model, params["prediction"])}
    limit = params.get("max_tokens", 1)
    if limit is None or type(limit) is int and limit == -1:
        params = {**params, "max_tokens": model.n_ctx}    # no limit but the context's end, as -n -1
    elif type(limit) is int and limit < 1:
        raise ParamError("max_tokens", f"max_tokens must be an integer >= 1, or -1 or None for no limit but the "
                         f"context's end; got {limit}")
    if not model.info.has_mtp and not {"spec", "draft_max"} & params.keys():
        params = {**params, "spec": "none"}     # as pymtp serve's default on such a model: plain decoding
    decode = DecodeParams(**params)
    decode.validate(model.draft_limit)
    # against the vocabulary here, before a request is queued: a batched engine admits
    # requests in its stepping thread, where a refusal would stop every slot's round
    check_logit_bias(decode.logit_bias, model.n_vocab)
    if decode.spec == "mtp":
        require_mtp(model.info)
    with model._guard.use():     # compiled now, so that a bad grammar is refused here
        constraint_for(model._native, decode.grammar, decode.json_schema)
    return decode


def prediction_ids(model: "Model", value: object) -> object:
    """A prediction (OpenAI's Predicted Outputs) as the token ids ``DecodeParams`` holds:
    a text is tokenized as the reply would spell it (no BOS, special-token text left as
    text); ids must lie in the vocabulary. None or an empty one: none. Anything else is
    handed on for ``DecodeParams.validate`` to refuse."""
    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        return None
    if isinstance(value, str):
        return tuple(model.tokenize(value, add_special=False))
    if isinstance(value, np.ndarray) and value.ndim != 1:
        return value
    if isinstance(value, (list, tuple, np.ndarray)):
        ids = tuple(value)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_)) for t in ids):
            return ids
        n_vocab = model.n_vocab
        bad = next((int(t) for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ParamError("prediction", f"prediction holds token id {bad}, outside this model's vocabulary "
                             f"of {n_vocab}; send the predicted text, or ids from model.tokenize")
        return tuple(int(t) for t in ids)     # numpy ints too (their range was checked above)
    return value


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


def _stop_list(stop: str | Sequence[str] | None) -> list[str]:
    """A string is one stop string (not one per character, as iterating it would give)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise ParamError("stop", f"stop must be a string or a list of strings, got {stop!r}")
    return stops


class SessionBusyError(RuntimeError):
    """A second generation was started on a session whose stream is open in this thread."""


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


def _check_options(o: LoadOptions) -> None:
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
    if o.tensor_split is not None and not o.rpc:
        raise ParamError("tensor_split", "tensor_split splits the layers between this host and rpc workers: "
                         "pass rpc='host:port[,host:port...]' too")
    if o.tensor_split is not None and not _shares(o.tensor_split):
        raise ParamError("tensor_split", f"tensor_split must be finite numbers >= 0 with a positive sum, one per "
                         f"device (this host's first), got {o.tensor_split!r}")
    if o.draft_vocab is not None and o.rpc:      # refused before the weights go to the workers
        raise ParamError("draft_vocab", "draft_vocab with rpc workers is not supported: leave one of them unset")


def _shares(value: object) -> bool:
    from .rpc import shares_ok

    return isinstance(value, (tuple, list)) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value) and shares_ok(value)


class Model:
    """A loaded Qwen3.5 GGUF. ``generate``/``stream`` use a default session; make more
    with ``session()`` to decode several sequences at once."""

    def __init__(self, path: str | os.PathLike | None = None, options: LoadOptions | None = None) -> None:
        self.options = options or LoadOptions()
        _check_options(self.options)
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
        if o.n_batch < self.draft_limit + 2:
            raise ParamError(
                "n_batch", f"n_batch={o.n_batch} is too small for draft_limit={self.draft_limit}: a verify batch "
                f"of draft_limit+1 tokens must fit in one ubatch with room to spare "
                f"(n_batch >= {self.draft_limit + 2})")
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
        self.sampling = o.sampling      # "auto": rounds.samples_in_graph decides per run
        # one budget for the prompt caches of every session and batcher of this model
        self.cache_budget = CacheBudget(int(o.prompt_cache_mib * 2**20)) if o.prompt_cache_mib > 0 else None
        self._guard = Guard("this model is closed; load it again with pymtp.load()")
        self._template = None
        self._special_texts: list[bytes] | None = None    # may_parse_special reads them
        # sessions and batchers, closed with the model (before it frees the llama model their
        # contexts use); one closed before leaves the set (GuardedEngine.close), one dropped
        # by the app goes by itself (held weakly: the engine holds the model)
        self._sessions: weakref.WeakSet = weakref.WeakSet()
        self._batchers: dict = {}          # engine -> the Batcher generate_batch uses
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
        would be alone. ``follow``: a batcher stepped beside this one, whose draft_max="auto"
        search picks the depth for both (depth_batched.Following)."""
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
        the first follows the first's depths (``follow``), made anew with it."""
        slots = min(n, BATCH_SLOTS, self._slots_that_fit())
        b = self._batchers.get(i)
        if b is None or b._guard.closed or (follow is not None and b.follows is not follow) \
                or (b.slots < slots and not b.busy):
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
            return self._batcher_for(len(prompts)).generate(prompts, **kwargs)
        groups, start = [], 0
        try:        # every prompt is checked before any decodes
            for i, n in enumerate(sizes):
                b = self._batcher_for(n, i, groups[0][0] if groups else None)
                groups.append((b, b.submit_all(prompts[start:start + n], first_index=start, **kwargs)))
                start += n
        except BaseException:
            for b, runs in groups:
                for run in runs:
                    b.cancel(run)
            raise
        with ThreadPoolExecutor(len(groups), thread_name_prefix="pymtp-engine") as pool:
            futures = [pool.submit(b.results, runs) for b, runs in groups]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:      # the other engines' prompts would run for no one
                for b, runs in groups:
                    for run in runs:
                        b.cancel(run)
                raise failed
            return [r for f in futures for r in f.result()]

    def stream_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs) -> Iterator[tuple[int, Chunk]]:
        """Yield (index of the prompt, chunk) as the batched rounds are accepted."""
        prompts = _prompt_list(prompts)
        if not prompts:     # still a stream: close() as on any other
            return _Holding(self, iter(()))
        return _Holding(self, self._batcher_for(len(prompts)).stream(prompts, **kwargs))

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
                    "to a few hundredths of a logit (seen: 23/24 prompts on a Q8_0 model); a llama.cpp "
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
        if self._special_texts is None:
            with self._guard.use():
                self._special_texts = self._native.parse_special_texts()
        data = text.encode("utf-8")
        return any(t in data for t in self._special_texts)     # an empty text matches all

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
        ids = list(ids)
        n_vocab = self.n_vocab
        if set(map(type, ids)) <= {int}:    # plain ints (a chat's ids): checked at C speed
            in_range = not ids or (min(ids) >= 0 and max(ids) < n_vocab)
            bad = None if in_range else next(t for t in ids if not 0 <= t < n_vocab)
        else:
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
                        or not 0 <= t < n_vocab), None)
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


def load(path: str | os.PathLike | None = None, **options) -> Model:
    """Load a Qwen3.5 GGUF (the embedded demo model when ``path`` is None)."""
    return Model(path, LoadOptions(**options))
