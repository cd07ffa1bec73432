"""ggml's backend registry through ctypes: the devices of this host, and the RPC backend's
workers (pymtp/rpc.py says how they are used). One function per C call, as in native.py.

llama-cpp-python's bindings stop at llama.h; these symbols live in libggml, which libllama
links, so the handle of the library it loaded resolves them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .native import C, NativeError, _init_backend, _log_tail

_GGML_DEV_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}


def _ggml(name: str, argtypes: list | None, restype):
    fn = getattr(C._lib, name)
    if argtypes is not None:
        fn.argtypes = argtypes
    fn.restype = restype
    return fn


_vp, _cp, _sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
_reg_by_name = _ggml("ggml_backend_reg_by_name", [_cp], _vp)
_reg_get_proc_address = _ggml("ggml_backend_reg_get_proc_address", [_vp, _cp], _vp)
_reg_dev_count = _ggml("ggml_backend_reg_dev_count", [_vp], _sz)
_reg_dev_get = _ggml("ggml_backend_reg_dev_get", [_vp, _sz], _vp)
_dev_count = _ggml("ggml_backend_dev_count", [], _sz)
_dev_get = _ggml("ggml_backend_dev_get", [_sz], _vp)
_dev_by_type = _ggml("ggml_backend_dev_by_type", [ctypes.c_int], _vp)
_dev_name = _ggml("ggml_backend_dev_name", [_vp], _cp)
_dev_description = _ggml("ggml_backend_dev_description", [_vp], _cp)
_dev_type = _ggml("ggml_backend_dev_type", [_vp], ctypes.c_int)
_dev_memory = _ggml("ggml_backend_dev_memory", [_vp, ctypes.POINTER(_sz), ctypes.POINTER(_sz)], None)
set_abort_callback = _ggml("ggml_set_abort_callback", None, _vp)   # takes a CFUNCTYPE
_ADD_SERVER_T = ctypes.CFUNCTYPE(_vp, _cp)


@dataclass(frozen=True)
class Device:
    """A ggml device: its handle for ``llama_model_params.devices`` and what it reports."""

    ptr: int
    name: str
    description: str
    kind: str         # "CPU", "GPU", "IGPU", "ACCEL"


def _device(ptr: int) -> Device:
    return Device(ptr, _dev_name(ptr).decode(errors="replace"),
                  _dev_description(ptr).decode(errors="replace"), _GGML_DEV_TYPES.get(_dev_type(ptr), "?"))


def local_gpus() -> list[Device]:
    """This host's GPU devices (dedicated and integrated), in ggml's order."""
    _init_backend(False)
    devs = (_device(_dev_get(i)) for i in range(_dev_count()))
    return [d for d in devs if d.kind in ("GPU", "IGPU")]


def cpu_device() -> Device:
    _init_backend(False)
    return _device(_dev_by_type(0))


def device_memory(dev: Device) -> tuple[int, int]:
    """(free, total) bytes as the device reports them (an RPC device asks its worker)."""
    free, total = _sz(0), _sz(0)
    _dev_memory(dev.ptr, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def rpc_add_server():
    """The RPC backend's ``ggml_backend_rpc_add_server``, found through the registry as
    llama.cpp's own tools find it; None when this build has no RPC backend."""
    _init_backend(False)
    reg = _reg_by_name(b"RPC")
    addr = _reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    return _ADD_SERVER_T(addr) if addr else None


def rpc_server_devices(add_server, endpoint: str) -> list[Device]:
    """Connect to a worker (``ggml_backend_rpc_add_server``) and list its devices."""
    reg = add_server(endpoint.encode())
    if not reg:
        raise NativeError(f"ggml_backend_rpc_add_server({endpoint!r}) returned NULL (no devices){_log_tail()}")
    return [_device(_reg_dev_get(reg, i)) for i in range(_reg_dev_count(reg))]
