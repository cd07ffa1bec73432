"""The command line: help, dry run, and option errors."""

from __future__ import annotations

import pytest

from .helpers import listing, run_cli


@pytest.fixture
def paths(fx):
    return fx("dense", with_mtp=False), fx("dense")


def test_help_describes_sources():
    result = run_cli("--help")
    assert result.exit_code == 0
    assert "Qwen/Qwen3.5-27B" in result.output and "--dry-run" in result.output


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


def test_out_is_required(paths):
    result = run_cli(*paths)
    assert result.exit_code == 1 and "OUT is required" in result.output


def test_unknown_type_is_refused(paths, tmp_path):
    result = run_cli(*paths, "-o", tmp_path / "o.gguf", "--type", "q4_k")
    assert result.exit_code == 2 and "q4_k" in result.output
