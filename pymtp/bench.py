"""``pymtp bench``: no-spec against MTP settings, alternating in one process.

Every prompt runs each setting once per repetition, in rotating order, after a warm-up,
so drift on a shared machine spreads over all settings alike. Speed is the median of
per-prompt decode tok/s; acceptance is pooled over all rounds.

With a ``LlamaServerPool`` (``--against-llama-server``), upstream llama-server runs the
same prompt ids with the same settings inside the same rotation, each pymtp setting next
to its llama-server twin, and every row says which ``system`` it measured.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .config import DEFAULTS, DecodeParams

if TYPE_CHECKING:
    from .generate import Model
    from .llama_server import LlamaServerPool

PYMTP, LLAMA = "pymtp", "llama-server"


@dataclass(frozen=True)
class Setting:
    spec: str
    draft_max: int | str = 0            # 0 with spec "none"; "auto": the depth policy
    p_min: float = DEFAULTS.p_min
    accept: str = DEFAULTS.accept

    @property
    def label(self) -> str:
        if self.spec == "none":
            return "no-spec"
        label = f"mtp k={self.draft_max}" + (f" p_min={self.p_min:g}" if self.p_min else "")
        return label + (" exact" if self.accept == "exact" else "")

    @property
    def has_twin(self) -> bool:
        """llama-server has no adaptive depth: an "auto" setting is measured on pymtp only."""
        return self.draft_max != "auto"

    @property
    def key(self) -> tuple[int | str, float]:
        """(draft_max, p_min), draft_max 0 for no-spec: what a llama-server is started with."""
        return (self.draft_max, self.p_min) if self.spec == "mtp" else (0, 0.0)


@dataclass
class Run:
    """One generation as the bench records it, from either system."""

    tokens: list[int]
    tok_s: float                                          # decode tokens per second
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)   # per draft position (pymtp only)
    accepted_at: list[int] = field(default_factory=list)
    depths: dict[int, int] = field(default_factory=dict)  # rounds by drafts planned (pymtp only)
    # prompt and decode together (0: not reported): tokens over it are a speed that no
    # line between the two phases can move
    request_s: float = 0.0


Runner = Callable[[Setting, list[int], int], Run]         # (setting, prompt ids, prompt index)


@dataclass
class SettingResult:
    setting: Setting
    system: str = PYMTP
    tok_s: list[float] = field(default_factory=list)
    request_tok_s: list[float] = field(default_factory=list)    # tokens / (prompt + decode)
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    identical: int = 0
    runs: int = 0
    depths: dict[int, int] = field(default_factory=dict)
    requests_at: dict[int, int] = field(default_factory=dict)   # runs by their deepest planned round
    in_order: list[tuple[int, float]] = field(default_factory=list)   # (that depth, tok/s) run by run
    outputs: dict[int, list[int]] = field(default_factory=dict)

    def add(self, prompt_idx: int, run: Run) -> None:
        self.tok_s.append(run.tok_s)
        if run.request_s > 0:
            self.request_tok_s.append(len(run.tokens) / run.request_s)
        self.drafted += run.drafted
        self.accepted += run.accepted
        for i, (d, a) in enumerate(zip(run.drafted_at, run.accepted_at)):
            if i >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += d
            self.accepted_at[i] += a
        for k, n in run.depths.items():
            self.depths[k] = self.depths.get(k, 0) + n
        if run.depths:      # one stream's auto runs a whole request at one depth (depth.Arms)
            top = max(run.depths)
            self.requests_at[top] = self.requests_at.get(top, 0) + 1
            self.in_order.append((top, round(run.tok_s, 1)))
        self.runs += 1
        self.outputs.setdefault(prompt_idx, run.tokens)

    def summary(self, baseline_median: float | None, n_prompts: int) -> dict:
        med = statistics.median(self.tok_s) if self.tok_s else 0.0
        return {
            "system": self.system,
            "setting": self.setting.label, "spec": self.setting.spec,
            "draft_max": self.setting.draft_max, "p_min": self.setting.p_min,
            "accept": self.setting.accept if self.setting.spec == "mtp" and self.system == PYMTP else None,
            "median_tok_s": round(med, 2),
            "tok_s_runs": [round(x, 1) for x in self.tok_s],     # run i: the i-th prompt x repetition
            "median_request_tok_s": round(statistics.median(self.request_tok_s), 2) if self.request_tok_s else None,
            "speedup": round(med / baseline_median, 3) if baseline_median else None,
            "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "accepted_per_position": [round(a / d, 4) for a, d in zip(self.accepted_at, self.drafted_at) if d],
            "identical_to_nospec": f"{self.identical}/{n_prompts}",
            "runs": self.runs,
            "depths": dict(sorted(self.depths.items())),
            "requests_at_depth": dict(sorted(self.requests_at.items())),
            # auto's requests as they ran: one price that went wrong shows as a run of
            # requests at one depth after a slow one at another
            **({"requests_in_order": self.in_order} if self.setting.draft_max == "auto" else {}),
        }


def read_prompts(path: str | Path) -> list[str]:
    """JSON lines with a "prompt" field (a plain JSON list of strings is accepted too)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                         "save the prompts file as UTF-8") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON list ({exc})") from exc
        if not isinstance(items, list):
            raise ValueError(f"{path}: not a JSON list")
        # an item is an object with a "prompt", or the prompt itself: a string (a number or a
        # null would have been benchmarked as the text "1" or "None")
        prompts = []
        for i, p in enumerate(items):
            if not isinstance(p, (str, dict)):
                raise ValueError(f"{path}: item {i}: expected a prompt string or an object with a \"prompt\" "
                                 f"field, got {json.dumps(p)[:80]}")
            prompts.append(_prompt_of(p if isinstance(p, dict) else {"prompt": p}, f"{path}: item {i}"))
    else:
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: expected a JSON object with a \"prompt\" field ({exc})") from exc
            prompts.append(_prompt_of(obj, f"{path}:{n}"))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _prompt_of(obj: object, where: str) -> str:
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: expected a JSON object with a \"prompt\" field holding a non-empty string, "
                         f"got {obj!r:.80}")
    return prompt


