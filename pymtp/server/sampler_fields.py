"""llama-server's own sampler fields: honoured where pymtp can give the same tokens, a 400
naming the field where it cannot.

Clients written for llama-server send its extensions on the OpenAI endpoints: ``samplers``
(the chain's order), ``typical_p``, ``mirostat``, ``dry_multiplier``, ``xtc_probability``
... Ignoring one that is switched on would silently give other text than the client asked
for, so each is checked against the value that makes its sampler a no-op in the pinned
llama.cpp (``llama_sampler_init_*`` returns its empty sampler there, src/llama-sampler.cpp).
Clients that send every field at its neutral value (SillyTavern, say) are served.

``samplers`` (a list of names or a string of llama.cpp's one-letter codes,
common/sampling.cpp) decides which samplers run at all: a sampler it leaves out is off in
llama-server whatever its field says. pymtp honours that by switching its own ones off
(``honour``): a request that sets ``top_k`` but lists no ``top_k`` samples without it, one
that lists no ``temperature`` samples at temperature 1, as llama-server's chain does. The
order pymtp applies its samplers in is fixed (sampling_filters.py: penalties, top_k,
top_p, min_p, temperature, llama-server's default order, with llama.cpp's infill sampler
before the temperature where the list names it, as code-completion clients do); a list
that puts the ones switched on in another order is a 400. Names an older llama.cpp took
(``tfs_z``, ``typical_p``; code ``f``) are skipped, as the pinned llama-server skips them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .errors import invalid, unsupported

# pymtp's samplers in the order it applies them, each with its switched-off settings.
PYMTP_ORDER = ("penalties", "top_k", "top_p", "min_p", "infill", "temperature")
_OFF: dict[str, dict[str, Any]] = {
    "penalties": {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0},
    "top_k": {"top_k": 0},
    "top_p": {"top_p": 1.0},
    "min_p": {"min_p": 0.0},
    "temperature": {"temperature": 1.0},
}
# llama-server's chain when a request names none (common/common.h, common_params_sampling).
LLAMA_DEFAULT = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_CODES = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
          "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
_NAMES = set(_CODES.values())
# names (and a code) an older llama.cpp server took, which clients written then still send
# (its web UI's ["top_k", "tfs_z", "typical_p", "top_p", "min_p", "temperature"], its codes
# "kfypmt"): the pinned llama-server matches none of them and runs the list without them,
# so pymtp skips them too. Any other unknown name is a 400: a typo there would silently
# switch a sampler off.
_RETIRED_NAMES = frozenset({"tfs_z", "tfs-z", "tfs", "typical_p", "typical-p", "typical"})
_RETIRED_CODES = frozenset("f")
_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
for _name in _NAMES:
    if "_" in _name:
        _ALIASES[_name.replace("_", "-")] = _name
        _ALIASES[_name.replace("_", "")] = _name


@dataclass(frozen=True)
class Unimplemented:
    """A llama-server setting pymtp has no sampler for, and when it is switched on."""

    field: str                       # the request field that switches it on
    sampler: str | None              # its name in ``samplers`` (None: it runs whatever the list says)
    on: Callable[[Callable[[str, float], float]], bool]   # given a reader of the body's numbers
    off: str                         # the values that leave it off, for the message
    why: str = "is not implemented by pymtp"


_LINE_RULE = "is applied on /completion and /infill (llama-server's code-completion routes), not here"
# Defaults are llama-server's (common/common.h); "off" is where its init returns the empty sampler.
UNIMPLEMENTED = (
    # llama-server reads mirostat as an integer clamped to [0, 2]: below 1 it is off
    Unimplemented("mirostat", None, lambda n: n("mirostat", 0) >= 1, "0"),
    Unimplemented("typical_p", "typ_p", lambda n: n("typical_p", 1.0) < 1.0, "1.0 (or more)"),
    Unimplemented("top_n_sigma", "top_n_sigma", lambda n: n("top_n_sigma", -1.0) > 0, "-1 (or any value <= 0)"),
    Unimplemented("xtc_probability", "xtc",
                  lambda n: n("xtc_probability", 0.0) > 0 and n("xtc_threshold", 0.1) <= 0.5,
                  "0 (or xtc_threshold > 0.5)"),
    Unimplemented("dry_multiplier", "dry",
                  lambda n: n("dry_multiplier", 0.0) != 0 and n("dry_penalty_last_n", 64) != 0,
                  "0 (or dry_penalty_last_n 0)"),
    Unimplemented("dynatemp_range", "temperature", lambda n: n("dynatemp_range", 0.0) > 0, "0 (or less)"),
    Unimplemented("adaptive_target", "adaptive_p", lambda n: n("adaptive_target", -1.0) >= 0,
                  "a negative value (or no adaptive_p in samplers)"),
    Unimplemented("min_keep", None, lambda n: n("min_keep", 0) > 1, "0 or 1"),
    # llama-server's line rules for code completion: /completion and /infill apply them
    # (llama_completion.LineRules), which take them out of the body before it gets here
    Unimplemented("t_max_predict_ms", None, lambda n: n("t_max_predict_ms", -1) > 0, "0 or less", _LINE_RULE),
    Unimplemented("n_indent", None, lambda n: n("n_indent", 0) > 0, "0", _LINE_RULE),
)
# the rules' second fields, which a first field switched off leaves unread: read all the same,
# so that a NaN there is refused whatever the first says
_SECOND_FIELDS = ("xtc_threshold", "dry_penalty_last_n")


def read(body: dict, number: Callable[[str], float | None]) -> tuple[str, ...] | None:
    """The request's ``samplers`` in canonical names (None: not sent), after refusing any
    llama-server setting that is switched on and that pymtp cannot apply. ``number`` reads
    one of the body's numbers (None when absent), refusing a value of another type."""
    names = _samplers(body)
    chain = LLAMA_DEFAULT if names is None else names

    def given(name: str, default: float) -> float:
        v = number(name)
        if v is not None and not math.isfinite(v):      # NaN compared as "off" and slipped through
            raise invalid(f"{name} must be a finite number, got {v!r}", name, "invalid_value")
        return default if v is None else v

    for name in _SECOND_FIELDS:
        given(name, 0.0)
    for u in UNIMPLEMENTED:
        if (u.sampler is None or u.sampler in chain) and u.on(given):
            raise unsupported(u.field, body.get(u.field),
                              f"{u.why}; send {u.off}, or leave it out")
    lora = body.get("lora")
    if lora not in (None, []):
        raise unsupported("lora", lora, "is not implemented by pymtp: it serves the model as loaded")
    return names


