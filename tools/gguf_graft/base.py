"""Read what the graft needs from a GGUF: architecture, trunk size, dimensions, weight types.

Used for BASE and for an MTP-only GGUF SOURCE. Nothing here loads tensor data: GGUFReader
memory-maps the file and only the header pages are touched.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import GraftError
from .mapping import Dims

ARCHS = ("qwen35", "qwen35moe")
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT, used when general.alignment is absent
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class GgufInfo:
    path: Path
    reader: GGUFReader
    arch: str
    n_trunk: int  # blocks before the MTP block(s): the MTP block's index
    n_nextn: int  # MTP blocks already in the file
    dims: Dims
    alignment: int
    full_layer: int  # the trunk's last full-attention layer, the MTP block's closest kin


def open_gguf(path: Path, role: str) -> GgufInfo:
    """Open a qwen35/qwen35moe GGUF; `role` ("BASE"/"SOURCE") names it in error messages."""
    if not path.is_file():
        raise GraftError(f"{role} not found: {str(path)!r} is not a file")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # GGUFReader raises ValueError, struct.error, IndexError, ...
        raise GraftError(f"cannot read {role} {str(path)!r} as GGUF: {e}") from e
    if (n_split := int(_scalar(reader, "split.count", 1))) > 1:
        raise GraftError(
            f"{role} {str(path)!r} is part {int(_scalar(reader, 'split.no', 0)) + 1} of a {n_split}-file split "
            f"GGUF; merge the parts first: llama-gguf-split --merge {str(path)!r} merged.gguf")
    if reader.byte_order != "I":
        raise GraftError(f"{role} {str(path)!r} is a big-endian GGUF; only little-endian files are supported")
    arch = _get(reader, "general.architecture", path)
    if arch not in ARCHS:
        raise GraftError(
            f"{role} {str(path)!r} has architecture {arch!r}; gguf_graft handles {' and '.join(ARCHS)} "
            "(Qwen3.5/3.6) only")
    block_count = int(_get(reader, f"{arch}.block_count", path))
    n_nextn = int(_scalar(reader, f"{arch}.nextn_predict_layers", 0))
    n_trunk = block_count - n_nextn
    full_layer = _last_full_attention_layer(reader, arch, n_trunk)
    return GgufInfo(path, reader, arch, n_trunk, n_nextn, _dims(reader, arch, full_layer, path),
                    int(_scalar(reader, "general.alignment", DEFAULT_ALIGNMENT)), full_layer)


def block_of(name: str) -> tuple[int, str] | None:
    """(block index, rest) for `blk.{i}.{rest}`, else None."""
    m = _BLOCK.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def matrix_type(info: GgufInfo) -> tuple[GGMLQuantizationType | None, str]:
    """The dominant type of the trunk's weight matrices, and which tensors it was read from.

    Prefers the full-attention `attn_q` tensors: the MTP block is a full-attention layer,
    and in K-quant mixes those are the closest kin. Falls back to all 2-D+ block weights.
    """
    tensors = [(block_of(t.name), t) for t in info.reader.tensors]
    trunk = [(b[1], t) for b, t in tensors if b is not None and b[0] < info.n_trunk]
    for label, chosen in (
        ("full-attention attn_q tensors", [t for rest, t in trunk if rest == "attn_q.weight"]),
        ("trunk weight matrices", [t for rest, t in trunk if len(t.shape) >= 2 and rest.endswith(".weight")]),
    ):
        if chosen:
            counts = Counter(t.tensor_type for t in chosen)
            return counts.most_common(1)[0][0], label
    return None, "no weight matrices found"


def _dims(reader: GGUFReader, arch: str, layer: int, path: Path) -> Dims:
    """Dims from the KV pairs, with the loader's fallbacks (llama-model.cpp, qwen35moe.cpp);
    per-layer arrays are read at `layer`."""

    def get(name: str, default: Any = KeyError) -> Any:
        return _per_layer(reader, f"{arch}.{name}", layer, default, path)

    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    if arch != "qwen35moe":
        return Dims(n_embd, n_head, n_head_kv, head_dim, n_ff=int(get("feed_forward_length")))
    n_ff = get("feed_forward_length", None)
    n_used = get("expert_used_count", None)
    n_ff_exp = get("expert_feed_forward_length", None)
    if n_ff_exp is None and n_ff is not None and n_used:
        n_ff_exp = int(n_ff) // int(n_used)
    n_ff_shexp = get("expert_shared_feed_forward_length", n_ff)
    return Dims(n_embd, n_head, n_head_kv, head_dim, n_expert=int(get("expert_count")),
                n_ff_exp=None if n_ff_exp is None else int(n_ff_exp),
                n_ff_shexp=None if n_ff_shexp is None else int(n_ff_shexp))


def _last_full_attention_layer(reader: GGUFReader, arch: str, n_trunk: int) -> int:
    """The last trunk layer that is not recurrent (per-layer arrays are read there)."""
    field = reader.fields.get(f"{arch}.attention.recurrent_layers")
    flags = field.contents()[:n_trunk] if field is not None else []
    full = [i for i, recurrent in enumerate(flags) if not recurrent]
    return full[-1] if full else max(n_trunk - 1, 0)


def _per_layer(reader: GGUFReader, key: str, layer: int, default: Any, path: Path) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise GraftError(f"{str(path)!r} lacks the metadata key {key!r}; is it a complete Qwen3.5 GGUF?")
        return default
    value = field.contents()
    return value[layer] if field.types[0] == GGUFValueType.ARRAY else value


def _get(reader: GGUFReader, key: str, path: Path | None = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        where = f" of {str(path)!r}" if path else ""
        raise GraftError(f"the metadata{where} lacks {key!r}; is it a GGUF written by llama.cpp's converter?")
    return field.contents()


def _scalar(reader: GGUFReader, key: str, default: Any) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()
