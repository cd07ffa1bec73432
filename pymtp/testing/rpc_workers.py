"""llama.cpp ``rpc-server`` workers on loopback, for the RPC tests and benchmarks/rpc_split.py.

The binary is built from the pinned llama.cpp by benchmarks/build_llama_server.sh, next to
llama-server; ``find_rpc_server`` looks where that script and CI put it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

from ..rpc import RpcError, probe
from .processes import free_port


def find_rpc_server() -> str | None:
    """$PYMTP_RPC_SERVER; else rpc-server-BACKEND beside $PYMTP_LLAMA_SERVER (the build
    script names them alike); else the build script's cache of CI; else rpc-server on PATH."""
    if os.environ.get("PYMTP_RPC_SERVER"):
        return os.environ["PYMTP_RPC_SERVER"]
    candidates = []
    llama_server = os.environ.get("PYMTP_LLAMA_SERVER")
    if llama_server:
        p = Path(llama_server)
        candidates.append(p.with_name(p.name.replace("llama-server", "rpc-server")))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    candidates.append(cache / "pymtp" / "llama-server" / "bin" / "rpc-server-cpu")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("rpc-server")


def wait_worker(proc: subprocess.Popen, endpoint: str, log: Path, timeout: float = 30.0) -> None:
    """Return once the worker answers the handshake; RuntimeError with its log otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            probe(endpoint, timeout=2.0)
            return
        except RpcError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rpc-server on {endpoint} did not answer in {timeout} s:\n"
                                   f"{log.read_text(errors='replace')[-2000:]}") from None
            time.sleep(0.1)


@contextlib.contextmanager
def rpc_workers(n: int, binary: str, logs: Path, threads: int = 1) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """``n`` rpc-server processes on 127.0.0.1 (never another interface: rpc-server has no
    authentication): [(endpoint, process)], killed on exit."""
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        for _ in range(n):
            port = free_port()
            log = logs / f"rpc-server-{port}.log"
            with open(log, "wb") as fh:
                proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)],
                                        stdout=fh, stderr=subprocess.STDOUT)
            endpoint = f"127.0.0.1:{port}"
            procs.append((endpoint, proc))
            wait_worker(proc, endpoint, log)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
