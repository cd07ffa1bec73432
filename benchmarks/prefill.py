"""Prompt throughput alone: pymtp and llama-server from the same pin, each prompt decoded
cold with two tokens after it, with the MTP head and without.

    python benchmarks/prefill.py MODEL --llama-server BIN [--threads 2] [--limit 6]

Under the issue #10 load on two CPU threads, rounds that carried a prompt chunk took half
of pymtp's round time (session 20's trace). This says whether pymtp's prompt rows cost
more than llama-server's: the held-out prompts, ``cache_prompt`` off, pymtp's
``stats.prompt_seconds`` against llama-server's ``timings.prompt_ms`` (``-np 1``), summed.
Two tokens, not one: pymtp's MTP head reads the prompt's rows after the first token
(``Stats.from_run``), and a run that ends at the first never makes that pass, which
llama-server's draft-mtp makes with its prompt.
"""


from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from load_server import HELD_OUT, running  # noqa: E402

# tokens a run asks for: the second makes pymtp's MTP head read the prompt (see above)
TOKENS = 2
SETTINGS = {"no-spec": ("none", []), "mtp": ("mtp", ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"])}


def pymtp_rate(model_path: str, prompts: list[str], threads: int, spec: str) -> tuple[int, float]:
    """(prompt tokens, seconds) of pymtp's prefills."""
    import pymtp

    m = pymtp.load(model_path, threads=threads)
    try:
        n = s = 0
        for text in prompts:
            st = m.generate(text, max_tokens=TOKENS, spec=spec, cache_prompt=False).stats
            n, s = n + st.prompt_tokens, s + st.prompt_seconds
        return n, s
    finally:
        m.close()


def llama_rate(binary: str, model_path: str, prompts: list[str], threads: int, extra: list[str]) -> tuple[int, float]:
    """(prompt tokens, seconds) of llama-server's prefills, by its own timings."""
    argv = [binary, "-m", model_path, "-t", str(threads), "-np", "1", "-c", "4096", "-fa", "off", *extra]
    with tempfile.TemporaryDirectory() as tmp, running(argv, Path(tmp) / "llama-server.log") as url:
        n = ms = 0
        for text in prompts:
            r = httpx.post(f"{url}/completion", json={"prompt": text, "n_predict": TOKENS, "cache_prompt": False},
                           timeout=300)
            r.raise_for_status()
            t = r.json()["timings"]
            n, ms = n + t["prompt_n"], ms + t["prompt_ms"]
        return n, ms / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-server", required=True, metavar="BIN")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=6, help="held-out prompts")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in HELD_OUT.read_text().splitlines()[: args.limit]]
    print(f"{len(prompts)} held-out prompts, cold, {args.threads} threads; {Path(args.model).name}\n")
    print("| setting | system | prompt tokens | prompt tok/s |\n| --- | --- | --- | --- |")
    out = {}
    for label, (spec, extra) in SETTINGS.items():
        for system, (n, s) in (("pymtp", pymtp_rate(args.model, prompts, args.threads, spec)),
                               ("llama-server", llama_rate(args.llama_server, args.model, prompts, args.threads,
                                                           extra))):
            out[f"{system} {label}"] = {"prompt_tokens": n, "tok_s": n / s}
            print(f"| {label} | {system} | {n} | {n / s:.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
