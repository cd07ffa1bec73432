"""Readers of one field of a request body each: its JSON type checked, and a refusal that
names the field in the OpenAI error shape. The routes' parsers (schemas.py, anthropic.py,
responses_api.py, llama_completion.py) build their requests from these.
"""

from __future__ import annotations

import math
import re

from ..chat_messages import kind_of
from ..config import MAX_LOGPROBS, added_bias, in_bias_range
from .errors import invalid

# stop strings a request may send (OpenAI's API takes 4; llama-server, its /completion, and
# Anthropic's stop_sequences more), and the length of one on the routes whose APIs allow
# long ones: each is matched against the text at every token, in the thread that
# steps every slot, so a million of them stalled all requests (0.08 s -> 7 s)
MANY_STOPS, STOP_CHARS = 64, 256
# llama.cpp's seed -1: draw a fresh seed (a request's overrides a server's --seed)
FRESH_SEED = -1


def opt(body: dict, name: str, kind: type, what: str, label: str | None = None):
    """``body[name]`` if it is a ``kind`` (None where it is absent or null), else a 400
    saying it must be ``what``; ``label`` names the field where it is nested."""
    v = body.get(name)
    if v is None:
        return None
    if kind is int and isinstance(v, float) and v.is_integer():
        return int(v)        # 40.0, as clients that build bodies from floats send it (llama-server takes it)
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        label = label or name
        raise invalid(f"{label} must be {what}, got {kind_of(v)}", label, "invalid_type")
    return v


def limit_field(body: dict, names: tuple[str, ...]) -> str:
    """The field that limits the reply: the first of ``names`` the body sets (OpenAI's,
    then llama-server's ``n_predict``, which its OpenAI routes read too)."""
    return next((name for name in names if body.get(name) is not None), names[0])


def reply_limit(body: dict, name: str) -> int | None:
    """The reply's token limit, None for none. llama-server's values below 1 are taken as
    it takes them: -1 is no limit (llama.cpp's web UI sends it for "infinite"), 0 one
    token; anything lower is a 400."""
    n = integer(body, name)
    if n is None or n >= 1:
        return n
    if n < -1:
        raise invalid(f"{name} must be a number of tokens >= 1, or -1 for no limit, got {n}", name, "invalid_value")
    return None if n == -1 else 1


def own_limit(body: dict, name: str) -> None:
    """Refuse a limit below 1 where an API's own field has no llama-server values
    (Anthropic's max_tokens, the Responses API's max_output_tokens): the chat route they
    go through would take -1 as no limit and 0 as one token (``reply_limit``)."""
    limit = body.get(name)
    if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit < 1:     # 0.0 too
        raise invalid(f"{name} must be an integer >= 1, got {limit}", name)


def integer(body: dict, name: str) -> int | None:
    return opt(body, name, int, "an integer")


def seed_of(body: dict) -> int | None:
    """A seed >= 0, or llama.cpp's -1 (null too) for a fresh one: said in the API's terms
    (the library's message offers Python's None)."""
    seed = integer(body, "seed")
    if seed is not None and seed < FRESH_SEED:
        raise invalid(f"seed must be an integer >= 0, or -1 (or null) for a fresh one, got {seed}", "seed",
                      "invalid_value")
    return seed


def number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"{name} must be a number, got {kind_of(v)}", name, "invalid_type")
    try:
        return float(v)
    except OverflowError:       # an integer of hundreds of digits
        raise invalid(f"{name} must be a number within a double's range, got an integer of {len(str(v))} digits",
                      name, "invalid_value") from None
