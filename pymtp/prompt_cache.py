"""The prompt cache's memory: per seq id, the tokens its KV holds and snapshots of its
recurrent state, within one byte budget per model (issue #11; the policy is
prefix_cache.py's).

A ``Snapshot`` at ``pos`` is what a sequence needs to go on from its first ``pos`` tokens
without decoding them again:

  - ``data``: the target's recurrent state there (``llama_state_seq_get_data_ext`` with
    ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: only the recurrent part of the hybrid memory;
    the attention KV of those positions stays in the context and is cut after them);
  - ``hidden_before``: the target's hidden row at pos - 1, which the MTP head pairs with
    the token at pos (the MTP KV at q holds (h_{q-1}, x_q); drafter.py); None for a
    plain run's, which a drafter resumes from only after a gap;
  - ``tail``: the MTP pairs of the last positions before pos that the drafter had not
    decoded when the snapshot was taken (a generation's last accepted drafts), so the
    MTP KV can be brought to pos without the target's hidden rows, which are gone.

The snapshots of a slot are valid while its KV holds the tokens they were taken on: a
restore at P drops those past P, a cold start drops them all, unless the batched engine
shelved them first with a copy of that KV (``Shelved``). One ``CacheBudget`` is shared by
every engine of a model, and evicts the oldest snapshot or shelved chat, wherever it is.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

log = logging.getLogger("pymtp.prompt_cache")

from .prefix_cache import Held, SlotView, evict, pick_snapshot, reuse_limit

if TYPE_CHECKING:
    from .drafter import LaneState
    from .round_state import CatchUp
    from .native import NativeContext


@dataclass(eq=False)
class Snapshot:
    pos: int                          # tokens covered
    data: np.ndarray                  # [size] uint8, the recurrent state
    hidden_before: np.ndarray | None  # [1, n_embd_out] the target's row at pos - 1; None when
                                      # taken without the hidden rows (a plain run): a drafter
                                      # resumes from it only after a gap (PromptCache.usable)
    tail: "CatchUp | None"            # MTP pairs of positions [pos - len(tail), pos)
    stamp: int

    @property
    def tail_start(self) -> int:
        return self.pos - (len(self.tail.tokens) if self.tail is not None else 0)

    @property
    def nbytes(self) -> int:
        n = self.data.nbytes + (self.hidden_before.nbytes if self.hidden_before is not None else 0)
        if self.tail is not None:
            n += self.tail.tokens.nbytes + self.tail.hidden.nbytes
        return n


@dataclass(eq=False)
class Slot:
    """What one seq id holds."""

    tokens: list[int] = field(default_factory=list)   # the target KV's tokens, by position
    snapshots: list[Snapshot] = field(default_factory=list)
    last_used: int = 0

    @property
    def end(self) -> int:
        """The tokens its newest snapshot covers (0: none)."""
        return max((s.pos for s in self.snapshots), default=0)


@dataclass(eq=False)
class Shelved:
    """A conversation a slot held, kept in host memory after another prompt took the slot
    (as llama-server's --cache-ram keeps prompts beyond its slots): the slot's tokens and
    snapshots, and the whole of what the target and MTP contexts held for it (a snapshot
    keeps only the recurrent part; the attention KV stays in the slot, which is gone)."""

    slot: Slot
    target: np.ndarray                # [size] uint8, the target's seq state (flags 0)
    drafter: "LaneState | None"       # the MTP KV's (None: no drafter)
    stamp: int

    @property
    def nbytes(self) -> int:
        return (self.target.nbytes + (self.drafter.data.nbytes if self.drafter is not None else 0)
                + sum(s.nbytes for s in self.slot.snapshots))

    def holds(self, exact: bool) -> int:
        """The pairs its drafter holds that count (``Resumes.mtp_end``'s, as shelved)."""
        d = self.drafter
        return 0 if d is None else d.whole if exact else d.end


class CacheBudget:
    """The byte budget of every prompt cache of one model, and its lock."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.lock = threading.RLock()
        self._caches: weakref.WeakSet[PromptCache] = weakref.WeakSet()
        self._stamps = itertools.count(1)
        self._told = False

    def too_small(self, nbytes: int) -> None:
        """Say once that a snapshot is bigger than the whole budget: no prompt is reused
        then, and nothing else tells the user why every request reads its prompt again."""
        if self._told:
            return
        self._told = True
        log.warning("prompt cache: one snapshot of the recurrent state takes %.2f MiB, more than the whole "
                    "budget of %.2f MiB, so no prompt is reused; give prompt_cache_mib (the server's "
                    "--cache-ram) at least %d MiB, several times that to keep more than one conversation",
                    nbytes / 2**20, self.budget / 2**20, math.ceil(nbytes / 2**20))

    def register(self, cache: "PromptCache") -> None:
        with self.lock:
            self._caches.add(cache)

    def stamp(self) -> int:
        return next(self._stamps)

    @property
    def used(self) -> int:
        with self.lock:
            return (sum(s.nbytes for c in self._caches for slot in c.slots.values() for s in slot.snapshots)
                    + sum(e.nbytes for c in self._caches for e in c.shelf))

    @property
    def count(self) -> int:
        """Snapshots, those of shelved conversations included."""
        with self.lock:
            return sum(len(slot.snapshots) for c in self._caches for slot in [*c.slots.values(),
                                                                               *(e.slot for e in c.shelf)])

    def fit(self) -> None:
        """Drop the oldest snapshots and shelved conversations until all fit the budget."""
        with self.lock:
            owners = {}
            held = []
            for c in self._caches:
                for slot in c.slots.values():
                    for s in slot.snapshots:
                        owners[s] = slot.snapshots
                        held.append(Held(s, s.nbytes, s.stamp))
                for e in c.shelf:
                    owners[e] = c.shelf
                    held.append(Held(e, e.nbytes, e.stamp))
            for s in evict(held, self.budget):
                owners[s].remove(s)


def tail_pairs(slot: Slot | None, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The MTP pairs (tokens, hidden rows) of positions [start, stop) from a tail of
    one of ``slot``'s snapshots that holds them all, or None. The snapshots of a slot
    were taken on the same tokens, so a later one's tail serves an earlier one: a
    generation that ended before it drafted again keeps the prompt's rows there."""
    for snap in slot.snapshots if slot is not None else ():
        if snap.tail is not None and snap.tail_start <= start and stop <= snap.pos:
            a, b = start - snap.tail_start, stop - snap.tail_start
            return snap.tail.tokens[a:b], snap.tail.hidden[a:b]
    return None


class PromptCache:
    """The snapshots of one context's seq ids; its engine saves and restores with them."""

    def __init__(self, budget: CacheBudget, every: int, *, jumps: bool = False) -> None:
        self.budget = budget
        self.every = every
        # the drafter may resume after a gap (NativeModel.positions_jump): any snapshot
        # with a hidden row serves an MTP run, whatever its tail
        self.jumps = jumps
        self.slots: dict[int, Slot] = {}
        self.shelf: list[Shelved] = []    # conversations no slot holds now, oldest first
        self._uses = itertools.count(1)
        budget.register(self)

    def clear(self) -> None:
        """Drop everything (its context is being freed)."""
        with self.budget.lock:
            self.slots.clear()
            self.shelf.clear()

    def slot(self, seq: int) -> Slot:
        return self.slots.setdefault(seq, Slot())

    def usable(self, seq: int, prompt: Sequence[int], mtp_end: int | None, exact: bool = False) -> Snapshot | None:
        """The snapshot to restore for ``prompt`` on ``seq``, or None. ``mtp_end``: the
        positions the drafter's KV holds for it (None: no drafter); a snapshot where no
        tail of the slot's (``pairs``) can bring the MTP KV up to it is passed over,
        unless the drafter may resume after a gap (``jumps``) and the request is not
        ``exact`` (a seeded one, whose text the drafts steer: config.drafts_steer_seed;
        a gap changes the drafts, and every later request on that snapshot repeated it).
        A plain run's (no ``hidden_before``, so the drafter holds none of it) needs
        RESUME_ROWS prompt tokens after it too, the pairs a drafter resuming after a
        plain epoch keeps: with 3 (demo, 101 reused, greedy, k=3) an 80-token reply took
        29 rounds against a cold run's 21; with 27, 26 against 25.
        Where another's tail does, the snapshot comes back with that tail's pairs as its
        own: another thread's save may evict that one before the restore."""
        with self.budget.lock:
            return self._usable(self.slots.get(seq), prompt, mtp_end, exact)

    def _usable(self, slot: Slot | None, prompt: Sequence[int], mtp_end: int | None, exact: bool) -> Snapshot | None:
        jumps = self.jumps and not exact
        if slot is None or not slot.snapshots:
            return None
        from .round_state import RESUME_ROWS
        snaps = [s for s in slot.snapshots if mtp_end is None
                 or (s.hidden_before is None and jumps and s.pos + RESUME_ROWS <= len(prompt))
                 or (s.hidden_before is not None and (jumps or s.tail_start <= mtp_end
                                                      or tail_pairs(slot, mtp_end, s.pos) is not None))]
        i = pick_snapshot([s.pos for s in snaps], reuse_limit(slot.tokens, prompt))
        if i is None:
            return None
        snap = snaps[i]
        if mtp_end is not None and snap.tail_start > mtp_end:
            pairs = tail_pairs(slot, mtp_end, snap.pos)
            if pairs is not None:
                from .round_state import CatchUp
                snap = replace(snap, tail=CatchUp(*pairs))
        return snap

    def pairs(self, seq: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``tail_pairs`` of ``seq``'s slot."""
        with self.budget.lock:
            return tail_pairs(self.slots.get(seq), start, stop)

    # -- conversations no slot holds (``Shelved``)
    def shelved_for(self, prompt: Sequence[int], spec: bool, exact: bool) -> tuple[Shelved, int] | None:
        """The shelved conversation a request on ``prompt`` would skip the most of, and
        how many tokens (None: none skips any). ``spec``, ``exact``: as ``usable``'s
        ``mtp_end`` and ``exact``, with the pairs its drafter held when shelved."""
        with self.budget.lock:
            best = None
            for e in self.shelf:
                snap = self._usable(e.slot, prompt, e.holds(exact) if spec else None, exact)
                if snap is not None and (best is None or snap.pos > best[1]):
                    best = (e, snap.pos)
            return best

    def could_shelve(self, seq: int, keep: int, state_bytes: int) -> bool:
        """Whether ``shelve`` would keep ``seq``'s chat with ``state_bytes`` of context
        state: asked before that state is copied out of the device."""
        with self.budget.lock:
            moved = self._moved(seq, keep)
            return bool(moved) and state_bytes + sum(s.nbytes for s in moved) <= self.budget.budget

    def _moved(self, seq: int, keep: int) -> list[Snapshot]:
        """The snapshots a request reusing ``keep`` of ``seq``'s tokens drops (``shelve`` takes them)."""
        slot = self.slots.get(seq)
        return [s for s in slot.snapshots if s.pos > keep] if slot is not None else []

    def take(self, e: Shelved) -> None:
        """Off the shelf, on its way back to a slot (``unshelve``)."""
        with self.budget.lock:
            if e in self.shelf:      # (another thread's save may have evicted it since)
                self.shelf.remove(e)

    def put_back(self, e: Shelved) -> None:
        """Back on the shelf after a restore that failed (``take``), as the newest, where
        the budget still holds it."""
        with self.budget.lock:
            if e not in self.shelf:
                e.stamp = self.budget.stamp()
                self.shelf.append(e)
                self.budget.fit()

    def shelve(self, seq: int, keep: int, target: np.ndarray, drafter: "LaneState | None") -> bool:
        """Keep ``seq``'s conversation, its slot's tokens and the snapshots past ``keep``
        (those the request taking the slot drops; it may restore one of the others) with the
        contexts' state (``target``, ``drafter``), for after another prompt took the slot.
        False where no snapshot lies past ``keep`` or the budget cannot hold them."""
        with self.budget.lock:
            moved = self._moved(seq, keep)
            if not moved:
                return False
            slot = self.slots[seq]
            e = Shelved(Slot(list(slot.tokens), moved, slot.last_used), target, drafter, self.budget.stamp())
            if e.nbytes > self.budget.budget:
                return False
            slot.snapshots = [s for s in slot.snapshots if s.pos <= keep]
            for s in slot.snapshots:     # what the request taking the slot restores goes last
                s.stamp = self.budget.stamp()
            e.stamp = self.budget.stamp()
            self.shelf.append(e)
            self.budget.fit()
            return e in self.shelf

    def unshelve(self, e: Shelved, seq: int) -> None:
        """``seq`` holds ``e``'s conversation now (its contexts' state was restored): its
        snapshots are the newest again, in their order."""
        with self.budget.lock:
            self.take(e)
            for s in e.slot.snapshots:
                s.stamp = self.budget.stamp()
            self.slots[seq] = Slot(e.slot.tokens, e.slot.snapshots, next(self._uses))
            self.budget.fit()

    def view(self, seq: int, prompt: Sequence[int] | None, mtp_end: int | None, exact: bool = False) -> SlotView:
        """``seq`` as slot choice sees it (``prompt`` None: the request does not reuse)."""
        snap = None if prompt is None else self.usable(seq, prompt, mtp_end, exact)
        slot = self.slots.get(seq)
        return SlotView(seq, snap.pos if snap is not None else 0, slot.last_used if slot else 0)

    def restored(self, seq: int, snap: Snapshot) -> None:
        """``seq`` now holds its first ``snap.pos`` tokens; later snapshots are stale."""
        with self.budget.lock:
            slot = self.slot(seq)
            del slot.tokens[snap.pos:]
            slot.snapshots = [s for s in slot.snapshots if s.pos <= snap.pos]
            slot.last_used = next(self._uses)

    def forget(self, seq: int) -> None:
        """``seq``'s KV was cleared: nothing it held can be reused."""
        with self.budget.lock:
            slot = self.slot(seq)
            slot.tokens, slot.snapshots = [], []
            slot.last_used = next(self._uses)

    def hold(self, seq: int, tokens: Sequence[int]) -> None:
        """``seq``'s KV holds ``tokens`` now (snapshots past them are stale)."""
        with self.budget.lock:
            slot = self.slot(seq)
            slot.tokens = list(tokens)
            slot.snapshots = [s for s in slot.snapshots if s.pos <= len(tokens)]

    def save(self, ctx: "NativeContext", seq: int, tokens: Sequence[int], hidden_before: np.ndarray | None,
             tail: "CatchUp | None" = None) -> Snapshot | None:
        """Snapshot ``seq``'s recurrent state, which covers ``tokens``; it replaces one at
        the same position. None when the budget cannot hold even this one."""
        pos = len(tokens)
        if pos == 0:
            return None
        if tail is not None and (tail.tokens.base is not None or tail.hidden.base is not None):
            # a view would keep the whole array it was cut from alive, past what nbytes counts
            tail = replace(tail, tokens=tail.tokens.copy(), hidden=tail.hidden.copy())
        buf = np.empty(ctx.state_size(seq), dtype=np.uint8)
        n = ctx.state_get(seq, buf)
        snap = Snapshot(pos, buf[:n], None if hidden_before is None else hidden_before.copy(), tail,
                        self.budget.stamp())
        if snap.nbytes > self.budget.budget:
            self.budget.too_small(snap.nbytes)
            return None
        with self.budget.lock:
            self.hold(seq, tokens)
            slot = self.slot(seq)
            slot.snapshots = [s for s in slot.snapshots if s.pos != pos] + [snap]
            self.budget.fit()
        return snap
