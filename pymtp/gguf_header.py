"""A GGUF's header -- its metadata and tensor table -- read without building its arrays.

gguf-py's GGUFReader makes a numpy view for every item of every metadata array. A model
with Qwen3.5's vocabulary has four arrays of 248,320 items (tokens, scores, types and,
on real checkpoints, about as many merges): reading its header took 10-15 s of
``pymtp.load`` on the 248k twin of the demo model. This reader walks the header once
with ``struct``, keeps an array as its item type, count and byte span, and decodes one
only when asked. What it reads of a header matches GGUFReader's (tests/test_gguf_header.py
compares them key by key and tensor by tensor).

It refuses what GGUFReader refuses -- a wrong magic or version, a key or tensor name
given twice, an unknown value or tensor type, a bad ``general.alignment`` -- and, like
gguf_bounded, any read past the end of the file or an array longer than any model's
metadata. Every refusal is a ValueError saying what was wrong.

Standard library only, plus gguf's table of tensor type sizes (imported on first use).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)     # what llama.cpp and gguf-py read
MAX_ARRAY = 1 << 24   # metadata array items; vocabularies hold a few hundred thousand
MAX_DIMS = 4          # GGML_MAX_DIMS: llama.cpp refuses a tensor with more
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # GGUF value types that are not fixed-size scalars
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
UINT32 = 4


@dataclass(frozen=True)
class Field:
    """One metadata value: a scalar, a string, or an array kept as (item type, count, span)."""
    buf: Any               # the file's bytes (an mmap)
    type: int              # GGUF value type
    offset: int            # where the value starts
    item_type: int = -1    # an array's item type
    count: int = 1         # an array's item count

    def contents(self) -> Any:
        """The value as gguf-py's ``ReaderField.contents()`` gives it: a Python scalar, a
        str, or a list of them."""
        if self.type != ARRAY:
            return _value(self.buf, self.type, self.offset)
        if self.item_type == STRING:
            return [s.decode("utf-8") for s in self.raw_strings()]
        if self.item_type == ARRAY:
            raise ValueError("an array of arrays cannot be read as one list")
        fmt = SCALARS[self.item_type]
        return list(struct.unpack_from(f"<{self.count}{fmt}", self.buf, self.offset + 12))

    def raw_strings(self) -> list[bytes]:
        """An array of strings' items, undecoded."""
        if self.type != ARRAY or self.item_type != STRING:
            raise ValueError("not an array of strings")
        buf, pos, out = self.buf, self.offset + 12, []
        for _ in range(self.count):
            n = _U64.unpack_from(buf, pos)[0]
            out.append(bytes(buf[pos + 8:pos + 8 + n]))
            pos += 8 + n
        return out


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: int
    shape: tuple[int, ...]   # GGUF order: the fastest-moving dimension first
    n_elements: int
    n_bytes: int
    data_offset: int         # from the start of the file


@dataclass
class Header:
    """The ``fields`` and ``tensors`` of a GGUF: what gguf_facts' functions read."""
    path: Path
    version: int
    fields: dict[str, Field]
    tensors: list[Tensor]
    data_offset: int


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def read_header(path: str | Path) -> Header:
    """Parse `path`'s header; ValueError on anything GGUFReader would refuse."""
    p = Path(path)
    with open(p, "rb") as f:
        if p.stat().st_size == 0:
            raise ValueError("the file is empty")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _Walk(buf).header(p)


