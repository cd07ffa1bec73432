"""The `gguf_graft` command: translates options into a graft() call."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import click

from pymtp import __version__
from pymtp.clitypes import HELP, OutputErrors

from . import graft, interrupts
from .errors import GraftError
from .quantize import TYPE_CHOICES


class _Command(OutputErrors, click.Command):
    pass


@click.command(cls=_Command, context_settings=HELP)
@click.argument("base", type=click.Path(dir_okay=False))
@click.argument("source")
@click.option("-o", "--out", type=click.Path(dir_okay=False), help="Output GGUF (required unless --dry-run).")
@click.option("--type", "qtype", type=click.Choice(TYPE_CHOICES, case_sensitive=False), default="auto",
              show_default=True,
              help="Type of the MTP block's matrices. auto: the base's, if gguf-py can write it, else Q8_0.")
@click.option("--no-split", is_flag=True,
              help="BASE is a split GGUF: write one file instead of the same parts.")
@click.option("--dry-run", is_flag=True, help="Check everything and print the plan as a table; write nothing.")
@click.option("--force", is_flag=True, help="Replace an MTP block BASE already has; overwrite OUT.")
@click.option("--check", is_flag=True,
              help="After writing, run a short greedy MTP generation and print the acceptance rate; "
                   "exit status 1 where it is near zero (the block does not fit BASE).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.version_option(version=__version__, prog_name="gguf_graft (pymtp)")
def main(base: str, source: str, out: str | None, qtype: str, no_split: bool, dry_run: bool, force: bool,
         check: bool, quiet: bool) -> None:
    """Graft the MTP block of a Qwen3.5/3.6 checkpoint into BASE.gguf, writing OUT.gguf.

    SOURCE is a safetensors file holding mtp.* tensors, an HF model directory, an MTP
    GGUF (convert_hf_to_gguf.py --mtp), or an HF repo id such as Qwen/Qwen3.5-27B, of
    which only config.json, the index and the shard(s) holding mtp.* are downloaded.

    BASE may be any part of a split GGUF (model-00001-of-00005.gguf); OUT is then split
    the same way (OUT-00001-of-00005.gguf, ...), the MTP block in its last part.
    """
    if dry_run and check:
        raise click.UsageError("--check runs the written file and --dry-run writes nothing: drop one of them")
    try:
        with _signals_exit():
            plan = graft(base, source, out, qtype=qtype, split=not no_split, dry_run=dry_run, force=force,
                         progress=not quiet, log=click.echo)
    except KeyboardInterrupt as e:   # Click's "Aborted!" exits 1; a shell's Ctrl-C status is 130
        written = getattr(e, "out_written", False)      # it came as the old OUT was removed
        click.echo("interrupted as OUT's old copy was removed: OUT was written whole" if written
                   else "interrupted: nothing written", err=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except GraftError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # disk full, permissions, a file vanishing under us: no traceback
        raise click.ClickException(f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")) from e
    if dry_run:
        click.echo("dry run: nothing written")
        return
    for path in plan.outputs:
        click.echo(f"wrote {path}")
    if check:
        _check(str(plan.outputs[0]))  # the first part: llama.cpp finds the others from it


@contextlib.contextmanager
def _signals_exit() -> Iterator[None]:
    """Make SIGTERM and SIGHUP raise SystemExit, as SIGINT raises KeyboardInterrupt (which
    main() turns into exit status 130), noted so that one lost in a numpy comparison is
    raised again before the write (interrupts.py).

    Their default action kills the process on the spot, which left the hidden
    ``.OUT.*.part`` file (hundreds of MB) behind; an exception lets the writer remove it.
    The exit status is the shell's for the signal (128 + its number).
    """
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():   # only the main thread may
        yield
        return
    interrupts.forget()
    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupts.note_and_raise)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check(out: str) -> None:
    from .check import NEAR_ZERO, run_check

    click.echo("check: loading the result with pymtp for a short greedy MTP generation ...")
    try:
        r = run_check(out)
    except Exception as e:  # the runtime's own errors: report them, OUT stays written
        raise click.ClickException(f"{out} was written, but --check could not run it: {e}") from e
    if r.drafted == 0:
        raise click.ClickException(
            f"the MTP block drafted nothing in {r.tokens} tokens, so --check judged nothing: a block that loads "
            f"drafts every round ({out} was written)")
    click.echo(f"check: {r.accepted}/{r.drafted} drafts accepted over {r.tokens} tokens, "
               f"acceptance rate {r.acceptance_rate:.1%}")
    if r.near_zero:      # a failed check: a script running --check must see it in the exit status
        raise click.ClickException(
            f"acceptance rate {r.acceptance_rate:.1%} is near zero (below {NEAR_ZERO:.0%}): the MTP block does not "
            f"fit this trunk. Is SOURCE the same model and revision as BASE? ({out} was written)")
