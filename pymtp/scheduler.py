"""Continuous batching: many requests on one target context and one MTP context, one round
at a time (issue #10).

``BatchEngine.step`` admits waiting requests into free seq ids, then runs one round
(rounds.Rounds.step) over every active sequence: their verify rows in one target decode,
their draft rows in batched MTP decodes, and the next chunk of each prompt still being
prefilled in that same target decode, so a long prompt delays the others by a chunk per
round, never by its whole prefill. A finished or cancelled sequence frees its seq id at
once; with a prompt cache the id keeps what it decoded, and a new request goes to the
free id holding the longest reusable prefix of its prompt (prefix_cache.pick_slot).
Requests may be submitted and cancelled from any thread; ``step`` runs in one.

How the contexts are laid out, and why (read from the pinned llama.cpp,
src/llama-context.cpp, llama-kv-cache.cpp, llama-batch.cpp, llama-memory-hybrid.cpp):

- ``n_seq_max`` = slots with ``kv_unified`` off: every sequence has a KV stream of its own
  holding n_ctx cells (the context is slots x n_ctx; llama.cpp divides n_ctx between the
  streams, so we multiply first). In a stream of its own, a sequence's positions sit in
  cells 0, 1, ... in order, as in a context of its own (``seq_rm`` moves the stream's head
  back to the first freed cell), and the attention's softmax and V sums run over its cells
  in the same order with the same SIMD grouping, so its rows round as they do alone. In
  one unified buffer its cells interleave with the other sequences' and those sums group
  its terms differently (docs/exactness.md, "Batched rounds", has the numbers;
  ``kv_unified`` is a knob here only for that comparison). A row the solo run decodes
  alone is the exception no layout fixes: in a batch it has company, and llama.cpp's CPU
  matmul picks another kernel for more than one row.
- llama.cpp splits a batch into ubatches with the same number of rows per sequence, keeps
  the last n_rs_seq + 1 rows of a sequence in one ubatch (the snapshots' rows), and with
  separate streams puts only *consecutive* seq ids in one ubatch. So verify rows are
  padded to one length (round_plan.verify_rows), a new request takes the lowest free id, and
  the MTP catch-up decodes its output rows together (drafter.catch_up_plan). A gap in the
  ids (a sequence finished between two running ones) would cost an extra ubatch until a new
  request takes the id, so rounds fill it with rows of their own (drafter.filler_ends).
- ``n_rs_seq`` = draft_limit snapshots per sequence; ``n_outputs_max`` = slots x
  (draft_limit + 1), every verify row of every sequence; the MTP context outputs one row
  per sequence per decode. ``n_batch`` must hold a round of every slot plus a prompt row.
- Backend sampling (``sampling="backend"``): llama.cpp attaches a sampler chain to a seq
  id and runs it on that id's output rows only, so every sequence of a batch keeps its
  own filters (backend_sampling.BackendChains); ``n_outputs_max_per_seq`` bounds the rows a chain
  serves per decode: a verify's draft_limit + 1 in the target, one in the MTP context.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Callable

from .config import DecodeParams, pin_seeded
from .drafter import MTPDrafter
from .backend_sampling import BackendChains
from .depth_batched import Epochs, Following
from .draft_vocab import DraftHead
from .round_state import RunStats, SeqState, Step
from .rounds import Rounds, prompt_too_long
from .native import ContextConfig, NativeContext, NativeModel
from .prefix_cache import pick_slot, worth_shelving
from .prompt_cache import CacheBudget, PromptCache, Slot
from .rpc import RpcError

log = logging.getLogger("pymtp.scheduler")


@dataclass(eq=False)
class Request:
    """One generation submitted to a ``BatchEngine``; its state is the engine's to change."""

    prompt: list[int]
    params: DecodeParams
    stats: RunStats = field(default_factory=RunStats)
    t_submit: float = 0.0
    t_admit: float | None = None      # when it got a seq id
    t_first: float | None = None      # when its first token was emitted
    seq: SeqState | None = None       # while it holds a seq id
    slot: int | None = None           # the seq id it was given, kept once it ends
    cancelled: bool = False
    done: bool = False                # finished, cancelled, or failed; holds no seq id
    finish: str | None = None         # "stop", "length", "cancelled" or "error"
    error: BaseException | None = None    # why it failed alone (finish "error" at its start)


