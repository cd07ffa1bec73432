"""GGUF fuzzing: broken model files get a clear error from ``pymtp.load`` / generation and
from ``gguf_graft``, never a signal, a traceback, a changed input or a left-behind ``.part``.

The cases run in worker processes (tests/gguf_fuzz_worker.py), so a crash shows as the
worker's signal and is reported with the case that caused it. Inputs are the dense
fixture (1.2 MB: a 12.8 KB header of metadata and tensor table, then 71 tensors):

* truncations: every byte of the first 1 KB, every 7th byte of the rest of the header,
  each tensor cut just inside its first and last byte, 50 seeded points in the data and
  the last 16 bytes (about 2,900 files); ``PYMTP_FUZZ_FULL=1`` takes every byte of the
  header and every 61st byte of the data (about 32,700);
* byte flips (1-3 bytes XORed with a random value) in the preamble, the model's
  hyperparameters, the tokenizer and the tensor table (400; 4,000 in the full run);
* edge values: each numeric metadata value set in turn to 0, -1, the sign bit, twice
  itself (NaN, inf, -1.0 for floats), in the dense and the MoE fixture;
* tensor subsets: each tensor left out in turn, the MTP block alone, the trunk without
  its MTP block, the global tensors alone, no tensors;
* ``gguf_graft`` with a truncated, flipped or edited base, MTP GGUF or safetensors source.

The default form takes about 80 s of CPU on 2 cores; the full one tens of minutes.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGUFReader
from graft.helpers import export_mtp_hf, write_subset
from pymtp.testing.processes import child_env

WORKER = Path(__file__).with_name("gguf_fuzz_worker.py")
REPO = WORKER.parent.parent
FULL = os.environ.get("PYMTP_FUZZ_FULL") == "1"
SEED = 18
HANG_SECONDS = 60       # one case this long is a hang (most take milliseconds)
# Tensors whose absence llama.cpp handles: the output head falls back to the tied token
# embeddings, and the MTP head's own norm and output head to the trunk's.
OPTIONAL = {"without output.weight", "without blk.4.nextn.shared_head_norm.weight"}


class Layout:
    """Where things are in a GGUF: its header end, tensor extents and field byte ranges."""

    def __init__(self, path: Path) -> None:
        r = GGUFReader(path)
        self.size = path.stat().st_size
        self.data_offset = r.data_offset
        self.tensors = [(t.name, int(t.data_offset), int(t.n_bytes)) for t in r.tensors]
        self.data_end = max(off + n for _, off, n in self.tensors)
        self.fields = {name: (f.offset, f.offset + sum(p.nbytes for p in f.parts))
                       for name, f in r.fields.items()}
        self.table = (min(t.field.offset for t in r.tensors),
                      max(t.field.offset + sum(p.nbytes for p in t.field.parts) for t in r.tensors))

    def ranges(self, pick) -> list[int]:
        return [b for name, (lo, hi) in self.fields.items() if pick(name) for b in range(lo, hi)]


def truncation_points(lay: Layout, rng: random.Random) -> list[int]:
    # a cut in the data costs a full header parse (~50 ms), one in the header a few ms
    if FULL:
        points = set(range(lay.data_offset + 1)) | set(range(lay.data_offset, lay.size, 61))
        for _, off, n in lay.tensors:
            points |= {off, off + 1, off + n - 1, off + n}
        points |= set(range(lay.size - 64, lay.size + 1))
    else:
        points = set(range(1024)) | set(range(1024, lay.data_offset + 1, 7))
        points |= {lay.data_offset + rng.randrange(lay.size - lay.data_offset) for _ in range(50)}
        for _, off, n in lay.tensors:
            points |= {off + 1, off + n - 1}          # each tensor cut just inside
        points |= set(range(lay.size - 16, lay.size + 1))
    return sorted(p for p in points if 0 <= p <= lay.size)


def flip_cases(lay: Layout, rng: random.Random) -> list[tuple[str, list[list[int]]]]:
    regions = {
        "preamble": list(range(0, 24)),           # magic, version, tensor and KV counts
        "hparams": lay.ranges(lambda k: not k.startswith(("tokenizer.", "GGUF."))),
        "tokenizer": lay.ranges(lambda k: k.startswith("tokenizer.")),
        "tensor table": list(range(*lay.table)),
    }
    n = 1000 if FULL else 100
    out = []
    for region, positions in regions.items():
        for _ in range(n):
            flips = [[rng.choice(positions), rng.randrange(1, 256)] for _ in range(rng.randint(1, 3))]
            out.append((region, flips))
    return out


WIDTHS = {"UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "UINT32": 4, "INT32": 4,
          "UINT64": 8, "INT64": 8, "BOOL": 1}


def edge_value_cases(path: Path) -> list[tuple[str, list[list[int]]]]:
    """(label, flips) that set each numeric metadata value in turn to an edge value: 0,
    all ones (-1), the sign bit, twice the value; NaN, inf, -1.0 for floats. Random flips
    rarely hit these; they found an epsilon of -1 or NaN (a ggml abort) and a rope
    dimension count of 0 (a hang). Token-type arrays only in the full run."""
    raw, r = path.read_bytes(), GGUFReader(path)
    ints = (0, 1, -1, 2, 3, 7, 100_000, 1 << 31, (1 << 31) - 1) if FULL else (0, -1, 1 << 31)
    nan, inf = float("nan"), float("inf")
    floats = (0.0, -1.0, nan, inf, 1e30, -1e30, 1e-30) if FULL else (-1.0, nan, inf)
    out = []
    for name, f in r.fields.items():
        kind = f.types[-1].name
        if name.startswith("GGUF.") or (name.startswith("tokenizer.ggml.") and len(f.data) > 1 and not FULL):
            continue
        for k, di in enumerate(f.data[:16]):
            off = f.offset + sum(int(p.nbytes) for p in f.parts[:di])
            if kind in ("FLOAT32", "FLOAT64"):
                fmt = "<f" if kind == "FLOAT32" else "<d"
                values = [struct.pack(fmt, v) for v in floats]
            elif kind in WIDTHS:
                width, v = WIDTHS[kind], int(f.parts[di][0])
                values = [((x if x != "2v" else 2 * v) % (1 << 8 * width)).to_bytes(width, "little")
                          for x in (*ints, "2v")]
            else:
                continue                      # strings: flips and truncations cover them
            for new in dict.fromkeys(values):
                flips = [[off + i, raw[off + i] ^ b] for i, b in enumerate(new) if raw[off + i] != b]
                if flips:
                    label = f"{name}" + (f"[{k}]" if len(f.data) > 1 else "") + f" = {new.hex()}"
                    out.append((label, flips))
    return out


def run_cases(spec: dict, tmp: Path) -> list[dict]:
    """Every case's result; a worker killed by a signal (or hung) marks its case and a
    new worker goes on after it."""
    spec = {**spec, "work": str(tmp / "work")}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    n = len(spec["cases"])
    results: dict[int, dict] = {}
    # GGML_NO_BACKTRACE: an abort prints its assertion, not a gdb session
    env = child_env(REPO, REPO / "tools", GGML_NO_BACKTRACE="1")
    start = 0
    while start < n:
        out_path = tmp / f"worker-{start}.out"
        with open(out_path, "wb") as out, open(tmp / f"worker-{start}.err", "wb") as err:
            proc = subprocess.Popen([sys.executable, str(WORKER), str(spec_path), str(start)],
                                    stdout=out, stderr=err, env=env, cwd=REPO)
            seen, last_progress, hung = 0, time.monotonic(), False
            while proc.poll() is None:
                time.sleep(0.2)
                lines = out_path.read_bytes().count(b"\n")
                if lines != seen:
                    seen, last_progress = lines, time.monotonic()
                elif time.monotonic() - last_progress > HANG_SECONDS:
                    hung = True
                    proc.kill()
                    proc.wait()
        # only our lines: ggml prints a backtrace (through gdb, when installed) on its own abort
        done = [json.loads(line) for line in out_path.read_text(errors="replace").splitlines()
                if line.startswith("{\"i\": ")]
        for r in done:
            results[r["i"]] = r
        nxt = done[-1]["i"] + 1 if done else start
        if proc.returncode == 0 and nxt >= n:
            break
        stderr = (tmp / f"worker-{start}.err").read_text(errors="replace")[-2000:]
        outcome = "hang" if hung else "signal" if proc.returncode < 0 else "died"
        results[nxt] = {"i": nxt, "outcome": outcome,
                        "returncode": proc.returncode, "message": stderr}
        start = nxt + 1
    return [results[i] for i in range(n)]


def _failures(cases: list[dict], results: list[dict], allowed) -> list[str]:
    return [f"{json.dumps(c)[:300]} -> {json.dumps(r)[:600]}"
            for c, r in zip(cases, results) if not allowed(c, r)]


@pytest.fixture(scope="module")
def dense_layout(dense_path) -> Layout:
    return Layout(dense_path)


def test_truncations_and_flips_get_clear_errors(dense_path, dense_layout, tmp_path):
    lay, rng = dense_layout, random.Random(SEED)
    trunc = truncation_points(lay, rng)
    flips = flip_cases(lay, rng)
    cases = ([{"op": "load", "input": {"src": "dense", "trunc": n}} for n in trunc]
             + [{"op": "load", "region": region, "input": {"src": "dense", "flips": f}} for region, f in flips])
    results = run_cases({"sources": {"dense": str(dense_path)}, "cases": cases}, tmp_path)

    def allowed(case, r) -> bool:
        if r["outcome"] not in ("ok", "error"):
            return False                      # a signal, a hang or a traceback
        n = case["input"].get("trunc")
        if n is not None and n < lay.data_end:
            # a truncated file is refused by name, before llama.cpp reads it
            return r["outcome"] == "error" and r["type"] == "ModelFileError" and "model.gguf'" in r["message"]
        # a load error names the file; a flipped byte in a token or a weight may load fine
        return r["outcome"] == "ok" or r["stage"] == "generate" or "model.gguf'" in r["message"]

    bad = _failures(cases, results, allowed)
    assert not bad, f"{len(bad)} of {len(cases)} cases:\n" + "\n".join(bad[:20])
    tally = {}
    for c, r in zip(cases, results):
        key = (c.get("region", "truncation"), r["outcome"])
        tally[key] = tally.get(key, 0) + 1
    print(f"\n{len(trunc)} truncations, {len(flips)} flip cases: {sorted(tally.items())}")
    assert results[-len(flips)]["i"] == len(trunc)      # every case ran (and reported)


def load_allowed(case: dict, r: dict) -> bool:
    """A flipped or edited file: loads, or fails in generation with a ValueError (a token id
    out of range), or is refused with a message naming the file."""
    if r["outcome"] not in ("ok", "error"):
        return False                          # a signal, a hang or a traceback
    return r["outcome"] == "ok" or r["stage"] == "generate" or "model.gguf'" in r["message"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_edge_values_in_metadata_get_clear_errors(kind, dense_path, moe_path, tmp_path):
    path = dense_path if kind == "dense" else moe_path
    edits = edge_value_cases(path)
    cases = [{"op": "load", "label": label, "input": {"src": kind, "flips": f}} for label, f in edits]
    results = run_cases({"sources": {kind: str(path)}, "cases": cases}, tmp_path)

    bad = _failures(cases, results, load_allowed)
    assert not bad, f"{len(bad)} of {len(cases)} cases:\n" + "\n".join(bad[:20])
    by_label = {c["label"]: r for c, r in zip(cases, results)}
    print(f"\n{len(cases)} edits: {sum(r['outcome'] == 'ok' for r in results)} load and run")
    arch = "qwen35" if kind == "dense" else "qwen35moe"
    assert "rope.dimension_count is 0," in by_label[f"{arch}.rope.dimension_count = 00000000"]["message"]
    assert "epsilon is nan," in by_label[f"{arch}.attention.layer_norm_rms_epsilon = 0000c07f"]["message"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tensor_subsets_get_clear_errors(kind, dense_path, moe_path, tmp_path):
    path = dense_path if kind == "dense" else moe_path
    names = [t.name for t in GGUFReader(path).tensors]
    mtp = f"blk.{max(int(n.split('.')[1]) for n in names if n.startswith('blk.'))}."
    subsets = {f"without {n}": (lambda n: lambda x: x != n)(n) for n in names}
    subsets.update({
        "MTP block only": lambda x: x.startswith(mtp),
        "MTP block and globals": lambda x: not x.startswith("blk.") or x.startswith(mtp),
        "trunk without its MTP block": lambda x: not x.startswith(mtp),
        "globals only": lambda x: not x.startswith("blk."),
        "no tensors": lambda x: False,
    })
    files = {label: write_subset(path, tmp_path / f"subset-{i}.gguf", keep)
             for i, (label, keep) in enumerate(subsets.items())}
    cases = [{"op": "load", "label": label, "input": {"file": str(p)}} for label, p in files.items()]
    results = run_cases({"sources": {}, "cases": cases}, tmp_path)

    def allowed(case, r) -> bool:
        # refused at load, naming the file; or, for a tensor llama.cpp can do without
        # (output.weight: tied to the embeddings), loaded and run
        if r["outcome"] == "ok":
            return case["label"] in OPTIONAL
        return r["outcome"] == "error" and r["stage"] == "load" and str(tmp_path) in r["message"]

    bad = _failures(cases, results, allowed)
    assert not bad, "\n".join(bad)
    by_label = {c["label"]: r for c, r in zip(cases, results)}
    print(f"\n{len(cases)} subsets: " + ", ".join(f"{k}: {r['outcome']}" for k, r in by_label.items()
                                               if r["outcome"] == "ok"))
    assert "only an MTP block" in by_label["MTP block and globals"]["message"]
    assert "is missing" in by_label["without blk.1.ssm_out.weight"]["message"]


@pytest.fixture(scope="module")
def graft_inputs(dense_path, nomtp_path, tmp_path_factory) -> dict[str, Path]:
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("graft-fuzz")
    names = [t.name for t in GGUFReader(dense_path).tensors]
    mtp = f"blk.{max(int(n.split('.')[1]) for n in names if n.startswith('blk.'))}."
    mtp_gguf = write_subset(dense_path, d / "mtp.gguf", lambda x: not x.startswith("blk.") or x.startswith(mtp))
    st = d / "mtp.safetensors"
    save_file(export_mtp_hf(dense_path), str(st))
    return {"base": nomtp_path, "mtp_gguf": mtp_gguf, "safetensors": st}


def test_graft_refuses_broken_inputs_and_leaves_them_and_no_part(graft_inputs, tmp_path):
    rng = random.Random(SEED)
    sizes = {k: p.stat().st_size for k, p in graft_inputs.items()}
    base_lay = Layout(graft_inputs["base"])
    mtp_lay = Layout(graft_inputs["mtp_gguf"])
    st_header = 8 + int.from_bytes(graft_inputs["safetensors"].read_bytes()[:8], "little")
    n = 400 if FULL else 40

    def cuts(lay: Layout | None, size: int, header: int) -> list[int]:
        pts = {rng.randrange(header) for _ in range(n)} | {rng.randrange(header, size) for _ in range(n // 4)}
        if lay is not None:
            pts |= {off for _, off, _ in lay.tensors}
        return sorted(pts | {0, 8, header, size - 1})

    def flips(header: int) -> list[list[list[int]]]:
        return [[[rng.randrange(header), rng.randrange(1, 256)] for _ in range(rng.randint(1, 3))]
                for _ in range(n)]

    pristine = {k: {"src": k} for k in graft_inputs}
    cases = [{"op": "graft", "base": pristine["base"], "source": pristine[s]} for s in ("mtp_gguf", "safetensors")]
    for t in cuts(base_lay, sizes["base"], base_lay.data_offset):
        cases.append({"op": "graft", "base": {"src": "base", "trunc": t}, "source": pristine["mtp_gguf"]})
    for f in flips(base_lay.data_offset):
        cases.append({"op": "graft", "base": {"src": "base", "flips": f}, "source": pristine["safetensors"]})
    for t in cuts(mtp_lay, sizes["mtp_gguf"], mtp_lay.data_offset):
        cases.append({"op": "graft", "base": pristine["base"], "source": {"src": "mtp_gguf", "trunc": t}})
    for f in flips(mtp_lay.data_offset):
        cases.append({"op": "graft", "base": pristine["base"], "source": {"src": "mtp_gguf", "flips": f}})
    for t in cuts(None, sizes["safetensors"], st_header):
        cases.append({"op": "graft", "base": pristine["base"], "source": {"src": "safetensors", "trunc": t}})
    for f in flips(st_header):
        cases.append({"op": "graft", "base": pristine["base"], "source": {"src": "safetensors", "flips": f}})
    results = run_cases({"sources": {k: str(p) for k, p in graft_inputs.items()}, "cases": cases}, tmp_path)

    def allowed(case, r) -> bool:
        if r["outcome"] not in ("ok", "error") or r.get("inputs_changed") or r.get("left_behind"):
            return False
        truncated = any(m.get("trunc") is not None and m["trunc"] < sizes[m["src"]]
                        for m in (case["base"], case["source"]))
        return not (truncated and r["outcome"] == "ok")      # a truncated input never grafts

    bad = _failures(cases, results, allowed)
    assert not bad, f"{len(bad)} of {len(cases)} cases:\n" + "\n".join(bad[:20])
    assert results[0]["outcome"] == results[1]["outcome"] == "ok"      # the harness can succeed
    outcomes = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    print(f"\n{len(cases)} graft cases: {outcomes}")


def test_graft_refuses_edge_values_in_metadata(graft_inputs, tmp_path):
    pristine = {k: {"src": k} for k in graft_inputs}
    cases = [{"op": "graft", "label": f"base: {label}", "base": {"src": "base", "flips": f},
              "source": pristine["safetensors"]} for label, f in edge_value_cases(graft_inputs["base"])]
    cases += [{"op": "graft", "label": f"source: {label}", "base": pristine["base"],
               "source": {"src": "mtp_gguf", "flips": f}} for label, f in edge_value_cases(graft_inputs["mtp_gguf"])]
    results = run_cases({"sources": {k: str(p) for k, p in graft_inputs.items()}, "cases": cases}, tmp_path)

    def allowed(case, r) -> bool:
        return r["outcome"] in ("ok", "error") and not r.get("inputs_changed") and not r.get("left_behind")

    bad = _failures(cases, results, allowed)
    assert not bad, f"{len(bad)} of {len(cases)} cases:\n" + "\n".join(bad[:20])
    by_label = {c["label"]: r for c, r in zip(cases, results)}
    print(f"\n{len(cases)} graft edits: {sum(r['outcome'] == 'ok' for r in results)} grafted")
    # were a struct.error and a ZeroDivisionError traceback
    assert "block_count is 4294967295" in by_label["base: qwen35.block_count = ffffffff"]["message"]
    assert "head_count 0;" in by_label["source: qwen35.attention.head_count = 00000000"]["message"]