def honour(names: tuple[str, ...] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` (DecodeParams keywords, the server's defaults merged in) with every
    pymtp sampler that ``names`` leaves out switched off, as llama-server's chain would
    leave it out; a 400 if the samplers switched on are listed out of pymtp's order."""
    if names is None:
        return kwargs
    out = dict(kwargs)
    for sampler in PYMTP_ORDER:
        if sampler not in names and sampler in _OFF:
            out.update(_OFF[sampler])
    if "infill" in names:         # it has no field of its own: naming it switches it on
        out["infill"] = True
    running = [s for s in names if s in PYMTP_ORDER and not _is_off(s, out)]
    if running != [s for s in PYMTP_ORDER if s in running]:
        raise invalid(f"samplers lists {', '.join(running)} in this order; pymtp applies them as "
                      f"{', '.join(PYMTP_ORDER)} (llama-server's default order) and cannot reorder them",
                      "samplers", "unsupported_parameter")
    return out


def _is_off(sampler: str, kwargs: dict[str, Any]) -> bool:
    if sampler == "infill":
        return not kwargs.get("infill")
    if sampler == "penalties" and kwargs.get("repeat_last_n") == 0:
        return True
    if sampler == "top_p":
        return kwargs["top_p"] >= 1.0
    if sampler == "min_p":
        return kwargs["min_p"] <= 0.0
    return all(kwargs[k] == v for k, v in _OFF[sampler].items())


def _samplers(body: dict) -> tuple[str, ...] | None:
    v = body.get("samplers")
    if v is None:
        return None
    if isinstance(v, str):
        bad = [c for c in v if c not in _CODES and c not in _RETIRED_CODES]
        if bad:
            raise invalid(f"samplers has unknown sampler codes {''.join(bad)!r}; the codes are "
                          f"{''.join(_CODES)} ({', '.join(f'{c}={n}' for c, n in _CODES.items())})",
                          "samplers", "invalid_value")
        return tuple(_CODES[c] for c in v if c in _CODES)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise invalid("samplers must be a list of sampler names such as [\"top_k\", \"top_p\", "
                      "\"temperature\"], or a string of their one-letter codes", "samplers", "invalid_type")
    out = []
    for name in v:
        canonical = _ALIASES.get(name.lower(), name.lower())
        if canonical in _RETIRED_NAMES:
            continue
        if canonical not in _NAMES:
            raise invalid(f"samplers names an unknown sampler {name!r}; known: {', '.join(sorted(_NAMES))}",
                          "samplers", "invalid_value")
        out.append(canonical)
    return tuple(out)
