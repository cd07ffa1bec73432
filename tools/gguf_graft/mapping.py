"""The HF -> GGUF map of the Qwen3.5/3.6 MTP block, as one table.

Facts come from llama.cpp's converter and loaders (pinned llama-cpp-python 0.3.36):
names from `conversion/qwen.py` `_QwenMtpMixin.filter_tensors` (`mtp.layers.0.*` becomes
block N = the trunk's block count, `mtp.fc/norm/pre_fc_*` map onto the same block) and
gguf-py's tensor map; the +1 on norms from `Qwen3NextModel.modify_tensors`; which tensors
stay F32 from `conversion/base.py` `prepare_tensors`; ggml shapes from `load_block_mtp`
in `src/models/qwen35.cpp` and `qwen35moe.cpp`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Dims:
    """The sizes an MTP block must agree on with its trunk."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int | None = None  # dense FFN width (qwen35)
    n_expert: int | None = None  # qwen35moe
    n_ff_exp: int | None = None
    n_ff_shexp: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.n_expert is not None


# Roles: how a tensor is transformed and which type it is written in.
NORM = "norm"  # Qwen3.5 zero-centred RMSNorm: +1 on conversion; always F32
ROUTER = "router"  # expert router and shared-expert gate: always F32
MATRIX = "matrix"  # written in the chosen --type

ANY, DENSE, MOE = "any", "dense", "moe"


@dataclass(frozen=True)
class Entry:
    hf: str  # HF name, prefix normalised to "mtp."
    gguf: str  # GGUF name without the "blk.{N}." prefix
    ffn: str  # which model kind has it: ANY, DENSE or MOE
    role: str
    ne: Callable[[Dims], tuple[int, ...]]  # ggml shape (fastest dim first)


L = "mtp.layers.0."

TABLE: tuple[Entry, ...] = (
    Entry("mtp.fc.weight", "nextn.eh_proj.weight", ANY, MATRIX, lambda d: (2 * d.n_embd, d.n_embd)),
    Entry("mtp.pre_fc_norm_embedding.weight", "nextn.enorm.weight", ANY, NORM, lambda d: (d.n_embd,)),
    Entry("mtp.pre_fc_norm_hidden.weight", "nextn.hnorm.weight", ANY, NORM, lambda d: (d.n_embd,)),
    Entry("mtp.norm.weight", "nextn.shared_head_norm.weight", ANY, NORM, lambda d: (d.n_embd,)),
    Entry(L + "input_layernorm.weight", "attn_norm.weight", ANY, NORM, lambda d: (d.n_embd,)),
    Entry(L + "post_attention_layernorm.weight", "post_attention_norm.weight", ANY, NORM,
          lambda d: (d.n_embd,)),
    # q_proj keeps HF's per-head [q | gate] rows; the graph views it with a 2*head_dim stride.
    Entry(L + "self_attn.q_proj.weight", "attn_q.weight", ANY, MATRIX,
          lambda d: (d.n_embd, 2 * d.n_head * d.head_dim)),
    Entry(L + "self_attn.k_proj.weight", "attn_k.weight", ANY, MATRIX,
          lambda d: (d.n_embd, d.n_head_kv * d.head_dim)),
    Entry(L + "self_attn.v_proj.weight", "attn_v.weight", ANY, MATRIX,
          lambda d: (d.n_embd, d.n_head_kv * d.head_dim)),
    Entry(L + "self_attn.o_proj.weight", "attn_output.weight", ANY, MATRIX,
          lambda d: (d.n_head * d.head_dim, d.n_embd)),
    Entry(L + "self_attn.q_norm.weight", "attn_q_norm.weight", ANY, NORM, lambda d: (d.head_dim,)),
    Entry(L + "self_attn.k_norm.weight", "attn_k_norm.weight", ANY, NORM, lambda d: (d.head_dim,)),
    Entry(L + "mlp.gate_proj.weight", "ffn_gate.weight", DENSE, MATRIX, lambda d: (d.n_embd, d.n_ff)),
    Entry(L + "mlp.up_proj.weight", "ffn_up.weight", DENSE, MATRIX, lambda d: (d.n_embd, d.n_ff)),
    Entry(L + "mlp.down_proj.weight", "ffn_down.weight", DENSE, MATRIX, lambda d: (d.n_ff, d.n_embd)),
    Entry(L + "mlp.gate.weight", "ffn_gate_inp.weight", MOE, ROUTER, lambda d: (d.n_embd, d.n_expert)),
    # HF stores the shared-expert gate as [1, n_embd]; the converter keeps both dims.
    Entry(L + "mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight", MOE, ROUTER,
          lambda d: (d.n_embd, 1)),
    Entry(L + "mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight", MOE, MATRIX,
          lambda d: (d.n_embd, d.n_ff_shexp)),
    Entry(L + "mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight", MOE, MATRIX,
          lambda d: (d.n_embd, d.n_ff_shexp)),
    Entry(L + "mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight", MOE, MATRIX,
          lambda d: (d.n_ff_shexp, d.n_embd)),
    # Stacked experts; see expert_member() for the per-expert and fused HF forms.
    Entry(L + "mlp.experts.gate_proj.weight", "ffn_gate_exps.weight", MOE, MATRIX,
          lambda d: (d.n_embd, d.n_ff_exp, d.n_expert)),
    Entry(L + "mlp.experts.up_proj.weight", "ffn_up_exps.weight", MOE, MATRIX,
          lambda d: (d.n_embd, d.n_ff_exp, d.n_expert)),
    Entry(L + "mlp.experts.down_proj.weight", "ffn_down_exps.weight", MOE, MATRIX,
          lambda d: (d.n_ff_exp, d.n_embd, d.n_expert)),
)

