"""What a depth-0 epoch costs inside a drafting batch, against ``spec="none"``.

    python benchmarks/depth0_cost.py MODEL [MODEL ...]

An 8-slot batcher runs 8 held-out prompts x 128 tokens, greedy, as ``spec="none"``, as
draft_max="auto" pinned at depth 0 (round_state.RESUME_ROWS 16 and 1) and pinned at 3. Prints
tok/s (median of 2 x 3 passes, prompts included) and, for each setting's last pass, where
its time went: the seconds of each llama.cpp call (on a GPU llama_get_logits waits for
the decode) and the rest, the host's Python. Used on the H100 (``device_cuda.sh py``).
"""
import sys, time, statistics, collections
import pymtp, pymtp.round_state as E
from pymtp.native import NativeModel
from pymtp.bench import read_prompts
from pathlib import Path
prompts = read_prompts(Path('benchmarks/prompts_heldout.jsonl'))[:8]
acc = collections.Counter(); cnt = collections.Counter()
real = NativeModel.run
def timed(self, fn, *a):
    t = time.perf_counter(); r = real(self, fn, *a)
    n = getattr(fn, "__name__", str(fn)); acc[n] += time.perf_counter() - t; cnt[n] += 1; return r
NativeModel.run = timed
for path in sys.argv[1:]:
    m = pymtp.load(path)
    res, split = {}, {}
    for rep in range(2):
        for mode in ("none", "zero16", "zero1", "k3"):
            E.RESUME_ROWS = 1 if mode == "zero1" else 16
            b = m.batcher(8)
            kw = dict(max_tokens=128, ignore_eos=True, cache_prompt=False)
            if mode == "none":
                kw["spec"] = "none"
            else:
                k = 3 if mode == "k3" else 0
                ep = b.engine.rounds.epochs; ep.pick = lambda bucket, k=k: k; ep.k = k; kw["draft_max"] = "auto"
            b.generate(prompts, **kw)
            for _ in range(3):
                acc.clear(); cnt.clear()
                t0 = time.perf_counter(); rs = b.generate(prompts, **kw); wall = time.perf_counter() - t0
                n = sum(len(r.tokens) for r in rs)
                res.setdefault(mode, []).append(n / wall)
                split[mode] = (wall, sum(acc.values()), dict(acc), dict(cnt), b.engine.metrics.rounds)
            b.close()
    print(path.rsplit('/', 1)[-1], " ".join(f"{k}={statistics.median(v):.0f}" for k, v in res.items()), flush=True)
    for mode, (wall, nat, a, c, rounds) in split.items():
        print(f"  {mode}: wall {wall*1e3:.1f} ms, native {nat*1e3:.1f}, host {(wall-nat)*1e3:.1f}; " +
              ", ".join(f"{k} {v*1e3:.1f} ms/{c[k]}" for k, v in sorted(a.items(), key=lambda x: -x[1])[:6]), flush=True)
    m.close()
