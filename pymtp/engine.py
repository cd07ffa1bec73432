"""The round loop: draft -> verify -> accept -> roll back, as a generator over token ids.

One round (DESIGN.md Part 1), with n the position of ``last`` (sampled, not yet in any KV):
  1. the drafter catches up on the rows accepted last round and drafts d_1..d_k;
  2. the target decodes [last, d_1..d_k] at n..n+k in one batch, every row an output;
  3. acceptance keeps a prefix of the drafts and adds one recovered or bonus token:
     greedy keeps the longest prefix where the target's argmax equals the draft; with
     temperature > 0, rejection sampling (or llama.cpp's exact-match rule) on the target's
     p and the drafter's q, both under the same filters;
  4. the target drops positions > n+a: one ``seq_rm`` that the recurrent snapshots serve,
     or, where they cannot, a restore of the checkpoint taken before the verify followed
     by a re-decode of the accepted rows.

Python work per round is O(k): slices of numpy views over llama.cpp's buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .acceptance import exact_match_accept, greedy_accept, rejection_accept
from .config import DecodeParams, ParamError
from .drafter import MTPDrafter
from .native import Batch, ContextConfig, NativeContext, NativeError, NativeModel
from .sampling import Dist, Sampler, make_sampler


class _LazyDists:
    """Target distributions of the verify rows, computed only for the rows acceptance reads."""

    def __init__(self, sampler: Sampler, logits: np.ndarray) -> None:
        self.sampler, self.logits = sampler, logits
        self.cache: dict[int, Dist] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> Dist:
        d = self.cache.get(i)
        if d is None:
            d = self.cache[i] = self.sampler.dist(self.logits[i])
        return d


@dataclass
class Step:
    """What one round emitted. ``tokens`` excludes an end-of-generation token."""

    tokens: list[int]
    drafted: int = 0
    accepted: int = 0
    finish: str | None = None        # "stop" (EOG), "length" (max_tokens or context full)
    logits: np.ndarray | None = None  # [len(tokens), n_vocab], only with record_logits


@dataclass
class RunStats:
    """Counters of one run, filled as the generator advances."""

    prompt_tokens: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    drafted_at: list[int] = field(default_factory=list)    # per draft position
    accepted_at: list[int] = field(default_factory=list)
    checkpoint_restores: int = 0
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    t_end: float = 0.0

    def count_round(self, k: int, a: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += a
        while len(self.drafted_at) < k:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(k):
            self.drafted_at[i] += 1
            if i < a:
                self.accepted_at[i] += 1


class Engine:
    """Owns one target context (and one MTP drafter) for one sequence at a time."""

    def __init__(self, model: NativeModel, *, n_ctx: int, n_batch: int, threads: int | None,
                 draft_limit: int, draft_kv: str = "target", row_by_row: bool = False,
                 flash_attn: str = "auto") -> None:
        self.model = model
        self.draft_limit = draft_limit
        self.draft_kv = draft_kv
        self.row_by_row = row_by_row
        self._cfg = dict(n_ctx=n_ctx, n_batch=n_batch, threads=threads, flash_attn=flash_attn)
        self._targets: dict[int, NativeContext] = {}
        self._drafter: MTPDrafter | None = None

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
                keep_accepted=self.draft_kv == "keep", row_by_row=self.row_by_row)
        return self._drafter

    def close(self) -> None:
        for ctx in self._targets.values():
            ctx.close()
        self._targets.clear()
        if self._drafter is not None:
            self._drafter.close()
            self._drafter = None

    # -- the loop
    def run(self, prompt: list[int], p: DecodeParams, stats: RunStats | None = None,
            *, record_logits: bool = False) -> Iterator[Step]:
        """Yield one Step per round until EOG, max_tokens or a full context."""
        stats = stats if stats is not None else RunStats()
        spec = p.spec == "mtp"
        # The MTP target keeps draft_limit snapshots whatever this request's draft_max, so
        # requests with different depths share one context. rollback="checkpoint" uses a
        # target with none, which is what an architecture without snapshots gets.
        n_rs = self.draft_limit if (spec and p.rollback == "auto") else 0
        tgt = self.target(n_rs)
        tgt.set_nextn_output(spec, masked=False)
        tgt.clear()
        drafter = self.drafter() if spec else None
        if drafter is not None:
            drafter.reset()
        if len(prompt) >= tgt.n_ctx:
            # here, not earlier: llama.cpp rounds n_ctx up, and the context says by how much
            raise ParamError("prompt", f"prompt has {len(prompt)} tokens but the context holds "
                             f"{tgt.n_ctx}; shorten the prompt or give the model a larger context "
                             "(n_ctx, --ctx-size)", code="context_length_exceeded")
        stats.prompt_tokens = len(prompt)
        stats.t_start = time.perf_counter()
        try:
            yield from self._loop(tgt, drafter, np.asarray(prompt, dtype=np.int32), p, stats,
                                  record_logits)
        finally:
            stats.t_end = time.perf_counter()

    def _loop(self, tgt: NativeContext, drafter: MTPDrafter | None, prompt: np.ndarray,
              p: DecodeParams, stats: RunStats, record: bool) -> Iterator[Step]:
        model = self.model
        nb = tgt.n_batch
        batch = Batch(nb)
        n_prompt = len(prompt)

        # Prefill in n_batch chunks. With MTP, every chunk but the last is mirrored into the
        # MTP KV at once (its hidden rows are overwritten by the next decode); the last chunk
        # is fused into the first draft decode.
        pending_h = np.zeros((1, model.n_embd_out), dtype=np.float32)   # h_{-1} = 0
        tail_tokens = prompt
        tail_hidden = pending_h
        for s in range(0, n_prompt, nb):
            e = min(s + nb, n_prompt)
            batch.set(prompt[s:e], s, outputs="last")
            tgt.decode(batch)
            if drafter is not None:
                h = tgt.hidden(e - s)
                rows = np.concatenate([pending_h, h[:-1]])
                if e < n_prompt:
                    drafter.feed(prompt[s:e], rows)
                else:
                    tail_tokens, tail_hidden = prompt[s:e], rows
                pending_h = h[-1:].copy()
        sampler = make_sampler(p.temperature, p.top_k, p.top_p, p.min_p, seed=p.seed)
        greedy = sampler.is_greedy
        logits = tgt.logits(1)
        last = int(logits[0].argmax()) if greedy else sampler(logits[0])
        stats.t_prompt_done = time.perf_counter()

        n = n_prompt                     # position of `last`
        eog = (lambda t: False) if p.ignore_eos else model.is_eog
        if eog(last):
            yield Step([], finish="stop", logits=logits[:0].copy() if record else None)
            return
        produced = 1
        stats.generated = 1
        yield Step([last], logits=logits.copy() if record else None)
        if produced >= p.max_tokens:
            yield Step([], finish="length")
            return

        # catch-up rows for the drafter: tokens and the target hidden row before each
        cu_tokens = np.concatenate([tail_tokens, [last]]).astype(np.int32) if drafter else None
        cu_hidden = np.concatenate([tail_hidden, pending_h]) if drafter else None
        ckpt = np.empty(0, dtype=np.uint8)
        vbatch = Batch(max(self.draft_limit, p.draft_max) + 1)

        while True:
            room = tgt.n_ctx - n - 1          # positions left after `last`
            if room < 0:
                yield Step([], finish="length")
                return
            remaining = p.max_tokens - produced
            k = 0
            if drafter is not None:
                k = max(0, min(p.draft_max, remaining - 1, room))
                draft_sampler = None if (greedy or p.accept == "exact") else sampler
                if k:
                    drafts, qs = drafter.propose(cu_tokens, cu_hidden, k, p.p_min, draft_sampler)
                else:
                    drafts, qs = np.empty(0, np.int32), []
                k = len(drafts)
            else:
                drafts, qs = np.empty(0, dtype=np.int32), []

            use_ckpt = k > 0 and k > tgt.n_rs_seq
            if use_ckpt:
                size = tgt.state_size(0)
                if ckpt.nbytes < size:
                    ckpt = np.empty(size, dtype=np.uint8)
                ckpt_n = tgt.state_get(0, ckpt)

            vtoks = np.empty(k + 1, dtype=np.int32)
            vtoks[0] = last
            vtoks[1:] = drafts
            vbatch.set(vtoks, n, outputs="all")
            tgt.decode(vbatch)
            vlogits = tgt.logits(k + 1)
            if greedy:
                verdict = greedy_accept(drafts, vlogits.argmax(axis=1))
            elif p.accept == "exact" or not k:
                verdict = exact_match_accept(drafts, _LazyDists(sampler, vlogits), sampler.rng)
            else:
                verdict = rejection_accept(drafts, qs, _LazyDists(sampler, vlogits), sampler.rng)
            a, nxt = verdict.n_accepted, verdict.next_token
            if k:
                stats.count_round(k, a)
            rec = vlogits[: a + 1].copy() if record else None   # before a re-decode overwrites it

            if a < k:
                rolled = (not use_ckpt) and tgt.seq_rm(0, n + a + 1, -1)
                if not rolled:
                    if not use_ckpt:
                        raise NativeError(
                            f"rollback of {k - a} rows refused with {tgt.n_rs_seq} snapshots")
                    tgt.state_set(0, ckpt, ckpt_n)
                    if not tgt.seq_rm(0, n, -1):
                        raise NativeError("could not trim the attention KV after a restore")
                    vbatch.set(vtoks[: a + 1], n, outputs="last")
                    tgt.decode(vbatch)
                    stats.checkpoint_restores += 1

            emitted = [int(t) for t in drafts[:a]] + [int(nxt)]
            # stop rules: EOG anywhere in the emitted run, then max_tokens
            finish = None
            for i, t in enumerate(emitted):
                if eog(t):
                    emitted = emitted[:i]
                    finish = "stop"
                    break
            if finish is None and produced + len(emitted) >= p.max_tokens:
                emitted = emitted[: p.max_tokens - produced]
                finish = "length"
            if rec is not None:
                rec = rec[: len(emitted)]
            produced += len(emitted)
            stats.generated = produced
            yield Step(emitted, drafted=k, accepted=a, finish=finish, logits=rec)
            if finish:
                return

            if drafter is not None:
                # Next catch-up: accepted drafts then the new last token at n+1..n+a+1, paired
                # with the verify's hidden rows at n..n+a (the rows that predicted them).
                # (`last` itself is already in the MTP KV: draft step 0 decoded it.)
                skip = drafter.commit(a)
                cu_tokens = np.empty(a + 1 - skip, dtype=np.int32)
                cu_tokens[: a - skip] = drafts[skip:a]
                cu_tokens[a - skip] = nxt
                cu_hidden = tgt.hidden(a + 1)[skip: a + 1]
            n += a + 1
            last = nxt
