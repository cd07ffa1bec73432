"""A JSON schema's number and integer bounds as GBNF: the values between them written as
JSON writes them, digit by digit (llama-cpp-python's converter ignores them, as
llama-server's does). The JSON-schema converter (schema_grammar) calls ``int_bounds`` /
``number_bounds`` to read and check a schema's bounds, then ``integer_range`` /
``number_range`` for the grammar."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Optional

from .grammar_counts import NoValue

# an integer bound past this many is none (a float's 1e308 would write 309 alternatives)
_FAR = 10 ** 20
# a number's bound nearer zero than this is refused (1e-300 would be 300 nested digits)
_NEAR = Decimal("1e-30")
# the most digits a bounded number's open side writes before (and after) its point, as the
# base converter's and llama.cpp's integral and decimal parts: without a cap ``minimum: 0``
# let a model write digits until max_tokens
_DIGITS = 16


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def exact_decimal(v: int | float) -> Decimal:
    """A JSON number exactly as written: a float from its shortest repr (0.1 as 0.1)."""
    return Decimal(v if isinstance(v, int) else repr(v))


@dataclass(frozen=True)
class Bound:
    """One side of a number's range: its value, and whether the value itself is out."""

    value: Decimal
    strict: bool


def bounds(schema: dict) -> tuple[Bound | None, Bound | None]:
    """A number's lower and upper bounds (None: unbounded), exact as the schema wrote them
    (a float bound read from its shortest repr, 0.1 as 0.1). Draft 4's boolean
    ``exclusiveMinimum``/``exclusiveMaximum`` make ``minimum``/``maximum`` strict."""
    lo = hi = None
    for key, up, strict in (("minimum", False, False), ("exclusiveMinimum", False, True),
                            ("maximum", True, False), ("exclusiveMaximum", True, True)):
        v = schema.get(key)
        if v is None or isinstance(v, bool):
            continue
        if not is_number(v) or not math.isfinite(v):
            raise ValueError(f"{key} must be a finite number, got {v!r}")
        b = Bound(exact_decimal(v), strict or schema.get(
            "exclusiveMaximum" if up else "exclusiveMinimum") is True)
        if up and (hi is None or b.value < hi.value or (b.value == hi.value and b.strict)):
            hi = b
        if not up and (lo is None or b.value > lo.value or (b.value == lo.value and b.strict)):
            lo = b
    return lo, hi


def int_bounds(schema: dict) -> tuple[int | None, int | None]:
    """An integer schema's inclusive bounds (None: unbounded)."""
    low, high = bounds(schema)
    lo = None if low is None else math.ceil(low.value) + (low.strict and low.value == math.ceil(low.value))
    hi = None if high is None else math.floor(high.value) - (high.strict and high.value == math.floor(high.value))
    if (lo is not None and lo > _FAR) or (hi is not None and hi < -_FAR):
        raise ValueError(f"integer bounds past {_FAR:.0e} are not supported")
    lo = None if lo is not None and lo < -_FAR else lo       # past the digits written: no bound
    hi = None if hi is not None and hi > _FAR else hi
    if lo is not None and hi is not None and lo > hi:
        raise NoValue(f"no integer lies between the bounds {lo} and {hi}")
    return lo, hi


def number_bounds(schema: dict) -> tuple[Bound | None, Bound | None]:
    """A number schema's bounds, checked: some number lies between them, and they can be
    written in a few digits (past 1e20 a bound is none, as an integer's)."""
    lo, hi = bounds(schema)
    for b in (lo, hi):
        if b is not None and b.value != 0 and abs(b.value) < _NEAR:
            raise ValueError(f"number bounds nearer zero than {_NEAR:.0e} are not supported")
    if (lo is not None and lo.value > _FAR) or (hi is not None and hi.value < -_FAR):
        raise ValueError(f"number bounds past {_FAR:.0e} are not supported")
    lo = None if lo is not None and lo.value < -_FAR else lo
    hi = None if hi is not None and hi.value > _FAR else hi
    if lo is not None and hi is not None and (lo.value > hi.value or (lo.value == hi.value and (lo.strict or hi.strict))):
        raise NoValue(f"no number lies between the bounds {lo.value} and {hi.value}")
    return _inside(lo, up=False), _inside(hi, up=True)


