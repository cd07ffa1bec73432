"""llama-server's own completion route, ``/completion`` (and its other name ``/completions``):
its request fields and its answer, which are not OpenAI's (``/v1/completions`` is that).

Clients written for llama-server call it (its README's first example does). The shapes
are those of tools/server in the pinned llama.cpp:

- ``prompt``: a string (special-token text parsed, BOS where the vocabulary adds one),
  token ids, strings and ids mixed (the first string alone gets BOS), an object
  ``{"prompt_string": ...}``, or a list of those: several prompts, answered by a list of
  objects in order (with ``n_cmpl`` choices each, prompt i's choice j at index i*n+j).
- ``n_predict`` (aliases ``max_tokens``, ``max_completion_tokens``): -1 is no limit; 0
  generates one token, as the pinned llama-server does (its README says none).
- ``n_probs`` (alias ``logprobs``): each token's logprob and the N likeliest, as
  ``completion_probabilities`` (less the stop word's own tokens, as llama-server's);
  ``return_tokens``; ``response_fields`` (paths, "a/b" for nested, kept under the path as
  written); ``stop`` (a string or a list, up to body_fields.MANY_STOPS where llama-server has no bound);
  ``json_schema`` and ``grammar``; and every sampling field the OpenAI routes take.

The answer: ``content``, ``tokens``, ``stop_type`` ("eos", "word", "limit"),
``stopping_word``, ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached`` (what
the slot holds after it: the prompt and the tokens but the last sampled), ``truncated``
(the context filled up), ``has_new_line``, ``generation_settings`` (a banned token's bias
null), ``prompt`` (the decoded ids, BOS included),
``timings``, ``model``, ``id_slot``, ``index``. A stream sends one object per token, as
llama-server does though a verify round accepts several (``content``: the text it
released, none while a stop string's start is held back; ``tokens``; ``stop``: false; a
token that ends inside a character goes with the next), then the final object, with
empty content and tokens, and no ``[DONE]``.

``n_indent`` and ``t_max_predict_ms`` end the text as llama-server's do (``LineRules``);
``/infill`` (editor plugins' fill-in-the-middle) builds its prompt with
``Model.infill_prompt`` and answers as ``/completion``.

Refused with a 400, as they would change the text and pymtp has nothing for them:
``lora``, ``post_sampling_probs`` and multimodal data.
Ignored, as they change nothing here: ``id_slot`` (a slot is picked by what its prompt
cache holds), ``n_keep`` and ``n_discard`` (pymtp shifts no context: a full one ends the
generation, ``truncated``), ``n_cache_reuse``, ``timings_per_token``, ``return_progress``,
``sse_ping_interval``, ``verbose``.

Unlike llama-server: the end-of-generation token is not among ``tokens`` nor counted in
``tokens_predicted`` (as on the OpenAI routes, whose usage leaves it out); a context that
fills up holds one more token (the last sampled needs no position).
"""

from __future__ import annotations

import asyncio
import codecs
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..chat_messages import kind_of
from ..config import ParamError
from ..generate import Model
from ..infill import InfillUnsupported
from ..logprobs import TokenLogprob
from ..results import Chunk
from .body_fields import many_stops, opt
from .errors import CLIENT_CLOSED, APIError, from_value_error, invalid, unsupported
from .llama_params import task_params
from .responses import UNLIKELY, timings
from .runs import canceller, collected, first_turn, framed, in_turns, merged, stream_turns
from .schemas import (GenerationRequest, _common, _constraint, asked_kwargs, generations, is_token_id, parse_json,
                      read_prompt)
from .service import Run, Service
from .slot_board import tokens_held
from .sse import SSEResponse

# fields whose only value pymtp can honour is the one that leaves them off
_OFF = {"lora": (None, []), "post_sampling_probs": (None, False)}
MAX_N_PROBS = 2**31 - 1      # llama-server reads n_probs as a 32-bit count
_LIMIT_NAMES = ("n_predict", "max_completion_tokens", "max_tokens")    # llama-server's order


