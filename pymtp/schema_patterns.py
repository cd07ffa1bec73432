"""A JSON schema's string ``pattern`` as the JSON text of the strings it matches, for
llama-cpp-python's converter to write (``plain_pattern``), its count cut to the string's
length where the pattern is one character repeated (``counted_pattern``); patterns the
grammar cannot hold (malformed, counts nested too deep, loops that match nothing) are
refused."""

from __future__ import annotations

import re
from typing import Any, Iterator

from .grammar_counts import NoValue, check_count

# the most a pattern's quantifier may count: the converter nests its optional repeats
_PATTERN_COUNT = 1000
# ... and the most counts nested in counted groups may multiply to: (a{0,20}){0,20} took
# llama.cpp's grammar 19-59 s for one full-vocabulary mask (a review), (a{0,10}){0,10} 0.3 s
_NESTED_COUNT = 64
# Python's words for a pattern that is malformed in ECMAScript's regexes too
_MALFORMED = ("missing )", "unbalanced parenthesis", "min repeat greater than max repeat", "multiple repeat",
              "nothing to repeat", "unterminated character set")


# what a JSON string holds only escaped: its quote, its backslash, control characters
_UNSAFE = {0x22, 0x5C} | set(range(0x20))
_SAFE_NOT = '"\\\\\\x00-\\x1F'        # those, as members of a negated class
_SHORT = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)], "s": [(0x20, 0x20)]}
# what a negated shorthand leaves out beyond its ASCII class: Unicode's white space for \\S
# (ECMA-262's and Python's), everything past ASCII for \\D and \\W (Python's reading
# counts other scripts' digits and letters)
_OUTSIDE = {"S": [(0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                  (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)],
            "D": [(0x80, 0x10FFFF)], "W": [(0x80, 0x10FFFF)]}
_CONTROL_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
_JSON_SHORT = {0x0A: "n", 0x09: "t", 0x0D: "r", 0x0C: "f", 0x08: "b", 0x22: '"', 0x5C: "\\\\"}


# a pattern of one character, repeated: ^[a-z]+$, ^\d{2,}$, ^.*?$ (a class, an escape, any
# character or a plain one; then its count)
_ONE_REPEATED = re.compile(r"\^(\[(?:\\.|[^\]\\])*\]|\\(?:u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|.)|[^\\^$|()\[\]{}*+?])"
                           r"(?:([*+?])|\{(\d+)(,(\d*))?\})?\??\$")


def counted_pattern(pattern: str, low: Any, high: Any) -> str:
    """A pattern of one character repeated, its count cut to ``minLength``/``maxLength``
    (what a grammar cannot do beside any other pattern); any other pattern as it is."""
    check_count(low, high)
    m = _ONE_REPEATED.fullmatch(pattern)
    if m is None or (low == 0 and high is None):
        return pattern
    atom, sign, m_low, comma, m_high = m.groups()
    if sign:
        least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[sign]
    elif m_low is not None:
        least, most = _repeats(m_low, comma, m_high)
    else:
        least, most = 1, 1
    least = max(least, low)
    most = high if most is None else most if high is None else min(most, high)
    if most is not None and least > most:
        raise NoValue(f"no string of pattern {pattern!r} has a length from {low} to {high}")
    if most is not None and most > _PATTERN_COUNT:
        return pattern        # a count the pattern's converter would nest: the length goes unenforced
    return f"^{atom}{{{least},{'' if most is None else most}}}$"


def plain_pattern(pattern: str) -> str:
    """A JSON schema ``pattern`` in the regex forms the base converter copies into the
    grammar, as the JSON text of the strings it matches: a quote, a backslash or a control
    character (``\\n``, ``\\u0022``) as its JSON escape, ``.`` and negated classes without
    them, ``\\d``, ``\\w`` and ``\\s`` (a space: the one white space written bare) as
    classes; class members only JSON escapes could write are left out (the class allows
    less, never text that is not the pattern's). A quantifier counts to ``_PATTERN_COUNT``."""
    escaped_end = (len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))) % 2 == 1     # "\\$" is no anchor
    try:        # what no regex dialect reads: the converter wrote "^(a$" as "a", "a{2,1}" as "aa"
        re.compile(pattern)
    except re.error as exc:
        if any(word in exc.msg for word in _MALFORMED):
            raise ValueError(f"pattern {pattern!r} is not a regular expression ({exc.msg} at position {exc.pos}); "
                             f"correct it") from None
    nested = _nested_count(pattern)
    if nested > _NESTED_COUNT:
        raise ValueError(f"pattern {pattern!r} nests counted repeats that multiply to {nested}: llama.cpp's "
                         f"grammar follows every way to split the text among them, which stalled a request "
                         f"for minutes; keep nested counts to {_NESTED_COUNT} in all, or use + and *")
    if (empty := _empty_loop(pattern)) is not None:
        raise ValueError(f"pattern {pattern!r} repeats {empty!r}, which can match the empty string: llama.cpp's "
                         f"grammar follows every way to split the text among its repeats, which held the server "
                         f"for minutes; make each repeated group match at least one character")
    # a pattern is a search (JSON schema's, ECMA-262's): an end without its anchor takes any text there
    starts, ends = pattern.startswith("^"), pattern.endswith("$") and not escaped_end
    out, i, n = [], 1 if starts else 0, len(pattern) - 1 if ends else len(pattern)
    while i < n:
        c = pattern[i]
        if c == "(" and pattern.startswith("(?", i):
            named = re.match(r"\(\?<[A-Za-z_$][\w$]*>", pattern[i:])
            if not (pattern.startswith("(?:", i) or named):
                raise ValueError(f"pattern {pattern!r} has a lookaround ({pattern[i:i + 3]}...) at position {i}, "
                                 "which a grammar cannot hold; write the pattern without it")
            out.append("(")         # a group that captures nothing, or a named one: the same strings
            i += len(named.group(0)) if named else 3
            continue
        if c == "[":
            members, negated, i = _read_class(pattern, i)
            out.append(_class(members, negated, pattern))
            continue
        if c in "^$":     # an anchor: at a branch's end, it says nothing more there
            at_start = c == "^" and (i == 1 or pattern[i - 1] in "|(")
            at_end = c == "$" and (i == n - 1 or pattern[i + 1] in "|)")
            if not (at_start or at_end):
                raise ValueError(f"pattern {pattern!r}: an anchor ({c}) inside a branch is not supported")
            i += 1
            continue
        if c == "?" and out and out[-1] in ("*", "+", "?", "}") and pattern[i - 1] in "*+?}":
            i += 1        # lazy: the same strings
            continue
        if c == "{":
            j = pattern.find("}", i)
            if j > 0 and re.fullmatch(r"\s*\d*\s*(,\s*\d*\s*)?", pattern[i + 1:j]) and \
                    any(int(x) > _PATTERN_COUNT for x in re.findall(r"\d+", pattern[i + 1:j])):
                raise ValueError(f"pattern {pattern!r} counts past {_PATTERN_COUNT} in {pattern[i:j + 1]}; "
                                 "use maxLength for a long string")
        if c == ".":
            out.append(f"[^{_SAFE_NOT}]")
            i += 1
        elif c == "\\" and i + 1 < n:
            code, shorthand, i = _read_escape(pattern, i)
            if shorthand is not None:
                if shorthand.isupper():     # JSON schema's regexes are ECMA-262's: ASCII \\d, \\w
                    out.append(_class(_SHORT[shorthand.lower()] + _OUTSIDE[shorthand], True, pattern))
                else:
                    out.append(_class(_SHORT[shorthand], False, pattern))
            else:
                out.append(_char(code))
        elif ord(c) in _UNSAFE:
            out.append(_char(ord(c)))
            i += 1
        else:
            out.append(c)
            i += 1
    # one group: the base converter writes a top-level "|" between the string's quotes
    anything = f"[^{_SAFE_NOT}]*"
    return f"^{'' if starts else anything}({''.join(out)}){'' if ends else anything}$"


