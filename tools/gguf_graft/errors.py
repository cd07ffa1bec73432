"""The one exception the graft tool raises for bad inputs."""

from __future__ import annotations


class GraftError(ValueError):
    """Something about BASE, SOURCE or OUT is wrong; the message says what and how to fix it.

    A ValueError, so library callers can catch it like any other bad argument; the CLI
    prints the message without a traceback.
    """
