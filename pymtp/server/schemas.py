"""OpenAI request bodies to one ``GenerationRequest``, and that to ``stream`` keywords.

Parsing is by hand rather than through pydantic models so that every refusal is a 400 in
the OpenAI error shape that names the offending field, and so that fields we do not
implement are refused when they would change the output (``best_of``, ``functions`` ...)
and ignored when they would not (``user``, ``metadata`` ...). llama-server's own sampler
fields (``samplers``, ``typical_p``, ``mirostat`` ...) are sampler_fields.py's.

Constraints (pymtp/constraint.py): ``response_format`` ``{"type": "json_object"}`` (any
JSON object; a ``schema`` in it is honoured, as llama-server does) or ``{"type":
"json_schema", "json_schema": {"schema": ...}}``, and llama-server's ``grammar`` (GBNF)
extension, on both endpoints; chat's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (pymtp/tools.py). A format beside tools is the text reply's, as
OpenAI's API takes them: a forced call is itself a grammar, and under "auto" the reply is
calls or the format (``tools.reply_constraint``).
Here fields get their JSON types checked; their values are the library's to check
(``DecodeParams.validate``), and its ``ParamError`` comes back as the 400.

Logprobs: completions take ``logprobs: N`` (and ``echo``), chat ``logprobs: true`` with
``top_logprobs: N``; N is 0 to ``MAX_LOGPROBS`` (20) on both. That is OpenAI's chat limit
and vLLM's default for both endpoints; OpenAI's completions stop at 5, llama-server has no
limit, and 20 serves evaluation harnesses that ask for more than 5. The count is checked
here because the request names it differently on each endpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..chat import continuation
from ..chat_messages import kind_of, read_messages
from ..config import DecodeParams, ParamError, check_reasoning_format, check_unicode
from ..constraint import json_object_grammar
from ..tools import ToolPlan
from . import sampler_fields
from .body_fields import (FRESH_SEED, integer, limit_field, logit_bias_of, logprob_count, number, opt,
                          reply_limit, seed_of, stop_of)
from .errors import from_value_error, invalid, unsupported


MAX_CHOICES = 128     # OpenAI's limit on ``n``
# Fields that would change the output, with the values that leave it unchanged.
_UNSUPPORTED_UNLESS = {
    "best_of": ((None, 1), "is not supported yet"),
    "functions": ((None, []), "is not supported; send the functions as tools"),
    "function_call": ((None, "auto", "none"), "is not supported; send tool_choice (and the functions as tools)"),
    "modalities": ((None, ["text"]), "is not supported: this server writes text only"),
    "audio": ((None,), "is not supported: this server writes text only"),
}
# Request fields that are DecodeParams fields of the same name; None: the server's default.
DECODE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repeat_penalty", "repeat_last_n", "logit_bias", "spec", "draft_max", "p_min",
                 "ignore_eos", "logprobs", "prompt_logprobs", "cache_prompt", "grammar", "json_schema", "prediction")


@dataclass(frozen=True)
class GenerationRequest:
    """What a completion or chat request asks for, its fields' JSON types checked."""

    kind: str                                # "completion" or "chat"
    model: str | None = None
    n: int = 1                               # choices: n generations of the prompt (choices_of)
    prompt: str | list[int] | None = None    # completions: the prompt a generation runs
    # completions: every prompt of the request (OpenAI's batch of prompts), () for one;
    # ``generations`` makes a request of each
    prompts: tuple[str | list[int], ...] = ()
    messages: list[dict] | None = None       # chat, normalised to {"role", "content"}
    template_kwargs: dict = field(default_factory=dict)
    max_tokens: int | None = None            # None: until end of generation or a full context
    max_tokens_field: str = "max_tokens"     # or "max_completion_tokens", as the request said it
    format_field: str = "response_format"    # or "text.format", "output_config.format": the API's name
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None                  # FRESH_SEED: a fresh one, whatever the server's default
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None      # llama-server's fields, as it names them
    repeat_last_n: int | None = None
    logit_bias: dict[int | str, float] | None = None    # token id or text -> bias (-inf: banned)
    samplers: tuple[str, ...] | None = None  # llama-server's chain, canonical names (sampler_fields)
    # pymtp extensions: per-request speculative settings and ignore_eos
    spec: str | None = None
    draft_max: int | str | None = None     # an integer or "auto"
    p_min: float | None = None
    ignore_eos: bool | None = None
    cache_prompt: bool | None = None         # llama-server's: reuse the slot's cached prefix (default on)
    # logprobs: the library's count of alternatives per token, None when not asked
    # (completions' ``logprobs: N``; chat's ``logprobs: true`` with ``top_logprobs: N``)
    logprobs: int | None = None
    prompt_logprobs: int | None = None       # completions with echo and logprobs
    echo: bool = False                       # completions: the prompt's text before the completion
    # completions: the text after the insertion (OpenAI's suffix): the prompt becomes a
    # fill-in-the-middle one (Model.infill_prompt), for a model with FIM tokens
    suffix: str | None = None
    # constraints: llama-server's GBNF ``grammar``, or response_format's JSON schema (json_object
    # without one is pymtp.constraint.json_object_grammar)
    grammar: str | None = None
    json_schema: dict | None = None
    formatted: bool = False                  # the constraint is response_format's, not a raw grammar
    tools: ToolPlan | None = None            # chat: tools, tool_choice, parallel_tool_calls
    # chat: llama-server's "reasoning_format" (config.REASONING_FORMATS); None: the server's
    reasoning_format: str | None = None
    # chat: llama-server's "reasoning_budget_tokens" (or "thinking_budget_tokens") and
    # "reasoning_budget_message"; None (or a budget of -1): the server's
    reasoning_budget: int | None = None
    reasoning_budget_message: str | None = None
    # chat: end the prompt with the generation prompt, or with the last (assistant)
    # message's content left open for the reply to go on with (``_continuation``)
    add_generation_prompt: bool = True
    continue_final: bool = False
    # chat: OpenAI's Predicted Outputs, the text the reply is expected to repeat (prediction.py)
    prediction: str | None = None


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    body = parse_json_value(raw)
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {kind_of(body)}", code="invalid_json")
    try:          # a 400 naming the field: encoding it for the tokenizer was a 500
        for name, value in body.items():
            check_unicode(value, name, name)
    except ParamError as e:
        raise invalid(str(e), e.param, e.code) from None
    return body


