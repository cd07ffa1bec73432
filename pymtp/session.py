"""One decoding slot's generations: keyword checks, stop strings, chunks and chat.

A Session owns an Engine (its own target and MTP contexts) on a shared Model; this module
turns the engine's token steps into text a user reads, with the checks every way to
generate shares (``decode_params``).
"""

from __future__ import annotations

import codecs
import math
import numbers
import threading
import time
from dataclasses import fields
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from .chat import chat_prompt, continuation
from .chat_messages import read_messages
from .config import (DecodeParams, ParamError, check_bans, check_logit_bias, check_reasoning_format, check_unicode,
                     is_int)
from .constraint import constraint_for, json_schema_grammar
from .depth import ARM_MIN_TOKENS
from .engine import Engine
from .gguf_info import ModelFileError, require_mtp
from .guard import Guard, GuardedEngine
from .logprobs import TokenLogprob
from .reasoning import block_at_start, budget_start, reply_split, split_reasoning, think_first
from .results import Calibration, Chunk, Result, Stats
from .round_state import PROMPT_ROUND, RunStats, Step
from .stops import StopMatcher, Stops
from .tools import ToolPlan, compiled_reply_constraint, template_messages

if TYPE_CHECKING:
    from .generate import Model


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

        ``params`` are the fields of ``pymtp.DecodeParams``, with its defaults: max_tokens,
        spec, draft_max, p_min; temperature, top_k, top_p, min_p, seed, accept, rollback;
        repeat_penalty, frequency_penalty, presence_penalty, repeat_last_n, logit_bias;
        grammar or json_schema; prediction; ignore_eos, cache_prompt, infill,
        reasoning_budget; logprobs, prompt_logprobs (its source says what each does). They
        are checked before the first chunk, so a bad one raises here, a ``ParamError``
        naming it.
        ``stop`` is a string or a list of strings; the text ends before the first one found.
        ``stats_out``, if given, receives the run's ``Stats`` when the stream ends.
        """
        if stats_out is not None and not isinstance(stats_out, list):
            raise ParamError("stats_out", f"stats_out must be a list (the run's Stats is appended to it when the "
                             f"stream ends), got {type(stats_out).__name__}")
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

        Nothing native runs while the consumer holds a chunk, so close() never waits on it;
        the guard is left between the prompt's rounds too, so it waits one round of them.
        """
        native = self.model._native
        steps = self.engine.run(ids, params, run)
        try:
            while True:
                with self._open():
                    step = next(steps, None)
                    if step is None:
                        return
                    if step is PROMPT_ROUND:
                        continue
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
        extra = sorted({"stop", "stats_out"} & params.keys())
        if extra:
            raise TypeError(f"calibrate() takes no {' or '.join(extra)}: its runs are timed to max_tokens and "
                            "their text is not kept; it takes the fields of pymtp.DecodeParams that make the kind "
                            "of request")
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
        stops at ``<|im_end|>``, but under ignore_eos); the keywords are ``stream``'s.

        ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are OpenAI's (pymtp/tools.py):
        the reply's calls come back in ``Result.tool_calls``, its other text in ``text``,
        and ``finish_reason`` is "tool_calls"; "required" or a named function constrains
        the reply to calls. A ``grammar`` or ``json_schema`` beside tools is the text
        reply's: under "auto" the reply is calls or that format. An assistant message may carry ``tool_calls`` and ``tool``
        messages the results.

        ``reasoning_format`` (llama-server's names, config.REASONING_FORMATS): other than "none",
        a reasoning model's leading ``<think>`` block comes back in ``Result.reasoning``
        and the rest in ``text`` (calls are read from that rest), where the chat template
        is a reasoning model's (it speaks of ``<think>``); "none" leaves ``text`` as the
        model wrote it. An assistant message may carry its ``reasoning_content``.

        Messages that end with an assistant message continue it, as the server does
        (``chat.continuation`` reads ``add_generation_prompt`` and ``continue_final_message``
        as llama-server does): the reply's ``text`` starts with that message's text.

        A conversation continued on the same session (its messages, this reply, a new
        message) decodes only what is new: the prompt cache holds the rest."""
        check_reasoning_format(reasoning_format)
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
        if add_generation_prompt is None and continue_final_message:    # "as the last message asks": continued
            add_generation_prompt = False
        add, cont = continuation(messages, add_generation_prompt, continue_final_message,
                                 forced or kwargs.get("grammar") is not None or kwargs.get("json_schema") is not None)
        ids, tail = chat_prompt(self.model, template, messages, extra=extra, add_generation_prompt=add,
                                continue_final=cont)
        prefill = template.text_of(messages[-1].get("content")) if cont else ""
        opened = reply_split(reasoning_format, template.thinks, tail, prefill)
        formatted = forced or (kwargs.get("json_schema") is not None and kwargs.get("grammar") is None)
        if opened is not None and formatted:
            # a forced call or a schema formats the reply from its first token: let it think first
            source = kwargs["grammar"] if forced else json_schema_grammar(kwargs["json_schema"])
            kwargs.update(grammar=think_first(source, opened), json_schema=None)
        room = budget_start(block_at_start(template.thinks, tail, prefill), formatted and opened is None)
        kwargs.update({"reasoning_budget": None} if room is None else {"reasoning_opened": room})
        turn_ends = template.turn_ends(constrained=bool(forced or schema), ignore_eos=bool(kwargs.get("ignore_eos")))
        given = _stop_list(stop)    # Stops' strings: where a chat's stops match is its tools' to say
        stops = list(given.strings if isinstance(given, Stops) else given) + list(turn_ends)
        result = self.generate(ids, stop=stops if plan is None else plan.stops(stops, opened), **kwargs)
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
    if step.finish:
        rest, hit = matcher.end()       # what was held back, cut at a stop it holds
        if hit:
            return Chunk(text + rest, list(step.tokens), "stop", lps, prompt_lps, **rnd,
                         stop_word=matcher.matched), 0
        # bytes of a character the end cut short read as U+FFFD after it: text, but no
        # stop's, as the model wrote no such character (llama-server meets none there; a
        # "\ufffd" stop turned a cut into "stop")
        tail = decoder.decode(b"", final=True)
        return Chunk(text + rest + tail, list(step.tokens), step.finish, lps, prompt_lps, **rnd), 0
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


class NoMtpBlock(ParamError, ModelFileError):
    """MTP asked of a model without the block: a keyword the request names (``spec`` or
    ``draft_max``), so a ``ParamError`` as every refused keyword, and the file's
    ``ModelFileError`` (what to do: graft the block, or decode plainly)."""


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
    if limit is None or is_int(limit) and limit == -1:
        params = {**params, "max_tokens": model.n_ctx}    # no limit but the context's end, as -n -1
    elif is_int(limit) and limit < 1:
        raise ParamError("max_tokens", f"max_tokens must be an integer >= 1, or -1 or None for no limit but the "
                         f"context's end; got {limit}")
    if not model.info.has_mtp and not {"spec", "draft_max"} & params.keys():
        params = {**params, "spec": "none"}     # as pymtp serve's default on such a model: plain decoding
    decode = DecodeParams(**params)
    decode.validate(model.draft_limit)
    # against the vocabulary here, before a request is queued: a batched engine admits
    # requests in its stepping thread, where a refusal would stop every slot's round
    check_logit_bias(decode.logit_bias, model.n_vocab)
    banned = {t for t, b in (decode.logit_bias or {}).items() if b == -math.inf}
    if decode.bans_end:
        banned.update(model.eog_ids)     # as Rounds.start bans them
    check_bans(len(banned), model.n_vocab)
    if decode.spec == "mtp":
        try:
            require_mtp(model.info)
        except ModelFileError as exc:
            raise NoMtpBlock("spec" if "spec" in params else "draft_max", str(exc)) from None
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


def _stop_list(stop: str | Sequence[str] | Stops | None) -> list[str] | Stops:
    """A string is one stop string (not one per character, as iterating it would give);
    ``Stops`` (a chat with tools: not inside a call) are taken as they are."""
    if stop is None:
        return []
    if isinstance(stop, Stops):
        return stop
    stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise ParamError("stop", f"stop must be a string or a list of strings, got {stop!r}")
    check_unicode(stops, "stop", "stop")    # as the prompt: no text to match (the server refused it already)
    return stops


class SessionBusyError(RuntimeError):
    """A second generation was started on a session whose stream is open in this thread."""
