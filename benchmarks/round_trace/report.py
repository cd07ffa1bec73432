"""Summarise a ROUND_TRACE_DIR (sitecustomize.py beside this file): per server, its rounds
of two or more sequences by depth, by whether a prompt chunk rode along, and by whether
the batch was full: how many, the share of their seconds, ms a round and tokens a second;
then the rounds in which prompts joined a running batch, and (traces with log counts)
how many rounds replayed a CUDA graph; then the decode rounds by how many rounds ago the
batch's rows changed (a prompt rode along, a sequence ended or joined): on a GPU the two
after a change run eagerly.
A round's seconds run from the landing of the round before it (as depth_batched.Epochs times it).

    python benchmarks/round_trace/report.py TRACE_DIR [--slots 8]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def depth_label(argv: list[str]) -> str:
    for flag in ("--spec", "--draft-max"):
        if flag in argv:
            return f"{flag} {argv[argv.index(flag) + 1]}"
    return "?"


def rows_plain(n: int, k: int) -> int:
    """A round's rows without prompt chunks: n sequences x (k + 1)."""
    return n * (max(k, 0) + 1)


def summarise(path: Path, slots: int) -> list[str]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    argv = lines[0].get("argv", [])
    label = depth_label(argv)
    fixed = None if label.endswith("auto") else 0 if label.endswith("none") else int(label.split()[1])
    groups: dict[tuple, list[tuple[float, int]]] = collections.defaultdict(list)
    prev = None
    for r in lines[1:]:
        if "idle" in r:
            prev = None
            continue
        if prev is not None and r["n"] >= 2:
            k = r["k"] if fixed is None else fixed
            # traces from before the "prompt" field: rows beyond the decoding ones
            prompt = r["prompt"] > 0 if "prompt" in r else r["rows"] > rows_plain(r["n"], k)
            groups[(k, "prompt" if prompt else "decode", r["n"] == slots)].append((r["t"] - prev, r["tok"]))
        prev = r["t"]
    total = sum(dt for g in groups.values() for dt, _ in g)
    out = [f"== {label} ({path.name}): {total:.3f} s in rounds of 2+ sequences"]
    out += joins(lines[1:], slots)
    out += since_change(lines[1:])
    for (k, kind, full), g in sorted(groups.items()):
        s = sum(dt for dt, _ in g)
        out.append(f"   depth {k} {kind:6s} {'full' if full else 'part'}: rounds {len(g):5d}  {s:7.3f} s "
                   f"({100 * s / total:4.1f}%)  ms/round {s / len(g) * 1e3:6.2f}  tok/s {sum(t for _, t in g) / s:7.0f}")
    return out


def joins(rounds: list[dict], slots: int) -> list[str]:
    """How prompts joined: rounds with prompt rows beside more than half the slots
    decoding (a prompt joining a running batch, as against a batch refilled at once),
    their seconds and rows; and, where the trace counted llama.cpp's log lines, how many
    rounds replayed a CUDA graph ("reused" and no warm-up line) and how many ran eagerly."""
    prev, n, seconds, rows, replayed, eager = None, 0, 0.0, 0, 0, 0
    logged = any("reused" in r.get("logs", {}) for r in rounds)     # not where ggml's log was muted
    for r in rounds:
        if "idle" in r:
            prev = None
            continue
        if prev is not None and r["prompt"] and r["n"] > slots // 2:
            n, seconds, rows = n + 1, seconds + r["t"] - prev, rows + r["prompt"]
        logs = r.get("logs", {})
        if "reused" in logs and not any(k.startswith("warmup") for k in logs):
            replayed += 1
        elif any(k.startswith("warmup") for k in logs) or (logged and not logs):
            eager += 1
        prev = r["t"]
    out = [f"   prompts joining {slots // 2 + 1}+ decoding sequences: rounds {n}  {seconds:.3f} s  prompt rows {rows}"]
    if logged:
        out.append(f"   CUDA graphs: rounds replayed {replayed}, run eagerly or captured {eager}")
    return out


def since_change(rounds: list[dict], most: int = 4) -> list[str]:
    """Decode rounds (no prompt rows, 2+ sequences) by rounds since the verify's rows
    changed or a prompt chunk rode in the round before (1 = the first round after the
    change, ``most`` = that many or more): how many, and ms a round."""
    buckets: dict[int, list[float]] = collections.defaultdict(list)
    prev, since = None, most
    for r in rounds:
        if "idle" in r:
            prev = None
            continue
        if prev is not None:
            since = 1 if (prev["prompt"] or r["rows"] != prev["rows"]) else min(since + 1, most)
            if not r["prompt"] and r["n"] >= 2:
                buckets[since].append(r["t"] - prev["t"])
        prev = r
    cells = [f"{k}{'+' if k == most else ''}: {len(v)} x {1e3 * sum(v) / len(v):.2f} ms"
             for k, v in sorted(buckets.items())]
    return ["   decode rounds by rounds since the rows changed: " + ", ".join(cells)] if cells else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()
    for path in sorted(args.trace_dir.glob("*.jsonl")):
        print("\n".join(summarise(path, args.slots)))


if __name__ == "__main__":
    main()