class _NotJson(ValueError):
    """NaN, Infinity or -Infinity in a body: JavaScript's, not JSON's."""


def _no_constant(name: str) -> Any:
    raise _NotJson(name)


def parse_json_value(raw: bytes) -> Any:
    """The request body as any JSON value (a route that takes a list), or a 400."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    except _NotJson as exc:    # Python's parser takes them: echoed or as a schema's value, they were a 500
        raise invalid(f"the request body is not valid JSON: {exc} is not a JSON number; send a finite "
                      "number (or null)", code="invalid_json") from None
    except RecursionError:     # the parser recurses once per level: this was a 500
        raise invalid("the request body nests arrays or objects too deeply to parse",
                      code="invalid_json") from None
    except ValueError as exc:  # an integer past Python's digit limit: this was a 500
        reason = str(exc).split(";")[0]     # without Python's hint to raise the server's limit
        raise invalid(f"the request body holds a number too long to parse: {reason}",
                      code="invalid_json") from None
    return body


def parse_completion(body: dict) -> GenerationRequest:
    if body.get("top_logprobs") not in (None, 0):
        raise unsupported("top_logprobs", body["top_logprobs"],
                          "is a chat field; completions take logprobs=N for N alternatives")
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, []):
            raise unsupported(name, body[name], "is a chat field; use /v1/chat/completions for tool calls")
    logprobs = logprob_count(body, "logprobs")
    echo = bool(opt(body, "echo", bool, "a boolean"))
    suffix = opt(body, "suffix", str, "a string") or None
    for name, value in (("echo", echo), ("logprobs", logprobs is not None)):
        if suffix is not None and value:
            raise invalid(f"{name} cannot be combined with suffix: the prompt a suffix makes is a "
                          "fill-in-the-middle one, not the text sent", name, "invalid_value")
    limit = limit_field(body, ("max_tokens", "max_completion_tokens", "n_predict"))
    if echo and body.get(limit) == 0 and not isinstance(body.get(limit), bool):
        # OpenAI's way to score a text: its logprobs, nothing generated. llama-server's 0 is
        # one token, which would add a token's text and logprob to the score unasked
        raise invalid(f"{limit} 0 with echo (the prompt's logprobs alone) is not supported: send {limit} 1 "
                      "and leave out the last token", limit, "unsupported_value")
    prompts = _prompts(body)
    return GenerationRequest(kind="completion", prompt=prompts[0], prompts=tuple(prompts) if len(prompts) > 1 else (),
                             logprobs=logprobs, echo=echo, suffix=suffix,
                             prompt_logprobs=logprobs if echo else None, **_common(body, limit),
                             **_constraint(body))


def parse_chat(body: dict) -> GenerationRequest:
    if body.get("echo") not in (None, False):
        raise unsupported("echo", body["echo"], "is a completions field; chat has no echo")
    kwargs = _effort(body, opt(body, "chat_template_kwargs", dict, "an object") or {})
    limit = limit_field(body, ("max_completion_tokens", "max_tokens", "n_predict"))
    constraint = _constraint(body)
    try:
        tools = ToolPlan.of(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except ParamError as exc:
        raise invalid(str(exc), exc.param, "invalid_value") from None
    if tools is not None:      # beside a format the reply is calls or that format
        tools = tools.beside(bool(constraint["grammar"] or constraint["json_schema"]))
    messages = _messages(body)
    constrained = bool(constraint["grammar"] or constraint["json_schema"] or (tools is not None and tools.grammar))
    add_generation_prompt, continue_final = _continuation(body, messages, constrained)
    return GenerationRequest(kind="chat", messages=messages, template_kwargs=kwargs,
                             logprobs=_chat_logprobs(body), tools=tools, reasoning_format=_reasoning_format(body),
                             add_generation_prompt=add_generation_prompt, continue_final=continue_final,
                             prediction=_prediction(body), **_budget(body), **_common(body, limit), **constraint)


def _budget(body: dict) -> dict:
    """llama-server's reasoning budget fields: ``reasoning_budget_tokens``, or else
    ``thinking_budget_tokens``, from -1 (the server's) up; ``reasoning_budget_message``."""
    name = "reasoning_budget_tokens" if body.get("reasoning_budget_tokens") is not None else "thinking_budget_tokens"
    budget = integer(body, name)
    if budget is not None and budget < -1:
        raise invalid(f"{name} must be an integer >= 0 (the most tokens of thinking), or -1 for the "
                      f"server's budget, got {budget}", name)
    return {"reasoning_budget": None if budget == -1 else budget,
            "reasoning_budget_message": opt(body, "reasoning_budget_message", str, "a string")}


def _effort(body: dict, kwargs: dict) -> dict:
    """The template's variables with OpenAI's ``reasoning_effort``, as llama-server reads
    it: "none" switches thinking off (``enable_thinking`` false, which Qwen3.5's templates
    read); another effort is the template's ``reasoning_effort`` variable, for templates
    that have one."""
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):     # "false" is a true string to a template
        raise invalid(f"chat_template_kwargs.enable_thinking must be true or false, got {thinking!r}",
                      "chat_template_kwargs", "invalid_value")
    effort = opt(body, "reasoning_effort", str, 'a string such as "low" or "none"')
    if effort is None:
        return kwargs
    if effort == "none":
        return {**{k: v for k, v in kwargs.items() if k != "reasoning_effort"}, "enable_thinking": False}
    return {**kwargs, "reasoning_effort": effort}