@dataclass(frozen=True)
class Ask:
    """What one ``/completion`` body asks for: its prompts (unresolved: strings and ids
    mixed are tokenized off the event loop), and how the answer is shaped."""

    base: GenerationRequest                      # every prompt's request but the prompt itself
    prompts: list[str | list]                    # each a string, or a list of ids and strings
    n_probs: int = 0
    return_tokens: bool = False
    response_fields: tuple[str, ...] = ()
    n_predict: int = -1                          # as the request said it (-1: no limit)
    rules: LineRules | None = None               # n_indent, t_max_predict_ms


def install_llama_completion(app: FastAPI, service: Service, generating: list) -> None:
    """Add ``/completion`` and ``/completions`` to ``app``, behind ``generating`` (the API
    key, and the refusal while draining)."""

    @app.post("/completion", dependencies=generating)
    @app.post("/completions", dependencies=generating)
    async def completion(request: Request) -> Response:
        ask = read(parse_json(await request.body()))
        try:
            prompts = await asyncio.to_thread(resolve_prompts, service.model, ask.prompts)
        except ParamError as exc:      # a string part too long for the context
            raise from_value_error(exc, {}) from exc
        return await _answer(service, request, replace(ask, prompts=prompts))

    @app.post("/infill", dependencies=generating)
    async def infill(request: Request) -> Response:
        body = parse_json(await request.body())
        fields = infill_fields(body)
        ask = read({**body, "prompt": [0]})       # its prompt is built below from the fields
        try:
            # llama-server leaves room for its server-wide -n (-1 by default), not the request's
            ids = await asyncio.to_thread(service.model.infill_prompt, *fields, n_predict=-1,
                                          spm=service.settings.spm_infill)
        except InfillUnsupported as exc:
            raise APIError(501, str(exc), type="not_supported_error") from exc
        except ParamError as exc:       # an id outside the vocabulary, named as the body names it
            raise from_value_error(exc, {"prefix": "input_prefix", "suffix": "input_suffix"}) from exc
        return await _answer(service, request, replace(ask, prompts=[ids]))


async def _answer(service: Service, request: Request, ask: Ask) -> Response:
    """Generate what ``ask`` asks for (its prompts resolved) and answer in llama-server's shapes."""
    prompts = ask.prompts
    # a logit_bias text by token id once, off the event loop (each Shape reports it too)
    base = await asyncio.to_thread(service.biases, ask.base)
    reqs = generations(replace(base, prompt=prompts[0], prompts=tuple(prompts) if len(prompts) > 1 else ()),
                       service.settings.decode.seed)
    if ask.base.stream:
        first = await first_turn(service, request, reqs)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        live = list(first)

        async def objects() -> AsyncIterator[dict]:
            async for start, runs in stream_turns(service, reqs, first, live):
                streams = [_events(run, Shape(ask, service, reqs[start + i], run, start + i))
                           for i, run in enumerate(runs)]
                async for obj in streams[0] if len(streams) == 1 else merged(streams):
                    yield obj
        return SSEResponse(framed(objects(), service.metrics), on_close=canceller(live))
    async def answer(first: int, part: list[GenerationRequest], runs: list[Run]) -> list:
        shapes = [Shape(ask, service, req, run, first + i) for i, (req, run) in enumerate(zip(part, runs))]
        ruled = None if ask.rules is None else lambda i, run: _by_rules(run, shapes[i])
        return [shape.final(c) for shape, c in zip(shapes, await collected(request, runs, ruled))]

    answers = await in_turns(service, request, reqs, answer)
    if answers is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(answers[0] if len(answers) == 1 else answers)