def logprob_count(body: dict, name: str) -> int | None:
    n = integer(body, name)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise invalid(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {n}", name, "invalid_value")
    return n


def stop_of(body: dict) -> tuple[str, ...]:
    """OpenAI's ``stop``: a string or a list. OpenAI takes 4; llama-server and vLLM any
    number, and clients written for them send more: up to MANY_STOPS."""
    return stop_strings(body, "stop", MANY_STOPS)


def many_stops(body: dict, name: str) -> tuple[str, ...]:
    """The APIs' that take more stop strings: up to MANY_STOPS of STOP_CHARS characters."""
    return stop_strings(body, name, MANY_STOPS, STOP_CHARS)


def stop_strings(body: dict, name: str, most: int, chars: int | None = None) -> tuple[str, ...]:
    """A string or a list of strings at ``name`` (the empty ones left out), at most ``most``
    of them, each at most ``chars`` characters (None: any)."""
    s = body.get(name)
    if s is None:
        return ()
    s = [s] if isinstance(s, str) else s
    if not isinstance(s, list):
        raise invalid(f"{name} must be a string or a list of strings, got {kind_of(s)}", name, "invalid_type")
    for i, x in enumerate(s):
        if not isinstance(x, str):
            raise invalid(f"{name}[{i}] must be a string, got {kind_of(x)}", name, "invalid_type")
    if chars is None and len(s) > most:
        raise invalid(f"{name} takes at most {most} strings, got {len(s)}", name)
    if chars is not None and (len(s) > most or any(len(x) > chars for x in s)):
        raise invalid(f"{name} takes at most {most} strings of at most {chars} characters, got "
                      f"{len(s)} of up to {max(map(len, s))}", name)
    return tuple(x for x in s if x)


# what C's strtol(key, &end, 10) reads to its end: C's white space, a sign, digits; "" reads as 0
_STRTOL_ID = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+|")


def logit_bias_of(body: dict) -> dict[int | str, float] | None:
    """OpenAI's ``logit_bias`` object (token ids as strings -> bias), or llama-server's
    list of [token, bias] pairs; ``false`` as a bias bans the token (llama-server's).
    As llama-server, a token given as text (a pair's string, an object's key that is no
    id) biases each token of that text: it stays a ``str`` key here, and the service
    tokenizes it (``Service.biases``). Pairs naming one token twice add up, as llama.cpp
    applies each, within the range each value is checked against here (config.added_bias);
    the ids' against the vocabulary are the library's to check (``check_logit_bias``)."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if isinstance(v, dict):
        pairs = list(v.items())
    elif isinstance(v, list) and all(isinstance(x, list) and len(x) == 2 for x in v):
        pairs = [tuple(x) for x in v]
    else:
        raise invalid(f'logit_bias must be an object of token ids to biases such as {{"1234": -100}}, '
                      f"or a list of [token id, bias] pairs, got {kind_of(v)}", "logit_bias", "invalid_type")
    out: dict[int | str, float] = {}
    for token, bias in pairs:
        key: int | str
        if isinstance(token, int) and not isinstance(token, bool):
            key = token
        elif isinstance(token, str) and isinstance(v, dict) and _STRTOL_ID.fullmatch(token):
            key = int(token or "0")     # an object's key is an id where strtol reads it whole, as llama-server's
        elif isinstance(token, str):
            key = token           # a pair's string is always text: "0" is the digit, not id 0
        else:
            raise invalid(f"logit_bias pairs take a token id or a text, got {kind_of(token)}", "logit_bias",
                          "invalid_type")
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise invalid(f"logit_bias for token {key!r} must be a number (or false to ban it), got {kind_of(bias)}",
                          "logit_bias", "invalid_type")
        try:
            value = float(bias)
        except OverflowError:       # an integer past a double, read as JSON reads 1e400: -inf bans (llama-server)
            value = math.inf if bias > 0 else -math.inf
            shown = f"an integer of {len(str(abs(bias)))} digits"
        else:
            shown = repr(value)
        if not in_bias_range(value):      # as sent: a token's entries add up within it
            raise invalid(f"logit_bias for token {key!r} must be in [-100, 100] (or false to ban it), "
                          f"got {shown}", "logit_bias", "invalid_value")
        out[key] = added_bias(out.get(key, 0.0), value)
    return out or None
