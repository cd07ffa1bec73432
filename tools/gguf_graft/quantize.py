"""Step 4: pick the type of each MTP tensor and encode float32 pieces into it with gguf-py.

gguf-py (numpy) can write F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1 and Q4_0 (also TQ1_0,
TQ2_0 and MXFP4, which are no use for an MTP block); K-quants and I-quants it can only
read. So `--type auto` keeps the base file's type when it is one of those and otherwise
writes Q8_0, the closest to lossless of the block types.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from .errors import GraftError
from .mapping import MATRIX
from .transform import Pieces

WRITABLE: dict[str, T] = {
    "f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0,
    "q5_1": T.Q5_1, "q5_0": T.Q5_0, "q4_1": T.Q4_1, "q4_0": T.Q4_0,
}
TYPE_CHOICES = ("auto", *WRITABLE)
FALLBACK = T.Q8_0


def choose_type(requested: str, base_type: T | None, base_from: str) -> tuple[T, str]:
    """The type for the MTP block's matrices, and a sentence saying why."""
    if requested != "auto":
        if requested.lower() not in WRITABLE:
            raise GraftError(f"--type must be one of {', '.join(TYPE_CHOICES)}, got {requested!r}")
        return WRITABLE[requested.lower()], f"{requested.upper()} as requested with --type"
    if base_type is None:
        return FALLBACK, f"{FALLBACK.name}: the base has no weight matrices to copy the type of"
    if base_type in WRITABLE.values():
        return base_type, f"{base_type.name}, the type of the base's {base_from}"
    return FALLBACK, (f"{FALLBACK.name}: the base's {base_from} are {base_type.name}, which gguf-py "
                      f"cannot quantize to (it writes {', '.join(k.upper() for k in WRITABLE)})")


def tensor_type(role: str, chosen: T, ne: tuple[int, ...]) -> tuple[T, str | None]:
    """Type of one tensor, as the converter picks it: norms and routers stay F32; a
    matrix whose rows do not fill whole blocks of the chosen type falls back to F16."""
    if role != MATRIX:
        return T.F32, None
    block = GGML_QUANT_SIZES[chosen][0]
    if ne[0] % block:
        return T.F16, f"rows of {ne[0]} are not a multiple of the {chosen.name} block ({block}): F16"
    return chosen, None


def nbytes(ne: tuple[int, ...], qtype: T) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(ne[1:], dtype=np.int64)) * (ne[0] // block) * size


def encode(pieces: Pieces, qtype: T) -> Iterator[np.ndarray]:
    """The stored bytes of `qtype`, piece by piece (quantization works on whole rows)."""
    for piece in pieces:
        yield quants.quantize(piece, qtype)
