"""A smaller vocabulary for the MTP head's drafts: its LM matmul over n ids, not every id.

Why: every draft step ends in the output head, one row of n_vocab logits. At Qwen3.5's
248,320 tokens that head is most of a small model's MTP step: on 2 CPU threads the 78M
shared model padded to 248k (benchmarks/pad_vocab.py) takes 14.6 ms a step with the whole
head and 1.0 ms over its 8,192 real ids. The target's verify keeps the whole vocabulary,
so the output stays what plain decoding gives: a draft only proposes (greedy identity),
and rejection sampling's q is the distribution the draft was drawn from, which may leave
ids out.

The drafter loads a file of its own, the "draft file": an MTP-only GGUF (what llama.cpp's
converter writes with ``--mtp`` and llama-server loads with ``-md``) with the model's
metadata, its MTP block and ``output_norm``, and the rows of the kept ids of every tensor
with a row per token (``token_embd``, ``output``, ``nextn.embed_tokens``,
``nextn.shared_head_head``), the tokenizer's tables cut to them. Its token i is the
model's token ``ids[i]``; the file says which in ``IDS_KEY``.

Which ids: the first n, since byte-level BPE numbers tokens by merge rank (the commonest
first), and every control or user-defined token after them (chat markers, end of turn).
A token outside them still reaches the head as its input, read as the file's token 0:
drafts after it are worse, the output the same.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ParamError
from .gguf_facts import ARCHITECTURE, BLOCK_COUNT, NEXTN_PREDICT_LAYERS, parse_split_name, scalar, split_name
from .gguf_header import Header, Tensor, read_header
from .native import NativeModel
from .sampling import Dist

IDS_KEY = "pymtp.draft_vocab.ids"    # int32 array: the model's id of each of the file's tokens
MIN_IDS = 256                        # byte-level BPE keeps its 256 byte tokens first
FORMAT = 1                           # bump when the file's contents change for the same input
TOKENS, TOKEN_TYPES, SCORES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"
PER_TOKEN_TABLES = (TOKENS, TOKEN_TYPES, SCORES)
SPECIAL_ID = re.compile(r"^tokenizer\.ggml\.\w+_token_id$")   # bos, eos, eot, pad, fim_*, ...
KEPT_TYPES = (3, 4)                  # llama.cpp's token types CONTROL and USER_DEFINED
ROW_TENSORS = re.compile(r"^(token_embd|output|blk\.\d+\.nextn\.(embed_tokens|shared_head_head))\.weight$")
FALLBACK = 0                         # the file's token for a model token it does not hold


class DraftVocabError(ValueError):
    """The draft vocabulary cannot be made; the message says why and what to pass instead."""


def draft_ids(token_types: np.ndarray, n: int) -> np.ndarray:
    """The ids a draft file keeps: 0..n-1 and every control or user-defined id after them,
    ascending (so a distribution over the file's ids maps to one over the model's in order)."""
    n_vocab = len(token_types)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not MIN_IDS <= n < n_vocab:
        raise ParamError("draft_vocab", f"draft_vocab must be an integer from {MIN_IDS} (the byte tokens) "
                         f"to {n_vocab - 1} (below the model's {n_vocab} tokens), got {n!r}; leave it unset "
                         "to draft over the whole vocabulary")
    types = np.asarray(token_types)
    tail = n + np.flatnonzero(np.isin(types[n:], KEPT_TYPES))
    return np.concatenate([np.arange(n), tail]).astype(np.int32)


@dataclass(frozen=True, eq=False)
class DraftVocab:
    """The draft file's ids and the model's: what the drafter maps tokens through."""

    ids: np.ndarray      # [m] int32, ascending: the model's id of the file's token i
    to_sub: np.ndarray   # [n_vocab] int32: the file's token for each model id (FALLBACK if absent)

    @classmethod
    def of(cls, ids: np.ndarray, n_vocab: int) -> DraftVocab:
        ids = np.asarray(ids, dtype=np.int32)
        if ids.ndim != 1 or not ids.size or ids[0] < 0 or ids[-1] >= n_vocab or np.any(np.diff(ids) <= 0):
            raise DraftVocabError(f"a draft file's ids must ascend within [0, {n_vocab}); this one's do not: "
                                  "make it again from this model")
        to_sub = np.full(n_vocab, FALLBACK, dtype=np.int32)
        to_sub[ids] = np.arange(ids.size, dtype=np.int32)
        return cls(ids, to_sub)

    def inputs(self, tokens: np.ndarray) -> np.ndarray:
        """The file's tokens for model tokens fed to the head."""
        return self.to_sub[tokens]

    def token(self, sub: int) -> int:
        """The model's id of the file's token ``sub`` (a draft)."""
        return int(self.ids[sub])

    def dist(self, d: Dist) -> Dist:
        """A distribution over the file's ids as one over the model's (ids stay ascending)."""
        return Dist(self.ids[d.ids], d.probs)

    def widen(self, logits: np.ndarray) -> np.ndarray:
        """The head's row over the model's ids, -inf where the file has no token: for the
        steps that speak the model's ids (penalties, a grammar's mask)."""
        row = np.full(self.to_sub.size, -np.inf, dtype=np.float32)
        row[self.ids] = logits
        return row


@dataclass(eq=False)
class DraftHead:
    """A draft file loaded: the model the drafter's context runs, and its ids."""

    model: NativeModel
    vocab: DraftVocab

    @classmethod
    def load(cls, path: Path, n_vocab: int, **model_options) -> DraftHead:
        """Load the draft file at ``path`` for a model of ``n_vocab`` tokens."""
        vocab = DraftVocab.of(read_ids(path), n_vocab)
        return cls(NativeModel(str(path), load_mtp=True, **model_options), vocab)

    def close(self) -> None:
        self.model.close()