def _decode_kwargs(s: Setting, *, max_tokens: int, sampling: dict, seed: int, ignore_eos: bool) -> dict:
    """The generate() keywords of one setting. Every run decodes its prompt from scratch,
    as llama-server's runs do (its requests send cache_prompt false): the settings run the
    same prompt one after another, and a prompt-cache hit would spare the later ones."""
    return dict(max_tokens=max_tokens, spec=s.spec, draft_max=s.draft_max, p_min=s.p_min,
                accept=s.accept, seed=seed, ignore_eos=ignore_eos, cache_prompt=False, **sampling)


def _kind_kwargs(s: Setting, sampling: dict, seed: int) -> dict:
    """The keywords that make a setting's requests the kind of request they are
    (engine.arm_kind), for ``Model.calibrate``."""
    kw = _decode_kwargs(s, max_tokens=0, sampling=sampling, seed=seed, ignore_eos=True)
    for key in ("max_tokens", "spec", "draft_max", "ignore_eos", "cache_prompt"):
        kw.pop(key)
    return kw


def check_settings(model: Model, settings: Iterable[Setting], *, max_tokens: int, sampling: dict,
                   seed: int) -> None:
    """Raise the ``ParamError`` a setting would meet, before anything runs."""
    for s in settings:
        kwargs = _decode_kwargs(s, max_tokens=max_tokens, sampling=sampling, seed=seed, ignore_eos=True)
        DecodeParams(**kwargs).validate(model.draft_limit)


