"""Constrained decoding: every generated token must keep the text inside a grammar.

A request's constraint is a GBNF grammar (llama.cpp's format), given as is or made from a
JSON schema (schema_grammar.py); llama.cpp's grammar sampler parses it and
keeps its parse state. Words used below:

- a **state** is the grammar's parse state after some tokens (a ``Mask``): it answers
  which ids may come next (token_masks.TokenMask) and moves on by one allowed token;
- the **constrained distribution** of a row is the sampler's own (penalties, filters,
  temperature) over the tokens the state allows only (token_masks.py).

Why speculative decoding stays lossless under a constraint: draft d_i and verify row i - 1
predict the same position after the same tokens (the emitted ones, then d_1..d_{i-1}), so
they share one state. A round walks the states along its drafts (``GrammarPath``): the
drafter samples d_i from q_i masked by state i - 1, the target's row i - 1 is masked by the
same state, and acceptance (acceptance.py) compares p and q both masked: rejection
sampling then emits tokens distributed as the constrained p, and greedy acceptance
emits the constrained argmax, exactly what constrained plain decoding gives. States are
cloned along the drafts (``llama_sampler_clone``, ~5-20 us) and the round keeps the one
after its accepted drafts, moved past its next token: a rejected draft's state is
dropped, so nothing is rewound.

Masking q matters for speed, not correctness: with an unmasked q the drafter proposes
tokens the grammar refuses, which are always rejected (p = 0 there).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ParamError
from .native import NativeError, NativeModel
from .native_samplers import Grammar
from .sampling import ThreadTokenData
from .schema_refs import RefError, flat_refs, has_ref, user_pointer

# the grammar's questions get their own array: the sampler's may hold a row it is still reading
_candidates = ThreadTokenData()


# --- a request's grammar, from what it asked -------------------------------------------

def json_object_grammar() -> str:
    """Any JSON object: OpenAI's JSON mode (``response_format: {"type": "json_object"}``)."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def json_schema_grammar(schema: Any, param: str = "json_schema") -> str:
    """The GBNF grammar of a JSON schema (a dict, or its JSON text), by the converter of
    schema_grammar.py; a schema it cannot convert raises ``ParamError`` naming ``param``."""
    from .grammar_counts import NoValue
    from .schema_grammar import merge_schemas, refusal_place, schema_gbnf

    text = schema if isinstance(schema, str) else _schema_text(schema, param)
    origins: dict[str, str] = {}      # refs' targets: where the user's schema holds them
    try:
        parsed = json.loads(text)
        if parsed is False:
            raise ValueError("the schema false allows no value")
        if isinstance(parsed, dict) and has_ref(parsed):      # refs as the converter reads them
            defs: dict[str, Any] = {}
            body = flat_refs(parsed, "def", defs, origins)
            ref = body.get("$ref")
            name = ref[len("#/$defs/"):] if isinstance(ref, str) and ref.startswith("#/$defs/") else None
            if name in defs:     # a root that is a ref: its target
                body = merge_schemas({k: v for k, v in body.items() if k != "$ref"}, defs[name])
            parsed = {**body, "$defs": defs} if defs else body
        return strict_strings(schema_gbnf(parsed))
    except json.JSONDecodeError as exc:
        raise ParamError(param, f"{param} is not valid JSON: {exc}") from None
    except RefError as exc:
        where = user_pointer(exc.schema_at, origins)
        raise ParamError(param, f"{param}{f' at {where}' if where else ''}: {exc}") from None
    except NoValue as exc:
        raise ParamError(param, f"{param} allows no JSON value ({exc}){refusal_place(exc, origins=origins)}; "
                         "loosen the keywords it names") from None
    except Exception as exc:     # the converter raises ValueError, KeyError, TypeError ...
        raise ParamError(param, f"{param} is not a JSON schema the converter understands "
                         f"({type(exc).__name__}: {exc}){refusal_place(exc, origins=origins)}; give a plain "
                         "JSON schema (type, properties, required, items, enum, const, anyOf, $defs/$ref)") from None