# ---------------------------------------------------------------------------- the file


def cache_dir() -> Path:
    """Where draft files are kept ($PYMTP_CACHE_DIR, else $XDG_CACHE_HOME/pymtp, else
    ~/.cache/pymtp): each is made once per model file and n."""
    root = os.environ.get("PYMTP_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pymtp"
    return Path(root) / "draft-vocab"


def draft_file(model: Path, n: int) -> Path:
    """The draft file of ``model`` over ``n`` ids, written first if the cache lacks it
    (once; seconds at a 248k vocabulary). Named after the
    model's files (path, size, modification time), so a changed model gets a new one."""
    from .gguf_info import read_parts

    split = parse_split_name(model.name)
    files = [model] if split is None else [model.with_name(split_name(split[0], i, split[2])) for i in range(split[2])]
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    key = hashlib.sha256(repr((FORMAT, n, stats)).encode()).hexdigest()[:12]
    out = cache_dir() / f"{model.stem}-dv{n}-{key}.gguf"
    if out.is_file() and not _whole(out):     # pymtp's own file, cut short or damaged since: made again
        out.unlink(missing_ok=True)
    if not out.is_file():
        try:
            write_draft_file(read_parts(model), n, out)
        except OSError as e:
            raise DraftVocabError(f"cannot write the draft file {str(out)!r} ({e.strerror or e}); set "
                                  "PYMTP_CACHE_DIR to a folder you can write") from e
    return out


def _whole(path: Path) -> bool:
    """Whether a cached draft file reads as one: its header, its ids, and every tensor's
    data inside the file (one cut short failed to load with an error about a byte offset)."""
    try:
        header = read_header(path)
        size = path.stat().st_size
    except (ValueError, OSError):
        return False
    return IDS_KEY in header.fields and all(t.data_offset + t.n_bytes <= size for t in header.tensors)


def write_draft_file(parts: list[Header], n: int, out: Path) -> np.ndarray:
    """Write the draft file of the model whose GGUF headers are ``parts`` (part 0 holds
    the metadata) to ``out``, through a temporary file renamed when complete. Returns
    the kept ids."""
    from gguf import GGUFValueType, GGUFWriter

    reader = parts[0]
    arch = scalar(reader, ARCHITECTURE)
    n_trunk = (int(scalar(reader, BLOCK_COUNT.format(arch=arch), 0))
               - int(scalar(reader, NEXTN_PREDICT_LAYERS.format(arch=arch), 0)))
    types = np.asarray(reader.fields[TOKEN_TYPES].contents(), dtype=np.int32)
    ids = draft_ids(types, n)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    os.close(fd)
    writer = GGUFWriter(tmp, arch)
    try:
        for key, value, vtype, sub in _metadata(reader, arch, ids):
            writer.add_key_value(key, value, vtype, sub_type=sub)
        writer.add_key_value(IDS_KEY, ids.tolist(), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
        tensors = [(t, _rows(r.path, t, ids)) for r in parts for t in r.tensors if _kept(t.name, n_trunk)]
        for t, data in tensors:
            writer.add_tensor_info(t.name, data.shape, np.dtype(np.uint8), data.nbytes, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, data in tensors:
            writer.write_tensor_data(data)
        writer.close()
        os.chmod(tmp, 0o644)      # mkstemp makes it 0600
        os.replace(tmp, out)
    finally:
        writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return ids


def read_ids(path: Path) -> np.ndarray:
    """The kept ids a draft file names (``IDS_KEY``)."""
    field = read_header(path).fields.get(IDS_KEY)
    if field is None:
        raise DraftVocabError(f"{str(path)!r} is not a pymtp draft file (it has no {IDS_KEY!r}); delete it "
                              "and load the model again to make a new one")
    return np.asarray(field.contents(), dtype=np.int32)


def _kept(name: str, n_trunk: int) -> bool:
    """A tensor the draft file holds: every one but the trunk's blocks."""
    m = re.match(r"^blk\.(\d+)\.", name)
    return m is None or int(m.group(1)) >= n_trunk


def _rows(path: Path, t: Tensor, ids: np.ndarray) -> np.ndarray:
    """The tensor's stored bytes, mapped from ``path``, shaped as its dimensions with a
    row's bytes last ([rows, bytes a row] for a per-token tensor), and cut to ``ids``
    where it has a row per token."""
    rows = tuple(reversed(t.shape[1:]))
    shape = (*rows, t.n_bytes // max(1, int(np.prod(rows))))
    data = np.memmap(path, np.uint8, "r", offset=t.data_offset, shape=shape)
    return np.ascontiguousarray(data[ids]) if ROW_TENSORS.match(t.name) else data


def _metadata(reader: Header, arch: str, ids: np.ndarray):
    """(key, value, type, item type) of every KV pair the draft file copies: the split
    keys dropped, the per-token tables cut to ``ids``, special ids renumbered (or dropped
    when the file lacks the token), the vocabulary size the file's."""
    from gguf import GGUFValueType

    sub = {int(i): j for j, i in enumerate(ids)}
    for key, f in reader.fields.items():
        if key == ARCHITECTURE or key.startswith("split."):
            continue
        vtype = GGUFValueType(f.type)
        item = GGUFValueType(f.item_type) if vtype == GGUFValueType.ARRAY else None
        value = f.contents()
        if key in PER_TOKEN_TABLES:
            value = [value[i] for i in ids]
        elif SPECIAL_ID.match(key):
            if int(value) not in sub:
                continue
            value = sub[int(value)]
        elif key == f"{arch}.vocab_size":
            value = len(ids)
        yield key, value, vtype, item
