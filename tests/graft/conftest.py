"""Fixtures of the graft tests: the synthetic models and their MTP blocks in HF form.

They need gguf, numpy and safetensors only, never llama.cpp: the graft tool runs
without the pymtp runtime, and so do its tests (only the ones that run a grafted file
are marked `needs_llama`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
from gguf import GGUFReader
from safetensors.numpy import save_file

from pymtp.testing.fixtures import fixture_path
from pymtp.testing.gguf_files import split_gguf

from .helpers import export_mtp_hf


@pytest.fixture(scope="session")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """fx(kind="dense", with_mtp=True, **knobs): a synthetic fixture GGUF, written once a session.

    Shared by every test: pass it to gguf_graft as an input only (never as OUT).
    """
    cache = tmp_path_factory.mktemp("graft-fixtures")

    def path(kind: str = "dense", with_mtp: bool = True, **knobs: Any) -> Path:
        return fixture_path(kind, with_mtp=with_mtp, cache_dir=cache, **knobs)

    return path


@pytest.fixture(scope="session")
def hf_mtp(fx: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """hf_mtp(kind="dense"): the fixture's MTP block as an HF safetensors file (`mtp.` names)."""
    directory = tmp_path_factory.mktemp("graft-hf")

    def path(kind: str = "dense") -> Path:
        out = directory / f"mtp-{kind}.safetensors"
        if not out.exists():
            save_file(export_mtp_hf(fx(kind)), out)
        return out

    return path


@pytest.fixture(scope="session")
def split_base(fx: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[Path]]:
    """split_base(kind="dense", with_mtp=False, counts=None): the fixture split in three parts
    (`m-00001-of-00003.gguf`, ...; a third of its tensors each, unless `counts`)."""
    made: dict[tuple[Any, ...], list[Path]] = {}

    def parts(kind: str = "dense", with_mtp: bool = False, counts: tuple[int, ...] | None = None) -> list[Path]:
        key = (kind, with_mtp, counts)
        if key not in made:
            src = fx(kind, with_mtp=with_mtp)
            n = len(GGUFReader(src).tensors)
            made[key] = split_gguf(src, tmp_path_factory.mktemp("split") / "m.gguf",
                                   counts or (n // 3, n // 3, n - 2 * (n // 3)))
        return made[key]

    return parts