def infill_fields(body: dict) -> tuple:
    """``/infill``'s own fields, checked: (input_prefix, input_suffix, input_extra as
    (file name, text) pairs, prompt), as ``Model.infill_prompt`` takes them."""
    parts = []
    for name in ("input_prefix", "input_suffix"):
        v = body.get(name)
        if v is None:
            raise invalid(f'"{name}" is required (the text before and after the cursor; "" for none)', name,
                          "missing_required_parameter")
        if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) or is_token_id(x) for x in v))):
            raise invalid(f"{name} must be a string, or token ids and strings mixed, got {kind_of(v)}", name,
                          "invalid_type")
        parts.append(v)
    extra = body.get("input_extra")
    extra = [] if extra is None else extra
    if not isinstance(extra, list):
        raise invalid('"input_extra" must be an array of {"filename": string, "text": string}', "input_extra",
                      "invalid_type")
    files = []
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid(f'input_extra[{i}] must hold a "text" string', "input_extra", "invalid_type")
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise invalid(f'input_extra[{i}]\'s "filename" must be a string', "input_extra", "invalid_type")
        files.append((name, chunk["text"]))
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise invalid(f'"prompt" must be a string (the text after the prefix), got {kind_of(prompt)}', "prompt",
                      "invalid_type")
    return parts[0], parts[1], files, prompt


# ----------------------------------------------------------------------------- the request


def read(body: dict) -> Ask:
    """The body's fields, their JSON types checked (their values are the library's to check)."""
    for name, neutral in _OFF.items():
        if body.get(name) not in neutral:
            raise unsupported(name, body[name], "is not supported by pymtp: leave it out")
    limit = next((name for name in _LIMIT_NAMES if body.get(name) is not None), "n_predict")
    n_predict = opt(body, limit, int, "an integer")
    n_predict = -1 if n_predict is None else n_predict
    if n_predict < -1:
        raise invalid(f"{limit} must be -1 (no limit) or a number of tokens >= 0, got {n_predict}", limit)
    n_probs = _probs(body)
    fields = body.get("response_fields") or []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise invalid(f"response_fields must be a list of strings, got {kind_of(fields)}", "response_fields",
                      "invalid_type")
    # _common reads the limit from "n_predict" as the request names it; -1 is none, and
    # 0 is one token, as the pinned llama-server makes it
    rules = LineRules(_rule(body, "n_indent"), _rule(body, "t_max_predict_ms"))
    common = _common({**body, "stop": None, "n_predict": None if n_predict == -1 else max(n_predict, 1),
                      "n_indent": None, "t_max_predict_ms": None,
                      # llama-server's own route takes stream_options on an unstreamed reply
                      "stream_options": body.get("stream_options") if body.get("stream") else None}, "n_predict")
    base = GenerationRequest(kind="completion", prompt=None, logprobs=n_probs or None, **{
        **common, "max_tokens_field": limit, "stop": many_stops(body, "stop")}, **_constraint(body))
    return Ask(base, _prompts(body), n_probs, bool(opt(body, "return_tokens", bool, "a boolean")),
               tuple(fields), n_predict, rules if rules.on else None)


def _rule(body: dict, name: str) -> int:
    """``n_indent`` or ``t_max_predict_ms``: an integer, 0 or less for off."""
    v = opt(body, name, int, "an integer")
    return max(v or 0, 0)


def _probs(body: dict) -> int:
    """``n_probs``: each token's most likely alternatives, as llama-server lists them: any
    count (the vocabulary's tokens at most), 0 or less for none; not OpenAI's 20."""
    name = "n_probs" if body.get("n_probs") is not None else "logprobs"
    n = opt(body, name, int, "an integer") or 0
    if n > MAX_N_PROBS:
        raise invalid(f"{name} must be at most {MAX_N_PROBS} (the vocabulary's tokens at most are listed), "
                      f"got {n}", name)
    return max(n, 0)


