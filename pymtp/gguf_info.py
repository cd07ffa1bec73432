"""Read a GGUF's header before llama.cpp sees it, so bad input gets a clear error.

llama.cpp reports a wrong file as a NULL model and a log line; here we say what is wrong
and how to fix it: missing path, not a GGUF, truncated, another architecture, missing
tensors, no MTP block, a part of a split GGUF that is not its first or whose other parts
are missing.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .gguf_facts import (ARCHS, BLOCK_COUNT, NEXTN_PREDICT_LAYERS, SplitError, architecture, check_parts,
                         parse_split_name, part_paths, recurrent_flags, scalar, split_paths, split_position)
from .gguf_header import Header, read_header

GRAFT_HINT = ("add one with `gguf_graft MODEL.gguf MTP_SOURCE -o MODEL-mtp.gguf` "
              "(MTP_SOURCE: the HF checkpoint or its mtp.safetensors)")


MTP_ONLY_HINT = ("this is an MTP-only file: graft it into its base with gguf_graft "
                 "(`gguf_graft BASE.gguf THIS_FILE -o MODEL-mtp.gguf`)")

# Trunk tensors llama.cpp needs in every layer (q/k/v of the attention layers may be fused
# or split, so they are left out; the recurrent layers' attn_qkv/attn_gate have no split
# form: llama.cpp loads them as optional but its graph uses them, and a file without one
# crashed the process with SIGSEGV).
# llama.cpp treats a file without blk.0.attn_norm as MTP-only and then loads *no* trunk
# tensor as required: such a file, or one with holes in its trunk, crashed the process in
# llama_init_from_model instead of failing the load, so we check before it sees the file.
GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight")
LAYER_TENSORS = ("attn_norm.weight", "post_attention_norm.weight")
RECURRENT_TENSORS = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias",
                     "ssm_a", "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight",
                     "ssm_out.weight")
ATTENTION_TENSORS = ("attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight")
FFN_TENSORS = {"qwen35": ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"),
               "qwen35moe": ("ffn_gate_inp.weight", "ffn_down_exps.weight")}


class ModelFileError(ValueError):
    """The model file cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    arch: str
    name: str
    block_count: int
    n_nextn: int
    n_embd: int
    n_recurrent_layers: int
    recurrent_bytes: int      # recurrent state of one sequence, one snapshot plane (f32)
    chat_template: str | None

    @property
    def has_mtp(self) -> bool:
        return self.n_nextn > 0