def check_prompts(model: Model, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Each prompt's tokens; a prompt the context cannot hold with ``max_tokens`` after it
    raises ``ValueError`` naming it by its place, before any run (it would fail only at
    its turn; a reply cut by the context's end stopped each system at another length, and
    the table called their outputs different)."""
    ids = [model.tokenize(p, special=True) for p in prompts]
    for i, toks in enumerate(ids):
        if len(toks) + max_tokens > model.n_ctx:
            raise ValueError(f"prompt {i + 1} ({prompts[i]!r:.40}) has {len(toks)} tokens, and {max_tokens} more "
                             f"(--max-tokens) make {len(toks) + max_tokens}, past the context's {model.n_ctx}; "
                             "shorten it, lower --max-tokens or give a larger context (--ctx-size)")
    return ids


def pymtp_runner(model: Model, *, max_tokens: int, sampling: dict, seed: int, ignore_eos: bool) -> Runner:
    def run(s: Setting, ids: list[int], i: int) -> Run:
        r = model.generate(ids, **_decode_kwargs(s, max_tokens=max_tokens, sampling=sampling, seed=seed + i,
                                                 ignore_eos=ignore_eos))
        st = r.stats
        return Run(r.tokens, st.tokens_per_second, st.drafted, st.accepted, st.drafted_at, st.accepted_at,
                   st.depths, st.prompt_seconds + st.decode_seconds)
    return run


def llama_server_runner(pool: LlamaServerPool, *, max_tokens: int, sampling: dict, seed: int,
                        ignore_eos: bool) -> Runner:
    from .llama_server import completion_body

    def run(s: Setting, ids: list[int], i: int) -> Run:
        c = pool.complete(s.key, completion_body(ids, max_tokens=max_tokens, seed=seed + i,
                                                 ignore_eos=ignore_eos, **sampling))
        return Run(c.tokens, c.tok_s, c.drafted, c.accepted, request_s=c.request_s)
    return run


def run_bench(model: Model, prompts: list[str], settings: Iterable[Setting], *, max_tokens: int,
              reps: int = 1, warmup: int = 1, ignore_eos: bool = True, sampling: dict | None = None,
              seed: int = 0, progress: Callable[[int], None] | None = None,
              llama_server: LlamaServerPool | None = None) -> list[dict]:
    """Run every setting on every prompt ``reps`` times, rotating the order per prompt.

    With temperature > 0 (``sampling``), prompt i uses seed+i in every setting, and
    "identical" counts outputs equal to no-spec (expected to differ: only the
    distribution is preserved). With ``llama_server``, its rows follow pymtp's; at
    temperature 0 they also count outputs equal to pymtp's on the same setting.
    """
    sampling = sampling or {}
    settings = list(settings)
    if not any(s.spec == "none" for s in settings):
        settings.insert(0, Setting("none"))
    ids = check_prompts(model, prompts, max_tokens)
    opts = {"max_tokens": max_tokens, "sampling": sampling, "seed": seed, "ignore_eos": ignore_eos}
    runners = {PYMTP: pymtp_runner(model, **opts)}
    cells = [(PYMTP, s) for s in settings]
    if llama_server is not None:
        runners[LLAMA] = llama_server_runner(llama_server, **opts)
        twins = {s.key: Setting(s.spec, s.draft_max, s.p_min) for s in settings if s.has_twin}
        cells = _interleave(cells, [(LLAMA, s) for s in twins.values()])
    results = {c: SettingResult(c[1], c[0]) for c in cells}
    # auto's search runs at load (Model.calibrate), not over the measured requests
    calibrations = {s: model.calibrate(**_kind_kwargs(s, sampling, seed)) for s in settings
                    if s.spec == "mtp" and s.draft_max == "auto"}

    # the warm-up reads the last prompt: the first measured runs read prompt 0, and a
    # prompt decoded again at once is not the run a user's first request is
    for _ in range(warmup):
        for system, s in cells:
            runners[system](s, ids[-1], len(ids) - 1)
    for r in range(reps):
        for i, toks in enumerate(ids):
            shift = (i + r) % len(cells)
            for system, s in cells[shift:] + cells[:shift]:
                results[(system, s)].add(i, runners[system](s, toks, i))
                if progress:
                    progress(1)

    greedy = not sampling.get("temperature")
    ours = {s.key: results[(PYMTP, s)].outputs for s in reversed(settings)}
    rows = []
    for system in runners:
        own = [res for (sys_, _), res in results.items() if sys_ == system]
        base = next(res for res in own if res.setting.spec == "none")
        base_med = statistics.median(base.tok_s) if base.tok_s else None
        for res in own:
            res.identical = sum(1 for i, t in base.outputs.items() if res.outputs.get(i) == t)
            row = res.summary(base_med, len(prompts))
            cal = calibrations.get(res.setting) if system == PYMTP else None
            if cal is not None:
                row["calibration"] = {"seconds": round(cal.seconds, 3), "depths": cal.depths,
                                      "estimates": cal.estimates}
            if system == LLAMA:
                # (ignore_eos bans the end tokens in both systems: their greedy outputs agree throughout)
                same = sum(ours[res.setting.key][i] == t for i, t in res.outputs.items())
                row["identical_to_pymtp"] = f"{same}/{len(prompts)}" if greedy else None
            rows.append(row)
    return rows


def _interleave(ours: list[tuple], theirs: list[tuple]) -> list[tuple]:
    """Place each llama-server cell right after the last pymtp cell with the same key."""
    last = {c[1].key: n for n, c in enumerate(ours)}
    out = []
    for n, c in enumerate(ours):
        out.append(c)
        out += [t for t in theirs if last[t[1].key] == n]
    return out


def compare(rows: list[dict], greedy: bool = True) -> dict:
    """pymtp / llama-server speed per setting, best MTP against best MTP, and identical outputs.

    "Best MTP" is the fastest row of each system that drafted: an auto row whose requests
    all ran at depth 0 decoded as no-spec. Above temperature 0 (``greedy`` false) the two
    systems accept drafts by different rules, and ``accept_rules`` says which."""
    key = lambda r: (r["draft_max"], r["p_min"]) if r["spec"] == "mtp" else (0, 0.0)
    theirs = {key(r): r for r in rows if r["system"] == LLAMA}
    ours = [r for r in rows if r["system"] == PYMTP]
    ratio = lambda a, b: round(a / b, 3) if b else None
    per_setting = [{"setting": r["setting"], "pymtp_tok_s": r["median_tok_s"],
                    "llama_server_tok_s": theirs[key(r)]["median_tok_s"],
                    "ratio": ratio(r["median_tok_s"], theirs[key(r)]["median_tok_s"]),
                    "request_ratio": ratio(r.get("median_request_tok_s") or 0.0,
                                           theirs[key(r)].get("median_request_tok_s") or 0.0)}
                   for r in ours if key(r) in theirs]
    drafted = lambda r: r["spec"] == "mtp" and r["acceptance"] is not None
    best = lambda rs: max(filter(drafted, rs), key=lambda r: r["median_tok_s"], default=None)
    b_ours, b_theirs = best(ours), best(theirs.values())
    best_mtp = None
    if b_ours and b_theirs:
        best_mtp = {"pymtp": {"setting": b_ours["setting"], "tok_s": b_ours["median_tok_s"]},
                    "llama_server": {"setting": b_theirs["setting"], "tok_s": b_theirs["median_tok_s"]},
                    "ratio": ratio(b_ours["median_tok_s"], b_theirs["median_tok_s"])}
    nospec = theirs.get((0, 0.0), {}).get("identical_to_pymtp")
    rules = None if greedy or not any(r["spec"] == "mtp" for r in ours) else ACCEPT_RULES
    return {"per_setting": per_setting, "best_mtp": best_mtp, "nospec_identical_to_pymtp": nospec,
            "accept_rules": rules}


# Above temperature 0 the systems keep drafts by different rules (README, `accept`).
ACCEPT_RULES = ("llama-server keeps a draft only where it equals the token sampled there (pymtp's "
                "--accept exact); pymtp's rows not marked exact keep a draft x with probability "
                "min(1, p(x)/q(x)) (rejection sampling), which keeps more drafts from the same distribution")


# Draws of the paired bootstrap behind auto's interval (ratio_interval).
INTERVAL_DRAWS = 2000


def ratio_interval(auto: list[float], fixed: list[list[float]], level: float = 0.95,
                   draws: int = INTERVAL_DRAWS, seed: int = 0) -> tuple[float, float] | None:
    """An interval for median(auto) / the best fixed setting's median, by a paired bootstrap
    over the runs: each draw resamples run indices, the same ones for every setting (run i
    of each is the same prompt and repetition, in one rotation), and picks the best fixed
    setting again, so the interval carries that pick's own luck (the best of several noisy
    medians reads high). A ratio of medians over 16 prompts moved 0.95x-1.04x between runs
    of one tree on one path (benchmarks/README.md, sessions 38-39); this says how far one
    run's figure can be trusted. None where the runs do not pair up or are fewer than 4."""
    n = len(auto)
    if n < 4 or not fixed or any(len(f) != n for f in fixed):
        return None
    idx = np.random.default_rng(seed).integers(0, n, size=(draws, n))
    ours = np.median(np.asarray(auto, dtype=float)[idx], axis=1)
    best = np.max([np.median(np.asarray(f, dtype=float)[idx], axis=1) for f in fixed], axis=0)
    lo, hi = np.quantile(ours / best, [(1 - level) / 2, (1 + level) / 2])
    return round(float(lo), 3), round(float(hi), 3)


