"""A split BASE (`m-00001-of-00003.gguf`, ...): any part given, the same parts come out with
the MTP block in the last, byte for byte what splitting the unsplit graft gives; or one
file with --no-split, byte for byte the unsplit graft. Split fixtures are cut from the
synthetic ones by gguf-py's own split writer (pymtp.testing.gguf_files)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf_graft.write
import pytest
from gguf import GGUFReader
from gguf_graft import graft

from pymtp.testing.gguf_files import split_gguf

from .helpers import gguf_contents, listing, needs_llama, refused, run_cli


@pytest.fixture
def outdir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def counts_of(paths: list[Path]) -> list[int]:
    return [len(GGUFReader(p).tensors) for p in paths]


def assert_same_files(got: list[Path], want: list[Path]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.read_bytes() == w.read_bytes(), (g.name, w.name)


@pytest.mark.parametrize("kind, given", [("dense", 0), ("dense", 2), ("moe", 1)])
def test_split_base_gives_the_same_parts_with_the_block_in_the_last(fx, hf_mtp, split_base, tmp_path, kind,
                                                                    given):
    parts = split_base(kind)
    plan = graft(parts[given], hf_mtp(kind), tmp_path / "out.gguf")
    assert plan.outputs == [tmp_path / f"out-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole = graft(fx(kind, with_mtp=False), hf_mtp(kind), tmp_path / "whole.gguf").outputs[0]
    counts = counts_of(parts)
    counts[-1] += len(plan.mtp)
    assert_same_files(plan.outputs, split_gguf(whole, tmp_path / "want.gguf", counts))


def test_no_split_writes_the_unsplit_graft(fx, hf_mtp, split_base, tmp_path):
    plan = graft(split_base()[1], hf_mtp(), tmp_path / "one.gguf", split=False)
    whole = graft(fx(with_mtp=False), hf_mtp(), tmp_path / "whole.gguf")
    assert plan.outputs == [tmp_path / "one.gguf"]
    assert (tmp_path / "one.gguf").read_bytes() == whole.outputs[0].read_bytes()
    assert not any(key.startswith("split.") for key in gguf_contents(tmp_path / "one.gguf")[0])


def test_split_mtp_gguf_as_source(fx, split_base, tmp_path):
    via_split = graft(fx(with_mtp=False), split_base(with_mtp=True)[2], tmp_path / "a.gguf")
    via_whole = graft(fx(with_mtp=False), fx(), tmp_path / "b.gguf")
    assert via_split.outputs[0].read_bytes() == via_whole.outputs[0].read_bytes()


def test_force_replaces_the_block_of_a_split_base(fx, hf_mtp, split_base, tmp_path):
    parts = split_base(with_mtp=True)  # its last part holds the block (thirds of 71 tensors: 23, 23, 25)
    plan = graft(parts[0], hf_mtp(), tmp_path / "out.gguf", force=True)
    assert len(plan.replaced) == len(plan.mtp) == 15
    whole = graft(fx(), hf_mtp(), tmp_path / "whole.gguf", force=True).outputs[0]
    assert_same_files(plan.outputs, split_gguf(whole, tmp_path / "want.gguf", counts_of(parts)))


def test_out_may_name_a_part(hf_mtp, split_base, outdir):
    plan = graft(split_base()[0], hf_mtp(), outdir / "x-00002-of-00003.gguf")
    assert plan.outputs == [outdir / f"x-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


def test_out_naming_another_part_count_is_refused(hf_mtp, split_base, outdir):
    refused(split_base()[0], hf_mtp(), outdir / "x-00001-of-00002.gguf",
            match=[f"OUT {str(outdir / 'x-00001-of-00002.gguf')!r} names a part of a 2-file split, but the output "
                   "has 3 parts, as BASE has: name it 'x-00001-of-00003.gguf', or pass --no-split for one file"])


def test_cli_reports_the_layout_and_every_part(hf_mtp, split_base, outdir):
    dry = run_cli(split_base()[0], hf_mtp(), "-o", outdir / "x.gguf", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "(qwen35, 4 trunk blocks, split in 3 parts)" in dry.output
    assert "in 3 parts as BASE's, the MTP block in the last" in dry.output
    assert "split.tensors.count: 56 -> 71" in dry.output
    assert listing(outdir) == set()
    result = run_cli(split_base()[0], hf_mtp(), "-o", outdir / "x.gguf", "-q")
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("wrote ")] == [
        f"wrote {outdir / f'x-0000{i}-of-00003.gguf'}" for i in (1, 2, 3)]
    one = run_cli(split_base()[0], hf_mtp(), "-o", outdir / "y.gguf", "-q", "--no-split")
    assert one.exit_code == 0 and f"wrote {outdir / 'y.gguf'}\n" in one.output
    assert "split.count: 3 -> (dropped: one file)" in one.output


# ---------------------------------------------------------------------------- refusals


def copy_parts(parts: list[Path], directory: Path, names: list[str] | None = None) -> list[Path]:
    directory.mkdir(exist_ok=True)
    return [Path(shutil.copy(p, directory / (n or p.name))) for p, n in zip(parts, names or [None] * len(parts))]


def test_missing_part(hf_mtp, split_base, outdir, tmp_path):
    parts = copy_parts(split_base(), tmp_path / "base")
    parts[1].unlink()
    refused(parts[2], hf_mtp(), outdir / "o.gguf",
            match=[f"BASE {str(parts[2])!r} is part 3 of a 3-file split GGUF, but 1 part(s) are missing: "
                   f"{str(parts[1])!r}; put every part in the same directory"])


def test_renamed_part(hf_mtp, split_base, outdir, tmp_path):
    renamed = copy_parts(split_base()[:1], tmp_path / "base", ["renamed.gguf"])[0]
    refused(renamed, hf_mtp(), outdir / "o.gguf",
            match=[f"BASE {str(renamed)!r} is part 1 of a 3-file split GGUF, but its name does not end in "
                   "'-00001-of-00003.gguf', so its other parts cannot be found"])


def test_part_in_the_wrong_place(hf_mtp, split_base, outdir, tmp_path):
    first = split_base()[0]
    parts = copy_parts([first, first, split_base()[2]], tmp_path / "base", [None, "m-00002-of-00003.gguf", None])
    refused(parts[0], hf_mtp(), outdir / "o.gguf",
            match=[f"BASE {str(parts[1])!r} should be part 2 of 3 by its name, but its header says part 1 of 3"])


def test_parts_of_different_splits(fx, hf_mtp, split_base, outdir, tmp_path):
    a, b, c = (split_base(counts=counts) for counts in ((20, 20, 16), (10, 30, 16), (20, 30, 6)))
    more = copy_parts([a[0], b[1], a[2]], tmp_path / "more")  # 20 + 30 + 16 tensors
    refused(more[0], hf_mtp(), outdir / "o.gguf",
            match=[f"BASE {str(more[0])!r} and its 2 other parts hold 66 tensors, but split.tensors.count says 56"])
    twice = copy_parts([a[0], b[1], c[2]], tmp_path / "twice")  # 20 + 30 + 6, tensors 10-19 twice
    first_twice = GGUFReader(fx(with_mtp=False)).tensors[10].name
    refused(twice[0], hf_mtp(), outdir / "o.gguf",
            match=[f"BASE {str(twice[0])!r} and its 2 other parts hold tensor {first_twice!r} more than once"])


def test_existing_part_needs_force(hf_mtp, split_base, outdir):
    (outdir / "o-00002-of-00003.gguf").write_bytes(b"keep me")
    refused(split_base()[0], hf_mtp(), outdir / "o.gguf",
            match=[f"OUT {str(outdir / 'o-00002-of-00003.gguf')!r} exists; pass --force to overwrite it"])
    assert (outdir / "o-00002-of-00003.gguf").read_bytes() == b"keep me"


def test_a_rename_failing_halfway_under_force_puts_the_old_parts_back(hf_mtp, split_base, outdir, monkeypatch):
    olds = {outdir / f"o-0000{i}-of-00003.gguf": f"old part {i}".encode() for i in (1, 2, 3)}
    for path, data in olds.items():
        path.write_bytes(data)
    base, source = split_base()[0], hf_mtp()   # made before os.replace is patched (for every module)
    real = os.replace
    placed: list[str] = []

    def fail_on_the_second_part(src, dst):
        if str(src).endswith(".part") and Path(dst).parent == outdir:
            if placed:   # the last part is in place by now; placing the second fails
                raise OSError(5, "Input/output error", str(dst))
            placed.append(str(dst))
        real(src, dst)

    monkeypatch.setattr(gguf_graft.write.os, "replace", fail_on_the_second_part)
    refused(base, source, outdir / "o.gguf", "--force", "-q",
            match=["Input/output error", "o-00002-of-00003.gguf"])
    assert placed == [str(outdir / "o-00003-of-00003.gguf")]
    assert {path: path.read_bytes() for path in olds} == olds


def test_force_over_old_parts_leaves_only_the_new_ones(hf_mtp, split_base, outdir):
    for i in (1, 2, 3):
        (outdir / f"o-0000{i}-of-00003.gguf").write_bytes(b"old")
    plan = graft(split_base()[0], hf_mtp(), outdir / "o.gguf", force=True, progress=False)
    assert listing(outdir) == {p.name for p in plan.outputs}
    assert all(p.read_bytes() != b"old" for p in plan.outputs)


def test_out_part_is_a_base_part(hf_mtp, split_base):
    parts = split_base()
    before = [p.read_bytes() for p in parts]
    refused(parts[0], hf_mtp(), parts[0].parent / "m.gguf", "--force",
            match=[f"OUT {str(parts[0])!r} is the input {str(parts[0])!r}"])
    assert [p.read_bytes() for p in parts] == before


def test_out_part_that_is_a_fifo(hf_mtp, split_base, outdir):
    fifo = outdir / "o-00003-of-00003.gguf"
    os.mkfifo(fifo)
    refused(split_base()[0], hf_mtp(), outdir / "o.gguf", "--force",
            match=[f"OUT {str(fifo)!r} is a FIFO; gguf_graft writes regular files only"])


def test_interrupt_while_writing_the_last_part_leaves_nothing(hf_mtp, split_base, outdir, monkeypatch):
    real = gguf_graft.write._write_tensor

    def interrupt_on_mtp(t, *args):
        if t.file_range is None:  # the MTP block, in the last part: the first two are written by then
            assert len([n for n in listing(outdir) if n.endswith(".part")]) == 3
            raise KeyboardInterrupt
        real(t, *args)

    monkeypatch.setattr(gguf_graft.write, "_write_tensor", interrupt_on_mtp)
    with pytest.raises(KeyboardInterrupt):
        graft(split_base()[0], hf_mtp(), outdir / "o.gguf")
    assert listing(outdir) == set()


def test_failed_rename_leaves_no_part_behind(hf_mtp, split_base, outdir, monkeypatch):
    real, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(dst))
        real(src, dst)

    monkeypatch.setattr(gguf_graft.write.os, "replace", second_fails)
    with pytest.raises(OSError):
        graft(split_base()[0], hf_mtp(), outdir / "o.gguf")
    assert calls[0] == outdir / "o-00003-of-00003.gguf"  # the first part is renamed last
    assert listing(outdir) == set()


# ---------------------------------------------------------------------------- llama.cpp


@needs_llama
def test_split_output_decodes_as_the_unsplit_graft(fx, hf_mtp, split_base, tmp_path):
    """llama.cpp loads the parts from the first one and decodes the same greedy tokens."""
    import pymtp

    whole = graft(fx(with_mtp=False), hf_mtp(), tmp_path / "whole.gguf").outputs[0]
    parts = graft(split_base()[1], hf_mtp(), tmp_path / "split.gguf").outputs
    runs = {}
    for path in (whole, parts[0]):
        model = pymtp.load(path, threads=1, n_ctx=512)
        try:
            r = model.generate("def fibonacci(n):", max_tokens=32, draft_max=3)
        finally:
            model.close()
        runs[path] = (r.tokens, r.stats.drafted, r.stats.accepted)
    assert runs[parts[0]] == runs[whole]
    tokens, drafted, accepted = runs[whole]
    assert len(tokens) == 32 and drafted > 0 and accepted > 0  # the MTP block in the last part drafts
