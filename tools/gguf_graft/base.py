"""Read what the graft needs from a GGUF: architecture, trunk size, dimensions, weight types.

Used for BASE and for an MTP-only GGUF SOURCE, either of which may be a split GGUF
(`model-00001-of-00005.gguf`, ...): given any part, every part is read, part 0 for the
metadata and all of them for the tensors. Nothing here loads tensor data: GGUFReader
memory-maps each file and only the header pages are touched.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from pymtp.gguf_bounded import BoundedReader
from pymtp.gguf_facts import (ALIGNMENT, ARCHITECTURE, ARCHS, BLOCK_COUNT, DEFAULT_ALIGNMENT,
                              NEXTN_PREDICT_LAYERS, SplitError, check_parts, part_paths, recurrent_flags,
                              scalar, split_position)

from .errors import GraftError
from .mapping import Dims

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
MAX_LAYERS = 512  # llama.cpp's per-layer arrays hold this many


@dataclass(frozen=True)
class GgufPart:
    """One file of a GGUF: the whole of an unsplit one, or one part of a split one."""

    path: Path
    reader: GGUFReader
    alignment: int  # of its tensor data (its own general.alignment, else 32)


@dataclass
class GgufInfo:
    path: Path  # as given: any part of a split GGUF
    parts: tuple[GgufPart, ...]  # one, or a split's parts in order; parts[0] holds the metadata
    arch: str
    n_trunk: int  # blocks before the MTP block(s): the MTP block's index
    n_nextn: int  # MTP blocks already in the file
    dims: Dims
    full_layer: int  # the trunk's last full-attention layer, the MTP block's closest kin

    @property
    def reader(self) -> GGUFReader:
        """The reader of the metadata (part 0)."""
        return self.parts[0].reader

    @property
    def is_split(self) -> bool:
        return len(self.parts) > 1

    @property
    def files(self) -> list[Path]:
        return [p.path for p in self.parts]

    def tensors(self) -> Iterator[tuple[int, ReaderTensor]]:
        """(index of the part holding it, tensor) for every tensor, in file order."""
        for i, part in enumerate(self.parts):
            for t in part.reader.tensors:
                yield i, t


def open_gguf(path: Path, role: str) -> GgufInfo:
    """Open a qwen35/qwen35moe GGUF, all its parts if it is split; `role` ("BASE"/"SOURCE")
    names it in error messages."""
    first = _read(path, role)
    try:
        return _read_info(path, first, role)
    except GraftError:
        raise
    except (ValueError, TypeError, IndexError, ArithmeticError) as e:   # a mangled value
        raise GraftError(f"{role} {str(path)!r} is corrupt: its metadata cannot be read "
                         f"({type(e).__name__}: {e}); download or convert it again") from e


def _read_info(path: Path, first: GgufPart, role: str) -> GgufInfo:
    parts = _all_parts(path, first, role)
    reader = parts[0].reader
    arch = _get(reader, ARCHITECTURE, parts[0].path)
    if arch not in ARCHS:
        raise GraftError(
            f"{role} {str(path)!r} has architecture {arch!r}; gguf_graft handles {' and '.join(ARCHS)} "
            "(Qwen3.5/3.6) only")
    block_count = int(_get(reader, BLOCK_COUNT.format(arch=arch), parts[0].path))
    n_nextn = int(scalar(reader, NEXTN_PREDICT_LAYERS.format(arch=arch), 0))
    # 2**32 - 1 blocks overflowed the block_count written back (a struct.error traceback)
    if not 0 < block_count <= MAX_LAYERS or not 0 <= n_nextn < block_count:
        raise GraftError(f"{role} {str(path)!r} is corrupt: {arch}.block_count is {block_count} with "
                         f"{n_nextn} MTP blocks (expected 1..{MAX_LAYERS} blocks, fewer MTP blocks)")
    n_trunk = block_count - n_nextn
    full_layer = _last_full_attention_layer(reader, arch, n_trunk)
    return GgufInfo(path, parts, arch, n_trunk, n_nextn, _dims(reader, arch, full_layer, parts[0].path), full_layer)


def _all_parts(path: Path, first: GgufPart, role: str) -> tuple[GgufPart, ...]:
    """`first` alone, or every part of the split GGUF it belongs to, checked to fit together."""
    index, count = split_position(first.reader)
    if count == 1:
        return (first,)
    try:
        paths = part_paths(path, index, count)
        parts = tuple(first if i == index else _read(p, role) for i, p in enumerate(paths))
        check_parts([p.reader for p in parts], paths)
    except SplitError as e:
        raise GraftError(f"{role} {e}") from e
    return parts


def _read(path: Path, role: str) -> GgufPart:
    if not path.is_file():
        raise GraftError(f"{role} not found: {str(path)!r} is not a file")
    try:
        reader = BoundedReader(path, "r")
    except Exception as e:  # GGUFReader raises ValueError, struct.error, IndexError, ...
        raise GraftError(f"cannot read {role} {str(path)!r} as GGUF: {e}") from e
    if reader.byte_order != "I":
        raise GraftError(f"{role} {str(path)!r} is a big-endian GGUF; only little-endian files are supported")
    return GgufPart(path, reader, int(scalar(reader, ALIGNMENT, DEFAULT_ALIGNMENT)))


def block_of(name: str) -> tuple[int, str] | None:
    """(block index, rest) for `blk.{i}.{rest}`, else None."""
    m = _BLOCK.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def matrix_type(info: GgufInfo) -> tuple[GGMLQuantizationType | None, str]:
    """The dominant type of the trunk's weight matrices, and which tensors it was read from.

    Prefers the full-attention `attn_q` tensors: the MTP block is a full-attention layer,
    and in K-quant mixes those are the closest kin. Falls back to all 2-D+ block weights.
    """
    tensors = [(block_of(t.name), t) for _, t in info.tensors()]
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
    if n_embd <= 0 or n_head <= 0:      # 0 heads was a ZeroDivisionError traceback
        raise GraftError(f"{str(path)!r} is corrupt: {arch}.embedding_length is {n_embd} and "
                         f"{arch}.attention.head_count {n_head}; both must be positive")
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
    full = [i for i, recurrent in enumerate(recurrent_flags(reader, arch, n_trunk)) if not recurrent]
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