def auto_against_fixed(rows: list[dict]) -> dict | None:
    """pymtp's draft_max="auto" against its best fixed setting (no-spec included), on the
    decode speeds and on whole requests (prompt + decode): auto prices a depth by the
    whole request, its drafter's pass over the prompt included (depth.Arms.observe),
    which the decode speed leaves out. None without an auto row (or a fixed one)."""
    ours = [r for r in rows if r.get("system", PYMTP) == PYMTP]
    auto = next((r for r in ours if r["draft_max"] == "auto"), None)
    fixed = [r for r in ours if r["draft_max"] != "auto"]
    if auto is None or not fixed:
        return None
    ratio = lambda a, b: round(a / b, 3) if a and b else None
    out = {}
    for name, field_ in (("decode", "median_tok_s"), ("request", "median_request_tok_s")):
        best = max(fixed, key=lambda r: r.get(field_) or 0.0)
        out[name] = {"best_fixed": best["setting"], "ratio": ratio(auto.get(field_), best.get(field_))}
    out["decode"]["interval"] = ratio_interval(auto.get("tok_s_runs") or [],
                                               [r.get("tok_s_runs") or [] for r in fixed])
    return out


def _grid(head: list[str], body: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(b) for b in body])


def format_table(rows: list[dict]) -> str:
    both = any(r.get("system", PYMTP) != PYMTP for r in rows)
    head = ["setting", "median tok/s", "speedup", "acceptance", "per position", "identical"]
    body = [[r["setting"], f'{r["median_tok_s"]:.1f}',
             f'{r["speedup"]:.2f}x' if r["speedup"] is not None else "-",
             f'{r["acceptance"]:.3f}' if r["acceptance"] is not None else "-",
             " ".join(f"{x:.2f}" for x in r["accepted_per_position"]) or "-",
             r["identical_to_nospec"]] for r in rows]
    if both:
        head = ["system"] + head + ["same as pymtp"]
        body = [[r["system"]] + b + [r.get("identical_to_pymtp") or "-"] for r, b in zip(rows, body)]
    text = _grid(head, body)
    for r in rows:
        if r.get("draft_max") == "auto" and r.get("requests_at_depth"):
            at = ", ".join(f"k={k}: {n}" for k, n in r["requests_at_depth"].items())
            text += f'\n{r["setting"]}: runs by depth {at} (k=0: decoded as no-spec)'
            seq = ", ".join(f"{k}@{v:.0f}" for k, v in r.get("requests_in_order", []))
            text += f'\n{r["setting"]}: depth@tok/s request by request (after the warm-up run): {seq}'
        if r.get("calibration"):
            c = r["calibration"]
            est = ", ".join(f"k={k}: {v}" for k, v in c["estimates"].items())
            text += (f'\n{r["setting"]}: calibrated at load in {c["seconds"]:.2f} s, depths run '
                     f'{c["depths"]}, estimated tok/s {est}')
    a = auto_against_fixed(rows)
    if a and a["decode"]["ratio"] is not None:
        x = lambda v: f"{v:.2f}x" if v is not None else "-"
        lo_hi = a["decode"]["interval"]
        band = f" [95% over resampled prompts: {lo_hi[0]:.2f}-{lo_hi[1]:.2f}]" if lo_hi else ""
        text += (f'\nauto against the best fixed setting: {x(a["decode"]["ratio"])} ({a["decode"]["best_fixed"]}){band}, '
                 f'whole requests {x(a["request"]["ratio"])} ({a["request"]["best_fixed"]})')
    return text