@dataclass
class SlotStats:
    """Acceptance of the requests that ran under one seq id."""

    requests: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Timings:
    """Count, sum and the latest values of one duration (a server runs for long)."""

    count: int = 0
    total: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=1024))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.recent.append(seconds)


@dataclass
class BatchMetrics:
    """What the engine did: sequences per round, and per request its wait and first token."""

    rounds: int = 0
    batch_sizes: Counter = field(default_factory=Counter)    # sequences in a round -> rounds
    rows: int = 0                                            # target rows decoded, pads included
    queue: Timings = field(default_factory=Timings)          # submit -> seq id
    ttft: Timings = field(default_factory=Timings)           # submit -> first token
    slots: list[SlotStats] = field(default_factory=list)
    epochs: Epochs | None = None                             # draft_max="auto"'s measurements

    def mean_batch_size(self) -> float:
        n = sum(self.batch_sizes.values())
        return sum(k * v for k, v in self.batch_sizes.items()) / n if n else 0.0


def lowest_free(free: set[int]) -> int:
    """The seq id a new sequence takes without a prompt cache: the lowest, so running ids
    stay consecutive. With one, prefix_cache.pick_slot chooses (lowest among equals)."""
    return min(free)


def round_rows(slots: int, draft_limit: int) -> int:
    """The batch rows a round may need: every slot's verify rows, and one to spare."""
    return slots * (draft_limit + 1) + 1


