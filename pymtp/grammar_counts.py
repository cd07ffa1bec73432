"""GBNF counts the JSON-schema converter's modules share: an item repeated or separated
from a minimum to a maximum number of times, and ``NoValue``, the error of a schema that
no JSON value satisfies."""

from __future__ import annotations

from typing import Any


class NoValue(ValueError):
    """A schema no JSON value satisfies (bounds past each other, an enum of nothing that
    fits, ``false``): refused alone, dropped as one branch of several."""


def repeated(item: str, low: int, high: int | None) -> str:
    """``item`` from ``low`` to ``high`` times (None: no bound), in GBNF's counts."""
    check_count(low, high)
    if high is None:
        return f"({item}){{{low},}}" if low else f"({item})*"
    if high == 0:
        return ""
    return f"({item}){{{low},{high}}}" if low != high else f"({item}){{{low}}}"


def separated(item: str, sep: str, low: int, high: int | None) -> str:
    """``item`` from ``low`` to ``high`` times with ``sep`` between them."""
    check_count(low, high)
    if high == 0:
        return ""
    rest = repeated(f"{sep} {item}", max(low - 1, 0), None if high is None else high - 1)
    return f"{item} {rest}" if low else f"({item} {rest})?"


def check_count(low: Any, high: Any) -> None:
    for v in (low, high):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"a count (minItems, maxItems, minLength, maxLength) must be an integer >= 0, got {v!r}")
    if high is not None and high < low:
        raise NoValue(f"a maximum count ({high}) below its minimum ({low}) allows nothing")