def _prompts(body: dict) -> list[str | list]:
    """The body's prompts: one, or several where ``prompt`` is a list that is not one
    prompt of ids (mixed with strings or not)."""
    p = body.get("prompt")
    if p is None:
        raise invalid("prompt is required", "prompt", "missing_required_parameter")
    several = isinstance(p, list) and not any(is_token_id(x) for x in p)
    prompts = [read_prompt(x, f"prompt[{i}]") for i, x in enumerate(p)] if several else [read_prompt(p, "prompt")]
    if not prompts:
        raise invalid("prompt must not be empty", "prompt", "invalid_value")
    return prompts


def resolve_prompts(model: Model, prompts: list[str | list]) -> list[str | list[int]]:
    """Each prompt as the library takes it: strings and ids mixed become ids (llama-server's
    tokenize_mixed: ids as they are, the first part BOS when it is a string)."""
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, str) or all(is_token_id(x) for x in p):
            out.append(p)
            continue
        ids: list[int] = []
        for i, part in enumerate(p):
            ids += model.tokenize(part, special=True, add_special=i == 0, fit_context=True) \
                if isinstance(part, str) else [part]
        out.append(ids)
    return out


# ----------------------------------------------------------------------------- line rules


@dataclass(frozen=True)
class LineRules:
    """llama-server's stops for code completion, on the text generated so far:
    ``n_indent``: a line that starts (its first character that is no space or tab) with
    less indentation ends the text, cut before that character (an editor's completion
    stays inside the block it is in); ``t_max_predict_ms``: once that long has passed
    since the first generated text, the next text holding a newline ends it. pymtp reads
    them after each verify round's text, so the time rule may let a round's few tokens
    more through than llama-server's token-by-token check; the cut is the same text. The
    time counts from the generation's first text (llama-server's: from its first token)."""

    n_indent: int = 0
    t_max_predict_ms: int = 0

    @property
    def on(self) -> bool:
        return self.n_indent > 0 or self.t_max_predict_ms > 0

    def end(self, before: str, new: str, elapsed_ms: float) -> int | None:
        """Where the text ``before + new`` ends by these rules (a length), or None."""
        text = before + new
        if self.n_indent > 0:
            start = text.find("\n")
            while start >= 0:
                pos = start + 1
                while pos < len(text) and text[pos] in " \t":
                    pos += 1
                if pos < len(text) and pos - start - 1 < self.n_indent:
                    return pos
                start = text.find("\n", start + 1)
        if self.t_max_predict_ms > 0 and "\n" in new and elapsed_ms > self.t_max_predict_ms:
            return len(text)
        return None


async def _by_rules(run: Run, shape: Shape) -> AsyncIterator[Chunk]:
    """The run's chunks, the last cut where the request's ``LineRules`` end the text (its
    finish "length", ``shape.ruled``); the generation is then stopped, and what it made
    meanwhile left out."""
    rules, text = shape.ask.rules, ""
    chunk = run.first
    while chunk is not None:
        if rules is not None:
            end = rules.end(text, chunk.text, (time.perf_counter() - run.t_first) * 1000)
            if end is not None:
                run.stop("length")
                async for _ in run.gen:       # until the slot is free and the stats are in
                    pass
                shape.ruled = True
                k = _tokens_to_see(shape.model, chunk, end - len(text))
                yield replace(chunk, text=(text + chunk.text)[len(text):end], finish_reason="length",
                              stop_word=None, tokens=chunk.tokens[:k],
                              logprobs=chunk.logprobs[:k] if chunk.logprobs is not None else None)
                return
            text += chunk.text
        yield chunk
        chunk = await anext(run.gen, None)


