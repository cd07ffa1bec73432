"""A real gguf_graft process killed while writing leaves no hidden .part file behind."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pymtp.testing.processes import child_env

from .helpers import listing

REPO = Path(__file__).resolve().parents[2]

# gguf_graft's own entry point, with the MTP tensor's write held open so the signal lands
# while the .part file exists. A shell starts a background job with SIGINT ignored (as the
# GPU routine's parallel test slices are), and Python then leaves it ignored: the child
# takes Ctrl-C's default back, as an interactive gguf_graft has it.
CHILD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import gguf_graft.write as w
real = w._write_tensor

def held(t, *args):
    if t.file_range is None:
        print("writing", flush=True)
        time.sleep(60)
    real(t, *args)

w._write_tensor = held
from gguf_graft.cli import main
main(args=sys.argv[1:], prog_name="gguf_graft")
"""


@pytest.mark.parametrize("sig, status, split", [
    (signal.SIGTERM, 128 + 15, False), (signal.SIGHUP, 128 + 1, False), (signal.SIGINT, 128 + 2, False),
    (signal.SIGTERM, 128 + 15, True),  # a split BASE: three .part files, one per part of OUT
], ids=["SIGTERM", "SIGHUP", "SIGINT", "SIGTERM-split"])
def test_signal_while_writing_removes_the_part_file(fx, hf_mtp, split_base, tmp_path, sig, status, split):
    base, source = split_base()[0] if split else fx("dense", with_mtp=False), hf_mtp("dense")
    outdir = tmp_path / "out"
    outdir.mkdir()

    def parts_written(proc):
        parts = [n for n in listing(outdir) if n.endswith(".part")]
        assert len(parts) == (3 if split else 1), (listing(outdir), proc.stderr.read()
                                                   if proc.poll() is not None else "")

    returncode, err = _signalled([CHILD, str(base), str(source), "-o", str(outdir / "o.gguf"), "-q"], "writing",
                                 sig, parts_written)
    assert returncode == status, err
    assert listing(outdir) == set()
    if sig == signal.SIGINT:    # Click's own "Aborted!" said nothing of the files
        assert "interrupted: nothing written" in err, err


# The swap, with OUT already there (--force): held at a rename of a new part into place, or
# at the removal of OUT's old copy set aside, so that Ctrl-C lands between two steps of it.
SWAP_CHILD = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
real_replace, real_unlink = os.replace, os.unlink
step = sys.argv.pop(1)

def replace(src, dst):
    if step == "rename" and str(src).endswith(".part"):
        print("held", flush=True)
        time.sleep(2)
    real_replace(src, dst)

def unlink(path):
    if step == "remove" and str(path).endswith(".old"):
        print("held", flush=True)
        time.sleep(2)
    real_unlink(path)

os.replace, os.unlink = replace, unlink
from gguf_graft.cli import main
main(args=sys.argv[1:], prog_name="gguf_graft")
"""


@pytest.mark.parametrize("step, kept", [("rename", "old"), ("remove", "new")])
def test_ctrl_c_in_the_swap_leaves_one_whole_out(fx, hf_mtp, tmp_path, step, kept):
    """A Ctrl-C while the new file replaces OUT waits for the swap's end: before the old
    copy's removal OUT is put back as it was; during it the swap completes. Either way no
    hidden .old copy of OUT (hundreds of MB) stays behind, as one did."""
    outdir = tmp_path / "out"
    outdir.mkdir()
    out = outdir / "o.gguf"
    out.write_bytes(b"the old OUT")
    returncode, err = _signalled([SWAP_CHILD, step, str(fx("dense", with_mtp=False)), str(hf_mtp("dense")),
                                  "-o", str(out), "-q", "--force"], "held", signal.SIGINT)
    assert returncode == 128 + signal.SIGINT, err
    assert listing(outdir) == {"o.gguf"}, err
    assert (out.read_bytes() == b"the old OUT") == (kept == "old")
    assert kept == "old" or out.read_bytes()[:4] == b"GGUF"
    said = "interrupted: nothing written" if kept == "old" else "OUT was written whole"
    assert said in err, err


# A Ctrl-C whose KeyboardInterrupt something swallowed after BASE was read, as numpy's
# comparison of its scalar with an Enum does (gguf-py's reader makes one per metadata
# field: on a real vocabulary seconds of them, where a Ctrl-C was lost half the time).
SWALLOW_CHILD = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import gguf_graft
real = gguf_graft.open_gguf

def reading(*args):
    info = real(*args)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        pass
    return info

gguf_graft.open_gguf = reading
from gguf_graft.cli import main
main(args=sys.argv[1:], prog_name="gguf_graft")
"""


def test_a_ctrl_c_swallowed_while_base_is_read_still_stops_the_write(fx, hf_mtp, tmp_path):
    """The SIGINT reached the process, its exception did not reach graft: the whole OUT
    was written and the run said "wrote" with status 0. Now a noted SIGINT stops the run
    before the write."""
    outdir = tmp_path / "out"
    outdir.mkdir()
    p = subprocess.run([sys.executable, "-c", SWALLOW_CHILD, str(fx("dense", with_mtp=False)), str(hf_mtp("dense")),
                        "-o", str(outdir / "o.gguf"), "-q"], capture_output=True, text=True, timeout=120,
                       env=child_env(REPO / "tools", REPO))
    assert "not interrupted" not in p.stdout      # the signal landed in the swallowing block
    assert (p.returncode, listing(outdir)) == (128 + signal.SIGINT, set()), p.stdout + p.stderr
    assert "interrupted: nothing written" in p.stderr, p.stderr


def _signalled(args: list[str], cue: str, sig: int, before=lambda proc: None) -> tuple[int, str]:
    """Run ``python -c ARGS...``, send it ``sig`` once it prints ``cue`` (after ``before``
    looked at it), and return its exit status and stderr."""
    proc = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(REPO / "tools", REPO))
    try:
        for line in proc.stdout:    # the plan's report comes first
            if line == f"{cue}\n":
                break
        before(proc)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, proc.stderr.read()