def _prediction(body: dict) -> str | None:
    """OpenAI's ``prediction`` (Predicted Outputs): ``{"type": "content", "content": ...}``
    with the text, or a list of text parts, the reply is expected to repeat."""
    v = body.get("prediction")
    if v is None:
        return None
    shape = '{"type": "content", "content": "the text the reply is expected to repeat"}'
    if not isinstance(v, dict) or v.get("type") != "content" or "content" not in v:
        got = repr(v)[:80] if isinstance(v, dict) else kind_of(v)
        raise invalid(f"prediction must be {shape}, got {got}", "prediction", "invalid_type")
    content = v["content"]
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid('prediction.content must be a string or a list of text parts such as '
                  f'[{{"type": "text", "text": "..."}}], got {kind_of(content)}', "prediction", "invalid_type")


def _continuation(body: dict, messages: list[dict], constrained: bool) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final): chat.continuation's reading of the fields."""
    add = opt(body, "add_generation_prompt", bool, "a boolean")
    try:
        return continuation(messages, add, body.get("continue_final_message"), constrained)
    except ParamError as exc:
        raise invalid(str(exc), exc.param) from None


def _reasoning_format(body: dict) -> str | None:
    """llama-server's ``reasoning_format``: whether the reply's thinking comes back apart,
    as ``reasoning_content`` (reasoning.py)."""
    v = opt(body, "reasoning_format", str, "a string")
    try:
        return None if v is None else check_reasoning_format(v)
    except ParamError as exc:
        raise invalid(str(exc), exc.param) from None


