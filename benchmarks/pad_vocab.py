"""Widen a trained Qwen3.5 GGUF's vocabulary to Qwen3.5's real size, for sampling benchmarks.

    python benchmarks/pad_vocab.py IN.gguf OUT.gguf [--n-vocab 248320] [--seed 0] [--force]

Why: the shared trained models have 8,192 tokens; real Qwen3.5/3.6 models have 248,320,
and everything sampling does per token (copy the logits, softmax, filters, draws) grows
with the vocabulary. The padded model keeps the trunk, so its decode pays for a real-size
output head, and its greedy output is the original's, token for token.

What changes (everything else is copied unchanged, in the same order):
- every tensor with one row per token (`token_embd.weight`, which is also the output head
  when the model has no `output.weight`; `output.weight`; the MTP block's
  `nextn.embed_tokens` / `nextn.shared_head_head` when a file has them) gets
  n_vocab - n_old new rows in the tensor's own type (Q8_0 rows are quantized with
  `gguf.quants.quantize`; f16 stays f16);
- `tokenizer.ggml.tokens` gets placeholders `<|pad_ID|>` (ID = the token id) of type
  NORMAL, as the bulk of a real 248k vocabulary is; `token_type` and `scores` (if present)
  grow with them, the merges stay as they are. No merge builds a placeholder and the
  pre-tokenizer splits `<|`, `pad`, ... apart, so text tokenizes exactly as before, even
  text containing `<|pad_9000|>`, and a sampled placeholder prints as its name. Not
  CONTROL or USER_DEFINED: llama.cpp scans every such token for each text it tokenizes
  (USER_DEFINED even without parse_special), so 240k of them made tokenizing a short
  prompt with special tokens 40x slower (7.3 ms against 0.18 ms), which no real Qwen3.5
  model pays;
- `{arch}.vocab_size`, if present.

The new rows, and so the tail of the distribution. Row j is mu + TAIL_SPREAD * sigma * g_j,
where mu and sigma are the per-column mean and standard deviation of the tensor's
original rows and g_j ~ N(0, I), drawn from a generator seeded by --seed. For a hidden
state h the new logit is h.mu + TAIL_SPREAD * (sigma * h).g_j: h.mu is exactly the mean
of the original logits, so each placeholder is as likely as an average real token, spread
log-normally around it. Zero-mean "small random vectors" would not do: their logits sit
near 0, above the average real logit (about -2 to -3 in the shared models), and 240k of
them took about 18% of the mass at temperature 1.

TAIL_SPREAD = 0.5 makes the new logits' spread about 0.3x that of the original logits.
Measured on the 2,582 positions of 8 held-out prompts, padded to 248,320 (tiny f16 /
small Q8_0): the highest placeholder logit stays at least 4.9 / 5.3 below the top
original logit, so greedy output cannot change, and the 240,128 placeholders share
1.5% / 3.8% of the probability mass at temperature 1 (median; mean 5.5% / 9.2%, as
flat distributions give them more, as in a real tail) and 0.14% / 0.29% at 0.7 (mean).
In simulation 1.0 cut the margin to ~1.3 logits and tripled the mass; 0 gives every
placeholder the same logit, which is no tail at all. See benchmarks/README.md.

Deterministic: the same input, --n-vocab and --seed give the same bytes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter, TokenType, quants
from gguf.gguf_reader import ReaderTensor
from tqdm import tqdm

QWEN35_N_VOCAB = 248_320
TAIL_SPREAD = 0.5
PAD_TEXT = "<|pad_{}|>"
PAD_TYPE = TokenType.NORMAL
CHUNK_ROWS = 16_384  # new rows generated and quantized at a time (bounds the float32 scratch)

# Tensors with one row per token, and the random stream their new rows come from: an
# MTP copy of the embedding or head gets the same new rows as the tensor it copies.
ROW_TENSORS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^token_embd\.weight$"), "embed"),
    (re.compile(r"^output\.weight$"), "head"),
    (re.compile(r"^blk\.\d+\.nextn\.embed_tokens\.weight$"), "embed"),
    (re.compile(r"^blk\.\d+\.nextn\.shared_head_head\.weight$"), "head"),
)
STREAMS = ("embed", "head")
TOKENS, TOKEN_TYPES, SCORES, MERGES = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                       "tokenizer.ggml.scores", "tokenizer.ggml.merges")
# Types gguf-py can encode new rows into (it only reads K-quants and I-quants).
WRITABLE = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
            GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_0,
            GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0)


class PadError(ValueError):
    """IN, OUT or --n-vocab is wrong; the message says what and how to fix it."""


@dataclass(frozen=True)
class KV:
    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True)
class OutTensor:
    """One tensor of OUT: its type, its stored shape in bytes (rows x bytes per row), and
    a function that returns those bytes (reporting progress in bytes as it goes)."""

    name: str
    qtype: GGMLQuantizationType
    byte_shape: tuple[int, ...]
    produce: Callable[[Callable[[int], object]], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape))


@dataclass
class Summary:
    n_old: int
    n_new: int
    widened: list[str] = field(default_factory=list)
    seconds: float = 0.0


def pad_vocab(src: str | os.PathLike, out: str | os.PathLike, n_vocab: int = QWEN35_N_VOCAB, *,
              seed: int = 0, force: bool = False, progress: bool = True) -> Summary:
    """Write OUT: IN with its vocabulary widened to `n_vocab` tokens (see the module docstring)."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    reader = open_gguf(src)
    n_old = check_request(reader, src, out, n_vocab, force)
    kv = widened_metadata(reader, n_old, n_vocab)
    tensors = widened_tensors(reader, n_old, n_vocab, seed)
    write_gguf(out, reader, kv, tensors, progress)
    widened = [t.name for t in reader.tensors if row_stream(t.name, reader) is not None]
    return Summary(n_old, n_vocab, widened, time.perf_counter() - t0)


