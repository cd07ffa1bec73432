"""``pymtp bench``: no-spec against MTP settings, alternating in one process.

Every prompt runs each setting once per repetition, in rotating order, after a warm-up,
so drift on a shared machine spreads over all settings alike. Speed is the median of
per-prompt decode tok/s; acceptance is pooled over all rounds.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .generate import Model


@dataclass(frozen=True)
class Setting:
    spec: str
    draft_max: int = 0
    p_min: float = 0.0
    accept: str = "rejection"

    @property
    def label(self) -> str:
        if self.spec == "none":
            return "no-spec"
        label = f"mtp k={self.draft_max}" + (f" p_min={self.p_min:g}" if self.p_min else "")
        return label + (" exact" if self.accept == "exact" else "")


@dataclass
class SettingResult:
    setting: Setting
    tok_s: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    identical: int = 0
    runs: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)

    def add(self, prompt_idx: int, tokens: list[int], stats, rounds_at: tuple[list[int], list[int]]) -> None:
        self.tok_s.append(stats.tokens_per_second)
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        d_at, a_at = rounds_at
        for i, (d, a) in enumerate(zip(d_at, a_at)):
            if i >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += d
            self.accepted_at[i] += a
        self.runs += 1
        self.outputs.setdefault(prompt_idx, tokens)

    def summary(self, baseline_median: float | None, n_prompts: int) -> dict:
        med = statistics.median(self.tok_s) if self.tok_s else 0.0
        return {
            "setting": self.setting.label, "spec": self.setting.spec,
            "draft_max": self.setting.draft_max, "p_min": self.setting.p_min,
            "accept": self.setting.accept if self.setting.spec == "mtp" else None,
            "median_tok_s": round(med, 2),
            "speedup": round(med / baseline_median, 3) if baseline_median else None,
            "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "accepted_per_position": [round(a / d, 4) for a, d in zip(self.accepted_at, self.drafted_at) if d],
            "identical_to_nospec": f"{self.identical}/{n_prompts}",
            "runs": self.runs,
        }


def read_prompts(path: str | Path) -> list[str]:
    """JSON lines with a "prompt" field (a plain JSON list of strings is accepted too)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        items = json.loads(text)
        return [p["prompt"] if isinstance(p, dict) else str(p) for p in items]
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompts.append(obj["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected a JSON object with a \"prompt\" field ({exc})") from exc
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def run_bench(model: Model, prompts: list[str], settings: Iterable[Setting], *, max_tokens: int,
              reps: int = 1, warmup: int = 1, ignore_eos: bool = True, sampling: dict | None = None,
              seed: int = 0, progress: Callable[[int], None] | None = None) -> list[dict]:
    """Run every setting on every prompt ``reps`` times, rotating the order per prompt.

    With temperature > 0 (``sampling``), prompt i uses seed+i in every setting, and
    "identical" counts outputs equal to no-spec (expected to differ: only the
    distribution is preserved).
    """
    sampling = sampling or {}
    settings = list(settings)
    if not any(s.spec == "none" for s in settings):
        settings.insert(0, Setting("none"))
    results = {s: SettingResult(s) for s in settings}
    ids = [model.tokenize(p, special=True) for p in prompts]

    def one(s: Setting, toks: list[int], i: int = 0):
        r = model.generate(toks, max_tokens=max_tokens, spec=s.spec, draft_max=s.draft_max or 1,
                           p_min=s.p_min, accept=s.accept, seed=seed + i, ignore_eos=ignore_eos,
                           **sampling)
        return r.tokens, r.stats, (r.stats.drafted_at, r.stats.accepted_at)

    for _ in range(warmup):
        for s in settings:
            one(s, ids[0])
    for r in range(reps):
        for i, toks in enumerate(ids):
            shift = (i + r) % len(settings)
            for s in settings[shift:] + settings[:shift]:
                tokens, stats, run = one(s, toks, i)
                results[s].add(i, tokens, stats, run)
                if progress:
                    progress(1)
    base = results[next(s for s in settings if s.spec == "none")]
    for res in results.values():
        res.identical = sum(1 for i, t in base.outputs.items() if res.outputs.get(i) == t)
    base_med = statistics.median(base.tok_s) if base.tok_s else None
    return [results[s].summary(base_med, len(prompts)) for s in settings]


def format_table(rows: list[dict]) -> str:
    head = ["setting", "median tok/s", "speedup", "acceptance", "per position", "identical"]
    body = [[r["setting"], f'{r["median_tok_s"]:.1f}',
             f'{r["speedup"]:.2f}x' if r["speedup"] is not None else "-",
             f'{r["acceptance"]:.3f}' if r["acceptance"] is not None else "-",
             " ".join(f"{x:.2f}" for x in r["accepted_per_position"]) or "-",
             r["identical_to_nospec"]] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(b) for b in body])
