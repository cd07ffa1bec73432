"""Step 1: read SOURCE and find its MTP tensors: names, shapes and where their bytes lie.

SOURCE is a safetensors file, an HF model directory (sharded or a single
`model.safetensors`), an MTP GGUF (llama.cpp's converter with `--mtp`, or any GGUF with an
MTP block), or an HF repo id, fetched by hub.py. HF tensors are keyed by their `mtp.…` name
and kept in the order llama.cpp's converter reads them (shards sorted by file name,
tensors sorted by name within a shard), so the graft can write them in the same order.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import hub
from .base import GgufInfo, block_of, open_gguf
from .errors import GraftError
from .mapping import INDEX, SINGLE, hf_mtp_name, mtp_shards

# safetensors dtypes we read; BF16 stays uint16 until transform.py widens it.
DTYPES: dict[str, str] = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class SourceTensor:
    """Where one tensor's bytes lie. Rows are read on demand with plain file reads, not a
    memory map, so the pages of a large SOURCE never pile up in the process's memory."""

    name: str  # name in the source file, for messages
    dtype: str  # safetensors dtype ("BF16", "F16", "F32") or GGML type name (GGUF)
    shape: tuple[int, ...]  # numpy order, outermost first
    path: Path
    offset: int  # of the first byte in `path`
    nbytes: int
    storage: str = "u1"  # numpy dtype of the stored values: BF16 as "<u2", GGUF as raw bytes

    @property
    def n_rows(self) -> int:
        """Rows of the 2-D view [-1, shape[-1]]."""
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    def read_rows(self, start: int, count: int) -> np.ndarray:
        """Rows [start, start + count) as stored: [count, stored values per row]."""
        row = self.nbytes // self.n_rows
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * row)
            buf = f.read(count * row)
        if len(buf) != count * row:
            raise GraftError(f"{str(self.path)!r} ends inside {self.name!r}: the file is truncated")
        return np.frombuffer(buf, dtype=self.storage).reshape(count, -1)


@dataclass
class Source:
    label: str  # what was read, for messages
    tensors: dict[str, SourceTensor]  # HF: "mtp.…" names; GGUF: "blk.{i}.…" names
    config: dict[str, Any] | None = None  # HF config.json, text_config merged in
    gguf: GgufInfo | None = None  # set when SOURCE is a GGUF
    files: list[Path] = field(default_factory=list)  # every file read (OUT must be none of them)


def read_source(spec: str | os.PathLike[str]) -> Source:
    """Find the MTP tensors of SOURCE; raises GraftError when there are none to find."""
    path = Path(spec)
    if path.is_dir():
        return _read_hf_dir(path, f"HF directory {str(path)!r}")
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _read_hf_dir(path.parent, f"HF directory {str(path.parent)!r}")
        if path.suffix == ".json":   # config.json given for its checkpoint: it holds no tensors
            raise GraftError(f"SOURCE {str(path)!r} is a JSON file, not a checkpoint; pass the HF model "
                             f"directory it is in ({str(path.parent)!r}) or a safetensors file")
        return _read_file(path)
    if _REPO_ID.match(str(spec)) and not str(spec).endswith((".gguf", ".safetensors", ".json")):
        return _read_hf_dir(hub.fetch(str(spec)), f"Hugging Face repo {str(spec)!r}")
    raise GraftError(
        f"source not found: {str(spec)!r} is not a file, a directory or a Hugging Face repo id "
        "(owner/name). Pass a safetensors file, an HF model directory, an MTP GGUF or a repo id.")


def _read_file(path: Path) -> Source:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _read_gguf(path)
    tensors = _read_safetensors(path)
    if not tensors:
        if (path.parent / INDEX).is_file():       # one shard of a checkpoint: the block may be in another
            raise GraftError(f"SOURCE {str(path)!r} holds no MTP tensors, but it is one shard of the checkpoint in "
                             f"{str(path.parent)!r}: pass that directory (or its {INDEX})")
        raise GraftError(
            f"SOURCE {str(path)!r} holds no MTP tensors (names starting with mtp., model.mtp. or "
            "model.language_model.mtp.); this checkpoint was saved without its MTP block")
    return Source(f"safetensors file {str(path)!r}", tensors, files=[path])


