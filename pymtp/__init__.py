"""pymtp: lossless MTP speculative decoding of Qwen3.5/3.6 GGUFs on llama.cpp."""

# llama.cpp's libraries load before numpy: on an H100 with the CUDA build (pip wheel or
# cmake), a process that had imported numpy first crashed in llama_model_load, inside
# libstdc++ code resolved through libggml-cuda; loading llama_cpp first avoided it.
try:
    import llama_cpp.llama_cpp  # noqa: F401
except ImportError:  # pymtp.native raises the explanatory error when it is needed
    pass

from .config import DecodeParams, LoadOptions, ParamError
from .generate import Chunk, Model, Result, Session, SessionBusyError, Stats, default_model_path, load
from .guard import ClosedError

__all__ = ["Chunk", "ClosedError", "DecodeParams", "LoadOptions", "Model", "ParamError", "Result", "Session",
           "SessionBusyError", "Stats", "default_model_path", "load"]
__version__ = "0.1.0"
