"""Every refusal names the problem, and leaves no output or temporary file behind."""

from __future__ import annotations

import json
import os

import gguf
import gguf_graft.write
import numpy as np
import pytest
from gguf_graft import GraftError, graft
from safetensors import safe_open
from safetensors.numpy import save_file

from .helpers import TINY, export_mtp_hf, listing, open_copy, refused, run_cli, write_subset


@pytest.fixture
def outdir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


@pytest.fixture
def hf_source(fx, tmp_path):
    """The dense fixture's MTP block as HF safetensors; pass edits to drop or add tensors."""
    def make(drop=(), add=None, kind="dense"):
        tensors = export_mtp_hf(fx(kind))
        for name in drop:
            del tensors[name]
        tensors.update(add or {})
        path = tmp_path / f"mtp-{len(list(tmp_path.iterdir()))}.safetensors"
        save_file(tensors, path)
        return path
    return make


def test_wrong_architecture(hf_source, outdir, tmp_path):
    base = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(base, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    refused(base, hf_source(), outdir / "o.gguf", match=["architecture 'llama'", "qwen35 and qwen35moe"])


def test_size_mismatch(fx, outdir):
    if not TINY.is_dir():
        pytest.skip(f"{TINY} absent")
    refused(fx("dense", False), TINY / "mtp.safetensors", outdir / "o.gguf",
            match=["does not fit BASE", "hidden size: BASE 64, SOURCE 384 (from tensor shapes)",
                   "attention heads: BASE 4, SOURCE 6", "same model"])


def test_config_mismatch_in_hf_directory(fx, outdir, tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    save_file(export_mtp_hf(fx()), d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 40, "hidden_size": 64}}))
    refused(fx("dense", False), d, outdir / "o.gguf",
            match=["trunk blocks (block_count without MTP): BASE 4, SOURCE 40 (from config.json)"])


@pytest.mark.parametrize("text_config", [None, [1, 2], "qwen"])
def test_a_text_config_that_is_no_object_is_named(fx, outdir, tmp_path, text_config):
    d = tmp_path / "hf"
    d.mkdir()
    save_file(export_mtp_hf(fx()), d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"text_config": text_config, "hidden_size": 64}))
    refused(fx("dense", False), d, outdir / "o.gguf",
            match=[f"config.json's text_config is {type(text_config).__name__}, not an object",
                   "mend config.json"])


