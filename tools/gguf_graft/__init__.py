"""gguf_graft: put the MTP block of a Qwen3.5/3.6 checkpoint into the GGUF you already have.

Most Qwen3.5/3.6 GGUFs were converted without the MTP block. `graft()` reads it from
SOURCE (a safetensors file, an HF directory or repo id, or an MTP GGUF), maps and converts
it exactly as llama.cpp's converter does, and streams BASE plus the block into OUT.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from . import report
from .errors import GraftError
from .plan import Plan, make_plan
from .quantize import TYPE_CHOICES
from .source import read_source
from .write import check_out, write_gguf

__all__ = ["GraftError", "Plan", "TYPE_CHOICES", "graft"]

PathLike = str | os.PathLike[str]


def graft(base: PathLike, source: PathLike, out: PathLike | None = None, *, qtype: str = "auto",
          dry_run: bool = False, force: bool = False, progress: bool = False,
          log: Callable[[str], object] | None = None) -> Plan:
    """Write BASE with SOURCE's MTP block grafted in to OUT; return the plan.

    `qtype` is "auto" (the base's matrix type when gguf-py can write it, else Q8_0) or one
    of TYPE_CHOICES. `dry_run` checks everything and writes nothing. `force` replaces an
    MTP block BASE already has and overwrites OUT. `log` receives the report lines (the
    plan's table too on a dry run). Raises GraftError on bad inputs; then nothing is written.
    """
    base, out = Path(base), None if dry_run or out is None else Path(out)
    if not dry_run:
        check_out(out, [base, Path(source)], force)  # before any download
    src = read_source(source)
    plan = make_plan(base, src, qtype.lower(), force)
    _log(log, report.summary(plan) + (["", *report.table(plan)] if dry_run else []))
    if out is not None:
        check_out(out, [base, *src.files], force)
        write_gguf(plan, out, progress)
    return plan


def _log(log: Callable[[str], object] | None, lines: list[str]) -> None:
    for line in lines if log is not None else ():
        log(line)
