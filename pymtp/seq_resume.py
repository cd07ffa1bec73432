"""What a seq id keeps between requests under the prompt cache (prompt_cache.py): where a
new sequence on it resumes (``reusable``, ``resume``), the snapshot a sequence leaves
(``snapshot``), and the drafter brought level with that snapshot while nothing runs
(``catch_up_parked``). ``Rounds`` holds one; a round itself only takes snapshots.
"""

from __future__ import annotations

import numpy as np

from .config import DecodeParams, drafts_steer_seed
from .drafter import DraftJob, MTPDrafter
from .native import NativeContext, NativeError, NativeModel
from .prompt_cache import PromptCache, Shelved, Snapshot
from .round_state import CatchUp, SeqState, tail_from


class Resumes:
    """The prompt cache's side of the target and MTP contexts a ``Rounds`` shares."""

    def __init__(self, model: NativeModel, target: NativeContext, drafter: MTPDrafter | None,
                 cache: PromptCache | None) -> None:
        self.model, self.target, self.drafter, self.cache = model, target, drafter, cache

    def reusable(self, seq: int, ids: np.ndarray, p: DecodeParams, spec: bool) -> Snapshot | None:
        """The snapshot a new sequence on ``seq`` starts from, or None (a cold start).
        Scoring a prompt (prompt_logprobs) needs every row of it decoded."""
        if self.cache is None or not p.cache_prompt or p.prompt_logprobs is not None:
            return None
        return self.cache.usable(seq, ids, *self.drafter_holds(seq, p, spec))

    def drafter_holds(self, seq: int, p: DecodeParams, spec: bool) -> tuple[int | None, bool]:
        """What the prompt cache weighs for a request on ``seq``: the pairs its drafter
        holds that count (None: it drafts with none), and whether it must resume as a cold
        run's would (a seed its drafts steer: only the pairs before a gap count)."""
        exact = spec and drafts_steer_seed(p)
        return (self.mtp_end(seq, exact) if spec else None), exact

    def mtp_end(self, seq: int, exact: bool = False) -> int | None:
        """Positions the drafter holds for ``seq`` (None without a drafter); ``exact``: only
        those before a gap (Drafter.whole), for a request whose drafts steer its seed."""
        if self.drafter is None:
            return None
        return self.drafter.whole(seq) if exact else self.drafter.end(seq)

    def resume(self, s: SeqState, snap: Snapshot) -> None:
        """Start ``s`` from ``snap``: its recurrent state restored, the attention KV cut
        after it, the MTP KV brought to the same position (from the snapshot's tail, which
        ``PromptCache.usable`` takes from a later snapshot where that one holds the pairs:
        the drafter then holds what a cold start's would, so its drafts, and a seed's text,
        are the same; a plain run's snapshot, which has no hidden row, leaves it a gap
        instead), the prefill going on from there."""
        seq = s.seq
        self.target.state_set(seq, snap.data, snap.data.nbytes)
        if not self.target.seq_rm(seq, snap.pos, -1):
            raise NativeError(f"could not cut the attention KV at {snap.pos} after a prompt-cache restore")
        if self.drafter is not None:
            # a seeded request's drafter keeps no pairs past a gap: the tail
            # (PromptCache.usable, told the same) brings it up from there as a cold run's
            exact = s.spec and drafts_steer_seed(s.params)
            end = self.drafter.trim(seq, min(snap.pos, self.drafter.whole(seq)) if exact else snap.pos)
            if s.spec and end < snap.pos:
                s.pending = tail_from(snap, end, self.model.n_embd_out)
        self.cache.restored(seq, snap)
        s.prefilled = snap.pos
        if snap.hidden_before is not None:
            s.hidden_before = snap.hidden_before.copy()
        elif s.spec:
            s.hidden_before = None      # a plain run's (PromptCache.usable: jumps only)
        s.stats.cached_tokens = snap.pos

    def shelved_for(self, prompt: np.ndarray, p: DecodeParams, spec: bool) -> tuple[Shelved, int] | None:
        """``PromptCache.shelved_for`` for a request with ``p`` (``spec``: it drafts)."""
        if self.cache is None:
            return None
        return self.cache.shelved_for(prompt, spec, spec and drafts_steer_seed(p))

    def shelve(self, seq: int, keep: int) -> bool:
        """Keep ``seq``'s conversation in host memory before a request that reuses its
        first ``keep`` tokens takes it (prompt_cache.Shelved): the target's whole seq
        state, the drafter's."""
        if self.cache is None:
            return False
        size = self.target.state_size(seq, flags=0)
        drafter = self.drafter.ctx.state_size(seq, flags=0) if self.drafter is not None else 0
        if not self.cache.could_shelve(seq, keep, size + drafter):
            return False      # a chat bigger than the budget is not copied out for nothing
        buf = np.empty(size, dtype=np.uint8)
        n = self.target.state_get(seq, buf, flags=0)
        lane = self.drafter.save(seq) if self.drafter is not None else None
        return self.cache.shelve(seq, keep, buf[:n], lane)

    def unshelve(self, e: Shelved, seq: int) -> None:
        """Put a shelved conversation back on ``seq`` (what it held is replaced)."""
        self.target.state_set(seq, e.target, e.target.nbytes, flags=0)
        if self.drafter is not None:
            if e.drafter is not None:
                self.drafter.load(seq, e.drafter)
            else:
                self.drafter.reset(seq)
        self.cache.unshelve(e, seq)

    def snapshot(self, s: SeqState) -> None:
        """Snapshot ``s`` at the end of what its target KV holds; it is between rounds."""
        if not s.caching:
            return
        s.unring()
        tail, hidden_before = None, (s.hidden_before if s.spec else None)
        if s.spec and s.pending is not None:
            if s.prefilling:       # every pending pair is inside the KV
                tail = s.pending
            else:                  # the last pair's token is `last`, not in the KV yet
                tail = CatchUp(s.pending.tokens[:-1], s.pending.hidden[:-1])
                hidden_before = s.pending.hidden[-1:]
            if s.held is not None and s.pending.start == len(s.prompt):
                # the prompt's rows a plain round kept back (``_hold``) and no round that
                # drafts took: without them a request resuming here had a drafter without
                # its prompt (drafts accepted less, and a seed's text differed from a cold run)
                tail = s.held.then(tail)
        elif not s.prefilling and s.spec:
            return    # between the draft and the verify: nothing consistent to keep
        tokens = list(s.prompt[: s.prefilled]) + s.committed
        self.cache.save(self.target, s.seq, tokens, hidden_before, tail)

    def catch_up_parked(self, seq: int, most: int | None = None) -> int:
        """While nothing runs: decode into the drafter the pairs that ``seq``'s newest
        snapshot keeps as its tail, so the next request that resumes from it starts with
        the drafter caught up. A generation that ended at its first token (or right after
        a plain round) left them there, and they were decoded in the next request's time
        to first token (456 rows at turn 2 of chat_turns.py: 60 ms on two CPU threads).
        At most ``most`` rows (None: all), so a request that arrives waits for little.
        Returns the rows decoded."""
        if self.cache is None or self.drafter is None:
            return 0
        slot = self.cache.slots.get(seq)
        snaps = [sn for sn in slot.snapshots if sn.tail is not None] if slot is not None else []
        if not snaps:
            return 0
        snap = max(snaps, key=lambda sn: sn.pos)
        end = self.drafter.end(seq)
        if end >= snap.pos or (end < snap.tail_start and not self.model.positions_jump):
            return 0          # caught up, or a gap the tail cannot fill
        rows = tail_from(snap, end, self.model.n_embd_out)
        stop = len(rows.tokens) if most is None else min(len(rows.tokens), most)
        self.drafter.propose([DraftJob(seq, rows.tokens[:stop], rows.hidden[:stop], start=rows.start)])
        return stop
