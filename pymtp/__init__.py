"""pymtp: lossless MTP speculative decoding of Qwen3.5/3.6 GGUFs on llama.cpp."""

from __future__ import annotations

import importlib

# llama.cpp's libraries load before numpy: on an H100 with the CUDA build (pip wheel or
# cmake), a process that had imported numpy first crashed in llama_model_load, inside
# libstdc++ code resolved through libggml-cuda; loading llama_cpp first avoided it.
try:
    import llama_cpp.llama_cpp  # noqa: F401
except ImportError:  # pymtp.native raises the explanatory error when it is needed
    pass

# The public API is imported on first use (PEP 562), so that the parts that need no
# llama.cpp (pymtp.testing, pymtp.gguf_info, pymtp.gguf_facts, and the gguf_graft tool
# that uses them) import where llama-cpp-python is not installed.
_EXPORTS = {
    "DecodeParams": "config", "LoadOptions": "config", "ParamError": "config",
    "Calibration": "results", "Chunk": "results", "Result": "results", "Stats": "results",
    "Model": "generate", "default_model_path": "generate", "load": "generate",
    "Session": "session", "SessionBusyError": "session",
    "ClosedError": "guard",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
