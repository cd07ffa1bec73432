"""pymtp: lossless MTP speculative decoding of Qwen3.5/3.6 GGUFs on llama.cpp."""

from .config import LoadOptions
from .generate import Chunk, Model, Result, Session, Stats, default_model_path, load

__all__ = ["Chunk", "LoadOptions", "Model", "Result", "Session", "Stats", "default_model_path", "load"]
__version__ = "0.1.0"
