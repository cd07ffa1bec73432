"""The checks between reading and writing: each failure names what is wrong and how to fix it.

Order matters for the messages: first whether BASE can take a block at all, then whether
SOURCE is the right kind of block with exactly the expected tensors, then whether its
sizes are the base model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import GgufInfo, block_of
from .errors import GraftError
from .mapping import DENSE, MOE, required

if TYPE_CHECKING:
    from .plan import Mapped
    from .source import Source

DIM_LABELS = {
    "n_trunk": "trunk blocks (block_count without MTP)",
    "n_embd": "hidden size",
    "n_head": "attention heads",
    "n_head_kv": "KV heads",
    "head_dim": "head dim",
    "n_ff": "feed-forward size",
    "n_expert": "experts",
    "n_ff_exp": "expert feed-forward size",
    "n_ff_shexp": "shared-expert feed-forward size",
}
# HF config.json keys for the same sizes (text_config merged in).
CONFIG_KEYS = {
    "n_trunk": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
    "n_head_kv": "num_key_value_heads", "head_dim": "head_dim", "n_ff": "intermediate_size",
    "n_expert": "num_experts", "n_ff_exp": "moe_intermediate_size",
    "n_ff_shexp": "shared_expert_intermediate_size",
}


def base_is_free(base: GgufInfo, force: bool) -> None:
    """A base with an MTP block is refused unless --force, which replaces the block; a
    base with no trunk layer at all (an MTP-only file) always: it is a SOURCE, and --force
    wrote a file of an MTP block alone that nothing can load."""
    if base.n_nextn and not any((b := block_of(t.name)) is not None and b[0] < base.n_trunk
                                for _, t in base.tensors()):
        raise GraftError(
            f"BASE {str(base.path)!r} has no trunk layers, only an MTP block: it is an MTP-only file, "
            f"a SOURCE; graft it into the model it came from: gguf_graft MODEL.gguf {str(base.path)!r} -o OUT.gguf")
    stray = next((t.name for _, t in base.tensors() if ".nextn." in t.name), None)
    if not base.n_nextn and stray is not None:
        # the block counted as a trunk layer: the graft appended a second one, unloadable
        raise GraftError(
            f"BASE {str(base.path)!r} holds MTP tensors ({stray}) but no {base.arch}.nextn_predict_layers: "
            "its metadata lost the MTP block's count, and llama.cpp cannot load it either; convert the "
            "model again (with or without its MTP block)")
    if base.n_nextn and not force:
        held = f"tensors blk.{base.n_trunk}.*" if stray is not None else "but none of its tensors"
        raise GraftError(
            f"BASE {str(base.path)!r} already has an MTP block ({base.arch}.nextn_predict_layers = "
            f"{base.n_nextn}, {held}); pass --force to replace it")


def complete(base: GgufInfo, source: Source, mapped: dict[str, Mapped], unknown: list[str],
             missing: list[str], gapped: set[str] | None = None) -> None:
    """SOURCE is a block of the base's kind, with every required tensor and no unknown one.

    `missing` and `gapped` come from the mapping: per-expert tensors it could not find,
    and the stacked tensors (GGUF suffixes) they belong to.
    """
    if source.gguf is not None and source.gguf.arch != base.arch:
        raise GraftError(f"SOURCE {source.label} is {source.gguf.arch} but BASE is {base.arch}; "
                         "they come from different models")
    kinds = {m.entry.ffn for m in mapped.values()} - {"any"}
    want = MOE if base.dims.is_moe else DENSE
    if kinds - {want}:
        have = "an MoE" if MOE in kinds else "a dense"
        raise GraftError(f"SOURCE {source.label} has {have} MTP block but BASE is {base.arch} "
                         f"({'MoE' if want == MOE else 'dense'}); they come from different models")
    missing = list(missing)
    for entry in required(base.dims):
        if entry.gguf in mapped or entry.gguf in (gapped or ()):
            continue
        if source.gguf is not None:
            missing.append(f"blk.{source.gguf.n_trunk}.{entry.gguf}")
        elif ".experts." in entry.hf:
            fused = "down_proj" if "down_proj" in entry.hf else "gate_up_proj"
            missing.append(f"{entry.hf.replace('experts.', 'experts.{e}.')} for every expert "
                           f"(or a fused mtp.layers.0.mlp.experts.{fused})")
        else:
            missing.append(entry.hf)
    problems = []
    if missing:
        problems.append("missing MTP tensors:\n" + "\n".join(f"  {n}" for n in missing))
    if unknown:
        problems.append("unknown MTP tensors (gguf_graft will not drop them silently; llama.cpp runs "
                        "exactly one MTP block):\n" + "\n".join(f"  {n}" for n in unknown))
    if problems:
        raise GraftError(f"SOURCE {source.label} is not a complete Qwen3.5 MTP block:\n"
                         + "\n".join(problems))


def fits(base: GgufInfo, source: Source, mapped: dict[str, Mapped]) -> None:
    """SOURCE's sizes (from shapes, config.json or GGUF metadata) are BASE's; then every
    tensor has exactly the ggml shape llama.cpp's loader asks for."""
    want = {k: v for k, v in vars(base.dims).items() if v is not None}
    want["n_trunk"] = base.n_trunk
    claims: list[tuple[str, dict[str, Any]]] = [("tensor shapes", dims_from_shapes(mapped))]
    if source.gguf is not None:
        claims.append(("its GGUF metadata", {**vars(source.gguf.dims), "n_trunk": source.gguf.n_trunk}))
    if source.config is not None:
        claims.append(("config.json", {k: source.config.get(key) for k, key in CONFIG_KEYS.items()}))
    wrong = [(where, f"  {DIM_LABELS[k]}: BASE {want[k]}, SOURCE {have[k]} (from {where})")
             for where, have in claims for k in DIM_LABELS
             if k in want and isinstance(have.get(k), int) and have[k] != want[k]]
    bad = [f"  blk.{base.n_trunk}.{name}: SOURCE {_ne(m.ne)} from {m.origin}, BASE needs {_ne(need)}"
           for name, m in mapped.items() if tuple(m.ne) != (need := m.entry.ne(base.dims))]
    another_model = any(where != "tensor shapes" for where, _ in wrong) or _agree(base, mapped)
    if wrong and another_model:
        raise GraftError(f"SOURCE {source.label} does not fit BASE {str(base.path)!r}:\n"
                         + "\n".join(line for _, line in wrong)
                         + "\nThe MTP block must come from the same model (size and variant) as BASE.")
    if bad:
        raise GraftError(f"SOURCE {source.label} has tensors of the wrong shape for BASE:\n" + "\n".join(bad)
                         + ("" if another_model else "\nThe other tensors' shapes disagree with these, so "
                            "the file is corrupt or was edited; convert or download it again."))


