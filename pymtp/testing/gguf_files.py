"""Copy and split GGUF files with gguf-py, to make test inputs from the fixtures.

`split_gguf` writes the layout llama-gguf-split writes (tools/gguf-split): part 0 holds
every KV pair followed by split.no, split.count and split.tensors.count, the other parts
hold only those three, and the parts are named `{stem}-00001-of-0000N.gguf`. Unlike
llama-gguf-split, the number of tensors in each part is given, so that a test can lay
out two files the same way and compare them byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from pymtp.gguf_facts import ALIGNMENT, ARCHITECTURE, DEFAULT_ALIGNMENT, architecture, scalar


def copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Add every KV pair of `reader` to `writer`, in order, with its stored type.

    general.architecture is left out: GGUFWriter writes it first by itself.
    """
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == ARCHITECTURE:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub)


def add_tensor_copy(writer: GGUFWriter, tensor) -> None:
    """Add a tensor of a GGUFReader to `writer` with its stored type and bytes."""
    writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)


def with_metadata(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                  values: dict[str, tuple[object, GGUFValueType]]) -> Path:
    """A copy of `src` at `dst` with these KV pairs added (key -> (value, GGUF type)),
    tensors unchanged: a fixture with metadata a converter would have written, such as a
    code model's fill-in-the-middle token ids."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, architecture(reader))
    writer.data_alignment = int(scalar(reader, ALIGNMENT, DEFAULT_ALIGNMENT))
    copy_metadata(reader, writer)
    for key, (value, kind) in values.items():
        writer.add_key_value(key, value, kind)
    for t in reader.tensors:
        add_tensor_copy(writer, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def split_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], counts: Sequence[int]) -> list[Path]:
    """Split `src` into len(counts) parts, the i-th holding the next counts[i] tensors.

    The parts are named after `dst` as llama.cpp looks for them (`dst` = "m.gguf" gives
    m-00001-of-00003.gguf, ...); returns their paths in order.
    """
    reader = GGUFReader(src)
    if len(counts) < 2 or min(counts) < 1 or sum(counts) != len(reader.tensors):
        raise ValueError(f"counts {list(counts)} must be two or more positive numbers adding up to the "
                         f"{len(reader.tensors)} tensors of {str(src)!r}")
    writer = GGUFWriter(dst, architecture(reader))
    writer.data_alignment = int(scalar(reader, ALIGNMENT, DEFAULT_ALIGNMENT))
    copy_metadata(reader, writer)
    firsts = set(np.cumsum(counts)[:-1].tolist())  # index of the first tensor of each later part
    for i, t in enumerate(reader.tensors):
        # gguf-py starts a new part when the current one holds split_max_tensors tensors.
        writer.split_max_tensors = len(writer.tensors[-1]) if i in firsts else 0
        add_tensor_copy(writer, t)
    paths = writer.format_shard_names(Path(dst))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return paths
