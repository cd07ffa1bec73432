"""Prompt-cache policy, as pure functions over token lists and plain numbers (issue #11).

A slot (a seq id) keeps the tokens its attention KV holds and a few snapshots of its
recurrent (Gated DeltaNet) state, each covering the first ``pos`` tokens. A new prompt
can reuse a slot's first P tokens when:

  - they are a common prefix of the prompt and of what the slot holds;
  - P < len(prompt): the prompt's last token is decoded again, for the logits the first
    generated token comes from;
  - a snapshot was taken at exactly P: the attention KV can be cut anywhere, the
    recurrent state only restored where it was saved (DESIGN.md, Part 4).

The mechanism (prompt_cache.py) saves and restores; everything it decides is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# A snapshot this many tokens before the end of every prompt, besides the one at its end:
# a request sent again, or a chat template that ends its generation prompt with markers
# the next turn renders differently (a thinking block), diverges within the last few
# tokens, where the end-of-prompt snapshot is useless. llama-server does the same.
TAIL_TOKENS = 4


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n


def reuse_limit(held: Sequence[int], prompt: Sequence[int]) -> int:
    """The most tokens of ``prompt`` a slot holding ``held`` could skip: the common prefix,
    less the prompt's last token, which is always decoded again for its logits."""
    return min(common_prefix(held, prompt), len(prompt) - 1)


def pick_snapshot(positions: Sequence[int], limit: int) -> int | None:
    """Index of the snapshot to restore: the one covering the most tokens, at most
    ``limit`` (None: none fits, the prompt is prefilled from the start). Position 0 is
    never worth a restore."""
    best = None
    for i, pos in enumerate(positions):
        if 0 < pos <= limit and (best is None or pos >= positions[best]):
            best = i
    return best


@dataclass(frozen=True)
class SlotView:
    """What slot choice needs to know of one free slot."""

    seq: int
    reusable: int        # prompt tokens a restore would skip on it (0: none)
    last_used: int       # a counter, higher is more recent; 0: never used


def pick_slot(free: Sequence[SlotView]) -> int:
    """The seq id a request goes to: the free slot where it reuses the most; with no reuse
    anywhere, the least recently used one, so the caches most likely to be asked for again
    survive (as llama-server's slot similarity, then LRU). Ties go to the lowest id,
    which keeps running ids consecutive (scheduler.py says why that matters)."""
    if not free:
        raise ValueError("no free slot to pick from")
    best = max(free, key=lambda v: (v.reusable, -v.seq))
    if best.reusable > 0:
        return best.seq
    return min(free, key=lambda v: (v.last_used, v.seq)).seq


def worth_shelving(held: int, reusable: int) -> bool:
    """Whether to keep a slot's conversation in host memory (prompt_cache.Shelved) before a
    request that reuses ``reusable`` of the ``held`` tokens its snapshots cover takes it:
    when it drops more than it keeps. Another conversation, or one sharing only a system
    prompt, drops most; the next turn of the same chat whose template rewrote the last
    reply drops that reply only, and copying the whole KV out for it would be waste."""
    return held - reusable > reusable


def prefill_stops(start: int, n_prompt: int, every: int) -> list[int]:
    """Positions after ``start`` where a prefill pauses to snapshot its recurrent state:
    every ``every`` tokens (0: none), ``TAIL_TOKENS`` before the end, and the end."""
    stops = set(range(every, n_prompt, every)) if every > 0 else set()
    stops.add(n_prompt - TAIL_TOKENS)
    stops.add(n_prompt)
    return sorted(p for p in stops if start < p <= n_prompt)


def clip_chunk(start: int, n: int, stops: Sequence[int]) -> int:
    """A prefill chunk of ``n`` tokens from ``start``, cut at the first stop inside it."""
    for p in stops:
        if start < p < start + n:
            return p - start
    return n


@dataclass(frozen=True)
class Held:
    """One snapshot as eviction sees it."""

    key: object
    nbytes: int
    stamp: int           # creation order: lower is older


def evict(held: Sequence[Held], budget: int) -> list[object]:
    """Keys of the snapshots to drop, oldest first, until the rest fit ``budget`` bytes."""
    total = sum(h.nbytes for h in held)
    out = []
    for h in sorted(held, key=lambda h: h.stamp):
        if total <= budget:
            break
        out.append(h.key)
        total -= h.nbytes
    return out