def _read_hf_dir(d: Path, label: str) -> Source:
    checkpoint: list[Path] = []      # its other files: OUT must not overwrite them either
    if (d / INDEX).is_file():
        weight_map = _load_json(d / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise GraftError(f"cannot read {str(d / INDEX)!r}: it has no weight_map")
        shards = mtp_shards(weight_map)
        checkpoint = [d / INDEX, *(d / str(f) for f in dict.fromkeys(weight_map.values()))]
        if not shards:
            raise GraftError(f"SOURCE {label} lists no mtp.* tensors in {INDEX}: this checkpoint "
                             "ships without the MTP block, so there is nothing to graft")
    elif (d / SINGLE).is_file():
        shards = [SINGLE]
    else:
        raise GraftError(f"SOURCE {label} has neither {INDEX} nor {SINGLE}; pass the model "
                         "directory of an HF safetensors checkpoint")
    tensors: dict[str, SourceTensor] = {}
    for shard in shards:
        if not (d / shard).is_file():
            raise GraftError(f"SOURCE {label}: shard {shard!r} holds mtp.* tensors but is missing; "
                             "download it too")
        for name, t in _read_safetensors(d / shard).items():
            if name in tensors:
                raise GraftError(f"SOURCE {label}: {t.name!r} appears twice ({shard} and an earlier shard)")
            tensors[name] = t
    if not tensors:
        raise GraftError(f"SOURCE {label} holds no mtp.* tensors: this checkpoint ships without the MTP block")
    config = _load_json(d / "config.json") if (d / "config.json").is_file() else None
    if config is not None:
        text = config.get("text_config", {})
        if not isinstance(text, dict):
            raise GraftError(f"SOURCE {label}: config.json's text_config is {type(text).__name__}, not an "
                             "object of the model's sizes; mend config.json (or leave text_config out)")
        config = {**config, **text}
    files = list(dict.fromkeys([*(d / s for s in shards), *checkpoint,
                                *([d / "config.json"] if config is not None else [])]))
    return Source(f"{label} ({len(shards)} shard{'s' * (len(shards) > 1)} with MTP tensors)",
                  tensors, config=config, files=files)


def _read_safetensors(path: Path) -> dict[str, SourceTensor]:
    """The MTP tensors of one safetensors file, by `mtp.…` name, sorted by stored name."""
    header, start = _safetensors_header(path)
    size = path.stat().st_size
    found: dict[str, SourceTensor] = {}
    for stored in sorted(header):
        if (name := hf_mtp_name(stored)) is None:
            continue
        meta = header[stored]
        dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        if dtype not in DTYPES:
            raise GraftError(
                f"{stored!r} in {str(path)!r} is {dtype}; gguf_graft reads F32, F16 and BF16 "
                "checkpoints (for an FP8 release, use the BF16 repo of the same model)")
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        if end - begin != want:
            raise GraftError(f"{stored!r} in {str(path)!r} has {end - begin} bytes where shape {shape} "
                             f"needs {want}; the file is corrupt (download it again)")
        if start + end > size:
            raise GraftError(f"{stored!r} in {str(path)!r} ends at byte {start + end} of a {size}-byte "
                             "file; the file is truncated (download it again)")
        if name in found:
            raise GraftError(f"{str(path)!r} holds both {found[name].name!r} and {stored!r}; keep one")
        found[name] = SourceTensor(stored, dtype, shape, path, start + begin, want, DTYPES[dtype])
    return found


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= min(size - 8, _MAX_HEADER):
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        for name, meta in header.items():
            if name != "__metadata__":
                _check_entry(name, meta)
    except (OSError, ValueError) as e:
        raise GraftError(f"cannot read SOURCE {str(path)!r}: not a GGUF or safetensors file ({e})") from e
    return header, 8 + n


def _check_entry(name: str, meta: Any) -> None:
    """Each header entry as the format defines it, so a corrupt one is named, not a TypeError later."""
    if not (isinstance(meta, dict) and {"dtype", "shape", "data_offsets"} <= meta.keys()):
        raise ValueError(f"bad entry for {name!r}: it needs dtype, shape and data_offsets")
    shape, offsets = meta["shape"], meta["data_offsets"]
    if not isinstance(meta["dtype"], str):
        raise ValueError(f"bad entry for {name!r}: dtype {meta['dtype']!r} is not a string")
    if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise ValueError(f"bad entry for {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)
            and offsets[0] <= offsets[1]):
        raise ValueError(f"bad entry for {name!r}: data_offsets {offsets!r} is not [begin, end] "
                         "with 0 <= begin <= end")


def _is_count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _read_gguf(path: Path) -> Source:
    info = open_gguf(path, "SOURCE")
    if info.n_nextn == 0:
        raise GraftError(
            f"SOURCE {str(path)!r} is a GGUF without an MTP block ({info.arch}.nextn_predict_layers is "
            "absent or 0); pass the HF checkpoint, or an MTP GGUF written by convert_hf_to_gguf.py --mtp")
    tensors = {}
    for part, t in info.tensors():
        if (b := block_of(t.name)) is not None and b[0] >= info.n_trunk:
            shape = tuple(int(n) for n in reversed(t.shape))
            tensors[t.name] = SourceTensor(t.name, t.tensor_type.name, shape, info.parts[part].path,
                                           int(t.data_offset), int(t.n_bytes))
    return Source(f"MTP GGUF {str(path)!r}", tensors, gguf=info, files=info.files)


def _load_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise GraftError(f"cannot read {str(path)!r}: {e}") from e
    if not isinstance(value, dict):
        raise GraftError(f"cannot read {str(path)!r}: expected a JSON object")
    return value