def test_one_tensor_of_the_wrong_shape_is_named_not_told_as_another_model(fx, hf_source, outdir):
    fc = export_mtp_hf(fx())["mtp.fc.weight"]  # HF (n_embd, 2 * n_embd)
    n = fc.shape[0]
    source = hf_source(add={"mtp.fc.weight": np.zeros((n // 2, 2 * n), fc.dtype)})
    problem = refused(fx("dense", False), source, outdir / "o.gguf",
                      match=["has tensors of the wrong shape for BASE",
                             f"nextn.eh_proj.weight: SOURCE {{{2 * n}, {n // 2}}}",
                             f"BASE needs {{{2 * n}, {n}}}", "the file is corrupt or was edited"])
    assert "same model" not in problem


def test_missing_tensors_are_listed(fx, hf_source, outdir):
    src = hf_source(drop=["mtp.fc.weight", "mtp.layers.0.self_attn.k_norm.weight"])
    refused(fx("dense", False), src, outdir / "o.gguf",
            match=["missing MTP tensors:", "  mtp.fc.weight", "  mtp.layers.0.self_attn.k_norm.weight"])


def test_missing_experts_are_listed(fx, hf_source, outdir):
    src = hf_source(kind="moe", drop=["mtp.layers.0.mlp.experts.2.up_proj.weight"])
    refused(fx("moe", False), src, outdir / "o.gguf",
            match=["missing MTP tensors:", "  mtp.layers.0.mlp.experts.2.up_proj.weight"])


def test_unknown_mtp_tensors_are_not_dropped(fx, hf_source, outdir):
    extra = {"mtp.layers.1.input_layernorm.weight": np.zeros(64, np.float32),
             "mtp.embed_tokens.weight": np.zeros((8, 64), np.float32)}
    refused(fx("dense", False), hf_source(add=extra), outdir / "o.gguf",
            match=["unknown MTP tensors", "  mtp.layers.1.input_layernorm.weight", "  mtp.embed_tokens.weight",
                   "exactly one MTP block"])


def test_a_stored_rotary_buffer_is_skipped(fx, hf_source, outdir):
    """Some exports keep the RoPE buffer `rotary_emb.inv_freq`; it was refused as an unknown tensor."""
    buffer = {"model.language_model.mtp.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    with_buffer = graft(fx("dense", False), hf_source(add=buffer), outdir / "a.gguf", progress=False)
    without = graft(fx("dense", False), hf_source(), outdir / "b.gguf", progress=False)
    assert with_buffer.outputs[0].read_bytes() == without.outputs[0].read_bytes()


def test_dense_block_into_moe_base(fx, hf_source, outdir):
    refused(fx("moe", False), hf_source(), outdir / "o.gguf",
            match=["has a dense MTP block but BASE is qwen35moe (MoE)"])


def test_base_with_mtp_needs_force(fx, hf_source, outdir):
    refused(fx("dense"), hf_source(), outdir / "o.gguf",
            match=["already has an MTP block", "qwen35.nextn_predict_layers = 1", "--force"])


def test_a_base_whose_metadata_lost_the_mtp_count_is_refused(fx, hf_source, outdir, tmp_path):
    """The MTP tensors were taken for a trunk layer, and a second block was appended (exit 0,
    a file llama.cpp refuses)."""
    r, w = open_copy(fx("dense"), tmp_path / "lost.gguf")
    del w.kv_data[0]["qwen35.nextn_predict_layers"]
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    for force in ([], ["--force"]):
        result = run_cli(tmp_path / "lost.gguf", hf_source(), "-o", str(outdir / "o.gguf"), *force)
        assert result.exit_code == 1, result.output
        assert "holds MTP tensors (blk." in result.output and "no qwen35.nextn_predict_layers" in result.output
    assert listing(outdir) == set()


def test_a_base_claiming_an_mtp_block_it_lacks_says_so(fx, hf_source, outdir, tmp_path):
    dense = fx("dense")
    last = int(gguf.GGUFReader(dense).fields["qwen35.block_count"].contents()) - 1
    lacking = write_subset(dense, tmp_path / "lacking.gguf", lambda n: not n.startswith(f"blk.{last}."))
    refused(lacking, hf_source(), outdir / "o.gguf",
            match=["already has an MTP block", "nextn_predict_layers = 1, but none of its tensors", "--force"])


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_an_mtp_only_base_is_a_source_even_with_force(fx, hf_source, outdir, tmp_path, force):
    """--force wrote a file of the MTP block alone (exit 0) that nothing can load."""
    dense = fx("dense")
    last = int(gguf.GGUFReader(dense).fields["qwen35.block_count"].contents()) - 1
    mtp_only = write_subset(dense, tmp_path / "mtp-only.gguf",
                            lambda n: not n.startswith("blk.") or n.startswith(f"blk.{last}."))
    refused(mtp_only, hf_source(), outdir / "o.gguf", *force,
            match=["has no trunk layers, only an MTP block", "a SOURCE", "gguf_graft MODEL.gguf"])


def test_existing_out_needs_force(fx, hf_source, outdir):
    out = outdir / "o.gguf"
    out.write_bytes(b"keep me")
    refused(fx("dense", False), hf_source(), out, match=["exists; pass --force"])
    assert out.read_bytes() == b"keep me"


def test_a_link_to_nothing_at_out_needs_force_too(fx, hf_source, outdir):
    """The check asked whether OUT exists through the link (no), the write then put a file
    in the link's place."""
    out = outdir / "o.gguf"
    os.symlink(outdir / "nowhere.gguf", out)
    refused(fx("dense", False), hf_source(), out, match=["exists; pass --force"])
    assert os.readlink(out) == str(outdir / "nowhere.gguf")


def test_a_read_only_file_system_is_named(outdir, monkeypatch):
    """os.access says "not writable" there too, which read as this user's permissions."""
    from gguf_graft.write import check_out

    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((*real(p)[:8], os.ST_RDONLY, real(p)[9])))
    with pytest.raises(GraftError, match="is on a read-only file system; choose another -o"):
        check_out([outdir / "o.gguf"], [], force=False)


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "a FIFO"),
    # a link to /dev/null: OUT resolves to the device, yet a regression replaces only the link
    (lambda p: os.symlink("/dev/null", p), "a character device"),
], ids=["fifo", "link-to-dev-null"])
def test_out_that_is_not_a_regular_file_is_refused(fx, hf_source, outdir, make, kind):
    out = outdir / "o.gguf"
    make(out)
    before = os.lstat(out)
    text = refused(fx("dense", False), hf_source(), out, "--force",
                   match=[f"OUT {str(out)!r} is {kind}; gguf_graft writes regular files only and never "
                          "replaces anything else: choose a file path for -o"])
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), text


