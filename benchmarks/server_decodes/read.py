"""Where a llama-server request's decode time goes, from shim.c's record of its decodes.

    python benchmarks/server_decodes/read.py /tmp/decodes.<pid> [--gap-ms 50]

A request is a run of calls with no gap longer than --gap-ms between them; its prompt
decode is the target's first long call (the target is the context with the most decode
time). Prints per request the draft context's call right after the prompt (the MTP
head's decode of the prompt, which llama-server's timings count as prompt time) and the
decode phase after it: target and draft calls, their sums, and their share of its wall.
"""

from __future__ import annotations

import argparse
import collections
import statistics


def read(path: str) -> list[tuple[str, float, float]]:
    rows = []
    for line in open(path):
        ctx, start, dur = line.split()
        rows.append((ctx, float(start), float(dur)))
    return rows


def requests(rows: list[tuple[str, float, float]], gap_ms: float) -> list[list[tuple[str, float, float]]]:
    out, cur = [], []
    for r in rows:
        if cur and r[1] - (cur[-1][1] + cur[-1][2]) > gap_ms:
            out.append(cur)
            cur = []
        cur.append(r)
    return out + ([cur] if cur else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("record")
    ap.add_argument("--gap-ms", type=float, default=50.0)
    ap.add_argument("--prompt-ms", type=float, default=20.0, help="a target call this long is a prompt's")
    args = ap.parse_args()
    rows = read(args.record)
    time_by_ctx = collections.Counter()
    for ctx, _, dur in rows:
        time_by_ctx[ctx] += dur
    target = time_by_ctx.most_common(1)[0][0]
    prompt_draft = []
    for req in requests(rows, args.gap_ms):
        i = next((i for i, r in enumerate(req) if r[0] == target and r[2] > args.prompt_ms), None)
        if i is None:
            continue
        after = req[i + 1:]
        mtp_prompt = after[0][2] if after and after[0][0] != target else 0.0
        phase = after[1:] if mtp_prompt else after
        if not phase:
            continue
        wall = phase[-1][1] + phase[-1][2] - phase[0][1]
        tgt = [d for c, _, d in phase if c == target]
        dft = [d for c, _, d in phase if c != target]
        prompt_draft.append(mtp_prompt)
        print(f"prompt {req[i][2]:8.1f} ms  draft's prompt decode {mtp_prompt:6.1f} ms | decode phase "
              f"{wall:7.1f} ms: target {len(tgt):3d} calls {sum(tgt):7.1f} ms, draft {len(dft):3d} calls "
              f"{sum(dft):6.1f} ms, busy {(sum(tgt) + sum(dft)) / wall:.3f}")
    if any(prompt_draft):
        print(f"draft's prompt decodes: median {statistics.median(prompt_draft):.1f} ms, "
              f"range {min(prompt_draft):.1f}-{max(prompt_draft):.1f} ms")


if __name__ == "__main__":
    main()
