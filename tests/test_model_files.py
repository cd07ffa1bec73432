"""GGUFs with a valid header but missing tensors: refused with a message, never a crash.

llama.cpp takes a file without ``blk.0.attn_norm.weight`` for an MTP-only file and then
requires no trunk tensor at all; loading one used to kill the process with SIGSEGV inside
``llama_init_from_model``. These run real processes, so a crash shows as its signal.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader
from graft.helpers import write_subset

import pymtp
from pymtp.gguf_info import ModelFileError

MTP_ONLY_MESSAGE = "has no trunk layers, only an MTP block; this is an MTP-only file: graft it into its base with gguf_graft"


@pytest.fixture(scope="module")
def mtp_only_path(dense_path, tmp_path_factory) -> Path:
    """Like the MTP-only GGUFs gguf_graft takes as a source: globals plus the MTP block."""
    last = int(GGUFReader(dense_path).fields["qwen35.block_count"].contents()) - 1
    return write_subset(dense_path, tmp_path_factory.mktemp("mtp-only") / "mtp-only.gguf",
                        lambda n: not n.startswith("blk.") or n.startswith(f"blk.{last}."))


def _pymtp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pymtp.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_mtp_only_file_refused_by_load(mtp_only_path):
    with pytest.raises(ModelFileError, match=MTP_ONLY_MESSAGE):
        pymtp.load(mtp_only_path)


@pytest.mark.parametrize("spec", ["mtp", "none"])
def test_generate_on_mtp_only_file_exits_with_message(mtp_only_path, spec):
    p = _pymtp("generate", str(mtp_only_path), "--prompt", "hi", "-n", "4", "--spec", spec)
    assert p.returncode == 1, p.stderr          # was -11 (SIGSEGV) / 139 from a shell
    assert p.stderr.startswith(f"Error: {str(mtp_only_path)!r} {MTP_ONLY_MESSAGE}")
    assert "Traceback" not in p.stderr


def test_serve_on_mtp_only_file_exits_before_listening(mtp_only_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _pymtp("serve", str(mtp_only_path), "--port", str(port), timeout=60)  # ran until killed before
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith(f"Error: {str(mtp_only_path)!r} {MTP_ONLY_MESSAGE}")


def test_hole_in_trunk_names_the_tensor(dense_path, tmp_path):
    p = write_subset(dense_path, tmp_path / "hole.gguf", lambda n: n != "blk.1.ssm_out.weight")
    with pytest.raises(ModelFileError) as exc:
        pymtp.load(p)
    assert str(exc.value) == (f"{str(p)!r} is missing 1 tensor(s) the model needs (blk.1.ssm_out.weight); "
                              "the file is incomplete: convert or download it again")
    r = _pymtp("generate", str(p), "--prompt", "hi", "-n", "4", "--spec", "none")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "is missing 1 tensor(s) the model needs (blk.1.ssm_out.weight)" in r.stderr


def test_missing_mtp_tensor_is_a_message_not_a_traceback(dense_path, tmp_path):
    p = write_subset(dense_path, tmp_path / "no-eh-proj.gguf", lambda n: "nextn.eh_proj" not in n)
    r = _pymtp("generate", str(p), "--prompt", "hi", "-n", "4")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"Error: llama.cpp could not load {str(p)!r}")
    assert "nextn.eh_proj.weight' not found" in r.stderr
