"""Models split across hosts with llama.cpp's RPC backend (ggml-rpc): endpoints, a
handshake probe, the layer split, and the guard that turns a lost worker into an error.

Each worker host runs ``rpc-server`` (built from the same pinned llama.cpp); the head
registers every ``host:port`` with ggml's RPC backend and loads the model over its own
devices plus the workers'. ggml moves the data: the weights once at load, then at every
decode the activations between the layers each device holds and the output rows. The
KV cache and the recurrent state of a layer stay on the device that holds the layer, so
MTP drafting, verification and rollback run unchanged; only batches of token ids, one
hidden row per batch row and the logits cross the wire.

Three things in the pinned ggml-rpc shape this module:

- A client that cannot connect, or whose worker dies mid-call, ends in ``GGML_ABORT``,
  which kills the process. So every endpoint is probed from Python first (TCP connect
  and the protocol's HELLO, with timeouts), and every llama.cpp call that may reach a
  worker runs on a helper thread of ``RemoteCalls``: on an RPC abort the abort callback
  parks that thread for good and the caller gets ``RpcWorkerLost``. The model it ran
  on is then unusable and is leaked, never freed (freeing would talk to the dead worker).
- ``rpc-server`` serves one client at a time; a probe of a worker that serves another
  head waits and times out, which the error says.
- Devices are passed to each model explicitly, never registered globally, so a later
  load without ``rpc`` (the local fail-over) cannot pick up a dead worker's device.
- ggml-rpc keeps one connection per endpoint for the whole process, and its abort names
  no endpoint: a lost worker fails every split model of the process, and a worker that
  a live model of this process already uses is not probed again (it would not answer).
"""

from __future__ import annotations

import ctypes
import math
import socket
import struct
import sys
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

# The slowest link a load is waited for at (10 MiB/s, a busy 100 Mb/s network): a split
# model's load sends every worker its layers in one llama.cpp call (RemoteCalls.load_timeout)
LOAD_BYTES_PER_S = 10 * 2**20

# The protocol version of the pinned ggml-rpc (ggml/include/ggml-rpc.h of llama-cpp-python
# 0.3.36): a worker must have the same major and a minor no newer.
RPC_PROTO_VERSION = (7, 0, 0)
# Wire facts of that version: a request is | cmd u8 | size u64 | data |, a reply
# | size u64 | data |; HELLO is command 14 with 24 bytes of transport capabilities, and its
# reply is major, minor, patch, one pad byte and the worker's 24 bytes of capabilities.
_CMD_HELLO = 14
_CAPS_SIZE = 24
_HELLO_REPLY_SIZE = 4 + _CAPS_SIZE

BUILD_HINT = ('reinstall llama-cpp-python with RPC: CMAKE_ARGS="-DGGML_RPC=on" pip install '
              '--no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36')
DEFAULT_PROBE_TIMEOUT = 5.0
# how long a lost worker's endpoint may leave a connection unanswered before it is named
REFUSAL_PROBE_TIMEOUT = 1.0


class RpcError(RuntimeError):
    """Something about the RPC workers; the message says which worker and what to do."""


class RpcUnsupported(RpcError):
    """This llama.cpp build has no RPC backend."""


class RpcUnreachable(RpcError):
    """A worker did not answer the handshake (down, firewalled, or serving another head)."""


class RpcVersionMismatch(RpcError):
    """A worker speaks another version of the RPC protocol than this build."""


class RpcWorkerLost(RpcError):
    """A worker failed during a call; the model that used it can no longer decode.
    ``failure`` says what failed, ``advice`` what to do (a server that fails over on its
    own tells its clients to send the request again instead)."""

    ADVICE = "this model can no longer decode: restart the worker and load the model again"

    def __init__(self, failure: str, advice: str = ADVICE) -> None:
        super().__init__(f"{failure}; {advice}")
        self.failure = failure


# ---------------------------------------------------------------------------- endpoints


