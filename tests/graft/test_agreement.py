"""Grafting the converter's --no-mtp file gives the converter's full file (shared tiny model)."""

from __future__ import annotations

import struct

import pytest

from .helpers import TINY, gguf_contents, run_cli

pytestmark = pytest.mark.skipif(not TINY.is_dir(), reason=f"{TINY} absent")

BASE = TINY / "gguf" / "model-nomtp-f16.gguf"
WANT = TINY / "gguf" / "model-f16.gguf"  # convert_hf_to_gguf.py --outtype f16, MTP included
SOURCES = {
    "safetensors": TINY / "mtp.safetensors",
    "hf-dir": TINY / "hf",
    "mtp-gguf": TINY / "gguf" / "mtp-qwen35-tiny-mtp-F16.gguf",
}


@pytest.fixture(scope="module")
def want():
    return gguf_contents(WANT)


def _size_label(value: bytes) -> bytes:
    key = b"general.size_label"
    return struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value


@pytest.mark.parametrize("source", SOURCES)
def test_graft_equals_converter_output(source, want, tmp_path):
    out = tmp_path / "out.gguf"
    result = run_cli(BASE, SOURCES[source], "--type", "f16", "-o", out, "-q")
    assert result.exit_code == 0, result.output

    got_kv, got_tensors = gguf_contents(out)
    want_kv, want_tensors = dict(want[0]), want[1]
    # Same tensors: names, order, types, shapes and data bytes.
    assert list(got_tensors.items()) == list(want_tensors.items())
    # Same metadata in the same order, except general.size_label: gguf_graft copies the
    # base's ("17M") verbatim, the converter counted the MTP block in ("19M").
    assert got_kv.pop("general.size_label")[1] == "17M" and want_kv.pop("general.size_label")[1] == "19M"
    assert list(got_kv.items()) == list(want_kv.items())
    # Hence the files are byte-identical but for that label.
    assert out.read_bytes().replace(_size_label(b"17M"), _size_label(b"19M")) == WANT.read_bytes()


def test_auto_type_keeps_the_base_f16(want, tmp_path):
    out = tmp_path / "out.gguf"
    result = run_cli(BASE, SOURCES["safetensors"], "-o", out, "-q")
    assert result.exit_code == 0, result.output
    assert "F16, the type of the base's full-attention attn_q tensors" in result.output
    assert gguf_contents(out)[1] == want[1]