def either_grammar(first: str, second: str) -> str:
    """A GBNF grammar of the texts either grammar allows: the second's rules renamed apart
    from the first's (under a prefix neither uses), a new root choosing between the roots."""
    if "root" not in rule_names(second):
        raise ParamError("grammar", "the grammar has no root rule; it must define root ::= ...")
    first_words, second_words = grammar_words(first), grammar_words(second)
    prefix = "either"
    while any(w.startswith(prefix) for w in first_words | second_words):
        prefix += "x"
    a = renamed_rules(first, {"root": f"{prefix}-a"})
    # every name of the second, defined there or not: one it only uses must stay undefined
    # (an error), not bind to a rule of the first
    b = renamed_rules(second, {name: f"{prefix}-b-{name}" for name in second_words})
    return f"{a.rstrip()}\n{b.rstrip()}\nroot ::= {prefix}-a | {prefix}-b-root\n"


def text_until(prefix: str, tag: str, follow: str, may_end: bool = False) -> list[str]:
    """Rules ``{prefix}0``... of any text up to the first ``tag``, then ``follow``: state
    k has matched the tag's first k characters; another character goes back to 0, or to 1
    where it is the tag's first (no character of the tag but its last may repeat the
    first, where the tag then ends). ``may_end``: the text may also end anywhere before a
    whole tag, with no ``follow``."""
    esc = [json.dumps(c)[1:-1] for c in tag]      # "\n" as GBNF writes it in a class too
    first = esc[0]
    open_, close = ("( ", " )?") if may_end else ("", "")
    rules = [f'{prefix}0 ::= {open_}[^{first}] {prefix}0 | "{first}" {prefix}1{close}']
    for k in range(1, len(esc)):
        nxt = f"{prefix}{k + 1}" if k + 1 < len(esc) else follow
        back = "" if esc[k] == first else f' | "{first}" {prefix}1'
        rules.append(f'{prefix}{k} ::= {open_}[^{esc[k]}{first}] {prefix}0{back} | "{esc[k]}" {nxt}{close}')
    return rules


def rule_names(gbnf: str) -> set[str]:
    """The rules ``gbnf`` defines."""
    return set(re.findall(r"(?m)^[ \t]*([A-Za-z0-9-]+)[ \t]*::=", gbnf))


def grammar_words(gbnf: str) -> set[str]:
    """The names in ``gbnf`` outside its string literals, character classes and comments."""
    seen: set[str] = set()
    renamed_rules(gbnf, {}, seen)
    return seen


def _pieces(gbnf: str) -> Iterator[tuple[str, str]]:
    """``gbnf`` as (kind, text) pieces, kind one of "count" (a repetition count such as
    {2,3}), "literal" (a string or character class), "comment", "word" and "other"."""
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == "{":
            j = gbnf.find("}", i)
            kind, end = "count", (n if j < 0 else j + 1)
        elif c in "\"[":
            close, j = ('"' if c == '"' else "]"), i + 1
            while j < n and gbnf[j] != close:
                j += 2 if gbnf[j] == "\\" else 1
            kind, end = "literal", j + 1
        elif c == "#":
            j = gbnf.find("\n", i)
            kind, end = "comment", (n if j < 0 else j)
        elif c.isascii() and (c.isalnum() or c == "-"):
            j = i
            while j < n and gbnf[j].isascii() and (gbnf[j].isalnum() or gbnf[j] == "-"):
                j += 1
            kind, end = "word", j
        else:
            kind, end = "other", i + 1
        yield kind, gbnf[i:end]
        i = end


def renamed_rules(gbnf: str, names: dict[str, str], seen: set[str] | None = None) -> str:
    """``gbnf`` with each rule name in ``names`` written as its value, in its definition and
    where it is used; string literals, character classes, repetition counts and comments
    are left as they are. Every name met is added to ``seen``."""
    out = []
    for kind, text in _pieces(gbnf):
        if kind == "word":
            if seen is not None:
                seen.add(text)
            text = names.get(text, text)
        out.append(text)
    return "".join(out)