def _inside(b: Bound | None, up: bool) -> Bound | None:
    """A strict bound as the nearest float inside it, inclusive. Clients read a number as
    a float: 0.99999999999999999 lies below 1 but reads as 1.0, which ``< 1`` refuses. An
    inclusive bound is safe as it is (rounding keeps a decimal on its side of a float).
    Next to zero the float inside is ``_NEAR``: a bound of 5e-324 would be 324 digits."""
    if b is None or not b.strict:
        return b
    inside = math.nextafter(float(b.value), -math.inf if up else math.inf)
    if abs(inside) < _NEAR:
        inside = float(-_NEAR if up else _NEAR)
    return Bound(Decimal(repr(inside)), False)


def number_range(lo: Bound | None, hi: Bound | None) -> str:
    """A GBNF expression of the JSON numbers between ``lo`` and ``hi`` (None: unbounded),
    written without an exponent: every number in the range has such a form. Negative ones
    are a minus sign before the positive range mirrored; zero is written unsigned."""
    alts = []
    if lo is None or lo.value < 0:
        up = None if lo is None else Bound(-lo.value, lo.strict)
        down = Bound(Decimal(0), True) if hi is None or hi.value >= 0 else Bound(-hi.value, hi.strict)
        if (body := _unsigned(down, up)) is not None:
            alts.append(f'"-" ({body})')
    if hi is None or hi.value >= 0:
        if (body := _unsigned(lo if lo is not None and lo.value >= 0 else Bound(Decimal(0), False), hi)) is not None:
            alts.append(body)
    if not alts:
        raise NoValue("no number lies between the bounds")
    return " | ".join(alts)


def _split(b: Bound) -> tuple[int, str]:
    """A bound >= 0 as its integer part and its fraction's digits (no trailing zeros)."""
    whole, _, frac = format(b.value, "f").partition(".")
    return int(whole), frac.rstrip("0")


def _unsigned(lo: Bound, hi: Bound | None) -> str | None:
    """The numbers >= 0 between ``lo`` and ``hi`` as integer part, then a fraction; None
    when there are none."""
    lo_int, lo_frac = _split(lo)
    low = (lo_frac, lo.strict)
    if hi is None:
        parts = [(str(lo_int), low, None), (_naturals(lo_int + 1, None), None, None)]
    else:
        hi_int, hi_frac = _split(hi)
        high = (hi_frac, hi.strict)
        if lo_int == hi_int:
            parts = [(str(lo_int), low, high)]
        else:
            parts = [(str(lo_int), low, None), (str(hi_int), None, high)]
            if lo_int + 1 <= hi_int - 1:
                parts.insert(1, (_naturals(lo_int + 1, hi_int - 1), None, None))
    alts = []
    for whole, low_, high_ in parts:
        digits, bare = _fraction(low_, high_)
        whole = f'"{whole}"' if whole.isdigit() else f"({whole})"
        if digits is not None:
            dot = f'"." ({digits})'
            alts.append(f"{whole} ({dot})?" if bare else f"{whole} {dot}")
        elif bare:
            alts.append(whole)
    return " | ".join(alts) or None


# A fraction's bound: its digits (no trailing zeros; "" is 0) and whether it is strict;
# None is none (a fraction's value lies in [0, 1) anyway).
FracBound = Optional[tuple[str, bool]]


def _fraction(lo: FracBound, hi: FracBound) -> tuple[str | None, bool]:
    """The fractions 0.d between ``lo`` and ``hi``: a GBNF expression of the digit strings
    d (one or more digits; None: none), and whether no fraction at all (0) is between."""
    lo = None if lo == ("", False) else lo            # >= 0 holds for every fraction
    bare = (lo is None) and (hi is None or hi[0] != "" or not hi[1])
    if hi is not None and hi == ("", True):           # < 0: none
        return None, False
    if lo is None and hi is None:
        return f"[0-9]{{1,{_DIGITS}}}", True
    if hi == ("", False):                             # <= 0: zeros, and only with no lower bound
        return (f'"0"{{1,{_DIGITS}}}', True) if lo is None else (None, False)
    if lo == ("", True) and hi is None:               # > 0: a digit other than 0 somewhere
        return f'"0"{{0,{_DIGITS - 1}}} [1-9] [0-9]{{0,{_DIGITS - 1}}}', False
    alts = []
    for first, last, low, high in _digit_steps(lo, hi):
        rest, empty = _fraction(low, high)
        cls = f"[{first}-{last}]" if first != last else f'"{first}"'
        if rest is not None:
            alts.append(f"{cls} ({rest})?" if empty else f"{cls} ({rest})")
        elif empty:
            alts.append(cls)
    return (" | ".join(alts) or None), bare