def generations(req: GenerationRequest, default_seed: int | None = None) -> list[GenerationRequest]:
    """One request per generation: each prompt's n choices (``choices_of``), prompt i's
    choice j at i * n + j, as OpenAI's batch of prompts numbers them."""
    if not req.prompts:
        return choices_of(req, default_seed)
    return [r for p in req.prompts for r in choices_of(replace(req, prompt=p, prompts=()), default_seed)]


def choices_of(req: GenerationRequest, default_seed: int | None = None) -> list[GenerationRequest]:
    """The requests of ``req``'s n choices, one generation each. With a seed (the
    request's, else the server's ``default_seed``), choice i samples with seed + i: the
    choices differ, and the same request repeats them all (choice 0 is the request with
    n=1)."""
    if req.n == 1:
        return [req]
    seed = req.seed if req.seed is not None else default_seed
    if seed == FRESH_SEED:
        return [replace(req, n=1) for _ in range(req.n)]
    return [replace(req, n=1, seed=None if seed is None else seed + i) for i in range(req.n)]


def decode_kwargs(req: GenerationRequest, defaults: DecodeParams, max_tokens: int) -> dict[str, Any]:
    """The ``DecodeParams`` keywords for ``Session.stream``: ``asked_kwargs`` as the
    library runs them (``runnable``)."""
    return runnable(asked_kwargs(req, defaults, max_tokens))


def asked_kwargs(req: GenerationRequest, defaults: DecodeParams, max_tokens: int) -> dict[str, Any]:
    """The request's own fields over the server's ``defaults``, as the request means them
    (what ``/slots`` and ``generation_settings`` report). A request without a token limit
    runs until end of generation or a full context (``max_tokens``), as OpenAI's API does."""
    given = {name: getattr(req, name) for name in DECODE_FIELDS if getattr(req, name) is not None}
    if given.get("seed") == FRESH_SEED:
        given["seed"] = None
    if isinstance(given.get("top_k"), int) and given["top_k"] < 0:
        given["top_k"] = 0        # off, as llama-server takes any value <= 0 (vLLM sends -1)
    return sampler_fields.honour(req.samplers, {**asdict(defaults), "max_tokens": max_tokens, **given})