def reversed_count(gbnf: str) -> str | None:
    """A repetition count {m,n} with m > n, which llama.cpp 0.3.36's parser does not refuse:
    its count of optional copies (n - m, unsigned) wraps, and it builds rules until the
    process runs out of memory (llama-grammar.cpp, parse_sequence)."""
    for kind, text in _pieces(gbnf):
        bounds = re.fullmatch(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text) if kind == "count" else None
        if bounds and int(bounds[1]) > int(bounds[2]):
            return text
    return None


# The converter's string character (llama-cpp-python 0.3.36) lets a raw control character
# such as a newline into a JSON string, which JSON forbids (json.loads refuses it); the
# one rule is swapped for llama.cpp's own JSON grammar's (grammars/json.gbnf).
_LOOSE_CHAR = r'char ::= [^"\\] |'
_STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def strict_strings(gbnf: str) -> str:
    return "\n".join(_STRICT_CHAR + line[len(_LOOSE_CHAR):] if line.startswith(_LOOSE_CHAR) else line
                     for line in gbnf.split("\n"))


def _schema_text(schema: Any, param: str) -> str:
    if not isinstance(schema, (dict, bool)):
        raise ParamError(param, f"{param} must be a JSON schema object, got {type(schema).__name__}")
    return json.dumps(schema)


# --- compiled grammars and their states ------------------------------------------------

class Constraint:
    """A compiled grammar for one model; ``start()`` is the state before any token."""

    def __init__(self, model: NativeModel, text: str, param: str = "grammar") -> None:
        if not isinstance(text, str) or not text.strip():
            raise ParamError(param, f"{param} must be a non-empty GBNF grammar with a 'root' rule")
        if (count := reversed_count(text)) is not None:
            raise ParamError(param, f"{param} has the repetition {count}, whose minimum exceeds its maximum; "
                             "write {m,n} with m <= n")
        try:
            self.grammar = Grammar(model, text)
        except NativeError as exc:
            raise ParamError(param, f"{param} is not a valid GBNF grammar: {exc}; see llama.cpp's "
                             "grammars/README.md for the format (the start rule is 'root')") from None
        self.n_vocab = model.n_vocab
        self.hidden = hidden_tokens(model)
        self.ends = end_tokens(model)

    def start(self, keep_going: bool = False) -> Mask:
        """``keep_going`` (ignore_eos): the end tokens only where the grammar allows
        nothing else, so the text goes on until the grammar ends it."""
        return Mask(self.grammar.clone(), self, keep_going)

    def close(self) -> None:
        self.grammar.close()


_hidden: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()
COMPILED_PER_MODEL = 16      # grammars kept compiled per model, most recently used


def hidden_tokens(model: NativeModel) -> np.ndarray:
    """[n_vocab] bool: control tokens that do not end generation. The grammar reads a
    token's text with control tokens spelled out (``<|im_start|>``) but the output drops
    that text, so such a token could satisfy the grammar and leave text that does not;
    the constraint never allows one. Computed once per model."""
    out = _hidden.get(model)
    if out is None:
        out = np.array([model.is_control(t) and not model.is_eog(t) for t in range(model.n_vocab)], dtype=bool)
        out.flags.writeable = False
        _hidden[model] = out
    return out


def end_tokens(model: NativeModel) -> np.ndarray:
    """[n_vocab] bool: the end-of-generation tokens. Computed once per model."""
    out = _ends.get(model)
    if out is None:
        out = np.zeros(model.n_vocab, dtype=bool)
        out[list(model.eog_ids)] = True
        out.flags.writeable = False
        _ends[model] = out
    return out