_COUNT = re.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")


def _repeats(low: str, comma: str | None, high: str | None) -> tuple[int, int | None]:
    """A quantifier ``{low}``, ``{low,}`` or ``{low,high}`` as (least, most; None: no bound)."""
    least = int(low or 0)
    return least, least if comma is None else int(high) if high else None


def _expanded(m: re.Match) -> int:
    """How many copies of its item a ``_COUNT`` match makes the grammar write: its bound,
    or its least where it has none (the rest is a loop)."""
    least, most = _repeats(*m.groups())
    return least if most is None else most


def _marks(pattern: str) -> Iterator[tuple[str, int, re.Match | None]]:
    """A pattern's group openings ``("(", i, None)``, closings with the count right after
    them ``(")", i, count or None)`` and other counts ``("{", i, count)``, escapes and
    classes passed over."""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
        elif c == "[":
            i = _read_class(pattern, i)[2]
        elif c == "(":
            yield "(", i, None
            i += 1
        elif c == ")":
            m = _COUNT.match(pattern, i + 1)
            yield ")", i, m
            i = m.end() if m else i + 1
        elif c == "{" and (m := _COUNT.match(pattern, i)):
            yield "{", i, m
            i = m.end()
        else:
            i += 1


def _empty_loop(pattern: str) -> str | None:
    """The first group repeated (``*``, ``+``, ``{n,}``, ``{n,m}`` with m > 1) that can match
    the empty string, with its quantifier (``(.*.*.*.*)*``: one token's mask over 8,192 ids
    took 50 s; ``{0,20}``: 1.6 s), or None. A repeat of a group that takes a character each
    time is cheap (``(\\w+\\s*)*``: under a millisecond)."""
    opened = []
    for kind, i, m in _marks(pattern):
        if kind == "(":
            opened.append(i)
        elif kind == ")" and opened:
            start = opened.pop()
            most = None if pattern[i + 1:i + 2] in ("*", "+") else 1 if m is None else _repeats(*m.groups())[1]
            body = pattern[start + 1:i]
            body = body[2:] if body.startswith("?:") else body
            try:
                empty = (most is None or most > 1) and re.fullmatch(body, "") is not None
            except re.error:
                empty = False
            if empty:
                return pattern[start:i + 1] + (m.group(0) if m is not None else pattern[i + 1])
    return None


