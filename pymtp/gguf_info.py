"""Read a GGUF's header before llama.cpp sees it, so bad input gets a clear error.

llama.cpp reports a wrong file as a NULL model and a log line; here we say what is wrong
and how to fix it: missing path, not a GGUF, truncated, another architecture, no MTP block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHS = ("qwen35", "qwen35moe")
GRAFT_HINT = ("add one with `gguf_graft MODEL.gguf MTP_SOURCE -o MODEL-mtp.gguf` "
              "(MTP_SOURCE: the HF checkpoint or its mtp.safetensors), or decode with spec='none'")


class ModelFileError(ValueError):
    """The model file cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    arch: str
    name: str
    block_count: int
    n_nextn: int
    n_embd: int
    n_recurrent_layers: int
    recurrent_bytes: int      # recurrent state of one sequence, one snapshot plane (f32)
    chat_template: str | None

    @property
    def has_mtp(self) -> bool:
        return self.n_nextn > 0


def _scalar(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def inspect(path: str | os.PathLike) -> ModelInfo:
    """Validate ``path`` as a Qwen3.5 GGUF and return what the runtime needs from its header."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found: {str(p)!r}")
    if p.is_dir():
        raise ModelFileError(f"{str(p)!r} is a directory; pass the path of a .gguf file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(
            f"{str(p)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "convert the checkpoint with llama.cpp's convert_hf_to_gguf.py")
    from gguf import GGUFReader   # imported late: it is slow to import

    try:
        reader = GGUFReader(p, "r")
    except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on bad headers
        raise ModelFileError(f"{str(p)!r} is truncated or corrupt: {exc}") from exc
    size = p.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelFileError(
            f"{str(p)!r} is truncated: its tensors need {end} bytes but the file has {size}; "
            "download or copy it again")
    arch = str(_scalar(reader, "general.architecture", ""))
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(
            f"{str(p)!r} is a {arch or 'unknown'!r} model; pymtp runs Qwen3.5/3.6 models "
            f"(architectures {', '.join(SUPPORTED_ARCHS)})")
    block_count = int(_scalar(reader, f"{arch}.block_count", 0))
    n_nextn = int(_scalar(reader, f"{arch}.nextn_predict_layers", 0))
    n_embd = int(_scalar(reader, f"{arch}.embedding_length", 0))
    recr = _scalar(reader, f"{arch}.attention.recurrent_layers")
    n_trunk = block_count - n_nextn
    if recr is not None:
        n_recr = sum(bool(x) for x in list(recr)[:n_trunk])
    else:
        interval = int(_scalar(reader, f"{arch}.full_attention_interval", 4))
        n_recr = sum(1 for i in range(n_trunk) if (i + 1) % interval != 0)
    d_conv = int(_scalar(reader, f"{arch}.ssm.conv_kernel", 4))
    d_state = int(_scalar(reader, f"{arch}.ssm.state_size", 0))
    n_group = int(_scalar(reader, f"{arch}.ssm.group_count", 0))
    dt_rank = int(_scalar(reader, f"{arch}.ssm.time_step_rank", 0))
    conv_dim = d_state * (2 * n_group + dt_rank)
    per_layer = (d_conv - 1) * conv_dim + d_state * d_state * dt_rank
    template = _scalar(reader, "tokenizer.chat_template")
    return ModelInfo(
        path=p, arch=arch, name=str(_scalar(reader, "general.name", p.stem)),
        block_count=block_count, n_nextn=n_nextn, n_embd=n_embd, n_recurrent_layers=n_recr,
        recurrent_bytes=4 * per_layer * n_recr,
        chat_template=str(template) if template is not None else None)


def require_mtp(info: ModelInfo) -> None:
    if not info.has_mtp:
        raise ModelFileError(f"{str(info.path)!r} has no MTP block (nextn_predict_layers is 0); {GRAFT_HINT}")
