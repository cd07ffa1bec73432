"""Which context knobs keep greedy MTP output identical to plain decoding, and why not.

Two measurements per knob setting, on one model:

* **batch variance**: decode a prompt, then the next tokens one row at a time, and again
  as one multi-row batch (what a verify does); the largest |logit difference| per row
  count says whether the backend's batched kernels round like its one-row kernels
  (0.0 means bit-identical).
* **identity**: greedy pymtp MTP (depths from --depth) against pymtp's own plain decoding
  on held-out prompts: how many outputs are identical, and where the first ones diverge.

Knobs that are llama.cpp environment variables (read once per process) run in a child
process of this script. Prints a table; ``--json`` writes every number.

    python benchmarks/identity_knobs.py MODEL.gguf --prompts P.json --limit 16 -n 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# pymtp first: it imports llama_cpp before numpy (CUDA builds crash otherwise).
import pymtp  # noqa: I001
import numpy as np
from pymtp import native
from pymtp.bench import read_prompts

# name -> (environment, context-param overrides, pymtp.load options). Context overrides
# apply to every context pymtp makes (target and MTP), through llama_context_default_params.
KNOBS: dict[str, tuple[dict[str, str], dict[str, object], dict[str, object]]] = {
    "baseline (fa auto)": ({}, {}, {"flash_attn": "auto"}),
    "fa off": ({}, {}, {"flash_attn": "off"}),
    "fa on": ({}, {}, {"flash_attn": "on"}),
    "kv_unified": ({}, {"kv_unified": True}, {"flash_attn": "auto"}),
    "no op offload": ({}, {"op_offload": False}, {"flash_attn": "auto"}),
    "cuda fusion off": ({"GGML_CUDA_DISABLE_FUSION": "1"}, {}, {"flash_attn": "auto"}),
    "cuda graphs off": ({"GGML_CUDA_DISABLE_GRAPHS": "1"}, {}, {"flash_attn": "auto"}),
    "fusion off + fa off": ({"GGML_CUDA_DISABLE_FUSION": "1"}, {}, {"flash_attn": "off"}),
}


def patch_context_defaults(overrides: dict[str, object]) -> None:
    orig = native.C.llama_context_default_params

    def patched():
        p = orig()
        for k, v in overrides.items():
            setattr(p, k, v)
        return p

    native.C.llama_context_default_params = patched


def batch_variance(nat: native.NativeModel, prompt: list[int], threads: int | None, flash_attn: str,
                   n_next: int = 6) -> dict[int, float]:
    """Max |logit diff| between one-row decodes and a multi-row batch of the same rows."""
    cfg = native.ContextConfig(n_ctx=1024, n_batch=512, n_ubatch=512, threads=threads,
                               n_outputs_max=8, flash_attn=flash_attn)

    def run(rows_per_decode: int) -> np.ndarray:
        ctx = native.NativeContext(nat, cfg)
        try:
            b = native.Batch(512)
            b.set(np.asarray(prompt, dtype=np.int32), 0, outputs="last")
            ctx.decode(b)
            toks = [int(ctx.logits(1)[0].argmax())]
            out = []
            pos = len(prompt)
            # the continuation is fixed first (one-row greedy), then replayed in groups
            while len(toks) < n_next:
                b.set(np.asarray(toks[-1:], dtype=np.int32), pos, outputs="last")
                ctx.decode(b)
                toks.append(int(ctx.logits(1)[0].argmax()))
                pos += 1
            ctx.clear()
            b.set(np.asarray(prompt, dtype=np.int32), 0, outputs="last")
            ctx.decode(b)
            pos = len(prompt)
            for s in range(0, n_next, rows_per_decode):
                grp = np.asarray(toks[s:s + rows_per_decode], dtype=np.int32)
                b.set(grp, pos, outputs="all")
                ctx.decode(b)
                out.append(ctx.logits(len(grp)).copy())
                pos += len(grp)
            return np.concatenate(out)
        finally:
            ctx.close()

    one = run(1)
    return {r: float(np.abs(run(r) - one).max()) for r in (2, 3, 4, 5)}


def identity(model: pymtp.Model, prompts: list[list[int]], depths: list[int], n: int) -> dict:
    res: dict = {}
    plain = [model.generate(p, max_tokens=n, spec="none", ignore_eos=True).tokens for p in prompts]
    # plain decoding through the MTP-path context (snapshots + nextn rows, drafting nothing)
    through = [model.generate(p, max_tokens=n, spec="mtp", draft_max=1, p_min=1.0,
                              ignore_eos=True).tokens for p in prompts]
    res["plain via mtp ctx"] = _compare(plain, through)
    for k in depths:
        outs = [model.generate(p, max_tokens=n, spec="mtp", draft_max=k, ignore_eos=True).tokens
                for p in prompts]
        res[f"k={k}"] = _compare(plain, outs)
    return res


def _compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    first = []
    for a, b in zip(ref, got):
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is not None:
            first.append(d)
    return {"identical": sum(a == b for a, b in zip(ref, got)), "of": len(ref), "first_diverge": first}


def run_knob(name: str, args) -> dict:
    env, ctx_over, load_opts = KNOBS[name]
    patch_context_defaults(ctx_over)
    t0 = time.perf_counter()
    # the native layer on its own first (a second copy of the weights would double memory)
    nat = native.NativeModel(args.model)
    try:
        prompts = [nat.tokenize(p) for p in read_prompts(args.prompts)][: args.limit]
        bv = batch_variance(nat, min(prompts, key=len)[-256:], args.threads, load_opts["flash_attn"])
    finally:
        nat.close()
    model = pymtp.load(args.model, threads=args.threads, **load_opts)
    try:
        ident = identity(model, prompts, args.depth, args.max_tokens)
        return {"knob": name, "env": env, "ctx": ctx_over, "load": load_opts, "batch_variance": bv, "identity": ident,
                "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, action="append", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--knob", action="append", default=None, help="run only these knobs")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.depth = args.depth or [1, 3]
    if args.child:
        print(json.dumps(run_knob(args.knob[0], args)))
        return
    rows = []
    for name in args.knob or list(KNOBS):
        env = {**os.environ, **KNOBS[name][0]}
        cmd = [sys.executable, __file__, args.model, "--prompts", args.prompts, "--limit", str(args.limit),
               "-n", str(args.max_tokens), "--knob", name, "--child"]
        cmd += [f"--depth={k}" for k in args.depth]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            rows.append({"knob": name, "error": (p.stderr or p.stdout)[-600:]})
            print(f"{name}: failed rc={p.returncode}\n{rows[-1]['error']}", file=sys.stderr)
            continue
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        bv = " ".join(f"{v:.2g}" for v in r["batch_variance"].values())
        ident = "  ".join(f"{k}: {v['identical']}/{v['of']}" for k, v in r["identity"].items())
        print(f"{Path(args.model).name:32s} {name:22s} | max|dlogit| rows 2-5: {bv:28s} | {ident}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
