"""Step 5: write the output GGUF, one file or the parts of a split, in one streaming pass.

Header, KV pairs and tensor infos first (every offset is known from the plan), then the
data: base tensors copied in chunks straight from BASE's files (copy_file_range where the
kernel has it, pread/write otherwise), MTP tensors encoded piece by piece. Memory stays
flat whatever the size of BASE.

The output appears under its names only when complete: every file is written to a
temporary file in the output directory, and they are renamed only when all are written;
any error, KeyboardInterrupt and SIGTERM/SIGHUP (cli.py) included, removes the temporary
files and any part already renamed, so no incomplete set is left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from gguf import GGUF_MAGIC, GGUF_VERSION
from tqdm import tqdm

from pymtp.gguf_facts import parse_split_name, split_name

from .errors import GraftError
from .interrupts import raise_if_interrupted
from .report import size_text
from .plan import Plan, PlannedTensor, PlanPart

COPY_CHUNK = 16 << 20
_NO_FAST_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}


def output_paths(out: Path, n_parts: int) -> list[Path]:
    """OUT itself for one file; for `n_parts` parts, their names as llama.cpp looks for them.

    `-o model-mtp.gguf` and `-o model-mtp-00001-of-00005.gguf` both give
    model-mtp-00001-of-00005.gguf ... model-mtp-00005-of-00005.gguf.
    """
    if n_parts == 1:
        return [out]
    parsed = parse_split_name(out.name)
    if parsed is not None and parsed[2] != n_parts:
        raise GraftError(
            f"OUT {str(out)!r} names a part of a {parsed[2]}-file split, but the output has {n_parts} parts, "
            f"as BASE has: name it {split_name(parsed[0], 0, n_parts)!r}, or pass --no-split for one file")
    prefix = parsed[0] if parsed is not None else out.name.removesuffix(".gguf")
    return [out.with_name(split_name(prefix, i, n_parts)) for i in range(n_parts)]


def check_out(outs: list[Path], inputs: Iterable[Path], force: bool) -> None:
    """Refuse an output file that is one of the inputs, or that exists without --force."""
    inputs = list(inputs)
    for out in outs:
        for path in inputs:
            if _same_file(out, path):
                raise GraftError(f"OUT {str(out)!r} is the input {str(path)!r}; gguf_graft never modifies "
                                 "its inputs: choose another -o")
        if out.is_dir():
            raise GraftError(f"OUT {str(out)!r} is a directory; give a file name, e.g. -o model-mtp.gguf")
        if not out.parent.is_dir():
            what = "is not a directory" if out.parent.exists() else "does not exist"
            raise GraftError(f"the directory of OUT {str(out)!r}, {str(out.parent)!r}, {what}")
        if _read_only(out.parent):
            raise GraftError(f"the directory of OUT {str(out)!r} is on a read-only file system; choose another -o")
        if not os.access(out.parent, os.W_OK | os.X_OK):     # a dry run said all was well, then the write failed
            raise GraftError(f"the directory of OUT {str(out)!r} is not one this user can write in; choose "
                             "another -o")
        refuse_non_file(out)
        if os.path.lexists(out) and not force:     # a link to nothing too: the write would replace it
            raise GraftError(f"OUT {str(out)!r} exists; pass --force to overwrite it")


def _read_only(directory: Path) -> bool:
    """Whether ``directory`` is on a file system mounted read-only (os.access then says
    "not writable", which reads as this user's permissions)."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


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


def needed_bytes(plan: Plan) -> int:
    """The bytes the output files of ``plan`` take, headers and padded data."""
    return sum(len(header(part)) + _data_size(part) for part in plan.parts)


def check_room(plan: Plan, outs: list[Path]) -> None:
    """Refuse OUT where its folder has less free space than the files need (a dry run
    checks it too)."""
    need = needed_bytes(plan)
    if (free := shutil.disk_usage(outs[0].parent).free) < need:
        # exact bytes beside the rounded size: two sizes a hair apart read alike once rounded
        raise GraftError(f"OUT needs {need:,} bytes ({size_text(need)}) but {str(outs[0].parent)!r} has {free:,} "
                         f"bytes ({size_text(free)}) free; free {need - free:,} bytes there or write OUT elsewhere")


def write_gguf(plan: Plan, outs: list[Path], progress: bool = True) -> None:
    """Write part i of `plan` to `outs[i]`, each through a temporary file in its directory."""
    heads = [header(part) for part in plan.parts]
    check_room(plan, outs)
    temps: list[str] = []
    placed: list[Path] = []
    kept: list[tuple[Path, str]] = []   # (OUT, its old file set aside) under --force
    committed = False                   # the new files in place: nothing left to undo
    try:
        total = sum(t.nbytes for t in plan.tensors)
        with contextlib.ExitStack() as stack:
            bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                           desc="Writing", disable=None if progress else True))
            bases = [_Base(stack.enter_context(open(p.path, "rb")).fileno(), p.path) for p in plan.base.parts]
            for part, head, out in zip(plan.parts, heads, outs):
                # a name near the 255-byte limit took the prefix past it: keep the prefix short
                fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name[:64]}.", suffix=".part")
                temps.append(tmp)
                try:
                    _write_part(fd, part, head, bases, bar.update)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; give it a normal file's mode
        raise_if_interrupted()      # a Ctrl-C numpy swallowed while the parts were written
        # The swap is a few renames: a signal in it is held to its end (a Ctrl-C between
        # two renames left a hidden .old copy of OUT behind), then undoes it as any error does.
        with _signals_held() as caught:
            for out in outs:
                refuse_non_file(out)  # again: something may have appeared at OUT while we wrote
            # Old parts are set aside, not overwritten, until every new one is in place: a rename
            # failing halfway then puts them back instead of leaving old and new parts mixed.
            for out in outs:
                if os.path.lexists(out):
                    fd, aside = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name[:64]}.", suffix=".old")
                    os.close(fd)
                    try:
                        os.replace(out, aside)
                    except BaseException:
                        os.unlink(aside)
                        raise
                    kept.append((out, aside))
            # The first part last: llama.cpp is given that one, so it never finds it without the rest.
            for tmp, out in reversed(list(zip(temps, outs))):
                os.replace(tmp, out)
                placed.append(out)
            if not caught:
                _commit(kept)
                committed, kept, placed, temps = True, [], [], []
        # a held signal whose handler let the run go on (one ignored): the swap stands
        _commit(kept)
    except BaseException as exc:
        if committed and isinstance(exc, KeyboardInterrupt):
            exc.out_written = True      # the Ctrl-C came while the old copies went: OUT is whole
        with _signals_held():       # a second Ctrl-C does not cut the clean-up short
            for path in [*temps, *placed]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            for out, aside in kept:
                with contextlib.suppress(OSError):  # else it stays beside OUT, under the hidden name
                    os.replace(aside, out)
        if isinstance(exc, OSError) and exc.filename is None:     # a write's error names no file
            raise GraftError(f"writing OUT in {str(outs[0].parent)!r} failed: {exc.strerror or exc}; nothing was "
                             "left there" + (f" (free some space: the files need {needed_bytes(plan):,} bytes)"
                                             if exc.errno == errno.ENOSPC else "")) from exc
        raise


