"""One stream's loop: ``Engine.run``, a generator of the rounds (rounds.py) of one sequence.

An ``Engine`` owns the contexts of one generation at a time (``Session``): a target per
snapshot depth, made lazily so that plain runs never pay for snapshots or the MTP KV, the
drafter, and each target's prompt cache. ``run`` yields a ``Step`` per round, launching the
next round before it hands one on where the device decodes while the host goes on (a GPU),
and leaves the caches consistent when its consumer stops early. With draft_max="auto" a
request runs at the one depth ``depth.Arms`` picks for its kind of request.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

from .config import SEEDED_DEPTH, DecodeParams, pin_seeded
from .drafter import MTPDrafter
from .backend_sampling import BackendChains
from .depth import Arms
from .draft_vocab import DraftHead
from .native import ContextConfig, NativeContext, NativeModel
from .prompt_cache import CacheBudget, PromptCache
from .round_state import PROMPT_ROUND, RunStats, SeqState, Step
from .rounds import Rounds
from .sampling_route import SAMPLING_PATHS


def arm_kind(p: DecodeParams) -> tuple:
    """What sets a request's speed with drafts apart from another's (depth.Arms): greedy
    or sampled and how hot, the acceptance rule, the draft cut-off, and a grammar."""
    constrained = p.grammar is not None or p.json_schema is not None
    return (round(p.temperature, 1), p.accept if p.temperature > 0 else None, p.p_min, constrained)


class Engine:
    """Owns one target context (and one MTP drafter) for one sequence at a time."""

    def __init__(self, model: NativeModel, *, n_ctx: int, n_batch: int, threads: int | None,
                 draft_limit: int, draft_kv: str = "target", row_by_row: bool = False,
                 flash_attn: str = "auto", sampling: str = "chain",
                 cache_budget: CacheBudget | None = None, checkpoint_every: int = 0,
                 draft: DraftHead | None = None) -> None:
        if sampling not in SAMPLING_PATHS:
            raise ValueError(f"sampling must be 'auto', 'chain', 'numpy' or 'backend', got {sampling!r}")
        self.model = model
        self.draft = draft        # the drafter's own model and ids (draft_vocab.py), or None
        self.cache_budget = cache_budget
        self.checkpoint_every = checkpoint_every
        self._caches: dict[int, PromptCache] = {}    # per target context
        self._drafter_for: int | None = None         # the target whose sequence the MTP KV follows
        self._open: tuple[Rounds, SeqState] | None = None   # the last run's, if it did not finish
        self._dirty = False                          # ... and it stopped inside a round
        self.draft_limit = draft_limit
        self.draft_kv = draft_kv
        self.row_by_row = row_by_row
        self.sampling = sampling
        self._cfg = dict(n_ctx=n_ctx, n_batch=n_batch, threads=threads, flash_attn=flash_attn)
        self._targets: dict[int, NativeContext] = {}
        self._drafter: MTPDrafter | None = None
        self._chains = BackendChains()
        # draft_max="auto": one depth a request, by what each measured (depth.Arms, per kind
        # of request)
        self.arms: dict[tuple, Arms] = {}

    # -- contexts are made lazily: no-spec runs never pay for snapshots or the MTP KV
    def target(self, n_rs_seq: int) -> NativeContext:
        ctx = self._targets.get(n_rs_seq)
        if ctx is None:
            nb = self._cfg["n_batch"]
            # Outputs per decode never exceed a verify batch (prefill asks for one row), and
            # llama.cpp sizes its logits buffer by this: n_batch x n_vocab would be ~0.5 GB
            # for a 248k vocabulary.
            ctx = NativeContext(self.model, ContextConfig(
                n_ctx=self._cfg["n_ctx"], n_batch=nb, n_ubatch=nb, n_rs_seq=n_rs_seq,
                threads=self._cfg["threads"], n_outputs_max=self.draft_limit + 1,
                flash_attn=self._cfg["flash_attn"]))
            self._targets[n_rs_seq] = ctx
        return ctx

    def drafter(self) -> MTPDrafter:
        if self._drafter is None:
            self._drafter = MTPDrafter(self.model, ContextConfig(
                n_ctx=self._cfg["n_ctx"], n_batch=self._cfg["n_batch"],
                n_ubatch=self._cfg["n_batch"], threads=self._cfg["threads"], mtp=True,
                n_outputs_max=1, flash_attn=self._cfg["flash_attn"]),
                keep_accepted=self.draft_kv == "keep", row_by_row=self.row_by_row, draft=self.draft)
        return self._drafter

    def close(self) -> None:
        self._open = None
        for cache in self._caches.values():
            cache.clear()
        self._caches.clear()
        for ctx in self._targets.values():
            ctx.close()
        self._targets.clear()
        if self._drafter is not None:
            self._drafter.close()
            self._drafter = None
        self._chains.close()

    def _rounds(self, target: NativeContext, drafter: MTPDrafter | None, cache: PromptCache | None) -> Rounds:
        return Rounds(self.model, target, drafter, sampling=self.sampling, chains=self._chains, cache=cache)

    def _prepare(self, n_rs_seq: int, spec: bool) -> Rounds:
        """The rounds of a run: its target (and drafter), and that target's prompt cache."""
        target = self.target(n_rs_seq)
        target.set_nextn_output(spec, masked=False)
        drafter = None
        if spec:
            drafter = self.drafter()
            if self._drafter_for != n_rs_seq:      # its KV follows another context's sequence
                drafter.reset()
                self._drafter_for = n_rs_seq
        elif self._drafter_for == n_rs_seq and self.cache_budget is not None:
            # a plain run on the context the MTP KV follows: its restores and resets must
            # cut the MTP KV too (it drafts nothing: DecodeParams.spec decides that)
            drafter = self._drafter
        cache = None
        if self.cache_budget is not None:
            cache = self._caches.get(n_rs_seq)
            if cache is None:
                cache = self._caches[n_rs_seq] = PromptCache(self.cache_budget, self.checkpoint_every,
                                                             jumps=self.model.positions_jump)
        else:
            target.clear()
            if drafter is not None:
                drafter.reset()
        return self._rounds(target, drafter, cache)

    def _settle(self) -> None:
        """What the last run left, if its consumer stopped early: kept for the prompt
        cache where it stopped between rounds, dropped where it stopped inside one."""
        if self._open is None:
            return
        rounds, seq = self._open
        self._open = None
        if self._dirty:
            rounds.flight = None
            rounds.release_id(seq.seq)
            return
        if rounds.flight is not None:     # launched before its consumer stopped: finish it
            rounds.land()
        if seq.finish is None:
            rounds.park(seq)

    def arms_for(self, p: DecodeParams) -> Arms:
        """The depth search of ``p``'s kind of request (depth.Arms), made at its first
        request or calibration (``Session.calibrate``)."""
        return self.arms.setdefault(arm_kind(p), Arms(self.draft_limit))

    @staticmethod
    def _arm_ran(arms: Arms, stats: RunStats) -> None:
        """A finished auto request: its decode speed to its depth, from where the drafter
        held the prompt's rows (its pass over them apart: Arms.observe says why); a plain
        one's rounds (one a token after the prompt's) are its depth histogram, all k=0."""
        if stats.arm == 0 and stats.generated > 1:
            stats.depths = {0: stats.generated - 1}
        if stats.t_prompt_done:
            ready = stats.decode_from
            arms.observe(stats.arm, stats.generated, time.perf_counter() - ready,
                         sum(stats.depths.values()), stats.drafted_at, stats.accepted_at,
                         prompt_s=ready - stats.t_prompt_done)

    # -- the loop
    def run(self, prompt: list[int], p: DecodeParams, stats: RunStats | None = None) -> Iterator[Step]:
        """Yield one Step per round until EOG, max_tokens or a full context (``PROMPT_ROUND``
        for a round of the prompt's that emitted nothing).

        ``prompt`` is non-empty and inside the vocabulary (Session.stream checks both); one
        too long for the context raises ``ParamError`` at the first step.
        """
        stats = stats if stats is not None else RunStats()
        p = pin_seeded(p, self.draft_limit)     # the default depth: auto, or one fixed for a seed
        spec = p.spec == "mtp"
        arms = None
        if spec and p.draft_max == "auto" and p.prediction:
            # drafts from a prediction need the drafting context: a fixed depth, off the
            # depth search (its speed says how close the prediction was, not what a depth costs)
            p = replace(p, draft_max=min(SEEDED_DEPTH, self.draft_limit))
        elif spec and p.draft_max == "auto":     # the whole request at one depth (depth.Arms); 0 decodes as no-spec does
            arms = self.arms_for(p)
            k = stats.arm = arms.choose()
            p, spec = (replace(p, draft_max=k) if k else replace(p, spec="none")), k > 0
        # The MTP target keeps draft_limit snapshots whatever this request's draft_max, so
        # requests with different depths share one context. rollback="checkpoint" uses a
        # target with none, which is what an architecture without snapshots gets.
        self._settle()
        rounds = self._prepare(self.draft_limit if (spec and p.rollback == "auto") else 0, spec)
        seq = rounds.start(0, prompt, p, stats)
        self._open, self._dirty = (rounds, seq), True      # dirty: inside a round
        observed = False
        try:
            rounds.launch([seq])
            while True:
                steps = rounds.land()
                if seq.error is not None:      # its draw failed (Rounds._alone): raised, still dirty
                    raise seq.error
                # on a GPU the next round's verify goes to the device before the caller
                # reads this one's tokens: its work overlaps the decode (Rounds.overlapped)
                ahead = seq.finish is None and rounds.overlapped
                if ahead:
                    rounds.launch([seq])
                self._dirty = False
                if seq.finish and arms is not None:     # before the last Step: its consumer may stop there
                    self._arm_ran(arms, stats)
                    observed = True
                for _, step in steps:
                    yield step
                if seq.finish:
                    return
                if not steps:
                    yield PROMPT_ROUND
                self._dirty = True
                if not ahead:
                    rounds.launch([seq])
        finally:
            stats.t_end = time.perf_counter()
            # its consumer ended it between rounds (a stop string, a closed stream): the
            # rounds ran at its depth all the same, and a search never told of them never moved
            if arms is not None and not observed and not self._dirty:
                self._arm_ran(arms, stats)