# ---------------------------------------------------------------------------- checks


def open_gguf(path: Path) -> GGUFReader:
    """A reader for IN, or a PadError saying why it is not a usable GGUF."""
    if not path.is_file():
        raise PadError(f"IN not found: {str(path)!r} is not a file")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # GGUFReader raises ValueError, struct.error, IndexError, ...
        raise PadError(f"cannot read IN {str(path)!r} as GGUF: {e}") from e
    if reader.endianess != GGUFEndian.LITTLE:
        raise PadError(f"IN {str(path)!r} is a big-endian GGUF; only little-endian files are supported")
    for key in ("general.architecture", TOKENS, TOKEN_TYPES):
        if key not in reader.fields:
            raise PadError(f"IN {str(path)!r} has no {key!r}; is it a model converted by llama.cpp?")
    if not any(t.name == "token_embd.weight" for t in reader.tensors):
        raise PadError(f"IN {str(path)!r} has no token_embd.weight tensor; is it a complete model?")
    return reader


def check_request(reader: GGUFReader, src: Path, out: Path, n_vocab: int, force: bool) -> int:
    """Refuse a smaller vocabulary, rows that disagree with the tokenizer, types gguf-py
    cannot write, and an OUT that is IN or exists without --force. Returns n_old."""
    n_old = len(reader.fields[TOKENS].data)
    if n_vocab < n_old:
        raise PadError(f"--n-vocab {n_vocab} is smaller than IN's vocabulary of {n_old} tokens; "
                       "this tool only widens (give at least the current size)")
    for t in reader.tensors:
        if row_stream(t.name, reader) is None:
            continue
        if len(t.shape) != 2 or int(t.shape[1]) != n_old:
            raise PadError(f"{t.name} has shape {list(map(int, t.shape))} but the tokenizer has {n_old} "
                           "tokens; the file is inconsistent")
        if t.tensor_type not in WRITABLE:
            raise PadError(f"{t.name} is {t.tensor_type.name}, which gguf-py cannot write; it writes "
                           f"{', '.join(q.name for q in WRITABLE)}: pad a file of one of those types")
    if out.exists() and out.resolve() == src.resolve():
        raise PadError(f"OUT {str(out)!r} is IN; this tool never modifies its input: choose another OUT")
    if out.is_dir():
        raise PadError(f"OUT {str(out)!r} is a directory; give a file name, e.g. model-248k.gguf")
    if not out.parent.is_dir():
        raise PadError(f"the directory of OUT {str(out)!r} does not exist")
    if out.exists() and not force:
        raise PadError(f"OUT {str(out)!r} exists; pass --force to overwrite it")
    return n_old