def _digit_steps(lo: FracBound, hi: FracBound) -> list[tuple[int, int, FracBound, FracBound]]:
    """A fraction's first digit, in runs of digits that leave the rest the same bounds:
    (first digit, last digit, the rest's lower bound, the rest's upper bound)."""
    runs: list[tuple[int, int, FracBound, FracBound]] = []
    for c in range(10):
        if lo is None:
            low = None
        elif lo[0] == "":                              # > 0: strict, what remains of it
            low = None if c > 0 else lo
        elif c != int(lo[0][0]):
            low = None if c > int(lo[0][0]) else "out"
        else:
            low = (lo[0][1:], lo[1])
        if hi is None:
            high = None
        elif c != int(hi[0][0]):
            high = None if c < int(hi[0][0]) else "out"
        else:
            high = (hi[0][1:], hi[1])
        if "out" in (low, high):
            continue
        if runs and runs[-1][1] == c - 1 and runs[-1][2:] == (low, high):
            runs[-1] = (runs[-1][0], c, low, high)
        else:
            runs.append((c, c, low, high))
    return runs


def integer_range(lo: int | None, hi: int | None) -> str:
    """A GBNF expression of the integers from ``lo`` to ``hi`` (None: unbounded), written
    as JSON writes them (no leading zeros, "-0" not among them)."""
    if lo is not None and hi is not None and hi < 0:
        return f'"-" ({integer_range(-hi, -lo)})'
    if lo is not None and lo < 0:
        neg = f'"-" ({_naturals(1, -lo)})'
        return neg if hi is not None and hi < 0 else f"{neg} | {integer_range(0, hi)}"
    if lo is None:
        neg = f'"-" [1-9] [0-9]{{0,{_DIGITS - 1}}}'
        return f"{neg} | {_naturals(0, hi)}" if hi is None or hi >= 0 else f'"-" ({_naturals(-hi, None)})'
    return _naturals(lo, hi)


def _naturals(lo: int, hi: int | None) -> str:
    """Integers from ``lo`` >= 0 to ``hi`` (None: up to ``_DIGITS`` digits, or as many as
    ``lo`` has), without leading zeros."""
    if hi is None:
        n = len(str(lo))
        same = _naturals(lo, 10 ** n - 1)
        return same if n >= _DIGITS else f"{same} | [1-9] [0-9]{{{n},{_DIGITS - 1}}}"
    alts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10 ** n - 1)
        if a <= b:
            alts += _same_length(str(a), str(b))
    return " | ".join(alts)


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives for the numbers from ``a`` to ``b``, two digit strings of one length."""
    if not a:
        return ['""']
    if a[0] == b[0]:
        inner = " | ".join(_same_length(a[1:], b[1:]))
        return [f'"{a[0]}"' if inner == '""' else f'"{a[0]}" ({inner})']
    n = len(a) - 1
    out = []
    first_full = a[1:] == "0" * n
    last_full = b[1:] == "9" * n
    lo_digit = int(a[0]) + (0 if first_full else 1)
    hi_digit = int(b[0]) - (0 if last_full else 1)
    if not first_full:
        out.append(f'"{a[0]}" ({" | ".join(_same_length(a[1:], "9" * n))})')
    if lo_digit <= hi_digit:
        digits = f"[{lo_digit}-{hi_digit}]" if lo_digit != hi_digit else f'"{lo_digit}"'
        out.append(f"{digits} [0-9]{{{n}}}" if n else digits)
    if not last_full:
        out.append(f'"{b[0]}" ({" | ".join(_same_length("0" * n, b[1:]))})')
    return out
