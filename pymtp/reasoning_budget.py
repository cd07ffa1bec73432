"""A reasoning budget: at most N tokens of thinking, then the end of the block is forced
(llama-server's ``--reasoning-budget N`` and its requests' ``reasoning_budget_tokens``).

The budget counts the tokens generated inside a ``<think>`` block: from the start where
the prompt left the block open (Qwen3.5's generation prompt ends in ``<think>\\n``), else
from the token that completes an open tag the model writes. When the count reaches the
budget the block is closed for the model: the ``forced`` tokens (a message, then the end
tag) come next, whatever the model would have said, and it goes on from there. A block the
model closes itself before that ends the count. A budget of 0 closes an opened block at
once. A budget that runs out inside a character written over several tokens waits for the
character to be whole, so the forced text never splits one.

Why a token mask: forcing a token is a state that allows it alone. The rounds treat the
budget's state as they treat a grammar's (constraint.py): drafts and verify rows are
masked alike, so speculative output stays what plain decoding under the same budget gives,
greedy or sampled, and while forcing, the drafts are the forced tokens and are all
accepted. A request's grammar, if any, is kept inside: both must allow a token.

Phases of one state (``BudgetMask``, never changed: ``then`` makes the next):

  ========  ====================================================================
  IDLE      outside a block: watching for the open tag
  COUNTING  inside a block: ``left`` tokens to go, watching for the end tag
  WAITING   no tokens left, a character unfinished: allowing its rest
  FORCING   ``forced[at]`` alone is allowed
  DONE      the block ended: everything allowed, nothing watched any more
  ========  ====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from .reasoning import THINK_CLOSE, THINK_OPEN

IDLE, COUNTING, WAITING, FORCING, DONE = "idle", "counting", "waiting", "forcing", "done"
OPEN, CLOSE = THINK_OPEN.encode(), THINK_CLOSE.encode()
# how far back a prompt is read for a block it left open: a continued assistant message
# may have started its thinking (the tokens there do not count, as llama-server's)
PROMPT_TAIL_TOKENS = 512


@dataclass(frozen=True)
class Budget:
    """One request's budget, in the model's tokens."""

    tokens: int                        # the most tokens inside a block before forcing
    forced: tuple[int, ...]            # the message's tokens, then the end tag's
    piece: Callable[[int], bytes]      # a token's bytes, special tokens spelled out
    n_vocab: int

    @classmethod
    def of(cls, model, tokens: int, message: str = "") -> Budget:
        """``model`` a native model (tokenize, token_to_bytes, n_vocab): the message as
        plain text, the end tag as the model's own token where it has one."""
        forced = model.tokenize(message, add_special=False) if message else []
        forced += model.tokenize(THINK_CLOSE, add_special=False, parse_special=True)
        return cls(tokens, tuple(int(t) for t in forced),
                   lambda t: model.token_to_bytes(t, special=True), model.n_vocab)

    def start(self, opened: bool, inner=None) -> BudgetMask:
        """The state before the first generated token: counting where the prompt left a
        block ``opened``, else watching for one. ``inner``: the request's grammar state,
        or None."""
        first = BudgetMask(self, IDLE, 0, b"", 0, inner)
        return first._opened() if opened else first


def opened_in(prompt_tail: bytes) -> bool:
    """Whether a raw prompt's last tokens (as bytes) leave a think block open. A chat knows
    better (``reasoning.block_at_start``: its generation prompt and continued message; a
    ``<think>`` in a user's message opens nothing) and says so (``reasoning_opened``)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def _whole_utf8(data: bytes) -> bool:
    """Whether ``data`` does not end inside a character."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return True
        if b >= 0xC0:          # a lead byte: how many bytes its character takes
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return back >= need
    return True


@dataclass(frozen=True)
class BudgetMask:
    """One budget state (a token_masks.TokenMask, and constraint.Mask's ``then``)."""

    budget: Budget
    phase: str
    left: int          # COUNTING: tokens still allowed inside the block
    tail: bytes        # the last bytes generated, enough to find a tag split over tokens
    at: int            # FORCING: the index of the forced token that comes next
    inner: object      # the request's grammar state (constraint.Mask), or None

    @property
    def keep_going(self) -> bool:
        return bool(getattr(self.inner, "keep_going", False))

    @property
    def allows_all(self) -> bool:
        """Every token allowed just now: no grammar inside and nothing forced."""
        return self.inner is None and self.phase != FORCING

    @property
    def forcing(self) -> int | None:
        """The one token allowed next, or None."""
        return self.budget.forced[self.at] if self.phase == FORCING else None

    def allows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int32)
        ok = self.inner.allows(ids) if self.inner is not None else np.ones(ids.size, dtype=bool)
        forced = self.forcing
        return ok if forced is None else ok & (ids == forced)

    def allowed(self) -> np.ndarray:
        forced = self.forcing
        if forced is not None:
            one = np.array([forced], dtype=np.int32)
            return one[self.allows(one)]
        if self.inner is not None:
            return self.inner.allowed()
        return np.arange(self.budget.n_vocab, dtype=np.int32)

    def then(self, token: int) -> BudgetMask:
        """The state after ``token``, which this state must allow."""
        forced = self.forcing
        if forced is not None and token != forced:
            raise ValueError(f"token {token} is not the reasoning budget's forced token {forced}")
        nxt = replace(self, inner=self.inner.then(token) if self.inner is not None else None)
        if self.phase == DONE:
            return nxt
        if self.phase == FORCING:
            at = self.at + 1
            return replace(nxt, phase=DONE if at == len(self.budget.forced) else FORCING, at=at)
        text = self.tail + self.budget.piece(int(token))
        if self.phase == IDLE:
            i = text.find(OPEN)
            if i < 0:
                return replace(nxt, tail=text[-(len(OPEN) - 1):])
            return replace(nxt, tail=text[i + len(OPEN):])._opened()
        if CLOSE in text:                       # the model closed the block itself
            return replace(nxt, phase=DONE, tail=b"")
        keep = text[-max(len(CLOSE) - 1, 4):]
        left = self.left - 1 if self.phase == COUNTING else 0
        if left > 0:
            return replace(nxt, phase=COUNTING, left=left, tail=keep)
        return replace(nxt, phase=FORCING if _whole_utf8(text) else WAITING, left=0, tail=keep, at=0)

    def _opened(self) -> BudgetMask:
        """Just inside a block: counting, or forcing at once where the budget is 0."""
        if self.budget.tokens > 0:
            return replace(self, phase=COUNTING, left=self.budget.tokens)
        return replace(self, phase=FORCING, left=0, at=0)

    def ending(self) -> BudgetMask:
        """constraint.Mask's: the grammar's end allowed where it may end (sampling's last
        resort under ignore_eos); the budget's phase stays."""
        return replace(self, inner=self.inner.ending()) if self.inner is not None else self

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