def test_out_in_a_folder_that_is_a_file(fx, hf_source, tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    result = run_cli(fx("dense", False), hf_source(), "-o", tmp_path / "file" / "o.gguf")
    assert result.exit_code == 1
    assert f"the directory of OUT {str(tmp_path / 'file' / 'o.gguf')!r}, {str(tmp_path / 'file')!r}, " \
           "is not a directory" in result.output, result.output
    assert (tmp_path / "file").read_bytes() == b"x"


def test_out_is_base(fx, hf_source, tmp_path):
    base = tmp_path / "base.gguf"
    base.write_bytes(fx("dense", False).read_bytes())
    before = base.read_bytes()
    refused(base, hf_source(), base, "--force", match=["is the input", "never modifies its inputs"])
    assert base.read_bytes() == before


def test_source_not_found(fx, outdir, tmp_path):
    refused(fx("dense", False), tmp_path / "nowhere.safetensors", outdir / "o.gguf",
            match=["source not found", "nowhere.safetensors"])


def test_config_json_as_source_points_to_its_folder(fx, outdir, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    refused(fx("dense", False), tmp_path / "config.json", outdir / "o.gguf",
            match=[f"is a JSON file, not a checkpoint; pass the HF model directory it is in ({str(tmp_path)!r})"])


def test_unreadable_source(fx, outdir, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\xff" * 64)
    refused(fx("dense", False), junk, outdir / "o.gguf", match=["cannot read SOURCE", "not a GGUF or safetensors file"])


@pytest.mark.parametrize("field, value, problem", [
    ("shape", "abc", "shape 'abc' is not a list of non-negative integers"),
    ("shape", [2, -1], "shape [2, -1] is not a list of non-negative integers"),
    ("data_offsets", 5, "data_offsets 5 is not [begin, end] with 0 <= begin <= end"),
    ("data_offsets", [8, 4], "data_offsets [8, 4] is not [begin, end] with 0 <= begin <= end"),
    ("dtype", 7, "dtype 7 is not a string"),
])
def test_corrupt_safetensors_entry(fx, hf_source, outdir, field, value, problem):
    path = hf_source()
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k.startswith("mtp."))
    header[name][field] = value
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    refused(fx("dense", False), path, outdir / "o.gguf",
            match=[f"cannot read SOURCE {str(path)!r}: not a GGUF or safetensors file "
                   f"(bad entry for {name!r}: {problem})"])


def test_truncated_safetensors_source(fx, hf_source, outdir):
    path = hf_source()
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    refused(fx("dense", False), path, outdir / "o.gguf",
            match=[f"of a {len(data) - 100}-byte file; the file is truncated (download it again)"])


def test_safetensors_entry_with_the_wrong_byte_count(fx, hf_source, outdir):
    path = hf_source()
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = min(k for k in header if k.startswith("mtp."))
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end - 2]
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    refused(fx("dense", False), path, outdir / "o.gguf",
            match=[f"{name!r} in {str(path)!r} has {end - begin - 2} bytes where shape",
                   f"needs {end - begin}; the file is corrupt (download it again)"])


def test_truncated_gguf_source(fx, outdir, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(fx("dense").read_bytes()[:4096])
    refused(fx("dense", False), cut, outdir / "o.gguf", match=["cannot read SOURCE", "as GGUF"])


def test_gguf_source_without_mtp(fx, outdir):
    refused(fx("dense", False), fx("dense", False), outdir / "o.gguf",
            match=["GGUF without an MTP block", "--mtp"])


def test_hf_directory_without_mtp(fx, outdir, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}))
    refused(fx("dense", False), tmp_path, outdir / "o.gguf", match=["ships without the MTP block"])


