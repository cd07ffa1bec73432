"""pymtp against two llama-server builds of the pin, in one rotation: is a gap the build?

    python benchmarks/server_builds.py MODEL.gguf SERVER_A SERVER_B [--reps N] [--limit N]
        [--threads N] [-k K]

pymtp (in process) and a single-slot server of each binary decode the same held-out
prompts (128 tokens, greedy, ignore_eos), no-spec and MTP at depth K, each prompt's cells
in rotating order after one warm-up, flash attention off for all three. Prints the median
tok/s of each cell and the ratios. Made to tell whether pymtp's CPU gap to
`build_llama_server.sh`'s static server is the build (pip links llama.cpp as shared
libraries): build a shared server with `-DBUILD_SHARED_LIBS=ON` beside it and pass both.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pymtp
from pymtp.bench import Setting, llama_server_runner, pymtp_runner, read_prompts
from pymtp.llama_server import LlamaServerPool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("server_a")
    ap.add_argument("server_b")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("-k", "--draft-max", type=int, default=3)
    args = ap.parse_args()
    m = pymtp.load(args.model, threads=args.threads, flash_attn="off")
    prompts = read_prompts(Path(__file__).with_name("prompts_heldout.jsonl"))[: args.limit]
    ids = [m.tokenize(p, special=True) for p in prompts]
    settings = [Setting("none"), Setting("mtp", args.draft_max)]
    opts = dict(threads=args.threads, n_ctx=4096, n_batch=m.options.n_batch, extra_args=("-fa", "off"))
    # the bench's own runners: the same requests as `pymtp bench --against-llama-server`
    run_opts = dict(max_tokens=128, sampling={}, seed=0, ignore_eos=True)
    cells = [(system, s) for s in settings for system in ("pymtp", "A", "B")]
    tok_s: dict[tuple[str, Setting], list[float]] = {c: [] for c in cells}
    keys = [s.key for s in settings]
    with LlamaServerPool(args.server_a, args.model, keys, **opts) as a, \
            LlamaServerPool(args.server_b, args.model, keys, **opts) as b:
        runners = {"pymtp": pymtp_runner(m, **run_opts), "A": llama_server_runner(a, **run_opts),
                   "B": llama_server_runner(b, **run_opts)}
        for system, s in cells:
            runners[system](s, ids[0], 0)
        for r in range(args.reps):
            for i, prompt in enumerate(ids):
                shift = (i + r) % len(cells)
                for system, s in cells[shift:] + cells[:shift]:
                    tok_s[(system, s)].append(runners[system](s, prompt, i).tok_s)
    med = {c: statistics.median(v) for c, v in tok_s.items()}
    print("| cell | median tok/s | runs |\n| --- | --- | --- |")
    for (system, s), v in med.items():
        print(f"| {system} {s.label} | {v:.1f} | {len(tok_s[(system, s)])} |")
    for s in settings:
        p, x, y = (med[(system, s)] for system in ("pymtp", "A", "B"))
        print(f"{s.label}: pymtp/A {p / x:.3f}, pymtp/B {p / y:.3f}, B/A {y / x:.3f}")


if __name__ == "__main__":
    main()
