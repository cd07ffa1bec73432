"""The flash-attention choice and what each backend promises about greedy identity."""

from __future__ import annotations

import pytest

from conftest import gpu_build


def test_flash_attn_default_follows_the_backend(dense_model):
    if not gpu_build():
        assert dense_model.flash_attn == "off"
        from pymtp.native import cpu_features

        assert dense_model.exactness.startswith("CPU: greedy MTP output is identical to plain decoding")
        assert ("GGML_LLAMAFILE=OFF" in dense_model.exactness) == (cpu_features().get("LLAMAFILE") == "1")
    else:
        assert dense_model.flash_attn == "auto"
        assert dense_model.exactness.startswith("GPU")


def test_gpu_exactness_names_the_batch_invariant_switch(dense_model, monkeypatch):
    if not gpu_build():
        pytest.skip("a CPU build's promise does not depend on GGML_CUDA_BATCH_INVARIANT")
    monkeypatch.delenv("GGML_CUDA_BATCH_INVARIANT", raising=False)
    assert dense_model.exactness.startswith("GPU: greedy MTP output can part")
    assert "GGML_CUDA_BATCH_INVARIANT=1" in dense_model.exactness
    monkeypatch.setenv("GGML_CUDA_BATCH_INVARIANT", "1")
    assert dense_model.exactness.startswith("GPU with GGML_CUDA_BATCH_INVARIANT=1: greedy MTP output is identical")


def test_cpu_features_parse_the_system_info():
    from pymtp.native import cpu_features

    feats = cpu_features()
    assert feats.get("SSE3") == "1" or feats.get("NEON") == "1"   # every x86-64 / arm64 build
    assert all(k == k.strip() and k for k in feats)


def test_flash_attn_on_cpu_is_reported(dense_path):
    import pymtp

    if gpu_build():
        pytest.skip("a GPU build reports its own exactness whatever flash_attn is")
    m = pymtp.load(dense_path, threads=1, n_ctx=256, flash_attn="on")
    try:
        assert m.flash_attn == "on"
        assert "flash_attn='off'" in m.exactness
        assert len(m.generate("x", max_tokens=4, ignore_eos=True).tokens) == 4
    finally:
        m.close()


def test_bad_flash_attn_names_the_choices(dense_path):
    import pymtp

    with pytest.raises(ValueError, match=r"flash_attn must be one of 'auto', 'on', 'off', got 'yes'"):
        pymtp.load(dense_path, flash_attn="yes")