def parse_endpoints(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"h1:50052,h2:50052"`` or a list of ``host:port`` -> the endpoints, checked."""
    if spec is None:
        return ()
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"rpc: each worker is a 'host:port' string, got {item!r}")
        item = item.strip()
        host, sep, port = item.rpartition(":")
        if "[" in item or ":" in host:
            # ggml-rpc cuts an endpoint at its first ':' and connects over IPv4 only: an IPv6
            # address passed the check here and failed at the connection as a lost worker
            raise ValueError(f"rpc: {item!r}: ggml-rpc reaches workers over IPv4 only, as host:port with an "
                             f"IPv4 address or a host name (e.g. 192.168.1.10:50052)")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rpc: {item!r} is not host:port (e.g. 192.168.1.10:50052)")
        if item in out:
            raise ValueError(f"rpc: worker {item!r} is listed twice")
        out.append(item)
    if not out:
        raise ValueError("rpc: no worker given; pass host:port[,host:port...]")
    return tuple(out)


def one_worker_each(endpoints: Sequence[str], resolve: Callable[[str], str] = socket.gethostbyname) -> None:
    """Refuse two endpoints that name one worker (``127.0.0.1:P`` and ``localhost:P``):
    ggml-rpc connects to each name, and rpc-server serves one client at a time, so the
    second connection waited out ``rpc_timeout`` (300 s) and then blamed a lost worker.
    Names are resolved as ggml-rpc resolves them (IPv4); one that does not resolve is left
    to the handshake to report."""
    seen: dict[tuple[str, int], str] = {}
    for endpoint in endpoints:
        host, port = _host_port(endpoint)
        try:
            key = (resolve(host), port)
        except OSError:
            continue
        if key in seen:
            raise ValueError(f"rpc: {seen[key]} and {endpoint} are one worker ({key[0]}:{port}) listed twice; "
                             f"list it once")
        seen[key] = endpoint


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def probe(endpoint: str, timeout: float = DEFAULT_PROBE_TIMEOUT) -> tuple[int, int, int]:
    """Connect to a worker and exchange HELLO: its protocol version, checked against ours.

    Raises ``RpcUnreachable`` or ``RpcVersionMismatch`` with what to do; ggml's own
    client would abort the process on either."""
    host, port = _host_port(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise RpcUnreachable(
            f"RPC worker {endpoint} is unreachable ({exc}); start it there with "
            f"'rpc-server --host ADDR --port {port}' and check the address") from None
    with sock:
        sock.settimeout(timeout)
        try:
            sock.sendall(struct.pack("<BQ", _CMD_HELLO, _CAPS_SIZE) + bytes(_CAPS_SIZE))
            size = struct.unpack("<Q", _recv_exactly(sock, 8))[0]
            reply = _recv_exactly(sock, size) if size <= 4096 else b""
        except socket.timeout:
            raise RpcUnreachable(
                f"RPC worker {endpoint} accepted the connection but did not answer the handshake "
                f"within {timeout:g} s: rpc-server serves one client at a time, so another head "
                f"may be connected to it, or this is not an rpc-server") from None
        except (OSError, EOFError) as exc:
            raise RpcVersionMismatch(
                f"RPC worker {endpoint} closed the connection during the handshake ({exc}): "
                f"it probably speaks another protocol version than this build's "
                f"{_version(RPC_PROTO_VERSION)}; build rpc-server from the same llama.cpp "
                f"(benchmarks/build_llama_server.sh)") from None
    if size != _HELLO_REPLY_SIZE:
        raise RpcVersionMismatch(
            f"RPC worker {endpoint} answered the handshake with {size} bytes, not "
            f"{_HELLO_REPLY_SIZE}: another protocol than this build's {_version(RPC_PROTO_VERSION)}; "
            f"build rpc-server from the same llama.cpp (benchmarks/build_llama_server.sh)")
    theirs = tuple(reply[:3])
    if theirs[0] != RPC_PROTO_VERSION[0] or theirs[1] > RPC_PROTO_VERSION[1]:
        raise RpcVersionMismatch(
            f"RPC worker {endpoint} speaks protocol {_version(theirs)}, this build "
            f"{_version(RPC_PROTO_VERSION)}; build rpc-server from the llama.cpp that "
            f"llama-cpp-python 0.3.36 vendors (benchmarks/build_llama_server.sh)")
    return theirs


def refusing(endpoints: Sequence[str], timeout: float = REFUSAL_PROBE_TIMEOUT) -> tuple[str, ...]:
    """The endpoints that refuse a TCP connection now (or leave it unanswered for
    ``timeout`` s). A live rpc-server serving another client still completes one: its
    listening socket queues it."""
    out = []
    for endpoint in endpoints:
        try:
            socket.create_connection(_host_port(endpoint), timeout=timeout).close()
        except (OSError, ValueError):
            out.append(endpoint)
    return tuple(out)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise EOFError(f"connection closed after {len(data)} of {n} bytes")
        data += part
    return data


def _version(v: Sequence[int]) -> str:
    return ".".join(map(str, v))


# ---------------------------------------------------------------------------- the split


@dataclass(frozen=True)
class Split:
    """How llama.cpp is asked to place the layers: what ``llama_model_params`` gets."""

    n_gpu_layers: int               # layers (of n_layer + 1, the output counted) on the devices
    tensor_split: tuple[float, ...]  # one share per entry of the devices list
    shares: tuple[float, ...]       # local first, then one per worker: what the user sees


def shares_ok(shares: Sequence[float]) -> bool:
    """Finite shares >= 0 with a finite positive sum (an infinite one left a worker no
    layers, or failed with "cannot convert float NaN to integer")."""
    return all(math.isfinite(s) and s >= 0 for s in shares) and 0 < sum(shares) < math.inf


def plan_split(n_units: int, shares: Sequence[float], n_local_devices: int) -> Split:
    """Place ``n_units`` layer units (block_count + 1 for the output layer) by ``shares``:
    one value per local device (the CPU when there is no GPU) and then one per worker.

    llama.cpp splits the offloaded layers over its devices list by ``tensor_split`` and
    keeps the first ``n_units - n_gpu_layers`` on the CPU. With local GPUs they are in the
    devices list, so the shares pass through; on a CPU-only head the CPU's share becomes
    the layers kept back from the devices."""
    shares = tuple(float(s) for s in shares)
    if not shares_ok(shares):
        raise ValueError(f"tensor_split: shares must be finite numbers >= 0 with a positive sum, got {list(shares)}")
    if n_local_devices > 0:
        return Split(-1, shares, shares)
    local, remote = shares[0], shares[1:]
    offloaded = round(n_units * sum(remote) / (local + sum(remote)))
    return Split(offloaded, remote, shares)


# ---------------------------------------------------------------------------- the guard

_ABORT_CALLBACK_T = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
# ggml-rpc's aborts on a lost or refusing worker: the client side's messages in the pin
_RPC_ABORTS = ("Remote RPC server crashed", "Failed to connect to", "RPC handshake failed",
               "RPC transport initialization failed", "Failed to parse endpoint")
_guards: "weakref.WeakSet[RemoteCalls]" = weakref.WeakSet()
_installed: list = []          # keeps the ctypes callback alive once installed
_install_lock = threading.Lock()


def _on_abort(message: bytes | None) -> None:
    text = (message or b"").decode("utf-8", errors="replace").strip()
    if not any(m in text for m in _RPC_ABORTS):
        print(text, file=sys.stderr, flush=True)      # not ours: ggml aborts as it would
        return
    for guard in list(_guards):
        guard._lost(text)
    threading.Event().wait()      # park this thread: returning would abort the process


def install_abort_guard(set_abort_callback: Callable) -> None:
    """Route ggml's aborts through ``_on_abort`` (once per process; RPC use only, so a
    local build keeps ggml's own abort with its backtrace)."""
    with _install_lock:
        if not _installed:
            cb = _ABORT_CALLBACK_T(_on_abort)
            set_abort_callback(cb)
            _installed.append(cb)


@dataclass(frozen=True)
class Placement:
    """Where a model's layers go: the devices list and split for ``llama_model_params``."""

    devices: tuple            # ggml_devices.Device: local GPUs, then every worker's devices
    split: Split
    names: tuple[str, ...]    # one per share: "CPU" or a local GPU's name, then "RPC0 (host:port)"
    remote: "RemoteCalls"

    def describe(self) -> str:
        total = sum(self.split.shares)
        return ", ".join(f"{n} {s / total:.0%}" for n, s in zip(self.names, self.split.shares))


def place(endpoints: Sequence[str], n_units: int, tensor_split: Sequence[float] | None = None,
          timeout: float | None = None, probe_timeout: float = DEFAULT_PROBE_TIMEOUT) -> Placement:
    """Probe and register the workers, and split ``n_units`` layer units (block_count + 1)
    between this host and them: by ``tensor_split`` (one share per local device, the CPU
    when there is no GPU, then one per worker device), or by each device's free memory."""
    from . import ggml_devices as devices

    add_server = devices.rpc_add_server()
    if add_server is None:
        raise RpcUnsupported(f"this llama-cpp-python build has no RPC backend (ggml-rpc); {BUILD_HINT}")
    one_worker_each(endpoints)
    for endpoint in endpoints:
        if not _in_use(endpoint):
            probe(endpoint, probe_timeout)
    install_abort_guard(devices.set_abort_callback)
    remote = RemoteCalls(endpoints, timeout)
    try:
        gpus = devices.local_gpus()
        local = gpus or [devices.cpu_device()]
        workers = [(ep, d) for ep in endpoints for d in remote.call(devices.rpc_server_devices, add_server, ep)]
        names = tuple([d.name for d in local] + [f"{d.name} ({ep})" for ep, d in workers])
        if tensor_split is None:
            shares = [devices.device_memory(d)[0] for d in local] + \
                     [remote.call(devices.device_memory, d)[0] for _, d in workers]
        else:
            shares = list(tensor_split)
            if len(shares) != len(names):
                raise ValueError(f"tensor_split has {len(shares)} shares for {len(names)} devices; give one "
                                 f"per device, this host's first: {', '.join(names)}")
        split = plan_split(n_units, shares, len(gpus))
    except BaseException:
        remote.close()      # its thread, and the endpoints it holds for _in_use
        raise
    return Placement(tuple(gpus) + tuple(d for _, d in workers), split, names, remote)


def _in_use(endpoint: str) -> bool:
    """Whether a live split model of this process holds ggml-rpc's connection to it."""
    return any(endpoint in g.endpoints and g.lost is None and not g.closed for g in list(_guards))


class RemoteCalls:
    """Runs the llama.cpp calls of one model that may reach a worker on one daemon thread.

    ``call`` returns the call's result, or raises ``RpcWorkerLost`` as soon as ggml-rpc
    reports a lost worker: the helper thread is then stuck inside llama.cpp for good, and
    so is every object of this model, which is why callers leak rather than free them."""

    def __init__(self, endpoints: Sequence[str], timeout: float | None = None) -> None:
        self.endpoints = tuple(endpoints)
        self.timeout = timeout
        self.lost: str | None = None
        self.culprits: tuple[str, ...] = ()     # the lost workers, where they could be told apart
        self.closed = False
        self._lock = threading.Lock()
        self._pending: Future | None = None
        self._jobs: list = []
        self._wake = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name="pymtp-rpc", daemon=True)
        self._thread.start()
        _guards.add(self)

    def call(self, fn: Callable[..., T], *args, timeout: float | None | str = "rpc_timeout") -> T:
        """``fn(*args)`` on the thread; ``timeout`` (s, None: none) bounds the wait in place
        of ``self.timeout`` where one call does more than one decode's work (the load)."""
        limit, why = (self.timeout, "rpc_timeout") if timeout == "rpc_timeout" else (timeout, "loading")
        if sys.is_finalizing() or self.closed:
            # a handle freed at interpreter exit (the daemon thread runs no more by then),
            # or after the model: no thread to hand it to
            if self.lost is not None:
                raise self._error()
            return fn(*args)
        fut: Future = Future()
        with self._lock:
            if self.lost is not None:
                raise self._error()
            self._jobs.append((fut, fn, args))
            self._wake.notify()
        try:
            return fut.result(limit)
        except FutureTimeout:
            # a worker that vanished without closing its socket: ggml-rpc would wait forever
            self._lost(f"no reply within {limit:g} s ({why})")
            raise self._error() from None

    def load_timeout(self, n_bytes: int) -> float | None:
        """What the load may take: the weights go to the workers in that one call, so
        rpc_timeout bounds it on top of the file's bytes at LOAD_BYTES_PER_S (a 40 GB
        model at 1 Gb/s takes ~5 min, all of rpc_timeout's 300 s: it was called lost)."""
        return None if self.timeout is None else self.timeout + n_bytes / LOAD_BYTES_PER_S

    def close(self) -> None:
        """The model is freed: end the thread once the calls queued before have run."""
        with self._lock:
            self.closed = True
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._jobs or self.closed)
                if not self._jobs:
                    return
                fut, fn, args = self._jobs.pop(0)
                self._pending = fut
            try:
                result, exc = fn(*args), None
            except BaseException as e:  # pragma: no cover - ctypes calls do not raise
                result, exc = None, e
            with self._lock:
                self._pending = None
                if fut.done():        # failed meanwhile by _lost (another worker's abort)
                    continue
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(result)

    def _lost(self, message: str) -> None:
        """Fail the call in flight and the queued ones. Under the lock: ``_loop`` settles a
        call that ends at this moment under it too, and a future settled twice raises."""
        # ggml-rpc's abort names no endpoint: among several, the ones that refuse a
        # connection now are the lost ones (asked outside the lock: a connect can wait)
        culprits = refusing(self.endpoints) if self.lost is None and len(self.endpoints) > 1 else ()
        with self._lock:
            if self.lost is None:
                self.lost = message
                self.culprits = culprits if len(culprits) < len(self.endpoints) else ()
            for fut in [self._pending] + [job[0] for job in self._jobs]:
                if fut is not None and not fut.done():
                    fut.set_exception(self._error())
            self._jobs.clear()

    def _error(self) -> RpcWorkerLost:
        what = self.lost.split(': ', 1)[-1]
        if self.culprits:
            rest = [e for e in self.endpoints if e not in self.culprits]
            who = "it refuses" if len(self.culprits) == 1 else "they refuse"
            return RpcWorkerLost(f"RPC worker {', '.join(self.culprits)} failed: {what} ({who} connections "
                                 f"now; {', '.join(rest)} still accept{'s' if len(rest) == 1 else ''} them)")
        return RpcWorkerLost(f"an RPC worker ({', '.join(self.endpoints)}) failed: {what}")