def constraint_for(model: NativeModel, grammar: str | None, json_schema: Any) -> Constraint | None:
    """The compiled constraint of a generation's ``grammar`` or ``json_schema`` keyword
    (None without either), compiled once per model and text: the check of a request and
    its run share it. A bad one raises ``ParamError`` naming its keyword."""
    if grammar is None and json_schema is None:
        return None
    param = "grammar" if grammar is not None else "json_schema"
    key = (param, grammar if grammar is not None else
           (json_schema if isinstance(json_schema, str) else _schema_text(json_schema, param)))
    with _cache_lock:
        cache = _compiled.setdefault(model, {})
        hit = cache.pop(key, None)
        if hit is not None:
            cache[key] = hit          # most recently used last
            return hit
    c = Constraint(model, grammar if grammar is not None else json_schema_grammar(key[1]), param)
    with _cache_lock:
        cache[key] = c
        while len(cache) > COMPILED_PER_MODEL:
            cache.pop(next(iter(cache)))
    return c


class Mask:
    """One grammar state: which tokens may come next (a token_masks.TokenMask), and the
    state after one of them. A state is never changed: ``then`` makes a new one."""

    def __init__(self, grammar: Grammar, constraint: Constraint, keep_going: bool = False) -> None:
        self.grammar, self.constraint = grammar, constraint
        self.keep_going = keep_going            # Constraint.start's
        self._all: np.ndarray | None = None     # [n_vocab] bool, once a whole row was asked

    def allows(self, ids: np.ndarray) -> np.ndarray:
        if self._all is not None:
            return self._all[ids]
        ids = np.asarray(ids, dtype=np.int32)
        cur = _candidates.get(ids.size)
        cur.set(np.zeros(ids.size, dtype=np.float32), ids)
        self.grammar.apply(cur)
        # the grammar only sets logits, in place: entries keep their order
        ok = np.isfinite(cur.result()["logit"])
        ok &= ~self.constraint.hidden[ids]
        whole = ids.size == self.constraint.n_vocab
        if self.keep_going:
            # some ids say nothing of the rest: an end token waits for a whole row that
            # allows nothing else (every caller comes to one before it gives up)
            rest = ok & ~self.constraint.ends[ids]
            ok = ok if whole and not rest.any() else rest
        if whole:
            self._all = ok
        return ok

    def allowed(self) -> np.ndarray:
        if self._all is None:
            self.allows(np.arange(self.constraint.n_vocab, dtype=np.int32))
        return np.flatnonzero(self._all).astype(np.int32)

    def then(self, token: int) -> Mask:
        """The state after ``token``, which this state must allow: llama.cpp aborts the
        process on a refused end-of-generation token, so a refusal raises here instead."""
        # the grammar says what may follow; keep_going only holds its end back from samplers
        judge = self.ending() if self.keep_going else self
        if not judge.allows(np.array([token], dtype=np.int32))[0]:
            raise ValueError(f"token {token} breaks the grammar here; a constrained sampler never picks it")
        g = self.grammar.clone()
        g.accept(int(token))
        return Mask(g, self.constraint, self.keep_going)

    def ending(self) -> Mask:
        """This state as the grammar alone sees it, its end tokens allowed where it may
        end (``keep_going`` off): sampling.Sampler's last resort where a logit bias banned
        every other token it allows. It shares the state's grammar, which it never changes."""
        return Mask(self.grammar, self.constraint)

    def close(self) -> None:
        self.grammar.close()


@dataclass
class GrammarPath:
    """The states along one round's drafts: ``states[i]`` follows the emitted tokens and
    d_1..d_i; it masks draft d_{i+1} and verify row i."""

    states: list[Mask]

    @classmethod
    def start(cls, state: Mask) -> GrammarPath:
        return cls([state])

    def at(self, i: int) -> Mask:
        return self.states[i]

    @property
    def last(self) -> Mask:
        return self.states[-1]

    def push(self, token: int) -> None:
        """A draft was proposed: the state after it masks the next draft and verify row."""
        self.states.append(self.states[-1].then(token))

    def settle(self, n_accepted: int, next_token: int) -> Mask:
        """The state the next round starts from: after the accepted drafts and the round's
        recovered or bonus token (the others are freed with the path)."""
        return self.states[n_accepted].then(next_token)
