"""A generation's settings as llama-server reports them: its task params
(``task_params::to_json``, tools/server/server-task.cpp of the pinned llama.cpp), which
``/completion`` answers as ``generation_settings`` and ``/slots`` as each slot's ``params``.

The names and the values are llama-server's where pymtp has the setting; llama-server's
samplers that pymtp has none of are left out (sampler_fields refuses them switched on),
and pymtp's speculative settings are added.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..config import shown_draft_max
from .sampler_fields import LLAMA_DEFAULT
from .body_fields import FRESH_SEED

# llama.cpp's "draw a fresh seed" (LLAMA_DEFAULT_SEED), as llama-server reports it
FRESH_SEED_REPORTED = 0xFFFFFFFF


def task_params(kw: dict[str, Any], *, n_predict: int, stop: tuple[str, ...] | list[str], stream: bool,
                n_probs: int, samplers: tuple[str, ...] | None = None, full: bool = True,
                ends: Sequence[int] = ()) -> dict[str, Any]:
    """What a generation runs with: ``kw`` are its ``Session.stream`` keywords (the
    server's defaults merged in), ``n_predict`` its limit as the request said it (-1: none),
    ``samplers`` its chain as it named it (None: llama-server's default chain, which pymtp
    runs as its own: clients such as llama.cpp's web page send /props' list back, and a
    list of only the samplers switched on would switch the others off, sampler_fields).
    ``full`` False leaves out what llama-server leaves out of ``/slots`` (the stop
    strings, the logit bias, the grammar), as its ``only_metrics``. ``ends``: the model's
    end tokens, whose ban ``ignore_eos`` adds to the bias as llama-server lists it."""
    seed = kw.get("seed")
    out: dict[str, Any] = {
        "seed": FRESH_SEED_REPORTED if seed in (None, FRESH_SEED) else seed,
        "temperature": kw["temperature"], "top_k": kw["top_k"], "top_p": kw["top_p"], "min_p": kw["min_p"],
        "repeat_last_n": kw["repeat_last_n"], "repeat_penalty": kw["repeat_penalty"],
        "presence_penalty": kw["presence_penalty"], "frequency_penalty": kw["frequency_penalty"],
        "max_tokens": n_predict, "n_predict": n_predict,
        "ignore_eos": bool(kw.get("ignore_eos")), "stream": stream, "n_probs": n_probs,
        "samplers": list(LLAMA_DEFAULT if samplers is None else samplers),
        # llama-server's words for drafting with the model's MTP head (its list of types
        # starts with "none" whatever it adds)
        "speculative.types": "none,draft-mtp" if kw.get("spec") == "mtp" else "none",
        "spec": kw.get("spec"), "draft_max": shown_draft_max(kw.get("draft_max")), "p_min": kw.get("p_min"),
    }
    if full:
        bias = list((kw.get("logit_bias") or {}).items())
        if kw.get("ignore_eos"):
            bias += [(t, -math.inf) for t in ends]
        out |= {"stop": list(stop),
                # a ban (-inf) as llama-server writes it: JSON has no infinity
                "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in bias],
                "grammar": kw.get("grammar") or ""}
    return out
