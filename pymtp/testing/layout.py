"""What a tiny Qwen3.5 GGUF holds: hyperparameters, metadata keys, tensor names and shapes.

The facts come from llama.cpp's loaders (`src/models/qwen35.cpp`, `qwen35moe.cpp`,
`src/llama-model.cpp`) and its converter (`conversion/qwen.py`); each table below is
the single place that states them. Shapes are in ggml order (`ne`, fastest dim first),
the reverse of the numpy shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

ARCH = {"dense": "qwen35", "moe": "qwen35moe"}


@dataclass(frozen=True)
class Hparams:
    """Model sizes. The defaults describe the dense fixture."""

    kind: str = "dense"
    n_trunk: int = 4  # trunk blocks; the MTP block, if any, is blk.{n_trunk}
    n_vocab: int = 384
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_rot: int = 8  # Qwen3.5 rotates a quarter of each head
    rope_sections: tuple[int, int, int, int] = (2, 1, 1, 0)  # sums to n_rot / 2
    rope_freq_base: float = 10_000_000.0
    rms_eps: float = 1e-6
    n_ctx_train: int = 4096
    full_attention_interval: int = 4
    n_ff: int = 128  # dense FFN width
    # Gated DeltaNet (linear attention) layers.
    ssm_d_conv: int = 4
    ssm_d_state: int = 16  # head_k_dim == head_v_dim
    ssm_n_group: int = 2  # key heads
    ssm_dt_rank: int = 4  # value heads
    # MoE FFN (qwen35moe only).
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0

    @property
    def arch(self) -> str:
        return ARCH[self.kind]

    @property
    def ssm_d_inner(self) -> int:
        return self.ssm_d_state * self.ssm_dt_rank

    @property
    def ssm_conv_dim(self) -> int:
        return 2 * self.ssm_d_state * self.ssm_n_group + self.ssm_d_inner

    def is_recurrent(self, il: int) -> bool:
        """Trunk pattern: three GDN layers, then one full-attention layer."""
        return il < self.n_trunk and (il + 1) % self.full_attention_interval != 0


DENSE = Hparams()
MOE = replace(DENSE, kind="moe", n_ff=0, n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=64)
HPARAMS = {"dense": DENSE, "moe": MOE}


def metadata(hp: Hparams, with_mtp: bool) -> list[tuple[str, Any]]:
    """Architecture keys in the order the converter writes them.

    `fixtures._add_typed` maps the Python values to GGUF types: int -> uint32,
    float -> float32, list[bool] / list[int] -> bool / int32 arrays.
    """
    a = hp.arch
    n_layer_all = hp.n_trunk + (1 if with_mtp else 0)
    keys: list[tuple[str, Any]] = [
        (f"{a}.block_count", n_layer_all),
        (f"{a}.context_length", hp.n_ctx_train),
        (f"{a}.embedding_length", hp.n_embd),
    ]
    if hp.kind == "dense":
        keys.append((f"{a}.feed_forward_length", hp.n_ff))
    keys += [
        (f"{a}.attention.head_count", hp.n_head),
        (f"{a}.attention.head_count_kv", hp.n_head_kv),
        (f"{a}.rope.dimension_sections", list(hp.rope_sections)),
        (f"{a}.rope.freq_base", hp.rope_freq_base),
        (f"{a}.attention.layer_norm_rms_epsilon", hp.rms_eps),
    ]
    if hp.kind == "moe":
        keys += [(f"{a}.expert_count", hp.n_expert), (f"{a}.expert_used_count", hp.n_expert_used)]
    keys += [
        (f"{a}.attention.key_length", hp.head_dim),
        (f"{a}.attention.value_length", hp.head_dim),
    ]
    if hp.kind == "moe":
        keys += [
            (f"{a}.expert_feed_forward_length", hp.n_ff_exp),
            (f"{a}.expert_shared_feed_forward_length", hp.n_ff_shexp),
        ]
    if with_mtp:
        keys.append((f"{a}.nextn_predict_layers", 1))
    keys += [
        (f"{a}.ssm.conv_kernel", hp.ssm_d_conv),
        (f"{a}.ssm.state_size", hp.ssm_d_state),
        (f"{a}.ssm.group_count", hp.ssm_n_group),
        (f"{a}.ssm.time_step_rank", hp.ssm_dt_rank),
        (f"{a}.ssm.inner_size", hp.ssm_d_inner),
        # One flag per block, MTP block included (padded False, as the converter does).
        (f"{a}.attention.recurrent_layers", [hp.is_recurrent(i) for i in range(n_layer_all)]),
        (f"{a}.full_attention_interval", hp.full_attention_interval),
        (f"{a}.rope.dimension_count", hp.n_rot),
    ]
    return keys


# Tensor tables: name suffix -> (ggml shape from the hparams, init role).
# Roles (see weights.py): "norm" scale 1; "in" a unit-gain projection into a sublayer;
# "out" a projection back onto the residual stream (scaled by the noise knob); the rest
# are GDN parameters with their own initialisation.
Shape = Callable[[Hparams], tuple[int, ...]]
TensorTable = tuple[tuple[str, Shape, str], ...]

GLOBAL_HEAD: TensorTable = (("token_embd.weight", lambda h: (h.n_embd, h.n_vocab), "embed"),)
GLOBAL_TAIL: TensorTable = (
    ("output_norm.weight", lambda h: (h.n_embd,), "norm"),
    ("output.weight", lambda h: (h.n_embd, h.n_vocab), "lm_head"),  # untied, unlike Qwen3.5-0.8B
)

GDN_MIXER: TensorTable = (
    ("attn_norm.weight", lambda h: (h.n_embd,), "norm"),
    ("ssm_a", lambda h: (h.ssm_dt_rank,), "ssm_a"),
    ("ssm_conv1d.weight", lambda h: (h.ssm_d_conv, h.ssm_conv_dim), "conv"),
    ("ssm_dt.bias", lambda h: (h.ssm_dt_rank,), "ssm_dt"),
    ("ssm_alpha.weight", lambda h: (h.n_embd, h.ssm_dt_rank), "in"),
    ("ssm_beta.weight", lambda h: (h.n_embd, h.ssm_dt_rank), "in"),
    ("attn_qkv.weight", lambda h: (h.n_embd, h.ssm_conv_dim), "in"),
    ("attn_gate.weight", lambda h: (h.n_embd, h.ssm_d_inner), "in"),
    ("ssm_norm.weight", lambda h: (h.ssm_d_state,), "norm"),  # no +1 shift for this one
    ("ssm_out.weight", lambda h: (h.ssm_d_inner, h.n_embd), "out"),
)

ATTN_MIXER: TensorTable = (
    ("attn_norm.weight", lambda h: (h.n_embd,), "norm"),
    ("attn_q.weight", lambda h: (h.n_embd, 2 * h.n_head * h.head_dim), "in"),  # per head [q | gate]
    ("attn_k.weight", lambda h: (h.n_embd, h.n_head_kv * h.head_dim), "in"),
    ("attn_v.weight", lambda h: (h.n_embd, h.n_head_kv * h.head_dim), "in"),
    ("attn_q_norm.weight", lambda h: (h.head_dim,), "norm"),
    ("attn_k_norm.weight", lambda h: (h.head_dim,), "norm"),
    ("attn_output.weight", lambda h: (h.n_head * h.head_dim, h.n_embd), "out"),
)

DENSE_FFN: TensorTable = (
    ("post_attention_norm.weight", lambda h: (h.n_embd,), "norm"),
    ("ffn_gate.weight", lambda h: (h.n_embd, h.n_ff), "in"),
    ("ffn_up.weight", lambda h: (h.n_embd, h.n_ff), "in"),
    ("ffn_down.weight", lambda h: (h.n_ff, h.n_embd), "out"),
)

MOE_FFN: TensorTable = (
    ("post_attention_norm.weight", lambda h: (h.n_embd,), "norm"),
    ("ffn_gate_inp.weight", lambda h: (h.n_embd, h.n_expert), "in"),
    ("ffn_gate_exps.weight", lambda h: (h.n_embd, h.n_ff_exp, h.n_expert), "in"),
    ("ffn_up_exps.weight", lambda h: (h.n_embd, h.n_ff_exp, h.n_expert), "in"),
    ("ffn_down_exps.weight", lambda h: (h.n_ff_exp, h.n_embd, h.n_expert), "out"),
    # HF stores the shared-expert gate as [1, n_embd]; the converter keeps that shape.
    ("ffn_gate_inp_shexp.weight", lambda h: (h.n_embd, 1), "in"),
    ("ffn_gate_shexp.weight", lambda h: (h.n_embd, h.n_ff_shexp), "in"),
    ("ffn_up_shexp.weight", lambda h: (h.n_embd, h.n_ff_shexp), "in"),
    ("ffn_down_shexp.weight", lambda h: (h.n_ff_shexp, h.n_embd), "out"),
)

NEXTN: TensorTable = (
    ("nextn.eh_proj.weight", lambda h: (2 * h.n_embd, h.n_embd), "eh_proj"),
    ("nextn.enorm.weight", lambda h: (h.n_embd,), "norm"),
    ("nextn.hnorm.weight", lambda h: (h.n_embd,), "norm"),
    ("nextn.shared_head_norm.weight", lambda h: (h.n_embd,), "norm"),
)


def tensor_plan(hp: Hparams, with_mtp: bool) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """Every tensor of the file, in file order: (name, ggml shape, role, in MTP block)."""
    ffn = MOE_FFN if hp.kind == "moe" else DENSE_FFN
    plan = [(n, s(hp), r, False) for n, s, r in GLOBAL_HEAD]
    for il in range(hp.n_trunk):
        mixer = GDN_MIXER if hp.is_recurrent(il) else ATTN_MIXER
        plan += [(f"blk.{il}.{n}", s(hp), r, False) for n, s, r in mixer + ffn]
    plan += [(n, s(hp), r, False) for n, s, r in GLOBAL_TAIL]
    if with_mtp:
        il = hp.n_trunk
        plan += [(f"blk.{il}.{n}", s(hp), r, True) for n, s, r in NEXTN + ATTN_MIXER + ffn]
    return plan
