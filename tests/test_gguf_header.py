"""pymtp.gguf_header against gguf-py's GGUFReader: the same header, the same refusals and why."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from gguf import GGUFReader

from pymtp.gguf_bounded import BoundedReader
from pymtp.gguf_header import MAX_ARRAY, read_header

DEMO = Path(__file__).resolve().parent.parent / "pymtp" / "data" / "qwen35-tiny-mtp-q8_0.gguf"


@pytest.fixture(params=["dense", "moe", "demo"])
def model(request, dense_path, moe_path) -> Path:
    return {"dense": dense_path, "moe": moe_path, "demo": DEMO}[request.param]


def test_every_key_and_tensor_reads_as_gguf_py_reads_it(model):
    ours, theirs = read_header(model), GGUFReader(model)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        assert ours.fields[k].contents() == theirs.fields[k].contents(), k
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, t.shape, t.n_elements, t.n_bytes, t.data_offset) for t in ours.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.n_elements, t.n_bytes, t.data_offset)
        for t in theirs.tensors]
    tokens = theirs.fields["tokenizer.ggml.tokens"]
    assert ours.fields["tokenizer.ggml.tokens"].raw_strings() == [tokens.parts[i].tobytes() for i in tokens.data]


# ---------------------------------------------------------------------------- refusals

def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: int, value: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + value


def gguf(kvs: list[bytes], tensors: list[bytes] = (), version: int = 3, magic: bytes = b"GGUF",
         data: bytes = b"\0" * 96) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % 32) + data


def tensor(name: str, dims: tuple[int, ...], ttype: int = 0, offset: int = 0) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ttype, offset)


NAME = kv("general.name", 8, s("m"))
TOKENS = kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + s("a") + s("bb") + s("c"))


def test_a_hand_made_header_reads_whole(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf([NAME, TOKENS, kv("x.f", 6, struct.pack("<f", 0.1)),
                           kv("x.arr", 9, struct.pack("<IQ3i", 5, 3, -1, 0, 7))],
                          [tensor("t", (4, 2), 0), tensor("u", (32,), 8, 32)]))
    h, g = read_header(path), GGUFReader(path)
    assert h.fields["tokenizer.ggml.tokens"].contents() == ["a", "bb", "c"]
    assert h.fields["x.arr"].contents() == [-1, 0, 7]
    assert h.fields["x.f"].contents() == g.fields["x.f"].contents() == struct.unpack("<f", struct.pack("<f", 0.1))[0]
    assert [(t.n_bytes, t.data_offset) for t in h.tensors] == [(32, h.data_offset), (34, h.data_offset + 32)]
    assert [(t.n_bytes, t.data_offset) for t in h.tensors] == [(t.n_bytes, t.data_offset) for t in g.tensors]


BAD = {
    "magic": (gguf([NAME], magic=b"GGUX"), "GGUF magic invalid"),
    "version": (gguf([NAME], version=1), "it is GGUF version 1; versions (2, 3) can be read"),
    "key twice": (gguf([NAME, NAME]), "key 'general.name' is given twice"),
    "value type": (gguf([kv("a", 13, b"\0" * 8)]), "value type 13 at byte"),
    "item type": (gguf([kv("a", 9, struct.pack("<IQ", 13, 1))]), "an array's item type is 13"),
    "long array": (gguf([kv("a", 9, struct.pack("<IQ", 4, MAX_ARRAY + 1))]), f"claims {MAX_ARRAY + 1} items"),
    "array past end": (gguf([kv("a", 9, struct.pack("<IQ", 4, 100))]), "claims 100 items"),
    "string past end": (gguf([kv("a", 8, struct.pack("<Q", 1 << 40))]), "but needs bytes up to"),
    "strings past end": (gguf([kv("a", 9, struct.pack("<IQ", 8, 3) + s("a") + struct.pack("<Q", 1 << 40))]),
                         "but needs bytes up to"),
    "tensor twice": (gguf([NAME], [tensor("t", (4,)), tensor("t", (4,))]), "tensor 't' is given twice"),
    "tensor type": (gguf([NAME], [tensor("t", (4,), 99)]), "tensor 't' has type 99, not a ggml tensor type"),
    "dims": (gguf([NAME], [tensor("t", (1, 1, 1, 1, 1))]), "tensor 't' has 5 dimensions"),
    "alignment": (gguf([kv("general.alignment", 4, struct.pack("<I", 24))]), "general.alignment is 24"),
    "alignment type": (gguf([kv("general.alignment", 5, struct.pack("<i", 32))]), "not a uint32"),
    "too many tensors": (b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1) + NAME, "but needs bytes up to"),
}


@pytest.mark.parametrize("case", BAD)
def test_what_gguf_py_refuses_is_refused_with_the_reason(case, tmp_path):
    data, message = BAD[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_header(path)
    if case != "dims":   # gguf-py reads 5 dimensions; llama.cpp refuses them
        with pytest.raises((ValueError, KeyError, IndexError)):
            BoundedReader(path, "r")   # the reader gguf_info used before


def test_an_empty_file_is_refused(tmp_path):
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="the file is empty"):
        read_header(tmp_path / "e.gguf")
