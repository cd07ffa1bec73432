"""Shared by the graft tests: paths, an inverse exporter (GGUF MTP block -> HF safetensors),
and GGUF comparison."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from pymtp.testing.gguf_files import copy_metadata

REPO = Path(__file__).resolve().parents[2]
TINY = REPO.parent / "shared" / "models" / "qwen35-tiny-mtp"  # trained fixture, may be absent

# For the few tests that run a grafted file: they need the pymtp runtime, hence llama.cpp.
needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="runs the grafted file, which needs llama-cpp-python (not installed)")

# GGUF suffix -> HF name under "mtp.", written from transformers' Qwen3.5 / Qwen3.5-MoE
# module names, independently of gguf_graft.mapping, so that a wrong entry there shows.
HF_NAMES = {
    "nextn.eh_proj.weight": "fc.weight",
    "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
    "attn_norm.weight": "layers.0.input_layernorm.weight",
    "post_attention_norm.weight": "layers.0.post_attention_layernorm.weight",
    "attn_q.weight": "layers.0.self_attn.q_proj.weight",
    "attn_k.weight": "layers.0.self_attn.k_proj.weight",
    "attn_v.weight": "layers.0.self_attn.v_proj.weight",
    "attn_output.weight": "layers.0.self_attn.o_proj.weight",
    "attn_q_norm.weight": "layers.0.self_attn.q_norm.weight",
    "attn_k_norm.weight": "layers.0.self_attn.k_norm.weight",
    "ffn_gate.weight": "layers.0.mlp.gate_proj.weight",
    "ffn_up.weight": "layers.0.mlp.up_proj.weight",
    "ffn_down.weight": "layers.0.mlp.down_proj.weight",
    "ffn_gate_inp.weight": "layers.0.mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "layers.0.mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "layers.0.mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "layers.0.mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "layers.0.mlp.shared_expert.down_proj.weight",
}
EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
SHIFTED = {"nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight", "attn_norm.weight",
           "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight"}


def mtp_block_values(path: Path) -> dict[str, np.ndarray]:
    """float32 values (numpy shape) of the MTP block of a GGUF, by suffix after `blk.{N}.`."""
    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    n = r.fields[f"{arch}.block_count"].contents() - r.fields[f"{arch}.nextn_predict_layers"].contents()
    prefix = f"blk.{n}."
    out = {}
    for t in r.tensors:
        if t.name.startswith(prefix):
            shape = tuple(int(d) for d in reversed(t.shape))
            out[t.name[len(prefix):]] = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
    return out


def export_mtp_hf(gguf_path: Path, *, experts: str = "per-expert", prefix: str = "mtp.") -> dict[str, np.ndarray]:
    """The HF tensors that llama.cpp's converter would turn into this GGUF's MTP block.

    Undoes the converter: subtracts 1 from the norms, unstacks the experts into
    per-expert tensors (`experts="per-expert"`) or into transformers-v5 fused
    `gate_up_proj` [E, 2*n_ff, n_embd] (gate first) plus `down_proj` (`experts="fused"`).
    """
    hf: dict[str, np.ndarray] = {}
    values = mtp_block_values(gguf_path)
    for name, v in values.items():
        if name in SHIFTED:
            hf[prefix + HF_NAMES[name]] = v - np.float32(1)
        elif name in HF_NAMES:
            hf[prefix + HF_NAMES[name]] = v
        elif name not in EXPERTS:
            raise KeyError(name)
        elif experts == "per-expert":
            for e in range(v.shape[0]):
                hf[f"{prefix}layers.0.mlp.experts.{e}.{EXPERTS[name]}.weight"] = np.ascontiguousarray(v[e])
    if experts == "fused" and "ffn_gate_exps.weight" in values:
        gate_up = np.concatenate([values["ffn_gate_exps.weight"], values["ffn_up_exps.weight"]], axis=1)
        hf[f"{prefix}layers.0.mlp.experts.gate_up_proj"] = gate_up
        hf[f"{prefix}layers.0.mlp.experts.down_proj"] = values["ffn_down_exps.weight"]
    return hf


def gguf_contents(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...], bytes]]]:
    """(metadata key -> (types, value), tensor name -> (type, ggml shape, stored bytes)), in file order."""
    r = GGUFReader(path)
    kv = {k: (f.types, f.contents()) for k, f in r.fields.items() if k not in ("GGUF.tensor_count", "GGUF.kv_count")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), np.asarray(t.data).tobytes())
               for t in r.tensors}
    return kv, tensors


def rewrite_gguf(src: Path, dst: Path, *, qtype: GGMLQuantizationType | None = None,
                 extra: dict[str, tuple[Any, GGUFValueType]] | None = None) -> Path:
    """A copy of `src` with `extra` KV pairs added and, given `qtype`, its weight matrices
    in that type (as llama-quantize would leave them: norms, routers and convs stay)."""
    r, w = open_copy(src, dst)
    for key, (value, vtype) in (extra or {}).items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        data = np.asarray(t.data)
        keep = data.ndim < 2 or any(s in t.name for s in ("norm", "gate_inp", "conv1d"))
        if qtype is not None and not keep:
            w.add_tensor(t.name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def listing(directory: Path) -> set[str]:
    """Every name in `directory`, hidden temp files included."""
    return set(os.listdir(directory))


def run_cli(*args: object) -> Any:
    """Invoke the gguf_graft command in-process; returns click's Result."""
    from click.testing import CliRunner
    from gguf_graft.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def refused(base: object, source: object, out: Path, *args: object, match: list[str]) -> str:
    """Run the CLI, expect exit 1 with every string of `match` in the message, and no new files."""
    before = listing(out.parent)
    result = run_cli(base, source, "-o", out, *args)
    assert result.exit_code == 1, result.output
    for text in match:
        assert text in result.output, result.output
    assert listing(out.parent) == before
    return result.output


def open_copy(src: Path, dst: Path) -> tuple[GGUFReader, GGUFWriter]:
    """A reader of ``src`` and a writer to ``dst`` that already holds all of src's metadata."""
    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    copy_metadata(r, w)
    return r, w


def write_subset(src: Path, dst: Path, keep) -> Path:
    """A copy of ``src`` (same metadata) holding only the tensors for which ``keep(name)``."""
    r, w = open_copy(src, dst)
    for t in r.tensors:
        if keep(t.name):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
