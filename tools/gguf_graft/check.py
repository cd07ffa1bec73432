"""--check: run the grafted file with the pymtp runtime and report the MTP acceptance rate.

A file can load and still carry a block that does not belong to its trunk (another model
or revision, a wrong transform); then almost no draft is accepted. A short greedy run on a
predictable prompt tells the two apart. The runtime is imported on use only, so the graft
tool itself needs nothing but gguf and numpy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

CHECK_PROMPT = "1, 2, 3, 4, 5,"  # counting: any working MTP head predicts most of it
CHECK_TOKENS = 64
CHECK_DRAFT_MAX = 3
NEAR_ZERO = 0.10  # below this, the block is almost certainly wired wrong


@dataclass(frozen=True)
class CheckResult:
    drafted: int
    accepted: int
    acceptance_rate: float
    text: str
    tokens: int = CHECK_TOKENS

    @property
    def near_zero(self) -> bool:
        """A failed check; a run that drafted nothing judged nothing, and fails too."""
        return self.drafted == 0 or self.acceptance_rate < NEAR_ZERO


def run_check(path: str | os.PathLike[str], prompt: str = CHECK_PROMPT, max_tokens: int = CHECK_TOKENS,
              **load_options: Any) -> CheckResult:
    """Greedy MTP generation on `path` (`load_options` go to `pymtp.load`, e.g. threads);
    raises RuntimeError if the runtime is unavailable."""
    try:
        import pymtp

        load = pymtp.load
    except (ImportError, AttributeError) as e:
        # pymtp itself missing, or present without what it runs on (llama-cpp-python): say which
        why = str(e) if isinstance(e, ImportError) and e.name not in (None, "pymtp") else \
            "it needs the pymtp runtime (pip install pymtp)"
        raise RuntimeError(why) from e
    model = load(path, **load_options)
    try:
        # ignore_eos: a reply ended early (an end token after the prompt) drafted too little to
        # judge the block by; the whole run is the trunk's, whatever it writes
        result = model.generate(prompt, max_tokens=max_tokens, draft_max=CHECK_DRAFT_MAX, ignore_eos=True)
    finally:
        model.close()
    s = result.stats
    return CheckResult(s.drafted, s.accepted, s.acceptance_rate, result.text, len(result.tokens))
