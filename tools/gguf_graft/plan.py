"""Step 2: the plan: every tensor of the output, where its bytes come from, its type and size.

SOURCE's tensors are mapped with the table in mapping.py into recipes (transform.py);
validate.py checks the result against BASE before anything is written. The plan orders
the MTP tensors as llama.cpp's converter emits them and puts them after the base's own
tensors, so grafting a converter-made `--no-mtp` file gives the converter's full file.

A split BASE gives a split output with as many parts, each with the same tensors, and
the MTP block appended to the last part, so the tensors come in the unsplit graft's order
and the parts are what splitting the unsplit graft at the same places gives. Or one file
(`split=False`): the graft of the merged base.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as T

from . import validate
from .base import GgufInfo, block_of, matrix_type
from .errors import GraftError
from .mapping import (
    BY_GGUF,
    GROUP_ORDER,
    NORM,
    Entry,
    expert_member,
    fused_expert,
    lookup,
)
from .metadata import Metadata, new_metadata, part_metadata
from .quantize import choose_type, encode, nbytes, tensor_type
from .source import Source, SourceTensor
from .transform import Part, Recipe, can_widen, finite, gguf_raw, gguf_values, stored_values


@dataclass
class Mapped:
    """One MTP tensor of SOURCE, mapped to its GGUF name."""

    entry: Entry
    ne: tuple[int, ...]  # ggml shape SOURCE gives it
    order: tuple[int, int]  # where the converter emits it: (last input's position, rank in group)
    origin: str  # the source tensor(s), for messages
    recipe: Recipe | None = None  # HF source: how to compute it
    stored: SourceTensor | None = None  # GGUF source: converted already


@dataclass
class PlannedTensor:
    name: str
    ne: tuple[int, ...]  # ggml shape
    qtype: T
    nbytes: int
    origin: str  # "BASE" or the source tensor(s)
    file_range: tuple[int, int] | None = None  # (offset, size) in BASE: copied unchanged
    base_part: int = 0  # which of BASE's files (parts) file_range lies in
    produce: Callable[[], Iterator[np.ndarray]] | None = None  # the stored bytes, in pieces
    note: str | None = None  # why its type differs from the chosen one


@dataclass
class PlanPart:
    """One output file: its KV pairs and tensors, the tensor data aligned to `alignment`."""

    metadata: Metadata
    tensors: list[PlannedTensor]
    alignment: int


@dataclass
class Plan:
    base: GgufInfo
    source: Source
    qtype: T  # type chosen for the MTP block's matrices
    type_reason: str
    parts: list[PlanPart]  # the output files in order: one, or one per part of a split BASE
    replaced: list[str] = field(default_factory=list)  # MTP tensors of BASE dropped under --force
    outputs: list[Path] = field(default_factory=list)  # the files graft() wrote, in the order of parts

    @property
    def metadata(self) -> Metadata:
        """The metadata of the first file, which holds all of it."""
        return self.parts[0].metadata

    @property
    def tensors(self) -> list[PlannedTensor]:
        """Every tensor in file order: the base's, then the MTP block."""
        return [t for part in self.parts for t in part.tensors]

    @property
    def mtp(self) -> list[PlannedTensor]:
        return [t for t in self.tensors if t.file_range is None]


def make_plan(base: GgufInfo, source: Source, qtype: str = "auto", force: bool = False,
              split: bool = True) -> Plan:
    """Map and check everything; raises GraftError naming each problem found.

    `split=False` plans one output file even when BASE is split.
    """
    validate.base_is_free(base, force)
    mapped = map_gguf(source, base) if source.gguf else map_hf(source, base)
    validate.fits(base, source, mapped)
    chosen, reason = choose_type(qtype, *matrix_type(base))
    kept: list[list[PlannedTensor]] = [[] for _ in base.parts]  # per part of BASE
    replaced: list[str] = []
    for part, t in base.tensors():
        if _in_mtp_block(t.name, base):
            replaced.append(t.name)
            continue
        kept[part].append(PlannedTensor(t.name, tuple(int(n) for n in t.shape), t.tensor_type, int(t.n_bytes),
                                        "BASE", file_range=(int(t.data_offset), int(t.n_bytes)), base_part=part))
    mtp = [_plan_mtp_tensor(m, base.n_trunk, chosen) for m in sorted(mapped.values(), key=lambda m: m.order)]
    return Plan(base, source, chosen, reason, _layout(base, kept, mtp, split), replaced)


def _layout(base: GgufInfo, kept: list[list[PlannedTensor]], mtp: list[PlannedTensor],
            split: bool) -> list[PlanPart]:
    """The output files: BASE's parts (or one file) with the MTP block at the end of the last."""
    n_tensors = sum(map(len, kept)) + len(mtp)
    groups = kept if split else [[t for group in kept for t in group]]
    groups[-1] = groups[-1] + mtp
    first = PlanPart(new_metadata(base, n_tensors, keep_split=split), groups[0], base.parts[0].alignment)
    rest = [PlanPart(part_metadata(part, n_tensors), group, part.alignment)
            for part, group in zip(base.parts[1:], groups[1:])]
    return [first, *rest]


