"""Which graph node first rounds differently when a row is decoded inside a batch.

identity_knobs.py says *that* a k+1-row verify batch rounds differently from a one-row
decode on some backends; this says *where*. It decodes a prompt, then the next token
once alone and once as the first row of an R-row batch, captures every F32 node of the
graph through llama.cpp's eval callback (``cb_eval``), and compares the node's first
token row between the two runs. Nodes are listed in graph order with their op and the
largest difference, so the first non-zero line names the kernel to look at.

    python benchmarks/op_variance.py MODEL.gguf [--rows 2 --rows 4 --rows 5] [--fa auto]

The callback asks for every node, which splits the graph at each node: fused kernels
are not used while it runs (the knob table in docs/exactness.md shows fusion off does not
remove the variance, so the comparison still finds the source).
"""

from __future__ import annotations

import argparse
import ctypes
import os
from pathlib import Path

import pymtp  # noqa: I001  (llama_cpp before numpy: CUDA builds crash otherwise)
import numpy as np
from llama_cpp import llama_cpp as C
from pymtp import native

GGML_TYPE_F32 = 0


def _ggml() -> ctypes.CDLL:
    """libggml-base from the directory llama.cpp was loaded from."""
    libdir = os.environ.get("LLAMA_CPP_LIB_PATH") or str(Path(C.__file__).parent / "lib")
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        p = Path(libdir) / name
        if p.exists():
            lib = ctypes.CDLL(str(p))
            break
    else:
        raise SystemExit(f"libggml-base not found in {libdir}")
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_op_desc.restype = ctypes.c_char_p
    lib.ggml_op_desc.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_is_contiguous.restype = ctypes.c_bool
    lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


class _Head(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml.h): type, buffer, ne, nb."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4)]


class Capture:
    """Records every contiguous F32 node of the graphs decoded while ``on``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.on = False
        self.nodes: list[tuple[str, str, tuple[int, ...], np.ndarray]] = []
        self.cb = C.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, t, ask, _user) -> bool:
        if ask:
            return self.on
        head = _Head.from_address(t)
        if head.type != GGML_TYPE_F32 or not self.lib.ggml_is_contiguous(t):
            return True
        n = self.lib.ggml_nbytes(t)
        buf = np.empty(n // 4, dtype=np.float32)
        self.lib.ggml_backend_tensor_get(t, buf.ctypes.data, 0, n)
        ne = tuple(int(x) for x in head.ne)
        name = self.lib.ggml_get_name(t).decode(errors="replace")
        op = self.lib.ggml_op_desc(t).decode(errors="replace")
        self.nodes.append((name, op, ne, buf.reshape(ne[::-1])))
        return True


def _is_state(name: str) -> bool:
    """Recurrent-state writes hold the state after the whole batch, not a row: not comparable."""
    return "state" in name or name.startswith("cache_")


def first_row(ne_one: tuple[int, ...], ne_many: tuple[int, ...], arr: np.ndarray, rows: int) -> np.ndarray | None:
    """The slice of a batch node that holds its first token, or None if the shapes do not pair."""
    diff = [i for i in range(4) if ne_one[i] != ne_many[i]]
    if len(diff) != 1 or ne_one[diff[0]] != 1 or ne_many[diff[0]] != rows:
        return arr if ne_one == ne_many else None
    axis = 3 - diff[0]  # numpy order is reversed
    return np.take(arr, [0], axis=axis)


def run(model_path: str, rows: list[int], fa: str, prompt_len: int, threads: int | None) -> None:
    lib = _ggml()
    cap = Capture(lib)
    orig = C.llama_context_default_params

    def with_cb():
        p = orig()
        p.cb_eval = cap.cb
        return p

    native.C.llama_context_default_params = with_cb
    nat = native.NativeModel(model_path, load_mtp=False)
    prompt = (np.arange(prompt_len, dtype=np.int32) * 7919 % max(2, nat.n_vocab - 1) + 1).astype(np.int32)
    cfg = native.ContextConfig(n_ctx=4096, n_batch=2048, n_ubatch=512, threads=threads,
                               n_outputs_max=8, flash_attn=fa)

    def decode_next(group: list[int]) -> list:
        ctx = native.NativeContext(nat, cfg)
        try:
            b = native.Batch(2048)
            b.set(prompt, 0, outputs="last")
            ctx.decode(b)
            cap.nodes, cap.on = [], True
            b.set(np.asarray(group, dtype=np.int32), prompt_len, outputs="all")
            ctx.decode(b)
            cap.on = False
            return cap.nodes
        finally:
            ctx.close()

    ctx = native.NativeContext(nat, cfg)
    b = native.Batch(2048)
    b.set(prompt, 0, outputs="last")
    ctx.decode(b)
    toks = [int(ctx.logits(1)[0].argmax())]
    pos = prompt_len
    while len(toks) < max(rows):
        b.set(np.asarray(toks[-1:], dtype=np.int32), pos, outputs="last")
        ctx.decode(b)
        toks.append(int(ctx.logits(1)[0].argmax()))
        pos += 1
    ctx.close()

    one = decode_next(toks[:1])
    print(f"{Path(model_path).name}: {len(one)} F32 nodes captured for a one-row decode (fa {fa})")
    for r in rows:
        many = decode_next(toks[:r])
        by_name: dict[str, list] = {}
        for name, op, ne, arr in many:
            by_name.setdefault(name, []).append((op, ne, arr))
        shown = 0
        worst = 0.0
        print(f"-- first row of a {r}-row batch vs the one-row decode: nodes that differ, in graph order")
        seen: dict[str, int] = {}
        for name, op, ne, arr in one:
            if _is_state(name):
                continue
            i = seen.get(name, 0)
            seen[name] = i + 1
            cands = by_name.get(name, [])
            if i >= len(cands):
                continue
            op2, ne2, arr2 = cands[i]
            sl = first_row(ne, ne2, arr2, r)
            if sl is None or sl.size != arr.size or arr.size == 0:
                continue
            d = float(np.abs(sl.reshape(arr.shape) - arr).max())
            worst = max(worst, d)
            if d > 0 and shown < 12:
                print(f"   {name:28s} {op:18s} ne={ne2} max|diff|={d:.3g}")
                shown += 1
        print(f"   ({'no node differs' if worst == 0 else f'largest difference {worst:.3g}'})")
    nat.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, action="append", default=None)
    ap.add_argument("--fa", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    run(args.model, args.rows or [2, 4, 5], args.fa, args.prompt_len, args.threads)


if __name__ == "__main__":
    main()