def runnable(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``asked_kwargs`` in the library's terms: OpenAI takes top_p 0, and llama.cpp's top_p
    keeps at least one token, the likeliest alone, which is top_k 1 (the library's check
    wants top_p > 0)."""
    if kwargs.get("top_p") == 0:
        return {**kwargs, "top_p": 1.0, "top_k": 1}
    return kwargs


# ----------------------------------------------------------------------------- fields


def _common(body: dict, limit_name: str) -> dict[str, Any]:
    for name, (neutral, why) in _UNSUPPORTED_UNLESS.items():
        if isinstance(body.get(name), bool) or body.get(name) not in neutral:     # true == 1
            raise unsupported(name, body[name], why)
    n = _choices(body)
    stream = bool(opt(body, "stream", bool, "a boolean"))
    options = opt(body, "stream_options", dict, "an object") or {}
    if body.get("stream_options") is not None and not stream:     # OpenAI and vLLM refuse it too
        raise invalid("stream_options is only for a streamed reply: set stream to true, or leave "
                      "stream_options out", "stream_options", "invalid_value")
    include_usage = opt(options, "include_usage", bool, "a boolean", "stream_options.include_usage")
    spec = opt(body, "spec", str, "'mtp' or 'none'")
    return dict(
        model=opt(body, "model", str, "a string"), n=n,
        max_tokens=reply_limit(body, limit_name), max_tokens_field=limit_name, stop=stop_of(body), stream=stream,
        include_usage=bool(include_usage) and stream,
        temperature=number(body, "temperature"), top_p=number(body, "top_p"),
        top_k=integer(body, "top_k"), min_p=number(body, "min_p"), seed=seed_of(body),
        presence_penalty=number(body, "presence_penalty"), frequency_penalty=number(body, "frequency_penalty"),
        repeat_penalty=number(body, "repeat_penalty"), repeat_last_n=integer(body, "repeat_last_n"),
        logit_bias=logit_bias_of(body), spec=spec, draft_max=_draft_max(body), p_min=number(body, "p_min"),
        ignore_eos=opt(body, "ignore_eos", bool, "a boolean"),
        cache_prompt=opt(body, "cache_prompt", bool, "a boolean"),
        samplers=sampler_fields.read(body, lambda name: number(body, name)))


def _choices(body: dict) -> int:
    """OpenAI's ``n``, or llama-server's name for it, ``n_cmpl``; both must agree."""
    n, n_cmpl = integer(body, "n"), integer(body, "n_cmpl")
    if n is not None and n_cmpl is not None and n != n_cmpl:
        raise invalid(f"n={n} and n_cmpl={n_cmpl} ask for different numbers of choices; send one of them",
                      "n_cmpl", "invalid_value")
    name, value = ("n", n) if n is not None else ("n_cmpl", n_cmpl)
    if value is not None and not 1 <= value <= MAX_CHOICES:
        raise invalid(f"{name} must be between 1 and {MAX_CHOICES} (choices to generate), got {value}", name)
    return 1 if value is None else value


def _constraint(body: dict) -> dict[str, Any]:
    """``grammar`` (GBNF text), llama-server's ``json_schema`` and ``response_format`` as
    the grammar or JSON schema the library takes; their contents are the library's to
    check (an invalid one is a 400). An empty grammar is none, as llama-server reads it."""
    grammar = opt(body, "grammar", str, "a GBNF grammar as a string") or None
    out = _format(body, grammar)
    schema = body.get("json_schema")
    if schema is None:
        return out
    if not isinstance(schema, dict):
        raise invalid(f"json_schema must be a JSON schema object, got {kind_of(schema)}", "json_schema", "invalid_type")
    if out["grammar"] is not None or out["json_schema"] is not None:
        raise invalid("json_schema and grammar (or response_format) both constrain the text; send one of them",
                      "json_schema", "invalid_value")
    # a schema it cannot convert is a 400 naming this field, not response_format
    return dict(grammar=None, json_schema=schema, formatted=True, format_field="json_schema")


def _format(body: dict, grammar: str | None) -> dict[str, Any]:
    """``response_format`` beside ``grammar``."""
    rf = body.get("response_format")
    if rf is None:
        return dict(grammar=grammar, json_schema=None, formatted=False)
    if not isinstance(rf, dict):
        raise invalid(f'response_format must be an object such as {{"type": "json_object"}}, got {kind_of(rf)}',
                      "response_format", "invalid_type")
    kind = rf.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
                      "response_format", "invalid_value")
    if kind == "text":
        return dict(grammar=grammar, json_schema=None, formatted=False)
    if grammar is not None:
        raise invalid("grammar and response_format both constrain the reply; send one of them",
                      "grammar", "invalid_value")
    if kind == "json_object":
        schema = rf.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise invalid(f"response_format.schema must be a JSON schema object, got {kind_of(schema)}",
                          "response_format", "invalid_type")
        return dict(grammar=None if schema else json_object_grammar(), json_schema=schema, formatted=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid('response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                      '"schema": {...}}', "response_format", "missing_required_parameter")
    schema = spec.get("schema")
    if schema is None:      # optional in OpenAI's API: any JSON object, as llama-server reads it
        return dict(grammar=json_object_grammar(), json_schema=None, formatted=True)
    if not isinstance(schema, dict):
        raise invalid(f"response_format.json_schema.schema must be a JSON schema object, got {kind_of(schema)}",
                      "response_format", "invalid_type")
    return dict(grammar=None, json_schema=schema, formatted=True)


def _chat_logprobs(body: dict) -> int | None:
    """Chat asks with ``logprobs: true``, and for alternatives with ``top_logprobs: N``
    (0 to MAX_LOGPROBS), which needs ``logprobs: true`` as in OpenAI's API."""
    wanted = opt(body, "logprobs", bool, "a boolean")
    top = logprob_count(body, "top_logprobs")
    if not wanted:
        if top not in (None, 0):
            raise invalid(f"top_logprobs={top!r} needs logprobs: true", "top_logprobs", "invalid_value")
        return None
    return top or 0


def _prompts(body: dict) -> list[str | list]:
    """``prompt``: a string, a list of token ids (strings mixed in or not, as llama-server's
    tokenize_mixed takes them: ``mixed_ids`` makes them ids), or a list of those (several
    prompts, a generation each, in turns of the server's slots: runs.in_turns and
    runs.stream_turns)."""
    p = body.get("prompt")
    several = isinstance(p, list) and p and all(isinstance(x, (str, list, dict)) for x in p)
    prompts = [read_prompt(x, f"prompt[{i}]") for i, x in enumerate(p)] if several else [read_prompt(p, "prompt")]
    return prompts


def is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_prompt(p: Any, where: str) -> str | list:
    """One prompt: a string, token ids (strings mixed in or not), or llama-server's
    ``{"prompt_string": ...}`` object (its ``multimodal_data`` refused: text models)."""
    if isinstance(p, dict):
        if p.get("multimodal_data"):
            raise unsupported(f"{where}.multimodal_data", "<data>", "is not supported: pymtp serves text models")
        p, where = p.get("prompt_string"), f"{where}.prompt_string"
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(isinstance(t, str) or is_token_id(t) for t in p):
        return list(p)
    if p is None and where == "prompt":
        raise invalid("prompt is required", "prompt", "missing_required_parameter")
    raise invalid(f"{where} must be a string, a list of token ids (strings mixed in or not), or "
                  f'{{"prompt_string": ...}}, got {kind_of(p)}', "prompt", "invalid_type")


def _messages(body: dict) -> list[dict]:
    try:
        return read_messages(body.get("messages"))
    except ParamError as exc:
        raise from_value_error(exc, {}) from None


def _draft_max(body: dict) -> int | str | None:
    v = body.get("draft_max")
    if v is None or v == "auto":
        return v
    return opt(body, "draft_max", int, 'an integer or "auto"')


