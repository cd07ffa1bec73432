"""Facts about Qwen3.5/3.6 GGUF files that the runtime (gguf_info) and gguf_graft share.

The architectures, the metadata keys both read, and the layout of a split GGUF
(``model-00001-of-00005.gguf``, ...). Key names come from llama.cpp's
``src/llama-arch.cpp`` (LLM_KV_NAMES); the split layout from ``src/llama.cpp``
(llama_split_path, llama_split_prefix), ``src/llama-model-loader.cpp`` (how the parts
are read) and ``tools/gguf-split/gguf-split.cpp`` (how they are written).

No imports beyond the standard library: the graft tool and the tests that build
fixtures use this without gguf's reader being loaded here and without llama.cpp.
Functions that look at a file take a ``reader`` with a ``fields`` mapping of key ->
field with ``.contents()`` (gguf's GGUFReader) and, for tensors, a ``tensors`` list.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any, Protocol, Sequence

ARCHS = ("qwen35", "qwen35moe")  # dense and MoE Qwen3.5/3.6

ARCHITECTURE = "general.architecture"
ALIGNMENT = "general.alignment"
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT, when general.alignment is absent

# Per-architecture keys: format with the architecture, e.g. BLOCK_COUNT.format(arch="qwen35").
BLOCK_COUNT = "{arch}.block_count"  # trunk blocks plus MTP blocks
NEXTN_PREDICT_LAYERS = "{arch}.nextn_predict_layers"  # MTP blocks, the last ones
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # one bool per block
FULL_ATTENTION_INTERVAL = "{arch}.full_attention_interval"  # when the array is absent
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default for qwen35 (llama-model.cpp)

# A split GGUF: part 0 holds every KV pair plus these three; the other parts hold only
# these three and their tensors. llama.cpp must be given part 0 and finds the others by
# name (SPLIT_NAME), in the same directory.
SPLIT_NO = "split.no"  # uint16, 0-based index of this part
SPLIT_COUNT = "split.count"  # uint16, number of parts
SPLIT_TENSORS_COUNT = "split.tensors.count"  # int32, tensors in all parts together
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT)
SPLIT_NAME = "{prefix}-{number:05d}-of-{count:05d}.gguf"  # number = index + 1
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")


class Reader(Protocol):
    fields: Any  # Mapping[str, field with .contents()]


class SplitError(ValueError):
    """The parts of a split GGUF do not fit together; the message names the part and the fix."""


def scalar(reader: Reader, key: str, default: Any = None) -> Any:
    """The value of metadata key `key`, or `default` where the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: Reader) -> str:
    """general.architecture, "" where it is missing."""
    return str(scalar(reader, ARCHITECTURE, ""))


def recurrent_flags(reader: Reader, arch: str, n_trunk: int) -> list[bool]:
    """Which trunk layers are recurrent (Gated DeltaNet) rather than full attention.

    From the per-block array where present, else from the full-attention interval as
    llama.cpp derives it: every interval-th layer is full attention.
    """
    flags = scalar(reader, RECURRENT_LAYERS.format(arch=arch))
    if flags is not None:
        return [bool(x) for x in list(flags)[:n_trunk]]
    interval = int(scalar(reader, FULL_ATTENTION_INTERVAL.format(arch=arch), DEFAULT_FULL_ATTENTION_INTERVAL))
    return [(i + 1) % interval != 0 for i in range(n_trunk)]


# ---------------------------------------------------------------------------- split files


def split_position(reader: Reader) -> tuple[int, int]:
    """(index, count) of this part of a split GGUF; (0, 1) for a file that is not split."""
    count = int(scalar(reader, SPLIT_COUNT, 1) or 1)  # gguf-split --merge leaves split.count = 0
    return (int(scalar(reader, SPLIT_NO, 0)), count) if count > 1 else (0, 1)


def split_name(prefix: str, index: int, count: int) -> str:
    """The file name of part `index` (0-based) of `count`, as llama.cpp looks for it."""
    return SPLIT_NAME.format(prefix=prefix, number=index + 1, count=count)


def parse_split_name(name: str) -> tuple[str, int, int] | None:
    """(prefix, index, count) for a name like `model-00002-of-00005.gguf`, else None."""
    m = _SPLIT_NAME.match(name)
    if m is None or not 0 < int(m["number"]) <= int(m["count"]):
        return None
    return m["prefix"], int(m["number"]) - 1, int(m["count"])


def split_paths(path: Path, index: int, count: int) -> list[Path]:
    """The names of every part of the split GGUF that `path` is part `index` of, in order.

    Raises SplitError when `path`'s name does not say where the other parts are.
    """
    parsed = parse_split_name(path.name)
    if parsed is None or parsed[1:] != (index, count):
        raise SplitError(
            f"{str(path)!r} is part {index + 1} of a {count}-file split GGUF, but its name does not end in "
            f"{split_name('', index, count)!r}, so its other parts cannot be found; keep the names "
            "llama-gguf-split gave the parts")
    return [path.with_name(split_name(parsed[0], i, count)) for i in range(count)]


def part_paths(path: Path, index: int, count: int) -> list[Path]:
    """split_paths(), after checking that every part is there (SplitError if not)."""
    paths = split_paths(path, index, count)
    missing = [repr(str(p)) for p in paths if not p.is_file()]
    if missing:
        raise SplitError(
            f"{str(path)!r} is part {index + 1} of a {count}-file split GGUF, but {len(missing)} part(s) are "
            f"missing: {', '.join(missing)}; put every part in the same directory")
    return paths


def check_parts(readers: Sequence[Reader], paths: Sequence[Path]) -> None:
    """The parts say they are parts 1..n of the same n, and hold split.tensors.count tensors."""
    count = len(readers)
    for i, (reader, path) in enumerate(zip(readers, paths)):
        if split_position(reader) != (i, count):
            index, n = split_position(reader)
            raise SplitError(
                f"{str(path)!r} should be part {i + 1} of {count} by its name, but its header says part "
                f"{index + 1} of {n}; the parts come from different splits: download them again")
    names = [t.name for r in readers for t in r.tensors]  # type: ignore[attr-defined]
    want = scalar(readers[0], SPLIT_TENSORS_COUNT)
    if want is not None and int(want) != len(names):
        raise SplitError(
            f"{str(paths[0])!r} and its {count - 1} other parts hold {len(names)} tensors, but {SPLIT_TENSORS_COUNT} says "
            f"{int(want)}; a part is from another split or incomplete: download them again")
    seen = Counter(names)
    if len(seen) != len(names):
        twice = next(n for n in names if seen[n] > 1)  # the first in file order
        raise SplitError(f"{str(paths[0])!r} and its {count - 1} other parts hold tensor {twice!r} more than once; "
                         "a part is from another split: download them again")