def _nested_count(pattern: str) -> int:
    """The most a group's count times the counts inside it multiply to (``(a{0,20}){0,20}``:
    400); 1 where no counted repeat sits inside a counted group."""
    inside, most = [1], 1      # per open group: the largest count in it so far
    for kind, _, m in _marks(pattern):
        if kind == "(":
            inside.append(1)
        elif kind == ")" and len(inside) > 1:
            inner = inside.pop()
            times = 1 if m is None else _expanded(m)
            if inner > 1 and times > 1:
                most = max(most, inner * times)
            inside[-1] = max(inside[-1], inner * max(times, 1))
        elif kind == "{":
            inside[-1] = max(inside[-1], _expanded(m))
    return most


def _read_escape(pattern: str, i: int) -> tuple[int | None, str | None, int]:
    """The escape at ``pattern[i]`` (a backslash): (its character's code, None) or (None,
    a shorthand class letter), and where it ends."""
    e = pattern[i + 1]
    if e in "dDwWsS":
        return None, e, i + 2
    if e in _CONTROL_ESCAPES:
        return _CONTROL_ESCAPES[e], None, i + 2
    if e in "ux":
        width = 4 if e == "u" else 2
        digits = pattern[i + 2:i + 2 + width]
        if len(digits) != width or not all(ch in "0123456789abcdefABCDEF" for ch in digits):
            raise ValueError(f"pattern {pattern!r}: \\{e} needs {width} hex digits")
        return int(digits, 16), None, i + 2 + width
    if e.isalnum():
        raise ValueError(f"pattern {pattern!r}: \\{e} is not supported (word boundaries, backreferences)")
    return ord(e), None, i + 2


def _char(code: int) -> str:
    """One character of the string as pattern text the base converter copies whole: its
    JSON escape where JSON needs one (a group, so that a quantifier takes all of it)."""
    if code in _UNSAFE:
        esc = _JSON_SHORT.get(code, f"u{code:04x}")
        return f"(\\\\{esc})" if code != 0x22 else '(\\\\")'
    return f"[{_code(code)}]" if code > 0x7F or chr(code) in "|.()[]{}*+?^$-/" else chr(code)


def _code(c: int) -> str:
    """A character as GBNF's escape of its code."""
    return f"\\u{c:04X}" if c <= 0xFFFF else f"\\U{c:08X}"


def _read_class(pattern: str, i: int) -> tuple[list[tuple[int, int]], bool, int]:
    """The class at ``pattern[i]`` ("["): its members as code ranges, whether it is
    negated, and where it ends."""
    j, n = i + 1, len(pattern)
    negated = j < n and pattern[j] == "^"
    j += negated
    members: list[tuple[int, int]] = []
    while j < n and pattern[j] != "]":
        if pattern[j] == "\\" and j + 1 < n:
            code, shorthand, j = _read_escape(pattern, j)
            if shorthand is not None:
                if shorthand.isupper():
                    raise ValueError(f"pattern {pattern!r}: \\{shorthand} inside [...] is not supported; "
                                     "write the class out")
                members += _SHORT[shorthand]
                continue
        else:
            code, j = ord(pattern[j]), j + 1
        if j + 1 < n and pattern[j] == "-" and pattern[j + 1] != "]":
            if pattern[j + 1] == "\\":
                end, shorthand, j = _read_escape(pattern, j + 1)
                if shorthand is not None:
                    raise ValueError(f"pattern {pattern!r}: a range cannot end in \\{shorthand}")
            else:
                end, j = ord(pattern[j + 1]), j + 2
            if end < code:
                raise ValueError(f"pattern {pattern!r}: the range {chr(code)}-{chr(end)} is backwards")
            members.append((code, end))
        else:
            members.append((code, code))
    if j >= n:
        raise ValueError(f"pattern {pattern!r}: a [ without its ]")
    return members, negated, j + 1


def _class(members: list[tuple[int, int]], negated: bool, pattern: str) -> str:
    """A class of the characters a JSON string may hold bare: a negated one leaves out
    the unsafe ones too; a positive one drops them from its ranges."""
    if negated:
        return "[^" + "".join(_code(a) if a == b else f"{_code(a)}-{_code(b)}" for a, b in members) + _SAFE_NOT + "]"
    parts = []
    for a, b in members:
        for lo, hi in _split_safe(a, b):
            parts.append(_code(lo) if lo == hi else f"{_code(lo)}-{_code(hi)}")
    if not parts:
        raise ValueError(f"pattern {pattern!r}: a class of only characters JSON writes escaped (quotes, "
                         "backslashes, control characters) is not supported")
    return "[" + "".join(parts) + "]"


def _split_safe(a: int, b: int) -> list[tuple[int, int]]:
    """The range a..b without the unsafe codes."""
    out, lo = [], a
    for u in sorted(x for x in _UNSAFE if a <= x <= b) + [b + 1]:
        if lo < u:
            out.append((lo, u - 1))
        lo = max(lo, u + 1)
    return out