BY_HF = {e.hf: e for e in TABLE}
BY_GGUF = {e.gguf: e for e in TABLE}

# Where the converter emits the tensors of a group that come out of one step together:
# per-expert tensors are stacked when the last one is seen, as down, gate, up
# (Qwen2MoeModel.modify_tensors); a fused gate_up_proj yields gate, then up.
GROUP_ORDER = {"down_proj": 0, "gate_proj": 1, "up_proj": 2}

_EXPERT = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.(gate_up_proj|down_proj)(\.weight)?$")


# How an HF checkpoint directory stores its weights.
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def mtp_shards(weight_map: dict[str, str]) -> list[str]:
    """The shard files of an HF index that hold MTP tensors, sorted as the converter reads them."""
    return sorted({shard for name, shard in weight_map.items() if hf_mtp_name(name)})


def hf_mtp_name(name: str) -> str | None:
    """`mtp.…` for an HF MTP tensor under any of its prefixes, else None.

    `model.language_model.mtp.`, `language_model.mtp.`, `model.mtp.` and `mtp.` all occur;
    the converter drops `language_model.` and then `model.` in front of `mtp.`. A stored
    `rotary_emb.inv_freq` is not a weight (the converter skips it too).
    """
    name = name.replace("language_model.", "")
    name = name.removeprefix("model.") if name.startswith("model.mtp.") else name
    if name.endswith(".rotary_emb.inv_freq"):   # a RoPE buffer some exports keep: llama.cpp computes it
        return None
    return name if name.startswith("mtp.") else None


def lookup(hf: str) -> Entry | None:
    """The table entry for an `mtp.…` HF name in its stacked form, else None."""
    return BY_HF.get(hf)


def expert_member(hf: str) -> tuple[str, int] | None:
    """(stacked name, expert index) for a per-expert HF tensor, else None."""
    if (m := _EXPERT.match(hf)) is None:
        return None
    return f"{L}mlp.experts.{m.group(2)}.weight", int(m.group(1))


def fused_expert(hf: str) -> list[tuple[str, int | None]] | None:
    """The stacked names a fused expert tensor ([E, rows, cols], no per-expert split) holds.

    Returns [(name, half)] where half is 0/1 for the gate/up halves of `gate_up_proj`
    (split on dim -2, gate first) and None for a whole `down_proj`; None if not fused.
    """
    if (m := _FUSED.match(hf)) is None:
        return None
    if m.group(1) == "down_proj":
        return [(f"{L}mlp.experts.down_proj.weight", None)]
    return [(f"{L}mlp.experts.gate_proj.weight", 0), (f"{L}mlp.experts.up_proj.weight", 1)]


def required(dims: Dims) -> list[Entry]:
    """The entries an MTP block of this model kind must have."""
    kind = MOE if dims.is_moe else DENSE
    return [e for e in TABLE if e.ffn in (ANY, kind)]