class _Walk:
    """A cursor over the file's bytes that refuses to pass its end."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.end:
            raise ValueError(f"it ends at byte {self.end} but needs bytes up to {start + n}")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def name(self) -> str:
        n = self.u64()
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8")

    def header(self, path: Path) -> Header:
        start = self.take(4)
        if self.buf[start:start + 4] != MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self.u32()
        if version not in VERSIONS:
            raise ValueError(f"it is GGUF version {version}; versions {VERSIONS} can be read"
                             + (" (a big-endian file?)" if version & 0xFFFF == 0 else ""))
        n_tensors, n_kv = self.u64(), self.u64()
        fields: dict[str, Field] = {}
        for _ in range(n_kv):
            at = self.pos
            key = self.name()
            if key in fields:
                raise ValueError(f"key {key!r} is given twice (the second at byte {at})")
            fields[key] = self.field()
        infos = [self.tensor_info() for _ in range(n_tensors)]   # each takes 24 bytes or more
        align = fields.get("general.alignment")
        alignment = DEFAULT_ALIGNMENT
        if align is not None:
            if align.type != UINT32:
                raise ValueError("general.alignment is not a uint32")
            alignment = align.contents()
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment is {alignment}, not a power of two")
        data = -(-self.pos // alignment) * alignment
        return Header(path, version, fields, _tensors(infos, data), data)

    def field(self) -> Field:
        vtype = self.u32()
        at = self.pos
        if vtype != ARRAY:
            self.skip(vtype)
            return Field(self.buf, vtype, at)
        item, count = self.u32(), self.u64()
        self.pos = at
        self.skip(ARRAY)
        return Field(self.buf, ARRAY, at, item, count)

    def skip(self, vtype: int, depth: int = 0) -> None:
        """Move past one value of type `vtype`."""
        if vtype in SCALARS:
            self.take(struct.calcsize(SCALARS[vtype]))
        elif vtype == STRING:
            self.take(self.u64())
        elif vtype == ARRAY:
            if depth > 1:
                raise ValueError(f"arrays are nested more than twice at byte {self.pos}")
            item, count = self.u32(), self.u64()
            if item not in SCALARS and item not in (STRING, ARRAY):
                raise ValueError(f"an array's item type is {item}, not a GGUF value type")
            least = struct.calcsize(SCALARS[item]) if item in SCALARS else 8 if item == STRING else 12
            if count > MAX_ARRAY or count * least > self.end - self.pos:
                raise ValueError(f"the array at byte {self.pos - 12} claims {count} items, more than "
                                 "the file can hold")
            if item in SCALARS:
                self.take(count * least)
            elif item == STRING:
                self.strings(count)
            else:
                for _ in range(count):
                    self.skip(item, depth + 1)
        else:
            raise ValueError(f"value type {vtype} at byte {self.pos - 4} is not a GGUF value type")

    def strings(self, count: int) -> None:
        """Move past `count` strings: the loop that must stay tight (a vocabulary's)."""
        buf, pos, end, u64 = self.buf, self.pos, self.end, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"it ends at byte {end} but needs bytes up to {pos + 8}")
            pos += 8 + u64(buf, pos)[0]
        self.take(pos - self.pos)   # refuses a last string that runs past the end

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.name()
        n_dims = self.u32()
        if n_dims > MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions; GGUF tensors have at most {MAX_DIMS}")
        shape = tuple(self.u64() for _ in range(n_dims))
        return name, shape, self.u32(), self.u64()


def _tensors(infos: list[tuple[str, tuple[int, ...], int, int]], data: int) -> list[Tensor]:
    sizes, out, seen = _type_sizes(), [], set()
    for name, shape, ttype, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name!r} is given twice")
        seen.add(name)
        if ttype not in sizes:
            raise ValueError(f"tensor {name!r} has type {ttype}, not a ggml tensor type")
        block, size = sizes[ttype]
        n = 1
        for d in shape:
            n *= d
        out.append(Tensor(name, ttype, shape, n, n * size // block, data + offset))
    return out


def _value(buf: Any, vtype: int, at: int) -> Any:
    if vtype == STRING:
        n = _U64.unpack_from(buf, at)[0]
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8")
    return struct.unpack_from("<" + SCALARS[vtype], buf, at)[0]


@cache
def _type_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (block size, bytes a block), from gguf's table."""
    from gguf.constants import GGML_QUANT_SIZES   # imported late: gguf is slow to import

    return {int(t): v for t, v in GGML_QUANT_SIZES.items()}
