"""The header check before llama.cpp sees a file, on split GGUFs (gguf only, no llama.cpp)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader

from pymtp.gguf_facts import parse_split_name, split_name
from pymtp.gguf_info import ModelFileError, inspect
from pymtp.testing.gguf_files import split_gguf


@pytest.fixture(scope="module")
def parts(dense_path, tmp_path_factory) -> list[Path]:
    """The dense fixture (with its MTP block) in three parts; its MTP block in the last."""
    n = len(GGUFReader(dense_path).tensors)
    return split_gguf(dense_path, tmp_path_factory.mktemp("split") / "m.gguf", [20, 20, n - 40])


@pytest.mark.parametrize("name, parsed", [
    ("m-00002-of-00005.gguf", ("m", 1, 5)),
    ("Qwen3.5-397B-A17B-Q4_K_M-00001-of-00006.gguf", ("Qwen3.5-397B-A17B-Q4_K_M", 0, 6)),
    ("m-00006-of-00005.gguf", None),  # past the last part
    ("m-00000-of-00005.gguf", None),  # parts count from 1
    ("m-0001-of-00005.gguf", None),  # five digits, as llama.cpp writes them
    ("m-00001-of-00005.bin", None),
])
def test_split_names(name, parsed):
    assert parse_split_name(name) == parsed
    if parsed is not None:
        assert split_name(*parsed) == name


def test_first_part_describes_the_whole_model(parts, dense_path):
    info, whole = inspect(parts[0]), inspect(dense_path)
    assert info.path == parts[0]
    assert (info.arch, info.block_count, info.n_nextn, info.n_recurrent_layers) == ("qwen35", 5, 1, 3)
    assert (info.block_count, info.n_nextn, info.recurrent_bytes) == (whole.block_count, whole.n_nextn,
                                                                      whole.recurrent_bytes)


def test_a_later_part_names_the_first(parts):
    with pytest.raises(ModelFileError) as e:
        inspect(parts[2])
    assert str(e.value) == (f"{str(parts[2])!r} is part 3 of a 3-file split GGUF; load its first part, "
                            f"{str(parts[0])!r} (llama.cpp reads the other parts from there)")


def test_a_missing_part_is_named(parts, tmp_path):
    first = Path(shutil.copy(parts[0], tmp_path))
    shutil.copy(parts[2], tmp_path)
    with pytest.raises(ModelFileError) as e:
        inspect(first)
    assert str(e.value) == (f"{str(first)!r} is part 1 of a 3-file split GGUF, but 1 part(s) are missing: "
                            f"{str(tmp_path / parts[1].name)!r}; put every part in the same directory")


def test_a_truncated_part_is_named(parts, tmp_path):
    copies = [Path(shutil.copy(p, tmp_path)) for p in parts]
    copies[1].write_bytes(parts[1].read_bytes()[:-1000])
    with pytest.raises(ModelFileError, match=re.escape(f"{str(copies[1])!r} is truncated")):
        inspect(copies[0])
