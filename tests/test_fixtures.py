"""The synthetic Qwen3.5 fixtures: determinism, layout, and that llama.cpp runs them."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from pymtp.testing import HPARAMS, bigram_map, fixture_path, write_fixture

try:
    import llama_cpp.llama_cpp as L
    import llama_cpp.llama_cpp_ext as LX
except ImportError as exc:  # pragma: no cover - depends on the environment
    L = LX = None
    _LLAMA_MISSING = f"llama_cpp cannot be imported: {exc}"
else:
    _LLAMA_MISSING = ""

needs_llama = pytest.mark.skipif(L is None, reason=_LLAMA_MISSING)

KINDS = ("dense", "moe")
ARCH = {"dense": "qwen35", "moe": "qwen35moe"}


@pytest.fixture(scope="module")
def fixtures_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fixtures")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _field(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


# ---------------------------------------------------------------- file level


@pytest.mark.parametrize("kind", KINDS)
def test_same_arguments_give_identical_bytes(tmp_path: Path, kind: str) -> None:
    a = write_fixture(tmp_path / "a.gguf", kind, seed=3)
    b = write_fixture(tmp_path / "b.gguf", kind, seed=3)
    assert _sha256(a) == _sha256(b)


def test_seed_and_knobs_change_the_file(tmp_path: Path) -> None:
    base = _sha256(write_fixture(tmp_path / "a.gguf", seed=0))
    assert _sha256(write_fixture(tmp_path / "b.gguf", seed=1)) != base
    assert _sha256(write_fixture(tmp_path / "c.gguf", seed=0, noise=0.1)) != base


@pytest.mark.parametrize("kind", KINDS)
def test_fixture_is_fast_and_small(tmp_path: Path, kind: str) -> None:
    start = time.perf_counter()
    path = write_fixture(tmp_path / "f.gguf", kind)
    assert time.perf_counter() - start < 1.0
    assert path.stat().st_size < 2 * 1024 * 1024


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_declares_one_mtp_block(fixtures_dir: Path, kind: str) -> None:
    hp = HPARAMS[kind]
    reader = GGUFReader(fixture_path(kind, True, fixtures_dir))
    arch = ARCH[kind]
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, f"{arch}.block_count") == hp.n_trunk + 1
    assert _field(reader, f"{arch}.nextn_predict_layers") == 1
    assert _field(reader, f"{arch}.attention.recurrent_layers") == [True, True, True, False, False]
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")
    if kind == "moe":
        assert _field(reader, f"{arch}.expert_count") == 4
        assert _field(reader, f"{arch}.expert_used_count") == 2


@pytest.mark.parametrize("kind", KINDS)
def test_mtp_tensors_have_loader_shapes(fixtures_dir: Path, kind: str) -> None:
    hp = HPARAMS[kind]
    d, n = hp.n_embd, hp.n_trunk
    tensors = {t.name: t for t in GGUFReader(fixture_path(kind, True, fixtures_dir)).tensors}
    expected = {  # ggml order, as llama.cpp's load_block_mtp asks for them
        f"blk.{n}.nextn.eh_proj.weight": [2 * d, d],
        f"blk.{n}.nextn.enorm.weight": [d],
        f"blk.{n}.nextn.hnorm.weight": [d],
        f"blk.{n}.nextn.shared_head_norm.weight": [d],
        f"blk.{n}.attn_q.weight": [d, 2 * hp.n_head * hp.head_dim],
        f"blk.{n}.attn_k.weight": [d, hp.n_head_kv * hp.head_dim],
        f"blk.{n}.attn_output.weight": [hp.n_head * hp.head_dim, d],
        f"blk.{n}.attn_q_norm.weight": [hp.head_dim],
    }
    if kind == "dense":
        expected[f"blk.{n}.ffn_down.weight"] = [hp.n_ff, d]
    else:
        expected[f"blk.{n}.ffn_gate_inp.weight"] = [d, hp.n_expert]
        expected[f"blk.{n}.ffn_up_exps.weight"] = [d, hp.n_ff_exp, hp.n_expert]
        expected[f"blk.{n}.ffn_down_exps.weight"] = [hp.n_ff_exp, d, hp.n_expert]
        expected[f"blk.{n}.ffn_gate_inp_shexp.weight"] = [d, 1]
        expected[f"blk.{n}.ffn_down_shexp.weight"] = [hp.n_ff_shexp, d]
    for name, shape in expected.items():
        assert name in tensors, name
        assert [int(x) for x in tensors[name].shape] == shape, name
    assert all(t.tensor_type == GGMLQuantizationType.F32 for t in tensors.values())
    assert np.all(tensors[f"blk.{n}.nextn.enorm.weight"].data == 1.0)  # +1 already applied


@pytest.mark.parametrize("kind", KINDS)
def test_without_mtp_is_the_same_trunk(fixtures_dir: Path, kind: str) -> None:
    arch = ARCH[kind]
    full = GGUFReader(fixture_path(kind, True, fixtures_dir))
    bare = GGUFReader(fixture_path(kind, False, fixtures_dir))
    assert _field(bare, f"{arch}.block_count") == HPARAMS[kind].n_trunk
    assert bare.get_field(f"{arch}.nextn_predict_layers") is None
    assert len(_field(bare, f"{arch}.attention.recurrent_layers")) == HPARAMS[kind].n_trunk
    full_tensors = {t.name: t for t in full.tensors}
    assert not any(".nextn." in t.name for t in bare.tensors)
    for t in bare.tensors:
        assert np.array_equal(t.data, full_tensors[t.name].data), t.name


def test_fixture_path_writes_once(tmp_path: Path) -> None:
    first = fixture_path("dense", True, tmp_path, seed=5)
    mtime = first.stat().st_mtime_ns
    again = fixture_path("dense", True, tmp_path, seed=5)
    assert again == first and again.stat().st_mtime_ns == mtime
    assert fixture_path("dense", True, tmp_path, seed=6) != first
    assert not list(tmp_path.glob("*.part"))


def test_bigram_map_is_one_long_cycle() -> None:
    succ = bigram_map()
    start = int(succ[ord("a")])
    seen, x = {start}, int(succ[start])
    while x != start:
        assert x not in seen
        seen.add(x)
        x = int(succ[x])
    assert len(seen) > 150  # every readable token is on it


# ---------------------------------------------------------------- llama.cpp


@contextlib.contextmanager
def _model(path: Path, load_mtp: bool) -> Iterator[object]:
    params = L.llama_model_default_params()
    params.load_mtp = load_mtp
    model = L.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    try:
        yield model
    finally:
        L.llama_model_free(model)


@contextlib.contextmanager
def _context(model: object, ctx_type: int = 0, n_rs_seq: int = 0) -> Iterator[object]:
    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 256, 128, 128
    params.ctx_type = ctx_type
    params.n_rs_seq = n_rs_seq
    ctx = L.llama_init_from_model(model, params)
    assert ctx, "llama_init_from_model returned NULL"
    try:
        yield ctx
    finally:
        L.llama_free(ctx)


def _tokenize(model: object, text: str, special: bool = False) -> list[int]:
    vocab = L.llama_model_get_vocab(model)
    raw = text.encode()
    buf = (L.llama_token * (len(raw) + 8))()
    n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, special)
    assert n >= 0
    return list(buf[:n])


def _detokenize(model: object, tokens: list[int]) -> str:
    vocab = L.llama_model_get_vocab(model)
    buf = ctypes.create_string_buffer(64)
    out = b""
    for tok in tokens:
        n = L.llama_token_to_piece(vocab, tok, buf, len(buf), 0, False)
        assert n >= 0
        out += buf.raw[:n]
    return out.decode()


def _decode(ctx: object, tokens: list[int]) -> None:
    arr = (L.llama_token * len(tokens))(*tokens)  # must outlive llama_decode
    assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) == 0


def _logits(ctx: object, model: object, i: int) -> np.ndarray:
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()


@needs_llama
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("load_mtp", [True, False])
def test_llama_cpp_loads_with_and_without_mtp(fixtures_dir: Path, kind: str, load_mtp: bool) -> None:
    with _model(fixture_path(kind, True, fixtures_dir), load_mtp) as model:
        assert L.llama_model_n_layer(model) == HPARAMS[kind].n_trunk
        assert L.llama_model_n_layer_nextn(model) == 1
    with _model(fixture_path(kind, False, fixtures_dir), load_mtp) as model:
        assert L.llama_model_n_layer(model) == HPARAMS[kind].n_trunk
        assert L.llama_model_n_layer_nextn(model) == 0


@needs_llama
@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n",
        "  tabs\tand   spaces, 12345 digits; 'quotes' \"too\" ~!@#$%^&*()_+{}|:<>?",
    ],
)
def test_tokenizer_round_trips_ascii(fixtures_dir: Path, text: str) -> None:
    with _model(fixture_path("dense", True, fixtures_dir), False) as model:
        tokens = _tokenize(model, text)
        assert _detokenize(model, tokens) == text
        if "fibonacci" in text:
            assert len(tokens) < len(text) // 2  # the merges do apply


@needs_llama
def test_special_tokens_are_single_end_of_generation_tokens(fixtures_dir: Path) -> None:
    with _model(fixture_path("dense", True, fixtures_dir), False) as model:
        vocab = L.llama_model_get_vocab(model)
        start, end, eot = (_tokenize(model, s, special=True) for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
        assert len(start) == len(end) == len(eot) == 1
        assert L.llama_vocab_eos(vocab) == L.llama_vocab_bos(vocab) == eot[0]
        assert L.llama_vocab_is_eog(vocab, end[0]) and L.llama_vocab_is_eog(vocab, eot[0])
        assert not L.llama_vocab_get_add_bos(vocab)
        assert b"<|im_start|>" in L.llama_model_chat_template(model, None)


@needs_llama
@pytest.mark.parametrize("kind", KINDS)
def test_target_decodes_and_mtp_context_opens(fixtures_dir: Path, kind: str) -> None:
    with _model(fixture_path(kind, True, fixtures_dir), True) as model:
        tokens = _tokenize(model, "class Counter:\n    def __init__(self):")
        with _context(model, n_rs_seq=3) as ctx:
            assert L.llama_n_rs_seq(ctx) == 3
            _decode(ctx, tokens)
            assert np.all(np.isfinite(_logits(ctx, model, -1)))
        with _context(model, ctx_type=L.LLAMA_CONTEXT_TYPE_MTP):
            pass


@needs_llama
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decoding_mostly_follows_the_bigram_map(fixtures_dir: Path, kind: str) -> None:
    """The trunk must matter (some steps leave pi) but not drown pi (most steps keep it)."""
    succ = bigram_map(kind=kind)
    steps = deviations = 0
    margins = []
    with _model(fixture_path(kind, True, fixtures_dir), False) as model:
        for prompt in ("def fibonacci(n):\n    return n", "The quick brown fox jumps."):
            with _context(model) as ctx:
                seq = _tokenize(model, prompt)
                _decode(ctx, seq)
                for _ in range(48):
                    logits = _logits(ctx, model, -1)
                    top2 = np.sort(logits)[-2:]
                    margins.append(top2[1] - top2[0])
                    tok = int(np.argmax(logits))
                    deviations += tok != succ[seq[-1]]
                    steps += 1
                    seq.append(tok)
                    _decode(ctx, [tok])
    assert 0.1 <= deviations / steps <= 0.5
    assert np.median(margins) > 0.5


def _mtp_batch(tokens: list[int], hidden: np.ndarray, pos0: int):
    """A batch carrying both a token and a target hidden row per entry (MTP input)."""
    n, n_embd = hidden.shape
    batch = L.llama_batch_init(n, n_embd, 1)
    token_buf = (L.llama_token * n)(*tokens)
    batch.token = ctypes.cast(token_buf, ctypes.POINTER(L.llama_token))
    embd = np.ctypeslib.as_array(batch.embd, shape=(n * n_embd,))
    embd[:] = hidden.reshape(-1)
    for j in range(n):
        batch.pos[j] = pos0 + j
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = 0
        batch.logits[j] = 1
    batch.n_tokens = n
    return batch, token_buf


@needs_llama
@pytest.mark.parametrize("kind", KINDS)
def test_mtp_head_drafts_the_bigram_successor(fixtures_dir: Path, kind: str) -> None:
    """Fed (x_q, h_{q-1}), the MTP head's argmax is pi(x_q) for most q."""
    succ = bigram_map(kind=kind)
    with _model(fixture_path(kind, True, fixtures_dir), True) as model:
        n_embd = L.llama_model_n_embd(model)
        tokens = _tokenize(model, "The quick brown fox jumps over the lazy dog; def run(self):")
        with _context(model) as tgt, _context(model, ctx_type=L.LLAMA_CONTEXT_TYPE_MTP) as mtp:
            LX.llama_set_embeddings_nextn(tgt, True, False)
            _decode(tgt, tokens)
            hidden = np.stack([
                np.ctypeslib.as_array(LX.llama_get_embeddings_nextn_ith(tgt, i), shape=(n_embd,))
                for i in range(len(tokens) - 1)
            ])
            batch, token_buf = _mtp_batch(tokens[1:], hidden, pos0=1)
            try:
                assert L.llama_decode(mtp, batch) == 0
                drafts = [int(np.argmax(_logits(mtp, model, j))) for j in range(len(tokens) - 1)]
            finally:
                batch.token = None  # owned by token_buf, not by llama_batch_free
                L.llama_batch_free(batch)
    hits = sum(d == succ[x] for d, x in zip(drafts, tokens[1:]))
    assert hits / len(drafts) >= 0.8
