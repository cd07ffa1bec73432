"""The command line: help, dry run, and option errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .helpers import listing, run_cli


@pytest.fixture
def paths(fx):
    return fx("dense", with_mtp=False), fx("dense")


def test_help_describes_sources():
    result = run_cli("--help")
    assert result.exit_code == 0
    assert "Qwen/Qwen3.5-27B" in result.output and "--dry-run" in result.output


def test_version_is_pymtps():
    from pymtp import __version__

    result = run_cli("--version")
    assert (result.exit_code, result.output) == (0, f"gguf_graft (pymtp), version {__version__}\n")


def test_dry_run_prints_the_plan_and_writes_nothing(paths, tmp_path):
    base, source = paths
    before = listing(tmp_path)
    result = run_cli(base, source, "-o", tmp_path / "out.gguf", "--dry-run", "--type", "Q8_0")
    assert result.exit_code == 0, result.output
    assert "Q8_0 as requested with --type" in result.output
    assert "blk.4.nextn.eh_proj.weight" in result.output and "{128, 64}" in result.output
    assert "qwen35.block_count: 4 -> 5" in result.output
    assert "dry run: nothing written" in result.output
    assert listing(tmp_path) == before


def test_a_dry_run_checks_out_as_the_run_would(paths, tmp_path):
    """A dry run refuses an OUT the real run refuses (an existing file, a missing folder,
    an input): it said "nothing written" with status 0, then the run failed."""
    base, source = paths
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"x")
    for out in (taken, tmp_path / "nowhere" / "o.gguf", base):
        result = run_cli(base, source, "-o", out, "--dry-run")
        assert result.exit_code == 1 and "dry run: nothing written" not in result.output, (out, result.output)
    assert taken.read_bytes() == b"x"
    assert run_cli(base, source, "-o", taken, "--dry-run", "--force").exit_code == 0


def test_a_forced_graft_says_what_it_replaced(paths, tmp_path):
    """A base that has an MTP block, grafted with --force: the block's per-layer entries
    are replaced, and the plan says so (it said "appended", while the output had one block)."""
    _, source = paths
    result = run_cli(source, source, "-o", tmp_path / "out.gguf", "--dry-run", "--force")
    assert result.exit_code == 0, result.output
    assert "qwen35.block_count: 5 -> 5" in result.output
    assert "appended" not in result.output
    assert ("qwen35.attention.recurrent_layers: false for the MTP block, in place of the base's false (it is "
            "full attention, not recurrent)") in result.output, result.output
    result = run_cli(*paths, "-o", tmp_path / "out.gguf", "--dry-run")
    assert "qwen35.attention.recurrent_layers: appended false for the MTP block (it" in result.output, result.output


def test_a_dry_run_checks_the_room_for_out(paths, tmp_path, monkeypatch):
    """A folder without the room OUT needs is refused by a dry run as by the run."""
    import shutil
    from collections import namedtuple

    base, source = paths
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6, 1000))
    for extra in (["--dry-run"], []):
        result = run_cli(base, source, "-o", tmp_path / "o.gguf", *extra)
        assert result.exit_code == 1, (extra, result.output)
        assert " has 1,000 bytes (1000 B) free; free " in result.output, (extra, result.output)
    assert not (tmp_path / "o.gguf").exists()


def test_a_dry_run_checks_that_the_folder_of_out_takes_files(paths, tmp_path, monkeypatch):
    """A folder this user cannot write in is refused by a dry run as by the run (root may
    write anywhere but a read-only mount, so the check is made to see one)."""
    import os

    base, source = paths
    folder = tmp_path / "ro"
    folder.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: os.path.abspath(p) != str(folder) and real(p, mode, **kw))
    for extra in (["--dry-run"], []):
        result = run_cli(base, source, "-o", folder / "o.gguf", *extra)
        assert result.exit_code == 1 and "is not one this user can write in" in result.output, (extra, result.output)
    assert not any(folder.iterdir())
    assert run_cli(base, source, "-o", tmp_path / "o.gguf", "--dry-run").exit_code == 0


def test_out_is_required(paths):
    result = run_cli(*paths)
    assert result.exit_code == 1 and "OUT is required" in result.output


def test_unknown_type_is_refused(paths, tmp_path):
    result = run_cli(*paths, "-o", tmp_path / "o.gguf", "--type", "q4_k")
    assert result.exit_code == 2 and "q4_k" in result.output


def test_dry_run_with_check_is_refused(paths, tmp_path):
    """--check runs the written file; with --dry-run it was ignored without a word."""
    base, source = paths
    result = run_cli(base, source, "-o", tmp_path / "out.gguf", "--dry-run", "--check")
    assert result.exit_code == 2, result.output
    assert "--check runs the written file and --dry-run writes nothing: drop one of them" in result.output
    assert listing(tmp_path) == set()


def test_no_progress_bar_where_standard_error_is_no_terminal(paths, tmp_path):
    """A log file or a CI job gets the plan and the summary, not a bar's carriage-return
    updates (on a multi-GB graft, one line of thousands)."""
    base, source = paths
    r = subprocess.run([sys.executable, "-c", "from gguf_graft.cli import main; main()", str(base), str(source), "-o",
                        str(tmp_path / "out.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.gguf").is_file()
    assert "\r" not in r.stderr + r.stdout and "Writing" not in r.stderr, r.stderr
