"""Token bytes come from a table filled on first use (NativeModel.token_to_bytes): the
table must say what llama.cpp says, for every token, with and without special text."""

from __future__ import annotations

from pathlib import Path

from conftest import _load

DEMO = next((Path(__file__).resolve().parent.parent / "pymtp" / "data").glob("*.gguf"))


def test_every_tokens_bytes_equal_llama_cpps_on_every_call():
    native = _load(DEMO)._native
    for special in (True, False, True):          # twice from the table, keyed by `special` too
        for t in range(native.n_vocab):
            assert native.token_to_bytes(t, special=special) == native._piece(t, special), (t, special)


def test_a_control_tokens_text_shows_only_with_special():
    model = _load(DEMO)
    (eot,) = model.tokenize("<|endoftext|>", special=True, add_special=False)
    native = model._native
    assert native.is_control(eot)
    assert native.token_to_bytes(eot) == b""
    assert native.token_to_bytes(eot, special=True) == b"<|endoftext|>"
    assert native.token_to_bytes(eot) == b""