def row_stream(name: str, reader: GGUFReader) -> str | None:
    """The random stream of a tensor with one row per token, else None. Without
    output.weight the embedding is the head (tied), so head copies follow the embedding."""
    for pattern, stream in ROW_TENSORS:
        if pattern.match(name):
            tied = not any(t.name == "output.weight" for t in reader.tensors)
            return "embed" if tied else stream
    return None


# ---------------------------------------------------------------------------- metadata


def widened_metadata(reader: GGUFReader, n_old: int, n_new: int) -> list[KV]:
    """IN's KV pairs with the tokenizer tables and `{arch}.vocab_size` widened."""
    arch = reader.fields["general.architecture"].contents()
    kv = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # header view; the writer adds arch
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = f.contents()
        if key == TOKENS:
            value = value + pad_tokens(value, n_new)
        elif key == TOKEN_TYPES:
            value = value + [int(PAD_TYPE)] * (n_new - n_old)
        elif key == SCORES:
            value = value + [min(value)] * (n_new - n_old)  # placeholders rank last
        elif key == f"{arch}.vocab_size":
            value = n_new
        elif key.startswith("tokenizer.") and key != MERGES and sub is not None and len(value) == n_old:
            raise PadError(f"IN has a per-token table {key!r} this tool does not know how to widen")
        kv.append(KV(key, value, vtype, sub))
    return kv


def pad_tokens(tokens: list[str], n_new: int) -> list[str]:
    """Placeholder texts for ids len(tokens)..n_new-1, none equal to an existing token."""
    new = [PAD_TEXT.format(i) for i in range(len(tokens), n_new)]
    if clash := set(new).intersection(tokens):
        raise PadError(f"IN already has token(s) {sorted(clash)[:3]} named like the placeholders; "
                       f"change PAD_TEXT ({PAD_TEXT!r})")
    return new


# ---------------------------------------------------------------------------- tensors


def widened_tensors(reader: GGUFReader, n_old: int, n_new: int, seed: int) -> list[OutTensor]:
    """Every tensor of OUT in IN's order: per-token tensors widened, the rest copied."""
    out = []
    for t in reader.tensors:
        old = stored_bytes(t)
        stream = row_stream(t.name, reader)
        if stream is None or n_new == n_old:
            out.append(OutTensor(t.name, t.tensor_type, old.shape, _copy(old)))
        else:
            rng_key = [seed, STREAMS.index(stream)]
            out.append(OutTensor(t.name, t.tensor_type, (n_new, old.shape[1]),
                                 lambda update, t=t, k=rng_key: widen(t, n_new, k, update)))
    return out


def stored_bytes(t: ReaderTensor) -> np.ndarray:
    """The tensor's stored bytes, memory-mapped, in the reader's shape with the last axis in
    bytes (for a per-token tensor: [n_old, bytes per row]); the writer reads ggml's shape
    back from it."""
    return np.asarray(t.data).view(np.uint8)


def _copy(data: np.ndarray) -> Callable[[Callable[[int], object]], np.ndarray]:
    def produce(update: Callable[[int], object]) -> np.ndarray:
        update(data.nbytes)
        return data
    return produce


