"""benchmarks/pad_vocab.py: a widened model loads at the new size, decodes the same greedy
tokens, tokenizes text the same, gives the placeholders a small nonzero tail, is
deterministic, and every bad input is refused with a message and no file left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType

from benchmarks import pad_vocab as pv

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "pymtp" / "data" / "qwen35-tiny-mtp-q8_0.gguf"  # Q8_0, tied head, 8192 tokens
N_DEMO = 8192
N_TEST = 16_384  # pymtp.load spends ~8 s reading a 248k token list; test_real_qwen35_size uses that size
PROMPTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import numpy as np\n\n\nclass Matrix:\n    def __init__(self, rows):\n",
    "# Parse the command line\nparser = argparse.ArgumentParser(description=",
)


def pad(src: Path, out: Path, n_vocab: int, **kw) -> Path:
    pv.pad_vocab(src, out, n_vocab, progress=False, **kw)
    return out


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture(scope="module")
def demo_padded(tmp_path_factory) -> Path:
    return pad(DEMO, tmp_path_factory.mktemp("pad") / "demo-16k.gguf", N_TEST)


@pytest.fixture(scope="module")
def models(demo_padded):
    """(original, padded) demo models, loaded once for the module."""
    import pymtp
    a = pymtp.load(DEMO, threads=1, n_ctx=1024)
    b = pymtp.load(demo_padded, threads=1, n_ctx=1024)
    yield a, b
    a.close()
    b.close()


# ---------------------------------------------------------------------------- runs in llama.cpp


def test_padded_model_loads_at_new_size(models):
    a, b = models
    assert (a.n_vocab, b.n_vocab) == (N_DEMO, N_TEST)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_greedy_tokens_unchanged(models, spec):
    a, b = models
    for prompt in PROMPTS:
        want = a.generate(prompt, max_tokens=32, spec=spec, ignore_eos=True).tokens
        got = b.generate(prompt, max_tokens=32, spec=spec, ignore_eos=True).tokens
        assert got == want, prompt


def test_text_tokenizes_as_before(models):
    a, b = models
    texts = [*PROMPTS, "s = '<|pad_9000|>' + <|pad_8192|><|pad_16383|>", "<|endoftext|>x<|pad_10000|>"]
    for text in texts:
        for special in (False, True):
            assert b.tokenize(text, special=special) == a.tokenize(text, special=special), text


def test_placeholder_prints_its_name(models):
    _, b = models
    assert b.detokenize([N_DEMO + 5]) == f"<|pad_{N_DEMO + 5}|>"
    assert not b.is_eog(N_DEMO + 5)


def test_tail_is_small_but_nonzero(models):
    """Every position's argmax stays in the original vocabulary, with room to spare, and
    the placeholders share a small, nonzero part of the probability mass."""
    from pymtp.native import Batch, ContextConfig, NativeContext, NativeModel

    _, b = models
    native = NativeModel(str(b.path))
    ctx = NativeContext(native, ContextConfig(n_ctx=512, threads=1))
    try:
        ids = np.array(b.tokenize("".join(PROMPTS)), dtype=np.int32)
        batch = Batch(len(ids))
        batch.set(ids, 0, outputs="all")
        ctx.decode(batch)
        logits = ctx.logits(len(ids)).astype(np.float64)  # [n_positions, N_TEST]
    finally:
        ctx.close()
        native.close()
    margin = logits[:, :N_DEMO].max(1) - logits[:, N_DEMO:].max(1)
    assert margin.min() > 2.0
    p = np.exp(logits - logits.max(1, keepdims=True))
    tail = p[:, N_DEMO:].sum(1) / p.sum(1)
    assert (tail > 0).all()
    assert 1e-5 < tail.mean() < 0.05, tail.mean()


def test_real_qwen35_size(tmp_path):
    """The synthetic fixture (untied head) widened to 248,320 tokens loads in llama.cpp."""
    from pymtp import native
    from pymtp.testing.fixtures import fixture_path

    out = pad(fixture_path("dense", cache_dir=tmp_path), tmp_path / "fx-248k.gguf", pv.QWEN35_N_VOCAB)
    model = native.NativeModel(str(out), n_gpu_layers=0)
    try:
        assert model.n_vocab == pv.QWEN35_N_VOCAB
    finally:
        model.close()


# ---------------------------------------------------------------------------- the file


def test_only_per_token_tables_change(demo_padded):
    """Original rows, other tensors and the merges are byte-identical; the new rows are Q8_0
    like the old; the placeholders are NORMAL tokens named after their ids."""
    a, b = GGUFReader(DEMO), GGUFReader(demo_padded)
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert tb.tensor_type == ta.tensor_type, ta.name
        if ta.name == "token_embd.weight":
            assert list(tb.shape) == [ta.shape[0], N_TEST]
            assert tb.tensor_type == GGMLQuantizationType.Q8_0
            assert np.array_equal(tb.data[:N_DEMO], ta.data)
            assert np.any(tb.data[N_DEMO:])
        else:
            assert list(tb.shape) == list(ta.shape) and np.array_equal(tb.data, ta.data), ta.name
    tokens = b.fields[pv.TOKENS].contents()
    assert tokens[:N_DEMO] == a.fields[pv.TOKENS].contents()
    assert tokens[N_DEMO] == f"<|pad_{N_DEMO}|>" and len(tokens) == N_TEST
    assert b.fields[pv.TOKEN_TYPES].contents()[N_DEMO:] == [TokenType.NORMAL] * (N_TEST - N_DEMO)
    assert b.fields[pv.MERGES].contents() == a.fields[pv.MERGES].contents()


def test_same_seed_same_bytes(demo_padded, tmp_path):
    again = pad(DEMO, tmp_path / "again.gguf", N_TEST)
    other = pad(DEMO, tmp_path / "other.gguf", N_TEST, seed=1)
    assert again.read_bytes() == demo_padded.read_bytes()
    assert other.read_bytes() != demo_padded.read_bytes()


def tiny_gguf(path: Path, *, head: bool, mtp_copies: bool, vocab_size_key: bool = False,
              scores: bool = False) -> Path:
    """A 3-token, 32-wide F16 model file: enough for the metadata and tensor recipe."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((3, 32)).astype(np.float16)
    w = GGUFWriter(path, "qwen35")
    w.add_token_list(["a", "b", "c"])
    w.add_token_types([TokenType.NORMAL] * 3)
    if scores:
        w.add_token_scores([0.0, -1.0, -2.0])
    if vocab_size_key:
        w.add_vocab_size(3)
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    if head:
        w.add_tensor("output.weight", (emb * 2).astype(np.float16))
    if mtp_copies:
        w.add_tensor("blk.0.nextn.embed_tokens.weight", emb)
        w.add_tensor("blk.0.nextn.shared_head_head.weight", (emb * 2 if head else emb).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("head", [True, False], ids=["untied", "tied"])
def test_mtp_copies_get_the_rows_of_their_twin(tmp_path, head):
    out = pad(tiny_gguf(tmp_path / "in.gguf", head=head, mtp_copies=True), tmp_path / "out.gguf", 40)
    t = {x.name: np.array(x.data) for x in GGUFReader(out).tensors}
    assert t["token_embd.weight"].shape == (40, 32) and t["output_norm.weight"].shape == (32,)
    assert np.array_equal(t["blk.0.nextn.embed_tokens.weight"], t["token_embd.weight"])
    twin = t["output.weight"] if head else t["token_embd.weight"]
    assert np.array_equal(t["blk.0.nextn.shared_head_head.weight"], twin)
    if head:  # the head's rows come from the head's own statistics and stream
        assert not np.array_equal(t["output.weight"][3:], t["token_embd.weight"][3:])


def test_vocab_size_key_and_scores_grow(tmp_path):
    src = tiny_gguf(tmp_path / "in.gguf", head=False, mtp_copies=False, vocab_size_key=True, scores=True)
    r = GGUFReader(pad(src, tmp_path / "out.gguf", 5))
    assert r.fields["qwen35.vocab_size"].contents() == 5
    assert r.fields["tokenizer.ggml.scores"].contents() == [0.0, -1.0, -2.0, -2.0, -2.0]


def test_same_size_is_a_plain_copy(tmp_path):
    """--n-vocab equal to the current size copies a file gguf-py wrote byte for byte."""
    src = tiny_gguf(tmp_path / "in.gguf", head=True, mtp_copies=False)
    out = pad(src, tmp_path / "out.gguf", 3)
    assert out.read_bytes() == src.read_bytes()


# ---------------------------------------------------------------------------- refusals


def refused(capsys, out_dir: Path, *argv: str | Path) -> str:
    """Run the CLI; expect exit 1, an error on stderr, and no new file in `out_dir`."""
    before = listing(out_dir)
    assert pv.main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pad_vocab.py: error: ")
    assert listing(out_dir) == before
    return err


def test_not_a_gguf(tmp_path, capsys):
    junk = tmp_path / "model.gguf"
    junk.write_text("not a model\n")
    assert "cannot read IN" in refused(capsys, tmp_path, junk, tmp_path / "out.gguf")


def test_missing_input(tmp_path, capsys):
    assert "IN not found" in refused(capsys, tmp_path, tmp_path / "nope.gguf", tmp_path / "out.gguf")


def test_smaller_vocab(tmp_path, capsys):
    err = refused(capsys, tmp_path, DEMO, tmp_path / "out.gguf", "--n-vocab", "4096")
    assert "--n-vocab 4096 is smaller than IN's vocabulary of 8192 tokens" in err


def test_output_exists(tmp_path, capsys):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    err = refused(capsys, tmp_path, DEMO, out, "--n-vocab", str(N_DEMO))
    assert "exists; pass --force to overwrite it" in err
    assert out.read_bytes() == b"keep me"
    assert pv.main([str(DEMO), str(out), "--n-vocab", str(N_DEMO), "--force", "-q"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"


def test_output_is_input(tmp_path, capsys):
    src = tiny_gguf(tmp_path / "in.gguf", head=True, mtp_copies=False)
    assert "is IN" in refused(capsys, tmp_path, src, src, "--n-vocab", "5", "--force")


def test_output_directory_missing(tmp_path, capsys):
    assert "does not exist" in refused(capsys, tmp_path, DEMO, tmp_path / "no" / "out.gguf")


def test_unwritable_type(tmp_path, capsys):
    src = tmp_path / "in.gguf"
    w = GGUFWriter(src, "qwen35")
    w.add_token_list(["a", "b"])
    w.add_token_types([TokenType.NORMAL] * 2)
    w.add_tensor("token_embd.weight", np.zeros((2, 2 * 144), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "token_embd.weight is Q4_K, which gguf-py cannot write" in refused(capsys, tmp_path, src, tmp_path / "o.gguf")


def test_error_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A failure while writing (here: in the new rows) removes the .part file."""
    src = tiny_gguf(tmp_path / "in.gguf", head=True, mtp_copies=False)

    def boom(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(pv, "encode", boom)
    with pytest.raises(RuntimeError, match="boom"):
        pad(src, tmp_path / "out.gguf", 5)
    assert listing(tmp_path) == ["in.gguf"]


def test_script_runs_standalone(tmp_path):
    """`python benchmarks/pad_vocab.py` works without the test's sys.path."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "pad_vocab.py"), str(DEMO),
                        str(tmp_path / "o.gguf"), "--n-vocab", "100"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1
    assert "smaller than IN's vocabulary of 8192 tokens" in r.stderr
