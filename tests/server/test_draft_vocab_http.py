"""``pymtp serve --draft-vocab N``: a real server whose MTP head drafts over N ids gives,
over HTTP, the completions plain decoding gives (pymtp/draft_vocab.py)."""

from __future__ import annotations

import pytest

from conftest import require_exact_kernels

from .helpers import live_server

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():"]


def test_a_server_with_a_draft_vocabulary_completes_as_plain_decoding(dense_path, dense_model, tmp_path,
                                                                     monkeypatch):
    require_exact_kernels()
    monkeypatch.setenv("PYMTP_CACHE_DIR", str(tmp_path / "cache"))
    plain = [dense_model.detokenize(dense_model.generate(p, spec="none", max_tokens=24, ignore_eos=True).tokens)
             for p in PROMPTS]
    with live_server([str(dense_path), "--parallel", "2", "--ctx-size", "512", "--threads", "1",
                      "--draft-vocab", "300"], tmp_path) as s:
        client = s.openai()
        for prompt, want in zip(PROMPTS, plain):
            r = client.completions.create(model="m", prompt=prompt, max_tokens=24,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == want
        drafted = s.metrics().get("pymtp_draft_tokens_total", 0.0)
    assert drafted > 0
    assert len(list((tmp_path / "cache" / "draft-vocab").glob("*.gguf"))) == 1


def test_serve_refuses_a_draft_vocabulary_out_of_range(dense_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYMTP_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="draft_vocab must be an integer from 256"):
        with live_server([str(dense_path), "--draft-vocab", "5000", "--threads", "1"], tmp_path, timeout=30):
            pass