def inspect(path: str | os.PathLike) -> ModelInfo:
    """Validate ``path`` as a Qwen3.5 GGUF and return what the runtime needs from its header."""
    p = Path(path)
    try:      # a folder on the way that cannot be entered raises PermissionError (a traceback)
        st = p.stat()
    except FileNotFoundError:
        link = " (a link whose target is missing)" if p.is_symlink() else ""
        raise ModelFileError(f"model file not found: {str(p)!r}{link}") from None
    except OSError as exc:
        raise ModelFileError(f"cannot read {str(p)!r}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelFileError(f"{str(p)!r} is a directory; pass the path of a .gguf file")
    if not stat.S_ISREG(st.st_mode):     # a pipe or a device: reading its header waited forever (a FIFO)
        raise ModelFileError(f"{str(p)!r} is not a regular file (a pipe or a device); llama.cpp maps the "
                             "model from disk: pass the path of a .gguf file")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read {str(p)!r}: {exc.strerror or exc}") from None
    if not magic:      # a download that failed: converting would not help
        raise ModelFileError(f"{str(p)!r} is empty (0 bytes); download or convert it again")
    if magic != b"GGUF":
        raise ModelFileError(
            f"{str(p)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "convert the checkpoint with llama.cpp's convert_hf_to_gguf.py")
    try:
        return _read_info(p, read_parts(p))
    except ModelFileError:
        raise
    except (ValueError, TypeError, IndexError, ArithmeticError) as exc:   # a mangled value
        raise ModelFileError(f"{str(p)!r} is corrupt: its metadata cannot be read "
                             f"({type(exc).__name__}: {exc}); download or convert it again") from exc


def _read_info(p: Path, readers: list[Header]) -> ModelInfo:
    reader = readers[0]  # part 0 of a split holds all the metadata
    arch = architecture(reader)
    if arch not in ARCHS:
        raise ModelFileError(
            f"{str(p)!r} is a {arch or 'unknown'!r} model; pymtp runs Qwen3.5/3.6 models "
            f"(architectures {', '.join(ARCHS)})")
    block_count = int(scalar(reader, BLOCK_COUNT.format(arch=arch), 0))
    n_nextn = int(scalar(reader, NEXTN_PREDICT_LAYERS.format(arch=arch), 0))
    _check_hparams(p, reader, arch, block_count, n_nextn)
    n_embd = int(scalar(reader, f"{arch}.embedding_length", 0))
    recurrent = recurrent_flags(reader, arch, block_count - n_nextn)
    n_recr = sum(recurrent)
    _check_tensors(p, {t.name for r in readers for t in r.tensors}, arch, recurrent, n_nextn)
    d_conv = int(scalar(reader, f"{arch}.ssm.conv_kernel", 4))
    d_state = int(scalar(reader, f"{arch}.ssm.state_size", 0))
    n_group = int(scalar(reader, f"{arch}.ssm.group_count", 0))
    dt_rank = int(scalar(reader, f"{arch}.ssm.time_step_rank", 0))
    conv_dim = d_state * (2 * n_group + dt_rank)
    per_layer = (d_conv - 1) * conv_dim + d_state * d_state * dt_rank
    template = scalar(reader, "tokenizer.chat_template")
    return ModelInfo(
        path=p, arch=arch, name=str(scalar(reader, "general.name", p.stem)),
        block_count=block_count, n_nextn=n_nextn, n_embd=n_embd, n_recurrent_layers=n_recr,
        recurrent_bytes=4 * per_layer * n_recr,
        chat_template=str(template) if template is not None else None)


def read_parts(p: Path) -> list[Header]:
    """The headers of the file, or of every part of a split GGUF given its first part."""
    reader = _read(p)
    index, count = split_position(reader)
    if count == 1:
        return [reader]
    try:
        if index != 0:
            raise ModelFileError(
                f"{str(p)!r} is part {index + 1} of a {count}-file split GGUF; load its first part, "
                f"{str(split_paths(p, index, count)[0])!r} (llama.cpp reads the other parts from there)")
        paths = part_paths(p, index, count)
        readers = [reader, *(_read(q) for q in paths[1:])]
        check_parts(readers, paths)
    except SplitError as e:
        raise ModelFileError(str(e)) from e
    return readers


def _read(p: Path) -> Header:
    """The header of `p`, refusing a file whose tensors run past its end."""
    try:
        reader = read_header(p)
    except OSError as exc:      # a part that cannot be read is not corrupt
        raise ModelFileError(f"cannot read {str(p)!r}: {exc.strerror or exc}") from None
    except Exception as exc:  # ValueError/IndexError/struct errors on bad headers
        raise ModelFileError(f"{str(p)!r} is truncated or corrupt: {exc}") from exc
    size = p.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelFileError(
            f"{str(p)!r} is truncated: its tensors need {end} bytes but the file has {size}; "
            "download or copy it again")
    return reader


LLAMA_MAX_LAYERS = 512    # llama.cpp's per-layer arrays hold this many
LLAMA_MAX_EXPERTS = 1024


def _check_hparams(p: Path, reader, arch: str, block_count: int, n_nextn: int) -> None:
    """Refuse values that llama.cpp takes on trust and then aborts on (GGML_ASSERT, SIGABRT):
    found by flipping bytes of a fixture's header (tests/test_fuzz_gguf.py)."""
    def corrupt(what: str) -> ModelFileError:
        return ModelFileError(f"{str(p)!r} is corrupt: {what}; download or convert it again")

    if not 0 < block_count <= LLAMA_MAX_LAYERS:
        raise corrupt(f"{arch}.block_count is {block_count}, not 1..{LLAMA_MAX_LAYERS}")
    if not 0 <= n_nextn < block_count:
        raise corrupt(f"{arch}.nextn_predict_layers is {n_nextn} of {block_count} layers")
    heads = scalar(reader, f"{arch}.attention.head_count", 0)
    heads = int(list(heads)[0] if isinstance(heads, list) else heads)
    n_embd = int(scalar(reader, f"{arch}.embedding_length", 0))
    head_dim = int(scalar(reader, f"{arch}.attention.key_length", n_embd // heads if heads > 0 else 0))
    n_rot = int(scalar(reader, f"{arch}.rope.dimension_count", head_dim))
    if n_rot % 2 or not 0 < n_rot <= head_dim:      # 0 hung the first decode
        raise corrupt(f"{arch}.rope.dimension_count is {n_rot}, not an even number in 2..{head_dim}")
    eps = float(scalar(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))
    if not eps >= 0:                                  # negative or NaN: ggml asserts on it
        raise corrupt(f"{arch}.attention.layer_norm_rms_epsilon is {eps}, not >= 0")
    sections = scalar(reader, f"{arch}.rope.dimension_sections")
    if sections is not None:
        total = sum(int(x) for x in list(sections)[:4])
        if not 0 < total <= head_dim:     # rope divides by it, and indexes the head with it
            raise corrupt(f"{arch}.rope.dimension_sections add up to {total}, not 1..{head_dim}")
    n_expert = int(scalar(reader, f"{arch}.expert_count", 0))
    used = scalar(reader, f"{arch}.expert_used_count", 0)
    used = max((int(x) for x in used), default=0) if isinstance(used, list) else int(used)
    if n_expert > LLAMA_MAX_EXPERTS or used > n_expert or (n_expert and not used):
        raise corrupt(f"{arch}.expert_used_count is {used} of {n_expert} experts")
    d_inner = scalar(reader, f"{arch}.ssm.inner_size")
    d_state = int(scalar(reader, f"{arch}.ssm.state_size", 0))
    dt_rank = int(scalar(reader, f"{arch}.ssm.time_step_rank", 0))
    # the graph uses one, the weights the other
    if d_inner is not None and int(d_inner) != d_state * dt_rank:
        raise corrupt(f"{arch}.ssm.inner_size is {d_inner}, not state_size x time_step_rank "
                      f"= {d_state * dt_rank}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(set(raw := tokens.raw_strings())) != len(raw):
        raise corrupt("tokenizer.ggml.tokens holds the same token twice")


def _check_tensors(p: Path, names: set[str], arch: str, recurrent: list[bool], n_nextn: int) -> None:
    """Refuse a file whose trunk is absent (an MTP-only file) or has holes in it."""
    trunk = [f"blk.{il}.{t}" for il, rec in enumerate(recurrent)
             for t in LAYER_TENSORS + (RECURRENT_TENSORS if rec else ATTENTION_TENSORS) + FFN_TENSORS[arch]]
    missing = [t for t in GLOBAL_TENSORS + tuple(trunk) if t not in names]
    if not missing:
        return
    if n_nextn > 0 and not any(t in names for t in trunk):
        raise ModelFileError(f"{str(p)!r} has no trunk layers, only an MTP block; {MTP_ONLY_HINT}")
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    raise ModelFileError(
        f"{str(p)!r} is missing {len(missing)} tensor(s) the model needs ({shown}); "
        "the file is incomplete: convert or download it again")


def require_mtp(info: ModelInfo, plain: str | None = "spec='none'") -> None:
    """Refuse MTP on a model without the block; ``plain`` is how the caller's user asks for
    plain decoding instead (None: there is no such way, as in bench)."""
    if not info.has_mtp:
        tail = f", or decode with {plain}" if plain else ""
        raise ModelFileError(f"{str(info.path)!r} has no MTP block (nextn_predict_layers is 0); {GRAFT_HINT}{tail}")


def gguf_bytes(path: Path) -> int:
    """The bytes of a GGUF, every part of a split one (model-00001-of-00003.gguf ...)."""
    parsed = parse_split_name(path.name)
    if parsed is None:
        return path.stat().st_size
    return sum(p.stat().st_size for p in split_paths(path, parsed[1], parsed[2]) if p.exists())
