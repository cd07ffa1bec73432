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
from .base import open_gguf
from .errors import GraftError
from .interrupts import raise_if_interrupted
from .plan import Plan, make_plan
from .quantize import TYPE_CHOICES
from .source import read_source
from .validate import base_is_free
from .write import check_out, check_room, output_paths, write_gguf

__all__ = ["GraftError", "Plan", "TYPE_CHOICES", "graft"]

PathLike = str | os.PathLike[str]


def graft(base: PathLike, source: PathLike, out: PathLike | None = None, *, qtype: str = "auto",
          split: bool = True, dry_run: bool = False, force: bool = False, progress: bool = False,
          log: Callable[[str], object] | None = None) -> Plan:
    """Write BASE with SOURCE's MTP block grafted in to OUT; return the plan.

    `qtype` is "auto" (the base's matrix type when gguf-py can write it, else Q8_0) or one
    of TYPE_CHOICES. A split BASE (any of its parts) gives OUT split the same way, named
    as llama.cpp expects (`OUT-00001-of-0000N.gguf`, ...), unless `split` is False: then
    one file. `dry_run` checks everything (OUT too, when given) and writes nothing. `force` replaces an MTP
    block BASE already has and overwrites OUT. `log` receives the report lines (the
    plan's table too on a dry run). Raises GraftError on bad inputs; then nothing is
    written. The plan's `outputs` lists the files written.
    """
    if out is None and not dry_run:
        raise GraftError("OUT is required (-o OUT.gguf), unless it is a dry run")
    if out is not None and str(out).endswith(("/", os.sep)):      # Path() drops the slash: a file was written there
        raise GraftError(f"OUT {str(out)!r} names a directory; give a file name, e.g. -o {str(out)}model-mtp.gguf")
    info = open_gguf(Path(base), "BASE")
    base_is_free(info, force)        # a swapped BASE and SOURCE is told as such, before SOURCE is read
    # a dry run with OUT checks it as the real run would (it said all was well, then the run refused OUT)
    outs = [] if out is None else output_paths(Path(out), len(info.parts) if split else 1)
    check_out(outs, [*info.files, Path(source)], force)  # before any download
    src = read_source(source)
    plan = make_plan(info, src, qtype.lower(), force, split)
    _log(log, report.summary(plan) + (["", *report.table(plan)] if dry_run else []))
    check_out(outs, [*info.files, *src.files], force)
    if outs:
        check_room(plan, outs)
    if outs and not dry_run:
        raise_if_interrupted()       # a Ctrl-C lost in reading BASE's header
        write_gguf(plan, outs, progress)
        plan.outputs = outs
    return plan


def _log(log: Callable[[str], object] | None, lines: list[str]) -> None:
    for line in lines if log is not None else ():
        log(line)