def widen(t: ReaderTensor, n_new: int, rng_key: list[int], update: Callable[[int], object]) -> np.ndarray:
    """IN's rows, then n_new - n_old rows mu + TAIL_SPREAD * sigma * g in the tensor's type."""
    old = stored_bytes(t)  # [n_old, bytes per row]
    n_old, n_embd = old.shape[0], int(t.shape[0])
    mu, sigma = column_stats(old, t.tensor_type, n_embd)
    rng = np.random.default_rng(rng_key)
    rows = np.empty((n_new, old.shape[1]), dtype=np.uint8)
    rows[:n_old] = old
    update(old.nbytes)
    for start in range(n_old, n_new, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, n_new)
        g = rng.standard_normal((stop - start, n_embd), dtype=np.float32)
        rows[start:stop] = encode(mu + np.float32(TAIL_SPREAD) * sigma * g, t.tensor_type)
        update(rows[start:stop].nbytes)
    return rows


def column_stats(stored: np.ndarray, qtype: GGMLQuantizationType, n_embd: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and standard deviation of the dequantized rows, in chunks (float32)."""
    total = np.zeros(n_embd, dtype=np.float64)
    square = np.zeros(n_embd, dtype=np.float64)
    for start in range(0, len(stored), CHUNK_ROWS):
        x = quants.dequantize(stored[start:start + CHUNK_ROWS], qtype).reshape(-1, n_embd).astype(np.float64)
        total += x.sum(0)
        square += (x * x).sum(0)
    mean = total / len(stored)
    var = np.maximum(square / len(stored) - mean * mean, 0.0)
    return mean.astype(np.float32), np.sqrt(var).astype(np.float32)


def encode(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 rows in the stored bytes of `qtype`: [rows, bytes per row]."""
    return np.ascontiguousarray(quants.quantize(rows, qtype)).view(np.uint8).reshape(len(rows), -1)


# ---------------------------------------------------------------------------- write


def write_gguf(out: Path, reader: GGUFReader, kv: list[KV], tensors: list[OutTensor], progress: bool) -> None:
    """Write OUT through a temporary file in its directory, renamed only when complete;
    any error (Ctrl-C included) removes the temporary file."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    os.close(fd)
    writer = GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    try:
        writer.data_alignment = reader.alignment
        for item in kv:
            writer.add_key_value(item.key, item.value, item.vtype, sub_type=item.sub_type)
        for t in tensors:
            writer.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(total=sum(t.nbytes for t in tensors), unit="B", unit_scale=True, unit_divisor=1024,
                  desc="Writing", disable=not progress) as bar:
            for t in tensors:
                writer.write_tensor_data(t.produce(bar.update))
        writer.close()
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; give it a normal file's mode
        os.replace(tmp, out)
    finally:
        writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pad_vocab.py", description=__doc__.split("\n\n")[0],
                                 epilog="See the docstring of benchmarks/pad_vocab.py for the recipe.")
    ap.add_argument("src", metavar="IN.gguf", help="a trained Qwen3.5 GGUF")
    ap.add_argument("out", metavar="OUT.gguf", help="the padded GGUF to write")
    ap.add_argument("--n-vocab", type=int, default=QWEN35_N_VOCAB,
                    help=f"vocabulary size of OUT (default: Qwen3.5's, {QWEN35_N_VOCAB})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the new rows (default: 0)")
    ap.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        s = pad_vocab(args.src, args.out, args.n_vocab, seed=args.seed, force=args.force, progress=not args.quiet)
    except PadError as e:
        print(f"pad_vocab.py: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # disk full, permissions: a message, not a traceback
        print(f"pad_vocab.py: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    print(f"wrote {args.out}: vocabulary {s.n_old} -> {s.n_new}, widened {', '.join(s.widened) or 'nothing'} "
          f"in {s.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
