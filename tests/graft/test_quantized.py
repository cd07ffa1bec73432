"""Types: --type q8_0 writes Q8_0 matrices close to the source; auto follows the base."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_graft import graft
from gguf_graft.mapping import MATRIX, NORM
from gguf_graft.quantize import choose_type, tensor_type

from .helpers import SHIFTED, gguf_contents, mtp_block_values, rewrite_gguf


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_q8_0_matrices_dequantize_close_to_the_source(fx, hf_mtp, tmp_path, kind):
    out = tmp_path / "out.gguf"
    graft(fx(kind, False), hf_mtp(kind), out, qtype="q8_0")
    types = {name: t[0] for name, t in gguf_contents(out)[1].items() if name.startswith("blk.4.")}
    got, want = mtp_block_values(out), mtp_block_values(fx(kind))
    assert got.keys() == want.keys()
    for name, w in want.items():
        if w.ndim == 1 or name.endswith("norm.weight") or "gate_inp" in name:
            assert types[f"blk.4.{name}"] == "F32" and np.array_equal(got[name], w), name
            continue
        assert types[f"blk.4.{name}"] == "Q8_0", name
        blocks = w.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # one Q8_0 quantum per block
        err = np.abs(got[name].reshape(-1, 32) - blocks)
        # Half a quantum from rounding, plus the scale's own F16 rounding (up to 127 * 2^-11).
        assert np.all(err <= step * 0.6 + 1e-12), name
        assert err.max() > 0  # it really was quantized


def test_gguf_and_hf_sources_quantize_to_the_same_tensors(fx, hf_mtp, tmp_path):
    via_hf, via_gguf = tmp_path / "hf.gguf", tmp_path / "gguf.gguf"
    graft(fx("moe", False), hf_mtp("moe"), via_hf, qtype="q4_0")
    graft(fx("moe", False), fx("moe"), via_gguf, qtype="q4_0")  # dequantized, then requantized
    assert gguf_contents(via_hf)[1] == gguf_contents(via_gguf)[1]


def test_auto_keeps_a_q8_0_base(fx, hf_mtp, tmp_path):
    base = rewrite_gguf(fx("dense", False), tmp_path / "base-q8_0.gguf", qtype=T.Q8_0)
    out = tmp_path / "out.gguf"
    lines: list[str] = []
    plan = graft(base, hf_mtp("dense"), out, log=lines.append)
    assert plan.qtype == T.Q8_0
    assert any("Q8_0, the type of the base's full-attention attn_q tensors" in line for line in lines)
    assert gguf_contents(out)[1]["blk.4.attn_q.weight"][0] == "Q8_0"
    # The Q8_0 output is a valid SOURCE: same type, so its bytes are copied unchanged.
    again = tmp_path / "again.gguf"
    graft(base, out, again)
    assert again.read_bytes() == out.read_bytes()


def test_auto_writes_q8_0_when_gguf_py_cannot_write_the_base_type():
    qtype, why = choose_type("auto", T.Q4_K, "full-attention attn_q tensors")
    assert qtype == T.Q8_0
    assert "Q4_K" in why and "cannot quantize" in why


def test_explicit_type_overrides_the_base():
    assert choose_type("bf16", T.Q8_0, "x") == (T.BF16, "BF16 as requested with --type")


def test_norms_stay_f32_and_short_rows_fall_back_to_f16():
    assert tensor_type(NORM, T.Q4_0, (64,)) == (T.F32, None)
    qtype, note = tensor_type(MATRIX, T.Q8_0, (48, 16))
    assert qtype == T.F16 and "not a multiple of the Q8_0 block (32)" in note


def test_every_shifted_norm_stays_f32(fx, hf_mtp, tmp_path):
    out = tmp_path / "out.gguf"
    graft(fx("dense", False), hf_mtp("dense"), out, qtype="q4_0")
    tensors = gguf_contents(out)[1]
    assert all(tensors[f"blk.4.{name}"][0] == "F32" for name in SHIFTED)
