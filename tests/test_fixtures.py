"""The synthetic Qwen3.5 fixtures: determinism, layout, and that llama.cpp runs them."""

from __future__ import annotations

import hashlib
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from pymtp.testing import HPARAMS, bigram_map, fixture_path, write_fixture

try:  # llama.cpp through pymtp's own thin wrapper
    from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel
except ImportError as exc:  # pragma: no cover - depends on the environment
    _LLAMA_MISSING = f"llama_cpp cannot be imported: {exc}"
else:
    _LLAMA_MISSING = ""

needs_llama = pytest.mark.skipif(bool(_LLAMA_MISSING), reason=_LLAMA_MISSING)

KINDS = ("dense", "moe")


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
def test_fixture_is_small(tmp_path: Path, kind: str) -> None:
    assert write_fixture(tmp_path / "f.gguf", kind).stat().st_size < 2 * 1024 * 1024


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_declares_one_mtp_block(fixtures_dir: Path, kind: str) -> None:
    hp = HPARAMS[kind]
    reader = GGUFReader(fixture_path(kind, True, fixtures_dir))
    arch = hp.arch
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
    arch = HPARAMS[kind].arch
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


def _model(path: Path, load_mtp: bool) -> closing[NativeModel]:
    return closing(NativeModel(str(path), load_mtp=load_mtp))


def _context(model: NativeModel, *, mtp: bool = False, n_rs_seq: int = 0) -> closing[NativeContext]:
    # one thread: a spinning second thread stalls when anything else shares the 2 cores
    cfg = ContextConfig(n_ctx=256, n_batch=128, n_ubatch=128, n_rs_seq=n_rs_seq, mtp=mtp, threads=1)
    return closing(NativeContext(model, cfg))


def _decode(ctx: NativeContext, tokens: list[int], pos0: int) -> np.ndarray:
    """Decode `tokens` at positions pos0...; the logits of the last: [n_vocab]."""
    batch = Batch(len(tokens))
    batch.set(np.asarray(tokens), pos0)
    ctx.decode(batch)
    return ctx.logits(1)[0].copy()


def _text(model: NativeModel, tokens: list[int]) -> str:
    return b"".join(model.token_to_bytes(t) for t in tokens).decode()


@needs_llama
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("load_mtp", [True, False])
def test_llama_cpp_loads_with_and_without_mtp(fixtures_dir: Path, kind: str, load_mtp: bool) -> None:
    with _model(fixture_path(kind, True, fixtures_dir), load_mtp) as model:
        assert (model.n_layer, model.n_layer_nextn) == (HPARAMS[kind].n_trunk, 1)
    with _model(fixture_path(kind, False, fixtures_dir), load_mtp) as model:
        assert (model.n_layer, model.n_layer_nextn) == (HPARAMS[kind].n_trunk, 0)


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
        tokens = model.tokenize(text, add_special=False)
        assert _text(model, tokens) == text
        if "fibonacci" in text:
            assert len(tokens) < len(text) // 2  # the merges do apply


@needs_llama
def test_special_tokens_are_single_end_of_generation_tokens(fixtures_dir: Path) -> None:
    with _model(fixture_path("dense", True, fixtures_dir), False) as model:
        start, end, eot = (model.tokenize(s, add_special=False, parse_special=True)
                           for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
        assert len(start) == len(end) == len(eot) == 1
        assert model.is_eog(end[0]) and model.is_eog(eot[0]) and not model.is_eog(start[0])
        assert model.meta("tokenizer.ggml.eos_token_id") == model.meta("tokenizer.ggml.bos_token_id") == str(eot[0])
        assert model.tokenize("hi", add_special=True) == model.tokenize("hi", add_special=False)  # no BOS added
        assert "<|im_start|>" in model.meta("tokenizer.chat_template")


@needs_llama
@pytest.mark.parametrize("kind", KINDS)
def test_target_decodes_and_mtp_context_opens(fixtures_dir: Path, kind: str) -> None:
    with _model(fixture_path(kind, True, fixtures_dir), True) as model:
        tokens = model.tokenize("class Counter:\n    def __init__(self):", add_special=False)
        with _context(model, n_rs_seq=3) as ctx:
            assert ctx.n_rs_seq == 3
            assert np.all(np.isfinite(_decode(ctx, tokens, 0)))
        with _context(model, mtp=True):
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
                seq = model.tokenize(prompt, add_special=False)
                logits = _decode(ctx, seq, 0)
                for _ in range(48):
                    top2 = np.sort(logits)[-2:]
                    margins.append(top2[1] - top2[0])
                    tok = int(np.argmax(logits))
                    deviations += tok != succ[seq[-1]]
                    steps += 1
                    seq.append(tok)
                    logits = _decode(ctx, [tok], len(seq) - 1)
    assert 0.1 <= deviations / steps <= 0.5
    assert np.median(margins) > 0.5


@needs_llama
@pytest.mark.parametrize("kind", KINDS)
def test_mtp_head_drafts_the_bigram_successor(fixtures_dir: Path, kind: str) -> None:
    """Fed (x_q, h_{q-1}), the MTP head's argmax is pi(x_q) for most q."""
    succ = bigram_map(kind=kind)
    with _model(fixture_path(kind, True, fixtures_dir), True) as model:
        tokens = model.tokenize("The quick brown fox jumps over the lazy dog; def run(self):", add_special=False)
        n = len(tokens) - 1
        with _context(model) as tgt, _context(model, mtp=True) as mtp:
            tgt.set_nextn_output(True, False)
            _decode(tgt, tokens, 0)
            hidden = tgt.hidden(len(tokens))[:n].copy()  # h_0 .. h_{n-1}
            batch = Batch(n, embd_width=model.n_embd)  # each row: token x_{q} and hidden row h_{q-1}
            batch.set(np.asarray(tokens[1:]), 1, outputs="all", embd=hidden)
            mtp.decode(batch)
            drafts = mtp.logits(n).argmax(axis=1)
    hits = sum(int(d) == succ[x] for d, x in zip(drafts, tokens[1:]))
    assert hits / len(drafts) >= 0.8
