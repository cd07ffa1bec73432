"""Write deterministic tiny Qwen3.5 GGUFs (dense `qwen35`, MoE `qwen35moe`) with an MTP block.

They load in the pinned llama.cpp like a converted checkpoint does (same keys, tensor
names and shapes, F32 weights), carry a real byte-level BPE tokenizer, and are weighted
so that greedy decoding follows a bigram map most of the time (see weights.py), which
gives the MTP head something to predict.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pymtp.testing import layout, tokenizer, weights

DEFAULT_NOISE = 0.75
DEFAULT_MTP_NOISE = 0.2
DEFAULT_LOGIT_SCALE = 10.0
DEFAULT_SEED = 0
# what a converter stores in half precision (norms, GDN parameters and convolutions stay f32)
_MATRIX_ROLES = frozenset({"embed", "lm_head", "in", "out", "eh_proj"})


def write_fixture(
    path: str | os.PathLike[str],
    kind: str = "dense",
    *,
    seed: int = DEFAULT_SEED,
    with_mtp: bool = True,
    noise: float = DEFAULT_NOISE,
    mtp_noise: float = DEFAULT_MTP_NOISE,
    logit_scale: float = DEFAULT_LOGIT_SCALE,
    hp: layout.Hparams | None = None,
    f16: bool = False,
) -> Path:
    """Write a fixture GGUF to `path` and return it.

    `kind` is "dense" or "moe". `with_mtp=False` writes the same trunk without the MTP
    block and without `nextn_predict_layers`. `noise` scales how far the trunk pulls
    greedy decoding off the bigram map; `mtp_noise` how far the MTP head strays from
    it; `logit_scale` is the winning logit of a noiseless step. `hp` overrides the
    kind's sizes (benchmarks/sized_model.py: a model as large as a real one), and `f16`
    stores the matrices as float16, as converted checkpoints do.
    """
    if kind not in layout.HPARAMS:
        raise ValueError(f"kind must be one of {sorted(layout.HPARAMS)}, got {kind!r}")
    hp = layout.HPARAMS[kind] if hp is None else hp
    if hp.kind != kind:
        raise ValueError(f"hp describes a {hp.kind!r} model, not {kind!r}")
    vocab = tokenizer.build_vocab(hp.n_vocab)
    succ = weights.bigram_map(vocab, seed)
    path = Path(path)

    writer = gguf.GGUFWriter(path, hp.arch)
    _add_general(writer, kind, with_mtp)
    for key, value in layout.metadata(hp, with_mtp):
        _add_typed(writer, key, value)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, vocab)

    for name, ne, role, in_mtp in layout.tensor_plan(hp, with_mtp):
        data = weights.init_tensor(
            name, ne, role, hp=hp, seed=seed, succ=succ,
            noise=mtp_noise if in_mtp else noise, logit_scale=logit_scale,
        )
        if f16 and role in _MATRIX_ROLES and data.ndim >= 2:
            data = data.astype(np.float16)
        writer.add_tensor(name, data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bigram_map(seed: int = DEFAULT_SEED, kind: str = "dense") -> np.ndarray:
    """pi of the fixture written with this seed: `succ[x]` is the favoured next token."""
    vocab = tokenizer.build_vocab(layout.HPARAMS[kind].n_vocab)
    return weights.bigram_map(vocab, seed)


def fixture_path(
    kind: str = "dense",
    with_mtp: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    **knobs: Any,
) -> Path:
    """Path of a fixture in `cache_dir`, written on first use.

    Meant for a session-scoped pytest fixture (e.g. with `tmp_path_factory.getbasetemp()`).
    The file name encodes every argument and a digest of this package's code (so a
    persistent cache never serves a file from older code), and the write goes through a
    temporary file and a rename, so parallel test workers never see a half-written file.
    """
    cache = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "pymtp-fixtures"
    cache.mkdir(parents=True, exist_ok=True)
    tag = "".join(f"-{k}{v}" for k, v in sorted(knobs.items()))
    name = f"{kind}-{'mtp' if with_mtp else 'nomtp'}{tag}-{_code_digest()}.gguf"
    path = cache / name
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".part")
        os.close(fd)
        try:
            write_fixture(tmp, kind, with_mtp=with_mtp, **knobs)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _code_digest() -> str:
    digest = hashlib.sha256()
    for module in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(module.read_bytes())
    return digest.hexdigest()[:10]


def _add_general(writer: gguf.GGUFWriter, kind: str, with_mtp: bool) -> None:
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"pymtp-fixture-{kind}{'' if with_mtp else '-nomtp'}")


def _add_typed(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """Write `value` with the GGUF type llama.cpp reads it as (see layout.metadata)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)  # bools -> BOOL, ints -> INT32
    else:
        raise TypeError(f"no GGUF type for {key}={value!r}")


def _add_tokenizer(writer: gguf.GGUFWriter, vocab: tokenizer.Vocab) -> None:
    eot = vocab.token_id(tokenizer.ENDOFTEXT)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_pad_token_id(eot)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(tokenizer.CHAT_TEMPLATE)
