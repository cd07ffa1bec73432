"""Step 3: turn source tensors into the values llama.cpp's converter writes, piece by piece.

Every recipe yields float32 pieces of whole rows ([k, ne0]) in file order, so a tensor of
any size passes through in bounded memory. The values match the converter's: it widens
BF16 to F32 (exact) and keeps F16, adds 1 to norms (Qwen3.5's RMSNorm scales by 1 + w) in
F32, or in F16 for an F16 source (rounded there, as the converter's torch add is),
stacks per-expert tensors on a new leading axis, and splits a fused `gate_up_proj`
[E, 2*n_ff, n_embd] on dim -2 with the gate half first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from .errors import GraftError
from .source import SourceTensor

PIECE_VALUES = 1 << 21  # values per piece: 8 MiB of float32

Pieces = Iterator[np.ndarray]  # float32 [k, ne0] pieces of one tensor, in file order


@dataclass(frozen=True)
class Part:
    """One source tensor, or one half of a fused gate_up_proj."""

    tensor: SourceTensor
    half: int | None = None  # 0: gate rows, 1: up rows (of dim -2)

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.tensor.shape
        return s if self.half is None else (*s[:-2], s[-2] // 2, s[-1])

    def row_ranges(self) -> Iterator[tuple[int, int]]:
        """(first row, row count) spans of the source's 2-D view that give this part in order."""
        if self.half is None:
            yield 0, self.tensor.n_rows
            return
        n = self.tensor.shape[-2] // 2
        for e in range(self.tensor.n_rows // (2 * n)):  # expert e: rows [gate n | up n]
            yield (2 * e + self.half) * n, n


@dataclass(frozen=True)
class Recipe:
    """How one output tensor is made from HF tensors."""

    parts: tuple[Part, ...]
    stack: bool = False  # experts: parts stacked on a new leading axis
    add_one: bool = False  # a norm

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy shape of the result (the ggml shape reversed)."""
        first = self.parts[0].shape
        return (len(self.parts), *first) if self.stack else first

    def pieces(self) -> Pieces:
        for part in self.parts:
            t = part.tensor
            for start, count in part.row_ranges():
                for first, n in _spans(start, count, t.shape[-1]):
                    raw = t.read_rows(first, n)
                    if self.add_one and t.dtype == "F16":      # the converter adds in F16
                        yield (raw + np.float16(1)).astype(np.float32)
                    else:
                        values = widen(raw, t.dtype)
                        yield values + np.float32(1) if self.add_one else values


def widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of raw safetensors data; BF16 is the top half of an F32."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def gguf_raw(t: SourceTensor) -> Pieces:
    """The stored bytes of a GGUF tensor, in pieces: for copying it unchanged."""
    for first, n in _spans(0, t.n_rows, t.shape[-1]):
        yield t.read_rows(first, n)


def gguf_values(t: SourceTensor) -> Pieces:
    """float32 values of a GGUF tensor of any type gguf-py can dequantize."""
    qtype = GGMLQuantizationType[t.dtype]
    for first, n in _spans(0, t.n_rows, t.shape[-1]):
        yield quants.dequantize(t.read_rows(first, n), qtype).reshape(n, t.shape[-1])


def finite(pieces: Pieces, origin: str, values: Callable[[np.ndarray], np.ndarray] | None = None) -> Pieces:
    """`pieces` unchanged, refusing one that holds a NaN or an infinity (`values` reads a
    piece of stored bytes as numbers). Nothing in the write checks them otherwise: such a
    block went out whole, and `--check` then blamed the trunk ("does not fit")."""
    for piece in pieces:
        bad = int(np.count_nonzero(~np.isfinite(piece if values is None else values(piece))))
        if bad:
            raise GraftError(f"SOURCE tensor {origin} holds NaN or infinite values ({bad:,} in one piece of "
                             f"{piece.shape[0]:,} rows): the checkpoint is damaged or its training diverged; "
                             "graft an MTP block from a good checkpoint")
        yield piece


def stored_values(t: SourceTensor) -> Callable[[np.ndarray], np.ndarray] | None:
    """How to read a GGUF tensor's stored bytes as numbers for `finite`, or None where
    gguf-py has no code to (such a tensor is copied unchecked)."""
    if not can_widen(t.dtype):
        return None
    qtype = GGMLQuantizationType[t.dtype]
    return lambda raw: quants.dequantize(raw, qtype)


def can_widen(dtype: str) -> bool:
    """Whether gguf-py dequantizes this GGUF type (it has no code for some the pinned
    llama.cpp stores, Q1_0, Q8_1, the IQ types ...): one zero block, tried."""
    qtype = GGMLQuantizationType[dtype]
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _spans(start: int, count: int, row_len: int) -> Iterator[tuple[int, int]]:
    """(first row, rows) pieces of about PIECE_VALUES values each."""
    step = max(1, PIECE_VALUES // max(1, row_len))
    for first in range(start, start + count, step):
        yield first, min(step, start + count - first)