def format_comparison(cmp: dict) -> str:
    x = lambda v: f"{v:.2f}x" if v is not None else "-"
    body = [[p["setting"], f'{p["pymtp_tok_s"]:.1f}', f'{p["llama_server_tok_s"]:.1f}', x(p["ratio"]),
             x(p.get("request_ratio"))] for p in cmp["per_setting"]]
    b = cmp["best_mtp"]
    if b:
        body.append(["best MTP", f'{b["pymtp"]["tok_s"]:.1f} ({b["pymtp"]["setting"]})',
                     f'{b["llama_server"]["tok_s"]:.1f} ({b["llama_server"]["setting"]})', x(b["ratio"]), "-"])
    # the decode speeds end the prompt phase where llama-server's timings do (results.Stats);
    # the whole request (prompt + decode) is the check that no such line can move
    text = _grid(["setting", "pymtp tok/s", "llama-server tok/s", "pymtp / llama-server", "whole request"], body)
    if cmp["nospec_identical_to_pymtp"]:
        text += f'\ngreedy no-spec outputs identical across systems: {cmp["nospec_identical_to_pymtp"]} prompts'
    if cmp.get("accept_rules"):
        text += f'\nacceptance rules: {cmp["accept_rules"]}'
    return text


def plot_depths(rows: list[dict], path: str | Path, title: str = "") -> None:
    """Median tok/s against draft depth (no-spec at 0), a line per system and MTP variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, dict[int, float]] = {}
    nospec = {r["system"]: r["median_tok_s"] for r in rows if r["spec"] == "none"}
    for r in rows:
        if r["spec"] == "mtp" and r["draft_max"] != "auto":
            name = r["system"] + (f" p_min={r['p_min']:g}" if r["p_min"] else "")
            name += " exact" if r.get("accept") == "exact" else ""
            lines.setdefault(name, {0: nospec[r["system"]]})[r["draft_max"]] = r["median_tok_s"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in lines.items():
        depths = sorted(points)
        ax.plot(depths, [points[d] for d in depths], marker="o", label=name)
    ax.set_xlabel("draft depth k (0 = no-spec)")
    ax.set_ylabel("median decode tok/s")
    ax.set_xticks(sorted({d for p in lines.values() for d in p}))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
