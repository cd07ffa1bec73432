"""Step 2b: the new metadata: the base's KV pairs with the MTP block counted in.

Every pair is copied byte for byte except: `{arch}.block_count` + 1;
`{arch}.nextn_predict_layers` = 1, inserted where the converter writes it (right after
`general.file_type`); each per-layer array, which gets one entry for the MTP block,
because llama.cpp rejects an array whose length is not block_count
(llama-model-loader.cpp, get_key_or_arr); and, for a split base, `split.tensors.count`
(the tensors of all parts; in every part), or no split.* keys at all when the parts are
written as one file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from gguf import GGUFValueType as V
from gguf.gguf_reader import ReaderField

from pymtp.gguf_facts import BLOCK_COUNT, NEXTN_PREDICT_LAYERS, SPLIT_KEYS, SPLIT_TENSORS_COUNT

from .base import GgufInfo, GgufPart

# Per-layer array keys llama.cpp reads for qwen35/qwen35moe (get_key_or_arr over
# n_layer_all, llama-model.cpp and src/models/qwen35*.cpp), and the MTP block's entry:
# it is a full-attention layer, so it is not recurrent and copies the sizes of the
# trunk's last full-attention layer.
NOT_RECURRENT = "it is full attention, not recurrent"
LIKE_FULL_ATTENTION = "as in the last full-attention layer"
PER_LAYER: dict[str, str] = {
    "attention.recurrent_layers": NOT_RECURRENT,
    "attention.head_count": LIKE_FULL_ATTENTION,
    "attention.head_count_kv": LIKE_FULL_ATTENTION,
    "feed_forward_length": LIKE_FULL_ATTENTION,
    "expert_feed_forward_length": LIKE_FULL_ATTENTION,
    "expert_used_count": LIKE_FULL_ATTENTION,
}
FIXED_LENGTH = ("rope.dimension_sections",)  # arrays that are not per layer, whatever their length
NEXTN_AFTER = ("general.file_type", BLOCK_COUNT)  # first present wins

_PACK = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
         V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}


@dataclass
class Metadata:
    kv: list[bytes] = field(default_factory=list)  # encoded KV pairs, in file order
    changes: list[str] = field(default_factory=list)  # what differs from the base, for the report
    notes: list[str] = field(default_factory=list)


def new_metadata(base: GgufInfo, n_tensors: int, keep_split: bool = True) -> Metadata:
    """The KV pairs of the output's first (or only) file: the base's for a file set of
    `n_tensors` tensors whose block `base.n_trunk` is one MTP block.

    A base that already has MTP blocks (replaced under --force) has its per-layer arrays
    cut back to the trunk first. `keep_split=False` drops the split.* keys (one file
    written from a split base).
    """
    arch, n = base.arch, base.n_trunk
    fields = base.reader.fields
    nextn_key = NEXTN_PREDICT_LAYERS.format(arch=arch)
    after = next((k.format(arch=arch) for k in NEXTN_AFTER if k.format(arch=arch) in fields), None)
    meta = Metadata()
    for key, f in fields.items():
        if key.startswith("GGUF."):  # the reader's view of the header, not KV pairs
            continue
        rel = key.removeprefix(f"{arch}.") if key.startswith(f"{arch}.") else None
        if rel == "block_count":
            meta.kv.append(encode_kv(key, f.types[0], n + 1))
            meta.changes.append(f"{key}: {f.contents()} -> {n + 1}")
        elif key in SPLIT_KEYS and not keep_split:
            meta.changes.append(f"{key}: {f.contents()} -> (dropped: one file)")
        elif key == nextn_key:
            meta.kv.append(encode_kv(key, f.types[0], 1))
            meta.changes.append(f"{key}: {f.contents()} -> 1")
        elif rel in PER_LAYER and f.types[0] == V.ARRAY:
            values = f.contents()
            extra = False if PER_LAYER[rel] == NOT_RECURRENT else values[base.full_layer]
            meta.kv.append(encode_kv(key, V.ARRAY, [*values[:n], extra], f.types[-1]))
            was = "" if len(values) <= n else f", in place of the base's {str(values[n]).lower()}"   # --force
            meta.changes.append(f"{key}: {'appended ' * (not was)}{str(extra).lower()} for the MTP block"
                                f"{was} ({PER_LAYER[rel]})")
        else:
            meta.kv.append(_copied(key, f, n_tensors, meta))
            if (rel is not None and rel not in FIXED_LENGTH and f.types[0] == V.ARRAY
                    and len(f.data) == base.n_trunk + base.n_nextn):
                meta.notes.append(f"{key} has one entry per block but is not a known per-layer key; "
                                  "copied unchanged")
        if key == after and nextn_key not in fields:
            meta.kv.append(encode_kv(nextn_key, V.UINT32, 1))
            meta.changes.append(f"{nextn_key}: (new) 1")
    return meta


def part_metadata(part: GgufPart, n_tensors: int) -> Metadata:
    """The KV pairs of a later part of a split output: the base part's own (the split.*
    keys, as llama-gguf-split writes them), the tensor count updated."""
    meta = Metadata()
    for key, f in part.reader.fields.items():
        if not key.startswith("GGUF."):
            meta.kv.append(_copied(key, f, n_tensors, meta))
    return meta


def _copied(key: str, f: ReaderField, n_tensors: int, meta: Metadata) -> bytes:
    """A KV pair as stored, except split.tensors.count, which counts the output's tensors."""
    if key == SPLIT_TENSORS_COUNT and f.contents() != n_tensors:
        meta.changes.append(f"{key}: {f.contents()} -> {n_tensors}")
        return encode_kv(key, f.types[0], n_tensors)
    return raw_kv(f)


def raw_kv(f: ReaderField) -> bytes:
    """A KV pair exactly as stored in the base."""
    return b"".join(part.tobytes() for part in f.parts)


def encode_kv(key: str, vtype: V, value: Any, item_type: V | None = None) -> bytes:
    out = _string(key) + struct.pack("<I", vtype)
    if vtype != V.ARRAY:
        return out + _value(vtype, value)
    assert item_type is not None
    return out + struct.pack("<IQ", item_type, len(value)) + b"".join(_value(item_type, v) for v in value)


def _value(vtype: V, value: Any) -> bytes:
    return _string(value) if vtype == V.STRING else struct.pack("<" + _PACK[vtype], value)


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b