@pytest.mark.parametrize("out_name", ["model.safetensors.index.json", "model-00001-of-00002.safetensors"])
def test_out_is_none_of_an_hf_checkpoints_files(fx, hf_source, tmp_path, out_name):
    """The index, and a shard without MTP tensors, were not counted as inputs: with --force
    OUT overwrote them with the GGUF and ruined the checkpoint."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), dtype=np.float32)},
              ckpt / "model-00001-of-00002.safetensors")
    mtp = hf_source()
    mtp.rename(ckpt / "model-00002-of-00002.safetensors")
    with safe_open(ckpt / "model-00002-of-00002.safetensors", "np") as f:
        names = list(f.keys())
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        **{n: "model-00002-of-00002.safetensors" for n in names}}}))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    result = run_cli(fx("dense", False), ckpt, "-o", tmp_path / "o.gguf", "--dry-run")
    assert result.exit_code == 0, result.output      # the checkpoint itself is read
    refused(fx("dense", False), ckpt, ckpt / out_name, "--force", match=["is the input", "never modifies its inputs"])
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_interrupt_while_writing_leaves_nothing(fx, hf_source, outdir, monkeypatch):
    real = gguf_graft.write._write_tensor

    def interrupt_on_mtp(t, *args):
        if t.file_range is None:
            raise KeyboardInterrupt
        real(t, *args)

    monkeypatch.setattr(gguf_graft.write, "_write_tensor", interrupt_on_mtp)
    with pytest.raises(KeyboardInterrupt):
        graft(fx("dense", False), hf_source(), outdir / "o.gguf")
    assert listing(outdir) == set()


def test_library_raises_value_error(fx, tmp_path):
    with pytest.raises(ValueError, match="source not found"):
        graft(fx("dense", False), tmp_path / "missing", dry_run=True)
    assert issubclass(GraftError, ValueError)


def test_swapped_base_and_source_are_told_as_swapped(fx, outdir, tmp_path):
    """An MTP-only BASE and a no-MTP SOURCE: SOURCE was read first, and its refusal (a GGUF
    without an MTP block) hid the one that says the two are the other way round."""
    dense = fx("dense")
    last = int(gguf.GGUFReader(dense).fields["qwen35.block_count"].contents()) - 1
    mtp_only = write_subset(dense, tmp_path / "mtp-only.gguf",
                            lambda n: not n.startswith("blk.") or n.startswith(f"blk.{last}."))
    refused(mtp_only, fx("dense", False), outdir / "o.gguf", match=["is an MTP-only file, a SOURCE"])


def test_out_ending_in_a_slash_is_a_directory(fx, hf_source, outdir):
    """-o newdir/ wrote a regular file named newdir (Path drops the slash)."""
    for extra in (["--dry-run"], []):
        result = run_cli(fx("dense", False), hf_source(), "-o", f"{outdir}/newdir/", *extra)
        assert result.exit_code == 1 and "names a directory" in result.output, result.output
    assert listing(outdir) == set()


def test_one_shard_without_the_block_points_to_its_checkpoint(hf_source, fx, outdir, tmp_path):
    shard = tmp_path / "ckpt" / "model-00001-of-00002.safetensors"
    shard.parent.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), dtype=np.float32)}, shard)
    (shard.parent / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    refused(fx("dense", False), shard, outdir / "o.gguf", match=["one shard of the checkpoint", "pass that directory"])


def test_a_name_near_the_limit_is_written(fx, hf_source, outdir):
    """The temporary file's name (a dot, OUT's name, a random part) went past 255 bytes."""
    out = outdir / ("a" * 245 + ".gguf")
    result = run_cli(fx("dense", False), hf_source(), "-o", out)
    assert result.exit_code == 0, result.output
    assert listing(outdir) == {out.name}


def test_a_write_that_fails_names_out_and_leaves_nothing(fx, hf_source, outdir, monkeypatch):
    """A disk that fills while the graft writes: the error was the bare "No space left on
    device", no file named."""
    import errno
    import os

    import gguf_graft.write as write

    real = os.write

    def full(fd, data):
        if len(data) > 1000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(write.os, "write", full)
    monkeypatch.setattr(write.os, "copy_file_range", None, raising=False)
    refused(fx("dense", False), hf_source(), outdir / "o.gguf",
            match=[f"writing OUT in {str(outdir)!r} failed: No space left on device", "free some space"])