def _tokens_to_see(model: Model, chunk: Chunk, at: int) -> int:
    """How many of ``chunk``'s tokens llama-server decodes before it sees the character at
    ``at`` of the chunk's text (it checks its line rules token by token: the tokens through
    the first whose text reaches that character); all of them where the chunk's text is
    not its tokens' own (text a stop string held back)."""
    data = b""
    for k, t in enumerate(chunk.tokens, 1):
        data += model.token_bytes(t)
        if len(data.decode("utf-8", errors="ignore")) > at:
            full = b"".join(model.token_bytes(t) for t in chunk.tokens).decode("utf-8", errors="ignore")
            return k if full == chunk.text else len(chunk.tokens)
    return len(chunk.tokens)


# ----------------------------------------------------------------------------- the answer


class Shape:
    """One generation's objects in llama-server's shapes."""

    def __init__(self, ask: Ask, service: Service, req: GenerationRequest, run: Run, index: int) -> None:
        self.ask, self.req, self.run, self.index = ask, req, run, index
        self.model = service.model
        self.model_id = service.model_id
        kw = asked_kwargs(req, service.settings.decode, max_tokens=service.model.n_ctx)     # bias by id (_answer)
        self.settings = task_params(kw, n_predict=ask.n_predict, stop=ask.base.stop, stream=ask.base.stream,
                                    n_probs=ask.n_probs, samplers=req.samplers, ends=service.model.eog_ids)
        self.predicted = 0          # tokens sent so far (a stream)
        self.ruled = False          # a line rule ended the text (_by_rules)
        self.sent = ""              # text sent so far (a stream)
        # each token's own text, as the engine's decoder reads the stream (Session._stream)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = 0              # characters decoded and not yet in a chunk's text (a stop's start)
        self._carried: list[tuple[int, TokenLogprob | None]] = []     # tokens ending inside a character

    def per_token(self, chunk: Chunk) -> list[Chunk]:
        """``chunk`` as llama-server streams it: an object a token, with the text that
        token released (``token_texts``: none while a stop string's start is held back);
        a token that ends inside a character goes with the next one."""
        if not chunk.tokens:
            return [chunk] if chunk.text else []
        pieces = [self._decoder.decode(self.model.token_bytes(t, special=False)) for t in chunk.tokens]
        texts = token_texts(pieces, chunk.text, self._held)
        self._held += sum(map(len, pieces)) - len(chunk.text)
        lps = chunk.logprobs if chunk.logprobs is not None else [None] * len(chunk.tokens)
        out = []
        for token, lp, piece, text in zip(chunk.tokens, lps, pieces, texts):
            self._carried.append((token, lp))
            if piece or text:
                out.append(self._part(chunk, text))
        if self._carried and chunk.finish_reason:
            out.append(self._part(chunk, ""))     # the end: what no character completed
        return out

    def _part(self, chunk: Chunk, text: str) -> Chunk:
        tokens, lps = [t for t, _ in self._carried], [lp for _, lp in self._carried]
        self._carried = []
        return replace(chunk, text=text, tokens=tokens, logprobs=lps if chunk.logprobs is not None else None)

    def partial(self, chunk: Chunk) -> dict:
        """A stream's object for one chunk."""
        self.predicted += len(chunk.tokens)
        self.sent += chunk.text
        out = {"index": self.index, "content": chunk.text, "tokens": list(chunk.tokens), "stop": False,
               "id_slot": self.run.slot, "tokens_predicted": self.predicted,
               "tokens_evaluated": self.run.prompt_tokens}
        if self.ask.n_probs and (probs := self._probs(chunk)):     # llama-server: only when some
            out["completion_probabilities"] = probs
        return out

    def final(self, chunks: list[Chunk], stream: bool = False) -> dict:
        """The last object: the whole answer, or (``stream``) its end, content sent already."""
        run, stats = self.run, self.run.stats
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks for t in c.tokens]
        finish = next((c for c in reversed(chunks) if c.finish_reason), None)
        stop_word = finish.stop_word if finish is not None else None
        predicted = len(tokens) if not stream else self.predicted
        stop_type = "word" if stop_word else "eos" if finish is not None and finish.finish_reason == "stop" \
            else "limit"
        out = {
            "index": self.index,
            "content": "" if stream else text,
            "tokens": tokens if self.ask.return_tokens and not stream else [],
            "id_slot": run.slot,
            "stop": True,
            "model": self.model_id,
            "tokens_predicted": predicted,
            "tokens_evaluated": run.prompt_tokens,
            "generation_settings": self.settings,
            "prompt": self._prompt_text(),
            "has_new_line": "\n" in (self.sent if stream else text),
            # the context filled up (not a line rule's end, whose chunk says "length" too)
            "truncated": stop_type == "limit" and not self.ruled
            and (self.ask.n_predict == -1 or predicted < max(self.ask.n_predict, 1)),
            "stop_type": stop_type,
            "stopping_word": stop_word or "",
            "tokens_cached": tokens_held(run.prompt_tokens, predicted, stop_type == "eos"),
            "timings": timings(stats) if stats is not None else {},
        }
        if self.ruled and stats is not None:
            # the engine may have decoded past the cut (the rest of its round, a round more
            # before the route stopped it): the answer's tokens are those llama-server would
            # have decoded, which stops at the cut; the speed stays the engine's
            out["timings"]["predicted_n"] = predicted
        if self.ask.n_probs and not stream:
            probs = [e for c in chunks for e in self._probs(c)]
            if stop_word:     # less as many as the stop word's own tokens, as llama-server does
                probs = probs[:len(probs) - min(len(probs), len(self.model.tokenize(stop_word, add_special=False)))]
            if probs:         # llama-server leaves the field out when no token is left
                out["completion_probabilities"] = probs
        return _fields(out, self.ask.response_fields) if self.ask.response_fields else out

    def _prompt_text(self) -> str:
        """The prompt as decoded (a BOS included), as llama-server shows it."""
        data = b"".join(self.model.token_bytes(t, special=True) for t in self.run.prompt_ids)
        return data.decode("utf-8", errors="replace")

    def _probs(self, chunk: Chunk) -> list[dict]:
        return [self._entry(r) for r in chunk.logprobs or ()]

    def _entry(self, r: TokenLogprob) -> dict:
        return {**self._token(r.token, r.logprob), "top_logprobs": [self._token(t, lp) for t, lp in r.top]}

    def _token(self, token: int, logprob: float) -> dict:
        # a control token's piece is empty, as llama-server renders pieces (its tag text
        # joined into a client's text would be text the reply never held)
        data = self.model.token_bytes(token, special=False)
        return {"id": token, "token": data.decode("utf-8", errors="ignore"), "bytes": list(data),
                "logprob": max(logprob, UNLIKELY)}


