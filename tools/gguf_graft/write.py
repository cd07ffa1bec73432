"""Step 5: write the output GGUF in one streaming pass.

Header, KV pairs and tensor infos first (every offset is known from the plan), then the
data: base tensors copied in chunks straight from BASE (copy_file_range where the kernel
has it, pread/write otherwise), MTP tensors encoded piece by piece. Memory stays flat
whatever the size of BASE.

The output appears under its name only when complete: it is written to a temporary file
in the output directory and renamed at the end, and any error, KeyboardInterrupt
included, removes the temporary file.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from gguf import GGUF_MAGIC, GGUF_VERSION
from tqdm import tqdm

from .errors import GraftError
from .plan import Plan, PlannedTensor

COPY_CHUNK = 16 << 20
_NO_FAST_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}


def check_out(out: Path | None, inputs: Iterable[Path], force: bool) -> None:
    """Refuse an OUT that is one of the inputs, or that exists without --force."""
    if out is None:
        raise GraftError("OUT is required (-o OUT.gguf), unless it is a dry run")
    for path in inputs:
        if _same_file(out, path):
            raise GraftError(f"OUT {str(out)!r} is the input {str(path)!r}; gguf_graft never modifies "
                             "its inputs: choose another -o")
    if out.is_dir():
        raise GraftError(f"OUT {str(out)!r} is a directory; give a file name, e.g. -o model-mtp.gguf")
    if not out.parent.is_dir():
        raise GraftError(f"the directory of OUT {str(out)!r} does not exist")
    refuse_non_file(out)
    if out.exists() and not force:
        raise GraftError(f"OUT {str(out)!r} exists; pass --force to overwrite it")


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def refuse_non_file(out: Path) -> None:
    """Refuse an existing OUT that is not a regular file.

    The rename at the end would put a regular file in place of whatever OUT is: with
    ``-o /dev/null --force`` as root that replaced the device node itself.
    """
    try:
        mode = os.stat(out).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
    raise GraftError(f"OUT {str(out)!r} is {kind}; gguf_graft writes regular files only and never "
                     "replaces anything else: choose a file path for -o")


def write_gguf(plan: Plan, out: Path, progress: bool = True) -> None:
    """Write `plan` to `out` through a temporary file in the same directory."""
    head = header(plan)
    need = len(head) + sum(t.nbytes + _padding(t.nbytes, plan.base.alignment) for t in plan.tensors)
    if (free := shutil.disk_usage(out.parent).free) < need:
        raise GraftError(f"OUT needs {need / 2**30:.2f} GiB but {str(out.parent)!r} has {free / 2**30:.2f} GiB free")
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    try:
        total = sum(t.nbytes for t in plan.tensors)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="Writing",
                  disable=not progress) as bar:
            with open(plan.base.path, "rb") as base:
                _write_all(fd, head)
                copier = _Copier(base.fileno(), fd)
                for t in plan.tensors:
                    _write_tensor(t, fd, copier, bar.update)
                    _write_all(fd, bytes(_padding(t.nbytes, plan.base.alignment)))
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; give it a normal file's mode
        refuse_non_file(out)  # again: something may have appeared at OUT while we wrote
        os.replace(tmp, out)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def header(plan: Plan) -> bytes:
    """Everything before the tensor data, padded to the data alignment."""
    align = plan.base.alignment
    parts = [struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(plan.tensors), len(plan.metadata.kv))]
    parts += plan.metadata.kv
    offset = 0
    for t in plan.tensors:
        name = t.name.encode("utf-8")
        info = struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.qtype, offset)  # dims, type, offset
        parts.append(struct.pack("<Q", len(name)) + name + info)
        offset += t.nbytes + _padding(t.nbytes, align)
    head = b"".join(parts)
    return head + bytes(_padding(len(head), align))


def _write_tensor(t: PlannedTensor, fd: int, copier: _Copier, update: Callable[[int], object]) -> None:
    if t.file_range is not None:
        copier.copy(*t.file_range, update)
        return
    assert t.produce is not None
    written = 0
    for piece in t.produce():
        buf = memoryview(np.ascontiguousarray(piece)).cast("B")
        _write_all(fd, buf)
        written += len(buf)
        update(len(buf))
    if written != t.nbytes:  # a bug in a recipe, not a user error
        raise RuntimeError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")


class _Copier:
    """Copies byte ranges of BASE into OUT, in the kernel when it can."""

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst = src, dst
        self.fast = hasattr(os, "copy_file_range")

    def copy(self, offset: int, size: int, update: Callable[[int], object]) -> None:
        end = offset + size
        while offset < end:
            n = self._chunk(offset, min(COPY_CHUNK, end - offset))
            if n == 0:
                raise GraftError(f"BASE ends at byte {offset}, inside its tensor data: the file is truncated")
            offset += n
            update(n)

    def _chunk(self, offset: int, n: int) -> int:
        if self.fast:
            try:
                return os.copy_file_range(self.src, self.dst, n, offset)
            except OSError as e:
                if e.errno not in _NO_FAST_COPY:
                    raise
                self.fast = False
        data = os.pread(self.src, n, offset)
        _write_all(self.dst, data)
        return len(data)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _padding(n: int, align: int) -> int:
    return -n % align


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