def slots_that_fit(n_batch: int, draft_limit: int) -> int:
    """The most slots whose round fits in ``n_batch`` rows (``round_rows``)."""
    return max(0, (n_batch - 1) // (draft_limit + 1))


class BatchEngine:
    """One target context and one MTP drafter serving up to ``slots`` sequences at once."""

    def __init__(self, model: NativeModel, *, slots: int, n_ctx: int, n_batch: int, threads: int | None,
                 draft_limit: int, spec: bool = True, draft_kv: str = "target", row_by_row: bool = False,
                 flash_attn: str = "auto", prefill_chunk: int | None = None, kv_unified: bool = False,
                 sampling: str = "chain", cache_budget: CacheBudget | None = None,
                 checkpoint_every: int = 0, draft: DraftHead | None = None,
                 follow: Epochs | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        need = round_rows(slots, draft_limit)
        if n_batch < need:
            raise ValueError(f"n_batch={n_batch} cannot hold a round of {slots} slots with draft_limit="
                             f"{draft_limit}: load the model with n_batch >= {need}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (or None for all the batch can hold), got {prefill_chunk}")
        self.model = model
        self.slots = slots
        self.draft_limit = draft_limit
        self.prefill_chunk = prefill_chunk
        self.n_ctx = n_ctx
        total = n_ctx if kv_unified else slots * n_ctx
        target = NativeContext(model, ContextConfig(
            n_ctx=total, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=slots,
            n_rs_seq=draft_limit if spec else 0, threads=threads,
            n_outputs_max=slots * (draft_limit + 1), n_outputs_max_per_seq=draft_limit + 1,
            flash_attn=flash_attn, kv_unified=kv_unified))
        drafter = None
        try:
            target.set_nextn_output(spec, masked=False)
            if spec:
                drafter = MTPDrafter(model, ContextConfig(
                    n_ctx=total, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=slots, threads=threads,
                    mtp=True, n_outputs_max=slots, n_outputs_max_per_seq=1, flash_attn=flash_attn,
                    kv_unified=kv_unified),
                    keep_accepted=draft_kv == "keep", row_by_row=row_by_row, draft=draft)
        except BaseException:
            target.close()
            raise
        self._chains = BackendChains()
        self.cache = (PromptCache(cache_budget, checkpoint_every, jumps=model.positions_jump)
                      if cache_budget is not None else None)
        # requests with draft_max="auto" draft one depth together, picked per epoch and
        # occupancy by the batch's tokens a second (depth_batched.Epochs); with ``follow``, the depth
        # another engine's epochs pick (depth_batched.Following), and its measurements are that one's
        epochs = None if drafter is None else Epochs(draft_limit) if follow is None else Following(follow)
        self.rounds = Rounds(model, target, drafter, sampling=sampling, chains=self._chains, cache=self.cache,
                             auto_limit=draft_limit, epochs=epochs)
        self.metrics = BatchMetrics(slots=[SlotStats() for _ in range(slots)],
                                    epochs=epochs if isinstance(epochs, Epochs) else None)
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._active: dict[int, Request] = {}       # seq id -> request
        self._free = set(range(slots))
        # told each request the moment it has its seq id, before the round that decodes its
        # prompt (the server's /slots shows the slot busy from then, as llama-server's)
        self.on_admit: Callable[[Request], None] | None = None

    @property
    def has_drafter(self) -> bool:
        return self.rounds.drafter is not None

    @property
    def n_ctx_seq(self) -> int:
        """What one sequence can hold, prompt and output together."""
        return self.rounds.target.n_ctx_seq

    def close(self) -> None:
        if isinstance(self.rounds.epochs, Following):
            self.rounds.epochs.leave()
        if self.cache is not None:
            self.cache.clear()
        self.rounds.target.close()
        if self.rounds.drafter is not None:
            self.rounds.drafter.close()
        self._chains.close()       # after the contexts they are attached to

    # -- from any thread
    def submit(self, prompt: list[int], params: DecodeParams) -> Request:
        """Queue a generation; it starts at the next ``step`` with a free seq id. ``prompt``
        is non-empty token ids inside the vocabulary, ``params`` validated (the caller's
        job, as for Engine.run); one too long for a sequence's context raises here."""
        req = self.request(prompt, params)
        self.enqueue(req)
        return req

    def request(self, prompt: list[int], params: DecodeParams) -> Request:
        """``submit`` in two steps, for a caller that must know the request before any
        ``step`` can see it: this checks and makes it, ``enqueue`` queues it."""
        if len(prompt) >= self.n_ctx_seq:
            raise prompt_too_long(len(prompt), self.n_ctx_seq)
        # the default depth: auto, or one fixed for a seeded sampled request
        return Request(list(prompt), pin_seeded(params, self.draft_limit))

    def enqueue(self, req: Request, arrived: float | None = None) -> None:
        """Queue ``req``; ``arrived`` (perf_counter) is when it came, where that was before
        now: a server's request waits for a slot first, and its queue time counts that."""
        req.t_submit = time.perf_counter() if arrived is None else arrived
        with self._lock:
            self._waiting.append(req)

    def cancel(self, req: Request) -> None:
        """Stop a request at the next ``step``; its seq id is free after it."""
        req.cancelled = True

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._active

    def free_ids(self) -> list[int]:
        """The seq ids no request holds now (any thread: the stepping one takes and frees them)."""
        with self._lock:
            return sorted(self._free)

    # -- the stepping thread
    def catch_up_idle(self, most: int | None = None) -> int:
        """Between requests: bring the drafter up to a free slot's newest snapshot
        (Resumes.catch_up_parked), at most ``most`` rows; returns the rows decoded (0: none
        is behind)."""
        with self._lock:
            free = sorted(self._free)
        for seq in free:
            n = self.rounds.resumes.catch_up_parked(seq, most)
            if n:
                return n
        return 0

    @property
    def overlapped(self) -> bool:
        """``launch`` returns while the device decodes (Rounds.overlapped): the landed
        Steps are best handed on after it; elsewhere before it."""
        return self.rounds.overlapped

    def step(self) -> list[tuple[Request, Step]]:
        """``land`` then ``launch``: what each request emitted in the round that was in
        flight, and a "cancelled" Step for each request cancelled since."""
        out = self.land()
        return out + self.launch()

    def land(self) -> list[tuple[Request, Step]]:
        """The Steps of the round in flight (none if none): what each request emitted in
        it; a request that finished appears with its last Step and ``done``, its seq id
        free. A request cancelled meanwhile gets none (``launch`` ends it)."""
        if self.rounds.flight is None:
            return []
        out = []
        by_seq = {r.seq: r for r in self._active.values()}
        for s, step in self.rounds.land():
            req = by_seq[s]
            if req.cancelled:
                continue
            if req.t_first is None and step.tokens:
                req.t_first = time.perf_counter()
                self.metrics.ttft.add(req.t_first - req.t_submit)
            if s.finish:
                req.error = s.error        # its own draw failed: it ends alone (Rounds._alone)
                self._release(req, s.finish)
            out.append((req, step))
        return out

    def launch(self) -> list[tuple[Request, Step]]:
        """End the cancelled requests (finish "cancelled", no tokens: returned), admit
        waiting ones (one whose start fails: an "error" Step, returned), and launch the next round over the active sequences
        (rounds.Rounds.launch): the device decodes it while the caller hands the landed
        Steps on, until the next ``land``."""
        if self.rounds.flight is not None:
            raise RuntimeError("a round is in flight: land() it before launching the next")
        out = self._drop_cancelled()
        out += self._admit()
        seqs = [r.seq for r in self._active.values()]
        if not seqs:
            self.rounds.idle()
            return out
        self.metrics.rounds += 1
        self.metrics.batch_sizes[len(seqs)] += 1
        self.rounds.launch(seqs, self.prefill_chunk)
        self.metrics.rows += self.rounds.verify_rows
        return out

    def _admit(self) -> list[tuple[Request, Step]]:
        """Start waiting requests on free seq ids. One cancelled since ``_drop_cancelled``
        ends with a "cancelled" Step, returned. A request whose start fails ends alone
        (finish "error", the error kept on it, its id free at once): the others in the
        round, and in the queue, go on. Returns an "error" Step for each of those. A lost
        RPC worker is the model's failure, not the request's: it is raised, as from a round."""
        failed, admitted = [], []
        with self._lock:
            while self._waiting and self._free:
                req = self._waiting.popleft()
                if req.cancelled:      # since _drop_cancelled: its Step too, or its run waits on
                    req.done, req.finish = True, "cancelled"
                    failed.append((req, Step([], "cancelled")))
                    continue
                seq = None
                try:      # from its leaving the queue: an interrupt anywhere ends it, never loses it or its id
                    seq = self._slot_for(req)
                    self._free.discard(seq)
                    req.slot = seq
                    req.t_admit = time.perf_counter()
                    self.metrics.queue.add(req.t_admit - req.t_submit)
                    req.seq = self.rounds.start(seq, req.prompt, req.params, req.stats)
                except BaseException as exc:
                    # the id is not the request's to keep: whatever start left on it goes
                    req.seq, req.done, req.finish, req.error = None, True, "error", exc
                    if seq is not None:
                        self._forget(seq)
                    # an interrupt, or a lost RPC worker (the model cannot decode for
                    # anyone: the server's worker fails over on it), ends the step
                    if not isinstance(exc, Exception) or isinstance(exc, RpcError):
                        raise
                    failed.append((req, Step([], "error")))
                    continue
                self._active[seq] = req
                self.metrics.slots[seq].requests += 1
                admitted.append(req)
        if self.on_admit is not None:      # outside the lock: a submit holds its caller's lock, then wants this
            for req in admitted:
                self.on_admit(req)
        return failed

    def _forget(self, seq: int) -> None:
        """Free ``seq`` after a start that failed part way: drop whatever it left there."""
        try:
            self.rounds.release_id(seq)
        except Exception:      # the context may be what failed; the next start drops it again
            pass
        self._free.add(seq)

    def _slot_for(self, req: Request) -> int:
        """The free seq id that holds the longest reusable prefix of the request's prompt
        (as llama-server routes by slot similarity), else the least recently used; with a
        prompt cache, the chat it held shelved first where the request drops most of it,
        and a shelved chat that holds more of the prompt put back on it."""
        if self.cache is None:
            return lowest_free(self._free)
        p = req.params
        wants = p.cache_prompt and p.prompt_logprobs is None
        spec = p.spec == "mtp" and self.rounds.drafter is not None
        resumes = self.rounds.resumes
        views = [self.cache.view(seq, req.prompt if wants else None, *resumes.drafter_holds(seq, p, spec))
                 for seq in sorted(self._free)]
        seq = pick_slot(views)
        reuse = next(v.reusable for v in views if v.seq == seq)
        # a conversation no slot holds (prompt_cache.Shelved) that skips more goes back
        # on the least recently used one
        shelved = resumes.shelved_for(req.prompt, p, spec) if wants else None
        back = None
        if shelved is not None and shelved[1] > reuse:
            seq, reuse, back = pick_slot([replace(v, reusable=0) for v in views]), 0, shelved[0]
            self.cache.take(back)     # off the shelf first: the budget never holds both chats
        try:
            if worth_shelving(self.cache.slots.get(seq, Slot()).end, reuse):
                resumes.shelve(seq, reuse)
            if back is not None:
                resumes.unshelve(back, seq)
        except BaseException as exc:
            # a restore that failed part way left the seq's KV apart from its snapshots:
            # the seq starts empty
            self._forget(seq)
            if not isinstance(exc, Exception) or isinstance(exc, RpcError):
                raise
            # the request prefills its whole prompt, as llama-server goes on after a cache
            # load that fails; the chat stays shelved, as its cache keeps the state
            if back is not None:
                self.cache.put_back(back)
            log.warning("restoring a shelved chat on seq %d failed (%s: %s): its prompt is decoded anew",
                        seq, type(exc).__name__, exc)
        return seq

    def _drop_cancelled(self) -> list[tuple[Request, Step]]:
        out = []
        for req in [r for r in self._active.values() if r.cancelled]:
            self._release(req, "cancelled")
            out.append((req, Step([], "cancelled")))
        with self._lock:
            for req in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(req)
                req.done, req.finish = True, "cancelled"
                out.append((req, Step([], "cancelled")))
        return out

    def _release(self, req: Request, finish: str) -> None:
        """Free the request's seq id now: the next admission may take it this very step."""
        seq = req.seq.seq
        slot = self.metrics.slots[seq]
        slot.drafted += req.stats.drafted
        slot.accepted += req.stats.accepted
        req.stats.t_end = time.perf_counter()
        if finish == "error":
            self.rounds.release_id(seq)
        else:      # what it decoded stays for the prompt cache (nothing without one)
            self.rounds.park(req.seq)
        with self._lock:
            del self._active[seq]
            self._free.add(seq)
        req.seq, req.done, req.finish = None, True, finish

    def fail_all(self) -> list[Request]:
        """After an error in ``step``: every request ends (the caller tells their owners)."""
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for req in waiting:
            req.done, req.finish = True, "error"
        return self.fail_active() + waiting

    def fail_active(self) -> list[Request]:
        """After an error in ``step``: the requests in the round end, their seq ids
        dropped, not parked: the round stopped part way, so what their contexts hold is
        no state a later request may reuse (an interrupt inside a round parked a half-read
        verify into the prompt cache, and the next requests' greedy tokens changed). The
        waiting requests are untouched: a later step starts them on clean ids."""
        self.rounds.flight = None
        self.rounds.idle()         # the next round's time starts at its launch
        with self._lock:
            reqs = list(self._active.values())
        for req in reqs:
            if req.seq is not None:
                try:
                    self._release(req, "error")
                except Exception:       # the context may be what failed
                    with self._lock:
                        self._active.pop(req.seq.seq, None)
                        self._free.add(req.seq.seq)
                    req.seq, req.done, req.finish = None, True, "error"
        return reqs