def token_texts(pieces: list[str], text: str, held: int) -> list[str]:
    """Each token's share of ``text``, what a chunk released, given each token's own text
    (``pieces``) and the ``held`` characters decoded before the chunk that no chunk had
    released (a stop string's start): the released text is the decoded text in order,
    so a token gets the part of it that ends where the token's own text ends, nothing
    while a stop string's start is held back, and the last one anything left over."""
    out, pos, fed = [], 0, held
    for piece in pieces:
        fed += len(piece)
        end = max(pos, min(len(text), fed))
        out.append(text[pos:end])
        pos = end
    if out and pos < len(text):
        out[-1] += text[pos:]
    return out


async def _events(run: Run, shape: Shape) -> AsyncIterator[dict]:
    """One generation's stream: an object per token, then the final one."""
    chunks: list[Chunk] = []
    async for chunk in _by_rules(run, shape):
        chunks.append(chunk)
        for part in shape.per_token(chunk):
            yield shape.partial(part)
    yield shape.final(chunks, stream=True)


def _fields(obj: dict, paths: tuple[str, ...]) -> dict:
    """llama-server's ``response_fields``: the values at these paths ("a/b": nested), under
    the path as written; a path that leads nowhere is left out."""
    out = {}
    for path in paths:
        value: Any = obj
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out
