"""benchmarks/sized_model.py: the fixture's model at the sizes asked for, matrices in f16,
loads in llama.cpp and drafts what it then accepts; bad sizes are refused, no file left."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

import pymtp
from benchmarks import sized_model as sm
from pymtp.gguf_header import read_header

SMALL = ["--n-embd", "128", "--n-trunk", "8", "--n-ff", "256", "--n-head", "4", "--n-head-kv", "2",
         "--head-dim", "64", "--ssm-d-state", "32", "--ssm-n-group", "2", "--ssm-dt-rank", "4"]


@pytest.fixture(scope="module")
def sized(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sized") / "sized.gguf"
    assert sm.main([str(out), *SMALL]) == 0
    return out


def test_the_header_has_the_sizes_and_f16_matrices(sized):
    h = read_header(sized)
    kv = {k: f.contents() for k, f in h.fields.items() if k.startswith("qwen35.")}
    assert kv["qwen35.embedding_length"] == 128
    assert kv["qwen35.block_count"] == 9                     # the trunk, then the MTP block
    assert kv["qwen35.feed_forward_length"] == 256
    assert kv["qwen35.attention.key_length"] == 64
    assert kv["qwen35.rope.dimension_count"] == 16           # a quarter of each head
    assert sum(kv["qwen35.rope.dimension_sections"]) == 8
    assert kv["qwen35.ssm.inner_size"] == 32 * 4
    types = {t.name: t.tensor_type for t in h.tensors}
    for name in ("blk.0.ffn_up.weight", "output.weight", "token_embd.weight", "blk.8.nextn.eh_proj.weight"):
        assert types[name] == GGMLQuantizationType.F16, name
    for name in ("blk.0.attn_norm.weight", "blk.0.ssm_conv1d.weight", "blk.0.ssm_a"):
        assert types[name] == GGMLQuantizationType.F32, name
    hp = sm.hparams(sm.parser().parse_args([str(sized), *SMALL]))
    assert sm.n_params(hp) == sum(t.n_elements for t in h.tensors)


def test_it_drafts_what_it_accepts(sized):
    # the bigram weights at this size still give the MTP head something to predict, and
    # greedy MTP decoding emits plain decoding's tokens on the CPU
    model = pymtp.load(sized, threads=2, n_ctx=512)
    try:
        plain = model.generate("def f(x):", max_tokens=32, spec="none")
        spec = model.generate("def f(x):", max_tokens=32, draft_max=3)
    finally:
        model.close()
    assert spec.tokens == plain.tokens
    assert spec.stats.acceptance_rate > 0.5, spec.stats


@pytest.mark.parametrize("argv, message", [
    (["--n-embd", "0"], "--n-embd must be positive"),
    (["--head-dim", "60"], "--head-dim must be a multiple of 8"),
])
def test_bad_sizes_are_refused(tmp_path, capsys, argv, message):
    out = tmp_path / "x.gguf"
    with pytest.raises(SystemExit) as e:
        sm.main([str(out), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_kept(tmp_path, capsys):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(SystemExit):
        sm.main([str(out), *SMALL])
    assert "--force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep"
