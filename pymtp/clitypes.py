"""Click parameter types shared by ``pymtp`` and ``pymtp serve`` (no FastAPI, no llama.cpp)."""

from __future__ import annotations

import click

from .config import ParamError, parse_draft_max


class DraftMaxParam(click.ParamType):
    """--draft-max: an integer, or "auto" (the depth policy picks k every round)."""

    name = "INTEGER|auto"

    def convert(self, value, param, ctx):
        try:
            return parse_draft_max(value)
        except ParamError as exc:
            self.fail(str(exc), param, ctx)


DRAFT_MAX = DraftMaxParam()
