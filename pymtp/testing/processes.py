"""Server processes for tests and benchmarks: a port for one, wait until it answers
/health, stop it.

Shared by the live-server tests, the load table and the soak, which each start real
``pymtp serve`` or llama-server processes and must fail with the server's own log when
one never comes up.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


RESERVED_PORTS = Path(tempfile.gettempdir()) / "pymtp-ports"
RESERVE_SECONDS = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now and handed out by no other process in the last
    RESERVE_SECONDS. A server binds only after loading its model, seconds after the port
    was chosen; test slices running side by side (the GPU routine) could be given the same
    port by the kernel meanwhile, and a test then talked to another slice's server. Each
    port handed out leaves a file in RESERVED_PORTS; where that folder cannot be written,
    the kernel's choice is returned as it is."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        mark = RESERVED_PORTS / str(port)
        try:
            RESERVED_PORTS.mkdir(exist_ok=True)
            try:
                if time.time() - mark.stat().st_mtime > RESERVE_SECONDS:
                    mark.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue                # handed out to someone else a moment ago
        except OSError:
            return port             # no shared folder to reserve in: the plain choice
        return port
    raise RuntimeError(f"no port on {host} that no other process was given lately (200 tries)")


def child_env(*paths: Path | str, **extra: str) -> dict[str, str]:
    """This process's environment for a child Python, with ``paths`` put before the
    inherited PYTHONPATH rather than replacing it: the GPU routine keeps llama_cpp and the
    wheels the device image lacks outside site-packages, and a child that loses them dies
    at import (a fuzz worker restarted for every case looked like a hang there)."""
    path = [str(p) for p in paths] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def _tail(log: Path, chars: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, *, timeout: float, what: str,
                 poll: float = 0.2) -> None:
    """Return once GET ``url`` answers 200; RuntimeError with the log's tail if ``proc``
    exits first or ``timeout`` seconds pass (a 503 while the model loads is waited out)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in {timeout} s:\n{_tail(log)}")
        time.sleep(poll)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; the exit status (None if it had to be killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.terminate()
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return None