def _agree(base: GgufInfo, mapped: dict[str, Mapped]) -> bool:
    """Whether SOURCE's tensors agree with each other on the sizes their shapes imply: a block
    from another model does, a corrupt or hand-edited file need not."""
    sizes = {**{k: v for k, v in vars(base.dims).items()}, **dims_from_shapes(mapped)}
    dims = type(base.dims)(**sizes)
    return all(tuple(m.ne) == m.entry.ne(dims) for m in mapped.values())


def dims_from_shapes(mapped: dict[str, Mapped]) -> dict[str, int]:
    """The sizes SOURCE's tensors imply (ggml shapes; see mapping.TABLE)."""
    ne = {name: m.ne for name, m in mapped.items()}
    found: dict[str, int] = {}

    def take(dim: str, tensor: str, axis: int, per: int = 1) -> None:
        if tensor in ne and len(ne[tensor]) > axis and per > 0:
            found[dim] = ne[tensor][axis] // per

    take("n_embd", "nextn.eh_proj.weight", 1)
    take("head_dim", "attn_q_norm.weight", 0)
    hd = found.get("head_dim", 0)
    take("n_head", "attn_q.weight", 1, 2 * hd)  # per head: q and its gate
    take("n_head_kv", "attn_k.weight", 1, hd)
    take("n_ff", "ffn_gate.weight", 1)
    take("n_expert", "ffn_gate_inp.weight", 1)
    take("n_expert", "ffn_gate_exps.weight", 2)
    take("n_ff_exp", "ffn_gate_exps.weight", 1)
    take("n_ff_shexp", "ffn_gate_shexp.weight", 1)
    return found


def _ne(ne: tuple[int, ...]) -> str:
    return "{" + ", ".join(str(n) for n in ne) + "}"