@pytest.mark.parametrize("edit", ["transposed", "short"])
def test_experts_of_one_tensor_must_share_a_shape(fx, hf_source, outdir, edit):
    """Only expert 0's shape was checked: expert 1 stored transposed was written as wrong
    data (exit 0), one with half its columns failed mid-write with a traceback."""
    name = "mtp.layers.0.mlp.experts.1.down_proj.weight"
    v = export_mtp_hf(fx("moe"))[name]
    bad = v.T if edit == "transposed" else v[:, : v.shape[1] // 2]
    src = hf_source(kind="moe", add={name: np.ascontiguousarray(bad)})
    refused(fx("moe", False), src, outdir / "o.gguf",
            match=[f"{name} has shape {list(bad.shape)}, mtp.layers.0.mlp.experts.0.down_proj.weight has "
                   f"{list(v.shape)}: the experts of one tensor must all have one shape"])


def test_a_fused_gate_up_with_odd_rows_is_refused(fx, outdir, tmp_path):
    """Its gate and up halves were cut at rows // 2, the odd row in neither, and written."""
    tensors = export_mtp_hf(fx("moe"), experts="fused")
    name = "mtp.layers.0.mlp.experts.gate_up_proj"
    v = tensors[name]
    tensors[name] = np.ascontiguousarray(np.concatenate([v, v[:, :1]], axis=1))
    save_file(tensors, tmp_path / "odd.safetensors")
    refused(fx("moe", False), tmp_path / "odd.safetensors", outdir / "o.gguf",
            match=[f"{name} has shape {list(tensors[name].shape)}: a fused gate_up_proj holds the gate and the up "
                   "rows, so its rows (the second last dimension) must be an even number"])


def test_a_gguf_source_of_a_type_gguf_py_cannot_read_is_refused_before_writing(fx, outdir, tmp_path):
    """gguf-py has no dequantization for some types (F64, Q1_0, Q8_1 ...): the plan and
    --dry-run passed and the write died with NotImplementedError's traceback."""
    dense = fx("dense")
    last = int(gguf.GGUFReader(dense).fields["qwen35.block_count"].contents()) - 1
    src = tmp_path / "mtp-f64.gguf"
    r, w = open_copy(dense, src)
    for t in r.tensors:
        if t.name == f"blk.{last}.attn_q.weight":
            w.add_tensor(t.name, np.asarray(t.data).astype(np.float64))
        elif t.name.startswith(f"blk.{last}."):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    for args in ([], ["--dry-run"]):
        refused(fx("dense", False), src, outdir / "o.gguf", *args,
                match=[f"SOURCE tensor blk.{last}.attn_q.weight is F64, which gguf-py cannot read back to values"])


@pytest.mark.parametrize("dtype, value", [(np.float32, np.nan), (np.float16, np.inf), (np.float32, -np.inf)])
def test_a_source_tensor_with_nan_or_inf_is_named_and_nothing_is_written(fx, hf_source, outdir, dtype, value):
    """Such a block was written whole (exit 0), and `--check` then blamed the trunk."""
    name = "mtp.layers.0.self_attn.q_proj.weight"
    v = export_mtp_hf(fx("dense"))[name].astype(dtype)
    v[1, 2] = value
    refused(fx("dense", False), hf_source(add={name: v}), outdir / "o.gguf",
            match=[f"SOURCE tensor {name} holds NaN or infinite values (1 in one piece of", "from a good checkpoint"])


def test_a_nan_in_a_norm_is_named_after_adding_one(fx, hf_source, outdir):
    name = "mtp.norm.weight"
    v = export_mtp_hf(fx("dense"))[name].copy()
    v[0] = np.nan
    refused(fx("dense", False), hf_source(add={name: v}), outdir / "o.gguf",
            match=[f"SOURCE tensor {name} holds NaN or infinite values"])


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("out_type", ["same", "f16"])
def test_a_gguf_source_with_a_nan_is_named_copied_or_converted(fx, outdir, tmp_path, qtype, out_type):
    """A copy of the same type checks the stored bytes as values; Q8_0's NaN is in a block's scale."""
    dense = fx("dense")
    last = int(gguf.GGUFReader(dense).fields["qwen35.block_count"].contents()) - 1
    name = f"blk.{last}.attn_q.weight"
    src = tmp_path / "mtp-nan.gguf"
    r, w = open_copy(dense, src)
    for t in r.tensors:
        if t.name == name:
            data = np.asarray(t.data).astype(np.float32)
            if qtype == "F32":
                data[0, 3] = np.nan
                w.add_tensor(t.name, data)
            else:
                raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
                raw[0, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)   # the first block's scale
                w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif t.name.startswith(f"blk.{last}."):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    args = ["--type", qtype.lower() if out_type == "same" else out_type]
    refused(fx("dense", False), src, outdir / "o.gguf", *args,
            match=[f"SOURCE tensor {name} holds NaN or infinite values"])