def map_hf(source: Source, base: GgufInfo) -> dict[str, Mapped]:
    """HF tensors -> recipes, keyed by GGUF name suffix (the part after `blk.{N}.`)."""
    out = _OneEach(source)
    unknown: list[str] = []
    experts: dict[str, dict[int, Part]] = defaultdict(dict)
    last_expert = -1
    for pos, (name, t) in enumerate(source.tensors.items()):
        if (entry := lookup(name)) is not None:
            recipe = Recipe((Part(t),), add_one=entry.role == NORM)
            out.add(Mapped(entry, recipe.shape[::-1], (pos, 0), t.name, recipe=recipe))
        elif (member := expert_member(name)) is not None:
            experts[member[0]][member[1]] = Part(t)
            last_expert = pos
        elif (halves := fused_expert(name)) is not None:
            if len(halves) == 2 and (len(t.shape) < 2 or t.shape[-2] % 2):
                raise GraftError(f"SOURCE {source.label}: {t.name} has shape {list(t.shape)}: a fused gate_up_proj "
                                 "holds the gate and the up rows, so its rows (the second last dimension) must be "
                                 "an even number")
            for stacked, half in halves:
                entry = lookup(stacked)
                recipe = Recipe((Part(t, half),))
                out.add(Mapped(entry, recipe.shape[::-1], (pos, half or 0), t.name, recipe=recipe))
        else:
            unknown.append(t.name)
    missing, gapped = [], set()
    for stacked, parts in experts.items():
        entry = lookup(stacked)
        n_expert = max(base.dims.n_expert or 0, max(parts) + 1)
        gaps = [stacked.replace("experts.", f"experts.{e}.") for e in range(n_expert) if e not in parts]
        if gaps:
            missing += gaps
            gapped.add(entry.gguf)
            continue
        # the recipe's shape is expert 0's: another of another shape was written wrong or cut short
        for e in range(1, n_expert):
            if parts[e].shape != parts[0].shape:
                raise GraftError(f"SOURCE {source.label}: {parts[e].tensor.name} has shape {list(parts[e].shape)}, "
                                 f"{parts[0].tensor.name} has {list(parts[0].shape)}: the experts of one tensor must "
                                 "all have one shape")
        recipe = Recipe(tuple(parts[e] for e in range(n_expert)), stack=True)
        origin = stacked.replace("experts.", f"experts.{{0..{n_expert - 1}}}.")
        rank = GROUP_ORDER[stacked.split(".")[-2]]
        out.add(Mapped(entry, recipe.shape[::-1], (last_expert, rank), origin, recipe=recipe))
    validate.complete(base, source, out, unknown, missing, gapped)
    return out


def map_gguf(source: Source, base: GgufInfo) -> dict[str, Mapped]:
    """Tensors of an MTP GGUF (already converted), keyed by GGUF name suffix."""
    assert source.gguf is not None
    out = _OneEach(source)
    unknown: list[str] = []
    for pos, (name, t) in enumerate(source.tensors.items()):
        block, rest = block_of(name)  # type: ignore[misc]  # source.py kept only blk.* names
        entry = BY_GGUF.get(rest) if block == source.gguf.n_trunk else None
        if entry is None:
            unknown.append(name)
            continue
        out.add(Mapped(entry, t.shape[::-1], (pos, 0), name, stored=t))
    validate.complete(base, source, out, unknown, [])
    return out


def _plan_mtp_tensor(m: Mapped, block: int, chosen: T) -> PlannedTensor:
    qtype, note = tensor_type(m.entry.role, chosen, m.ne)
    t = m.stored
    if t is not None and t.dtype != qtype.name and not can_widen(t.dtype):
        raise GraftError(f"SOURCE tensor {m.origin} is {t.dtype}, which gguf-py cannot read back to values to "
                         f"write as {qtype.name}: give the MTP block in safetensors, or a GGUF of F16, BF16, F32 "
                         "or a common quant type (Q8_0, Q4_K ...)")
    return PlannedTensor(f"blk.{block}.{m.entry.gguf}", m.ne, qtype, nbytes(m.ne, qtype), m.origin,
                         produce=_producer(m, qtype), note=note)


def _producer(m: Mapped, qtype: T) -> Callable[[], Iterator[np.ndarray]]:
    """The stored bytes of `m` in `qtype`, piece by piece, when called."""
    if m.recipe is not None:
        recipe = m.recipe
        return lambda: encode(finite(recipe.pieces(), m.origin), qtype)
    t = m.stored
    assert t is not None
    if t.dtype == qtype.name:  # same type: copy the bytes, no round trip through F32
        values = stored_values(t)
        if values is None:          # no code reads them as numbers: copied unchecked
            return lambda: gguf_raw(t)
        return lambda: finite(gguf_raw(t), m.origin, values)
    return lambda: encode(finite(gguf_values(t), m.origin), qtype)


class _OneEach(dict):
    """Mapped tensors by GGUF suffix; refuses two source tensors for one GGUF tensor."""

    def __init__(self, source: Source) -> None:
        super().__init__()
        self.source = source

    def add(self, m: Mapped) -> None:
        if (other := self.get(m.entry.gguf)) is not None:
            raise GraftError(f"SOURCE {self.source.label} has two tensors for blk.N.{m.entry.gguf}: "
                             f"{other.origin} and {m.origin}; keep one")
        self[m.entry.gguf] = m


def _in_mtp_block(name: str, base: GgufInfo) -> bool:
    b = block_of(name)
    return b is not None and b[0] >= base.n_trunk
