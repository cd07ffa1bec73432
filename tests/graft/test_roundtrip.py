"""Export a fixture's MTP block to HF form, graft it into the fixture without MTP, and get
the fixture back, tensor for tensor (F32 fixtures: exactly)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf_graft import graft
from safetensors.numpy import save_file

from pymtp.testing import layout

from .helpers import HF_NAMES, SHIFTED, export_mtp_hf, gguf_contents, mtp_block_values


def assert_same_model(got, want):
    """Same tensors (by name: the fixture's own order is not the converter's) and metadata."""
    got_kv, got_tensors = gguf_contents(got)
    want_kv, want_tensors = gguf_contents(want)
    assert got_tensors == want_tensors
    for kv in (got_kv, want_kv):
        kv.pop("general.name")  # the fixture names its -nomtp variant differently
    assert got_kv == want_kv


@pytest.mark.parametrize("kind, experts, prefix", [
    ("dense", "per-expert", "mtp."),
    ("dense", "per-expert", "model.mtp."),
    ("moe", "per-expert", "mtp."),
    ("moe", "fused", "model.language_model.mtp."),
])
def test_safetensors_round_trip(fx, tmp_path, kind, experts, prefix):
    src = tmp_path / "mtp.safetensors"
    save_file(export_mtp_hf(fx(kind), experts=experts, prefix=prefix), src)
    out = tmp_path / "out.gguf"
    plan = graft(fx(kind, with_mtp=False), src, out)
    assert plan.qtype.name == "F32"  # auto: the fixtures are all F32
    assert_same_model(out, fx(kind))


def test_sharded_hf_directory_round_trip(fx, tmp_path):
    tensors = export_mtp_hf(fx("moe"), prefix="model.language_model.mtp.")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, tmp_path / shard)
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    weight_map["model.language_model.embed_tokens.weight"] = "model-00003-of-00003.safetensors"  # never opened
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hp = layout.MOE  # a multimodal-style config: the text model's sizes under text_config
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "hidden_size": hp.n_embd, "num_attention_heads": hp.n_head, "num_key_value_heads": hp.n_head_kv,
        "head_dim": hp.head_dim, "num_experts": hp.n_expert, "moe_intermediate_size": hp.n_ff_exp,
        "shared_expert_intermediate_size": hp.n_ff_shexp, "num_hidden_layers": hp.n_trunk}}))
    out = tmp_path / "out" / "out.gguf"
    out.parent.mkdir()
    graft(fx("moe", with_mtp=False), tmp_path, out)
    assert_same_model(out, fx("moe"))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gguf_source_round_trip(fx, tmp_path, kind):
    """A full GGUF with an MTP block works as SOURCE: only its MTP block is taken."""
    out = tmp_path / "out.gguf"
    graft(fx(kind, with_mtp=False), fx(kind), out)
    assert_same_model(out, fx(kind))


def test_force_replaces_an_existing_block(fx, tmp_path):
    src = tmp_path / "mtp.safetensors"
    save_file(export_mtp_hf(fx("dense")), src)
    out = tmp_path / "out.gguf"
    plan = graft(fx("dense"), src, out, force=True)
    assert len(plan.replaced) == len(plan.mtp) == 15
    got_kv, got_tensors = gguf_contents(out)
    want_kv, want_tensors = gguf_contents(fx("dense"))
    assert got_tensors == want_tensors and got_kv == want_kv


def test_an_f16_source_adds_one_to_the_norms_in_f16_as_the_converter_does(fx, tmp_path):
    """The converter widens only BF16 before Qwen3.5's norm shift (conversion/base.py), so an
    F16 checkpoint's 1 + w is rounded to F16 before the F32 norm is written: adding in F32
    gave up to ~5e-4 other values."""
    hf = {n: v.astype(np.float16) for n, v in export_mtp_hf(fx("dense")).items()}
    rng = np.random.default_rng(0)      # norm weights off F16's grid near 1, as trained ones are
    for name in SHIFTED:
        w = hf["mtp." + HF_NAMES[name]]
        hf["mtp." + HF_NAMES[name]] = rng.uniform(-0.2, 0.2, w.shape).astype(np.float16)
    src = tmp_path / "mtp-f16.safetensors"
    save_file(hf, src)
    out = tmp_path / "out.gguf"
    graft(fx("dense", with_mtp=False), src, out, progress=False)
    got = mtp_block_values(out)
    shifted = [n for n in SHIFTED if n in got]
    assert len(shifted) == 7
    rounded = 0
    for name in shifted:
        w = hf["mtp." + HF_NAMES[name]]
        in_f16 = (w + np.float16(1)).astype(np.float32)
        assert np.array_equal(got[name], in_f16), name
        rounded += int(np.sum(in_f16 != w.astype(np.float32) + 1))
    assert rounded > 0      # the fixture's norms tell the two sums apart
    for name in (set(HF_NAMES) & set(got)) - set(SHIFTED):
        assert np.array_equal(got[name], hf["mtp." + HF_NAMES[name]].astype(np.float32)), name


def test_a_file_system_whose_kernel_copy_copies_nothing_grafts_alike(fx, tmp_path, monkeypatch):
    """copy_file_range answering 0 (some FUSE, overlayfs and NFS kernels) was taken for a
    truncated BASE; the copy goes on with pread and the output is the same."""
    import gguf_graft.write as write

    calls = []

    def copies_nothing(src, dst, count, offset_src=None, offset_dst=None):
        calls.append(count)
        return 0

    monkeypatch.setattr(write.os, "copy_file_range", copies_nothing, raising=False)
    src = tmp_path / "mtp.safetensors"
    save_file(export_mtp_hf(fx("dense")), src)
    out = tmp_path / "out.gguf"
    graft(fx("dense", with_mtp=False), src, out)
    assert calls
    assert_same_model(out, fx("dense"))
