"""Ctrl-C that reached the process, kept so that graft can honour one Python lost.

numpy swallows an exception raised while it compares one of its scalars with an Enum
(it probes the Enum's attributes and clears what comes up), and gguf-py's header reader
makes such comparisons for every metadata field: on a 248k vocabulary that takes
seconds, and a Ctrl-C in them was lost about half the time, the whole OUT then written
(tens of GB). The CLI's SIGINT handler notes each signal before raising as Python's
own does; ``graft`` re-raises a noted one before it starts writing.
"""

from __future__ import annotations

_noted: list[int] = []


def note_and_raise(signum: int, frame: object) -> None:
    """A SIGINT handler: Python's KeyboardInterrupt, noted first."""
    _noted.append(signum)
    raise KeyboardInterrupt


def forget() -> None:
    """A new run: signals from an earlier one (a library caller's) do not count."""
    _noted.clear()


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt a noted SIGINT should have raised, if something swallowed it."""
    if _noted:
        raise KeyboardInterrupt