def _commit(kept: list[tuple[Path, str]]) -> None:
    """Remove the old copies set aside: the new files stand."""
    for _, aside in kept:
        os.unlink(aside)


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """SIGINT, SIGTERM and SIGHUP noted, not acted on, until the block ends (the list says
    which came); then the first is raised again for its own handler. Only the main thread
    can set handlers: elsewhere nothing is held."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in sigs}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def header(part: PlanPart) -> bytes:
    """Everything before the tensor data of one output file, padded to its data alignment."""
    align = part.alignment
    parts = [struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(part.tensors), len(part.metadata.kv))]
    parts += part.metadata.kv
    offset = 0
    for t in part.tensors:
        name = t.name.encode("utf-8")
        info = struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.qtype, offset)  # dims, type, offset
        parts.append(struct.pack("<Q", len(name)) + name + info)
        offset += t.nbytes + _padding(t.nbytes, align)
    head = b"".join(parts)
    return head + bytes(_padding(len(head), align))


@dataclass(frozen=True)
class _Base:
    """An open file of BASE: where copied tensors come from."""

    fd: int
    path: Path


def _write_part(fd: int, part: PlanPart, head: bytes, bases: list[_Base], update: Callable[[int], object]) -> None:
    _write_all(fd, head)
    copier = _Copier(fd)
    for t in part.tensors:
        _write_tensor(t, fd, copier, bases, update)
        _write_all(fd, bytes(_padding(t.nbytes, part.alignment)))


def _data_size(part: PlanPart) -> int:
    return sum(t.nbytes + _padding(t.nbytes, part.alignment) for t in part.tensors)


def _write_tensor(t: PlannedTensor, fd: int, copier: _Copier, bases: list[_Base],
                  update: Callable[[int], object]) -> None:
    if t.file_range is not None:
        copier.copy(bases[t.base_part], *t.file_range, update)
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
    """Copies byte ranges of BASE's files into one output file, in the kernel when it can."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self.fast = hasattr(os, "copy_file_range")

    def copy(self, src: _Base, offset: int, size: int, update: Callable[[int], object]) -> None:
        end = offset + size
        while offset < end:
            n = self._chunk(src.fd, offset, min(COPY_CHUNK, end - offset))
            if n == 0:
                raise GraftError(f"BASE {str(src.path)!r} ends at byte {offset}, inside its tensor data: "
                                 "the file is truncated")
            offset += n
            update(n)

    def _chunk(self, src: int, offset: int, n: int) -> int:
        if self.fast:
            try:
                copied = os.copy_file_range(src, self.dst, n, offset)
            except OSError as e:
                if e.errno not in _NO_FAST_COPY:
                    raise
                copied = 0
            if copied > 0:
                return copied
            # 0 inside a range is the file's end, or a file system that copies nothing in the
            # kernel (some FUSE, overlayfs and NFS kernels): pread tells them apart
            self.fast = False
        data = os.pread(src, n, offset)
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
